"""engine.backends.cpu.step: the lean CPU decode step gives the model's own logits (RoPE tables
from the model's rope module, every rope flavour mlx-lm builds for llama), ragged
rows and one row, and is only used where it fits."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from engine.backends.cpu.step import CpuDecodeStep  # noqa: E402
from engine.loading import build_random_model  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    RANDOM_LLAMA,
    ROPES,  # noqa: E402
    prefilled_batch,
)

TINY = {**RANDOM_LLAMA, "vocab_size": 97}
PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14])  # ragged: an array mask


def _check(model, step, prompts, steps=4):
    mine, theirs = prefilled_batch(model, prompts), prefilled_batch(model, prompts)
    tokens = mx.array([[1]] * len(prompts), dtype=mx.int32)
    for _ in range(steps):
        got = step(tokens, mine)
        want = model(tokens, cache=theirs)[:, -1, :]
        assert got.shape == want.shape
        err = mx.abs(got - want).max().item()
        assert err < 1e-4 * max(1.0, mx.abs(want).max().item()), err
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
    for a, b in zip(mine, theirs):  # the KV it wrote is the model's
        assert mx.allclose(a.keys[:, :, : a.length], b.keys[:, :, : b.length], atol=1e-5).item()




@pytest.mark.parametrize("flavour", sorted(ROPES))
def test_lean_step_matches_model(flavour):
    model = build_random_model("llama", {**TINY, **ROPES[flavour]}, seed=11).model
    step = CpuDecodeStep.build(model)
    assert step is not None
    _check(model, step, PROMPTS)
    _check(model, step, PROMPTS[:1])  # one row: no mask


def test_runner_uses_it_on_the_cpu_and_falls_back():
    model = build_random_model("llama", TINY, seed=2).model
    assert isinstance(ModelRunner(model).decode_step, CpuDecodeStep)
    # 4-bit QuantizedLinear projections: not this step's kind (the fused one runs them)
    quant = build_random_model("llama", TINY, seed=2, quantize_bits=4, group_size=32).model
    assert CpuDecodeStep.build(quant) is None
    assert not isinstance(ModelRunner(quant).decode_step, CpuDecodeStep)
    # not a llama block
    gemma = build_random_model(
        "gemma3_text",
        {**TINY, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8},
        seed=2,
    ).model
    assert CpuDecodeStep.build(gemma) is None


def test_runner_decode_is_greedy_identical_to_the_plain_model():
    """Through ModelRunner (what the worker calls), with rows joining mid-way."""
    loaded = build_random_model("llama", TINY, seed=5)
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
            for layer, seq in zip(batch, kv):
                layer.add(*seq.kv())
        seen = []
        for _ in range(6):
            tokens = mx.argmax(runner.decode(batch, tokens), axis=-1).tolist()
            seen.append(tokens)
        outs.append(seen)
    assert outs[0] == outs[1]
