"""engine.backends.cpu.step: the lean CPU decode step gives the model's own logits (RoPE tables
from the model's rope module, every rope flavour mlx-lm builds for llama; Gemma 3's
sandwich norms, q/k norms, GELU MLP and sliding-window layers; Gemma 2's soft-capped
scores and logits), ragged rows and one row, and is only used where it fits."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from engine.backends.cpu.native_step import NativeDecodeStep  # noqa: E402
from engine.backends.cpu.step import CpuDecodeStep  # noqa: E402
from engine.loading import build_random_model  # noqa: E402
from engine.model import attention  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    RANDOM_LLAMA,
    ROPES,  # noqa: E402
    TINY_GEMMA2,
    TINY_GEMMA3,
    TINY_QWEN3,
    check_step,
)

TINY = {**RANDOM_LLAMA, "vocab_size": 97}
CPU_STEPS = (CpuDecodeStep, NativeDecodeStep)  # the runner's CPU steps (native_step wraps lean)
# 6 layers (5 sliding, 1 global), a window of 4 that the longer prompts outgrow: the
# sliding layers' mask hides keys the global layer still sees
TINY_GEMMA = {**TINY_GEMMA3, "vocab_size": 97, "sliding_window": 4}
PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14])  # ragged: an array mask


@pytest.mark.parametrize("flavour", sorted(ROPES))
def test_lean_step_matches_model(flavour):
    model = build_random_model("llama", {**TINY, **ROPES[flavour]}, seed=11).model
    step = CpuDecodeStep.build(model)
    assert step is not None
    check_step(model, step, PROMPTS)
    check_step(model, step, PROMPTS[:1])  # one row: no mask


@pytest.mark.parametrize("window", [4, 512])
def test_lean_step_matches_gemma3(window):
    """Gemma 3's layers: with a window the prompts outgrow (the sliding layers' own
    mask) and one they do not; two RoPE bases (local and global layers)."""
    model = build_random_model("gemma3_text", {**TINY_GEMMA, "sliding_window": window}, seed=3)
    step = CpuDecodeStep.build(model.model)
    assert step is not None and step.family == "gemma3"
    assert len(step._ropes) == 2 and step._sliding == [True] * 5 + [False]
    check_step(model.model, step, PROMPTS, steps=6)
    check_step(model.model, step, PROMPTS[:1], steps=6)


def test_lean_step_gemma3_untied_head():
    """A gemma3_text checkpoint with its own lm_head: the step's output layer is it."""
    loaded = build_random_model("gemma3_text", TINY_GEMMA, seed=4)
    model = loaded.model
    if getattr(model, "tie_word_embeddings", True):
        import mlx.nn as nn

        model.tie_word_embeddings = False
        model.lm_head = nn.Linear(64, 97, bias=False)
        mx.eval(model.parameters())
    step = CpuDecodeStep.build(model)
    assert step is not None
    assert mx.array_equal(step._head_wt, model.lm_head.weight.T).item()
    assert not mx.array_equal(step._head_wt, model.model.embed_tokens.weight.T).item()
    check_step(model, step, PROMPTS)


def test_runner_uses_it_on_the_cpu_and_falls_back():
    model = build_random_model("llama", TINY, seed=2).model
    assert isinstance(ModelRunner(model).decode_step, CPU_STEPS)
    # 4-bit QuantizedLinear projections: not this step's kind (the fused one runs them)
    quant = build_random_model("llama", TINY, seed=2, quantize_bits=4, group_size=32).model
    assert CpuDecodeStep.build(quant) is None
    assert not isinstance(ModelRunner(quant).decode_step, CPU_STEPS)
    # Gemma 3's layers: this step
    gemma = build_random_model("gemma3_text", TINY_GEMMA, seed=2).model
    assert isinstance(ModelRunner(gemma).decode_step, CPU_STEPS)
    # not llama's, gemma3_text's or gemma2's block (qwen3: q/k norms without Gemma's form)
    qwen = build_random_model("qwen3", TINY_QWEN3, seed=2).model
    assert CpuDecodeStep.build(qwen) is None
    assert not isinstance(ModelRunner(qwen).decode_step, CPU_STEPS)


def test_lean_step_matches_gemma2():
    """Gemma 2's layers: soft-capped scores (small caps, so the tanh bends them) and
    logits, every layer global."""
    config = {**TINY_GEMMA2, "vocab_size": 97, "attn_logit_softcapping": 2.0}
    model = build_random_model("gemma2", {**config, "final_logit_softcapping": 3.0}, seed=3)
    attention.install(model.model)  # the reference's own call on a batch needs its mask form
    step = CpuDecodeStep.build(model.model)
    assert step is not None and step.family == "gemma2"
    check_step(model.model, step, PROMPTS, steps=6)
    check_step(model.model, step, PROMPTS[:1], steps=6)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma2"])
def test_runner_decode_is_greedy_identical_to_the_plain_model(family):
    """Through ModelRunner (what the worker calls), with rows joining mid-way."""
    config = {"llama": TINY, "gemma3_text": TINY_GEMMA, "gemma2": TINY_GEMMA2}[family]
    loaded = build_random_model(family, config, seed=5)
    lean = ModelRunner(loaded.model)
    plain = ModelRunner(loaded.model, fused_decode=False)
    outs = []
    for runner in (lean, plain):
        batch = runner.new_batch_kv()
        tokens = []
        for prompt in PROMPTS:
            kv = runner.new_sequence_kv()
            logits = runner.prefill(kv, prompt, want_logits=True)
            tokens.append(int(mx.argmax(logits).item()))
            runner.join_batch(batch, kv, kv.rows())
        seen = []
        for _ in range(6):
            tokens = mx.argmax(runner.decode(batch, tokens), axis=-1).tolist()
            seen.append(tokens)
        outs.append(seen)
    assert outs[0] == outs[1]


def _alone_and_batched(runner, prompts, steps):
    """Greedy tokens of each prompt decoded alone, and of all of them in one batch."""

    def run(group):
        batch = runner.new_batch_kv()
        tokens = []
        for prompt in group:
            kv = runner.new_sequence_kv()
            logits = runner.prefill(kv, prompt, want_logits=True)
            tokens.append(int(mx.argmax(logits).item()))
            runner.join_batch(batch, kv, kv.rows())
        out = [[t] for t in tokens]
        for _ in range(steps):
            tokens = mx.argmax(runner.decode(batch, tokens), axis=-1).tolist()
            for row, t in zip(out, tokens):
                row.append(t)
        sliding, full = batch.leaves[0], batch.leaves[-1]
        assert sliding.window == TINY_GEMMA["sliding_window"] and full.window is None
        assert sliding.length < full.length  # the window's keys only
        return out

    alone = [run([p])[0] for p in prompts]
    return alone, run(prompts)


def test_gemma3_batched_equals_alone_and_plain():
    """Tiny random gemma3_text, rows of different lengths past the window: each row's
    greedy tokens batched are its tokens alone, and the lean step's are the plain
    model call's."""
    loaded = build_random_model("gemma3_text", TINY_GEMMA, seed=9)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15], [16]]
    lean = ModelRunner(loaded.model)
    assert isinstance(lean.decode_step, CPU_STEPS)
    # 24 steps: the sliding layers' caches drop keys no row can see (engine/kv.py's
    # compact) while the global layers keep them all
    alone, together = _alone_and_batched(lean, prompts, steps=24)
    assert together == alone
    plain = ModelRunner(loaded.model, fused_decode=False)
    assert plain.decode_step is None
    assert _alone_and_batched(plain, prompts, steps=24)[1] == together
