"""Prefill's last logits come from one pass over the chunk (engine/runner.py): the
body over every row, then the output layer on the last row only. They must equal
the model's own logits for that position, tied and untied, every plain family; a
family not known to be plain keeps the two-pass fallback."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.loading.random_model import build_random_model
from engine.platform import on_gpu
from engine.runner import ModelRunner, output_head
from tests.helpers.models import TINY_CONFIGS

PROMPT = [3, 17, 5, 99, 42, 7, 7, 1, 250, 64, 8, 33]
# The families whose output layer is known (engine/runner.py's PLAIN_HEAD_FAMILIES)
# that the GGUF tests also build; every family through the engine, and the output-layer
# cut of the others: tests/engine/test_conformance.py.
ENGINE_FAMILIES = ("llama", "gemma3_text", "qwen3", "qwen3_moe", "mixtral")
SERVED_CONFIGS = {f: c for f, c in TINY_CONFIGS.items() if f in ENGINE_FAMILIES}


def _cases():
    for family, cfg in SERVED_CONFIGS.items():
        yield family, dict(cfg)
        if family in ("llama", "qwen3"):  # the other tying of the same family
            yield family, dict(cfg, tie_word_embeddings=not cfg.get("tie_word_embeddings"))


@pytest.mark.parametrize(
    "family,cfg",
    list(_cases()),
    ids=[f"{f}-tie{c.get('tie_word_embeddings')}" for f, c in _cases()],
)
def test_one_pass_prefill_equals_the_model(family, cfg) -> None:
    loaded = build_random_model(family, cfg, seed=3)
    model = loaded.model
    runner = ModelRunner(model, fused_decode=False)
    assert runner.head is not None, f"{family}: expected the one-pass head"
    want = np.array(model(mx.array([PROMPT], dtype=mx.int32))[0, -1].astype(mx.float32))
    got = np.array(runner.prefill(runner.new_sequence_kv(), PROMPT, True).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # and the two-pass fallback agrees, on the same chunk split in two
    runner.head = None
    kv = runner.new_sequence_kv()
    runner.prefill(kv, PROMPT[:5], False)
    two = np.array(runner.prefill(kv, PROMPT[5:], True).astype(mx.float32))
    np.testing.assert_allclose(two, want, rtol=1e-4, atol=1e-4)


def test_unknown_family_keeps_the_fallback() -> None:
    loaded = build_random_model("llama", dict(TINY_CONFIGS["llama"]), seed=1)
    model = loaded.model

    class Wrapped(type(model)):  # a subclass from another module: maybe not plain
        __module__ = "somewhere.custom_family"

    model.__class__ = Wrapped
    assert output_head(model) is None
    runner = ModelRunner(model, fused_decode=False)
    want = np.array(model(mx.array([PROMPT], dtype=mx.int32))[0, -1].astype(mx.float32))
    got = np.array(runner.prefill(runner.new_sequence_kv(), PROMPT, True).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_async_chunks_equal_sync_chunks(monkeypatch) -> None:
    """MARKBASE_PREFILL_ASYNC=1 (the GPU's default) queues the chunks without logits;
    the last chunk's logits and the KV cache must be what the synchronous chunks give."""
    loaded = build_random_model("llama", dict(TINY_CONFIGS["llama"]), seed=5)
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("MARKBASE_PREFILL_ASYNC", flag)
        runner = ModelRunner(loaded.model, fused_decode=False)
        assert runner.async_prefill is (flag == "1")
        kv = runner.new_sequence_kv()
        for s in range(0, len(PROMPT) - 4, 4):
            assert runner.prefill(kv, PROMPT[s : s + 4], False) is None
        logits = runner.prefill(kv, PROMPT[-4:], True)
        keys = np.array(kv[0].keys.astype(mx.float32))
        results.append((np.array(logits.astype(mx.float32)), keys))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
    monkeypatch.delenv("MARKBASE_PREFILL_ASYNC")
    assert ModelRunner(loaded.model, fused_decode=False).async_prefill is on_gpu()


_TOGETHER_CASES = {
    **SERVED_CONFIGS,
    # a window shorter than the prompts: the sliding layers' masks matter
    "gemma3_text-window": dict(
        TINY_CONFIGS["gemma3_text"], sliding_window=4, sliding_window_pattern=2
    ),
}


@pytest.mark.parametrize("cached", [(0, 0, 0, 0, 0), (5, 0, 8, 3, 0)], ids=["new", "cached"])
@pytest.mark.parametrize("case", list(_TOGETHER_CASES))
def test_prompts_prefilled_together_equal_one_by_one(case, cached) -> None:
    """Prompts of different lengths in one right-padded forward, each the rest of a
    prompt after what its cache holds (``cached`` tokens: none for new prompts, prefixes
    of different lengths for prefix-cache hits), give each prompt's own last logits
    and leave each sequence's cache as its own prefill does. Every family: each row's
    RoPE start, cached keys behind a left pad, sliding windows shorter than the
    prompts, MoE routing of the pads."""
    family = case.split("-")[0]
    loaded = build_random_model(family, dict(_TOGETHER_CASES[case]), seed=7)
    runner = ModelRunner(loaded.model, fused_decode=False)
    assert runner.can_prefill_together()
    prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5, 4, 3, 2, 1], PROMPT[2:], [4, 4, 2]]
    kvs = []
    for prompt, c in zip(prompts, cached):
        kv = runner.new_sequence_kv()
        if c:
            runner.prefill(kv, prompt[:c], False)
            mx.eval([layer.keys for layer in kv])
        kvs.append(kv)
    tails = [p[c:] for p, c in zip(prompts, cached)]
    together = np.array(runner.prefill_together(kvs, tails).astype(mx.float32))
    assert together.shape[0] == len(prompts)
    for i, prompt in enumerate(prompts):
        kv = runner.new_sequence_kv()
        alone = np.array(runner.prefill(kv, prompt, True).astype(mx.float32))
        np.testing.assert_allclose(together[i], alone, rtol=1e-4, atol=1e-4)
        for mine, theirs in zip(kvs[i], kv):
            assert mine.offset == theirs.offset == len(prompt)
            for a, b in zip(mine.kv(), theirs.kv()):
                np.testing.assert_allclose(
                    np.array(a.astype(mx.float32)),
                    np.array(b.astype(mx.float32)),
                    rtol=1e-4,
                    atol=1e-4,
                )


def test_prompts_together_switch(monkeypatch) -> None:
    loaded = build_random_model("llama", dict(TINY_CONFIGS["llama"]), seed=1)
    runner = ModelRunner(loaded.model, fused_decode=False)
    assert runner.can_prefill_together()
    monkeypatch.setenv("MARKBASE_PREFILL_TOGETHER", "0")
    assert not runner.can_prefill_together()
