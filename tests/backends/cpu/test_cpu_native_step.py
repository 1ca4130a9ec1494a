"""engine.backends.cpu.native_step: the llama-form decode step as one C call gives the
model's own logits and writes the model's own keys and values (every rope flavour, one
row and ragged rows, a cache that grows mid-decode), each row's result independent of
the batch, and hands batches it does not index to the lean step."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from engine.backends.cpu.native_step import NativeDecodeStep  # noqa: E402
from engine.backends.cpu.step import CpuDecodeStep  # noqa: E402
from engine.loading import build_random_model  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    RANDOM_LLAMA,
    ROPES,
    TINY_GEMMA2,
    TINY_GEMMA3,
    check_step,
    prefilled_batch,
)

TINY = {**RANDOM_LLAMA, "vocab_size": 97}
TINY_GEMMA = {**TINY_GEMMA3, "vocab_size": 97}
PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14])  # ragged: rows with padding


def _native(model) -> NativeDecodeStep:
    step = NativeDecodeStep.build(model)
    if not isinstance(step, NativeDecodeStep):
        pytest.skip("the sgemm shim is not loaded here")
    return step


@pytest.mark.parametrize("flavour", sorted(ROPES))
def test_native_step_matches_model(flavour):
    model = build_random_model("llama", {**TINY, **ROPES[flavour]}, seed=11).model
    step = _native(model)
    check_step(model, step, PROMPTS)
    check_step(model, step, PROMPTS[:1])


def test_native_step_cache_grows():
    """A row whose keys reach the end of the buffer: the cache grows between steps."""
    model = build_random_model("llama", TINY, seed=5).model
    step = _native(model)
    check_step(model, step, ([3] * 254, [4, 5]), steps=5)


def test_native_step_row_independent_of_batch():
    """A row's logits are the same bits alone and beside other (padded) rows."""
    model = build_random_model("llama", TINY, seed=12).model
    step = _native(model)
    alone = prefilled_batch(model, PROMPTS[1:2])
    together = prefilled_batch(model, PROMPTS)
    tok1 = mx.array([[7]], dtype=mx.int32)
    tok3 = mx.array([[2], [7], [9]], dtype=mx.int32)
    for _ in range(3):
        a = step(tok1, alone)
        t = step(tok3, together)
        assert mx.array_equal(a[0], t[1]).item()


@pytest.mark.parametrize("window", [4, 512])
def test_native_step_matches_gemma3(window):
    """Gemma 3's layers: sandwich norms, head norms, GELU-tanh MLP, two RoPE bases, and
    sliding layers with a window the prompts outgrow (their caches keep about the
    window's keys: their own lengths) and one they do not."""
    loaded = build_random_model("gemma3_text", {**TINY_GEMMA, "sliding_window": window}, seed=3)
    step = _native(loaded.model)
    assert step.gemma and step._s.n_layers == 6
    check_step(loaded.model, step, PROMPTS, steps=6)
    check_step(loaded.model, step, PROMPTS[:1], steps=6)


def test_native_step_leaves_other_layers_to_the_lean_step():
    loaded = build_random_model("gemma2", {**TINY_GEMMA2, "vocab_size": 97}, seed=3)
    step = NativeDecodeStep.build(loaded.model)
    assert type(step) is CpuDecodeStep and step.family == "gemma2"


def test_two_models_decode_at_once():
    """Two models' C steps called from two threads at once (several models in one
    server, a worker thread each): every step's logits equal that model's alone."""
    import threading

    models = [build_random_model("llama", TINY, seed=s).model for s in (21, 22)]
    steps = [_native(m) for m in models]

    def run(i, out):
        batch = prefilled_batch(models[i], PROMPTS)
        tokens = mx.array([[1]] * len(PROMPTS), dtype=mx.int32)
        for _ in range(8):
            logits = steps[i](tokens, batch)
            out.append(logits)
            tokens = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32)

    alone = [[], []]
    for i in (0, 1):
        run(i, alone[i])
    together = [[], []]
    threads = [threading.Thread(target=run, args=(i, together[i])) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(together[i]) == 8
        for a, b in zip(alone[i], together[i]):
            assert mx.array_equal(a, b).item()


def test_a_token_outside_the_vocabulary_is_an_error_not_a_read():
    """A token id past the embedding table fails the step with a clear error instead
    of reading memory past the table."""
    model = build_random_model("llama", TINY, seed=8).model
    step = _native(model)
    batch = prefilled_batch(model, PROMPTS[:1])
    with pytest.raises(RuntimeError, match="token id outside the embedding"):
        step(mx.array([[TINY["vocab_size"] + 5]], dtype=mx.int32), batch)
