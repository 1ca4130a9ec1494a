"""engine/backends/cuda/products/gemv.py: the few-row product kernels equal float32 products of the same
(dequantized) weights, for 1-17 rows, 4-bit group sizes 32/64/128, bf16 and fp16.

Needs MLX's CUDA backend (skipped elsewhere). On the H200, after bench/gpu/env.sh:
``python3 -m pytest -q tests/backends/cuda/test_gpu_gemv.py``. ``bench/gpu/nvrtc_check.py``
compiles the kernels without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine.backends.cuda.products import gemv as gpu_gemv  # noqa: E402

SHAPES = [(1, 4096, 4096), (2, 64, 256), (3, 128, 1024), (5, 6144, 2048), (8, 4096, 14336),
          (12, 256, 512), (17, 64, 256)]  # fmt: skip


def _close(got, want):
    got = np.array(got.astype(mx.float32))
    want = np.array(want)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=2e-2 * scale, rtol=2e-2)


def check_quantized_product(product, shape, dtype):
    """``product(x, w, scales, biases, group_size)`` equals x @ dequantize(w).T in
    float32 for group sizes 64, 32 and 128 (also tests/backends/cuda/test_gpu_mma.py's)."""
    m, n, k = shape
    rng = np.random.default_rng(m * 7 + n)
    for gs in (64, 32, 128):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=gs, bits=4)
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
        deq = mx.dequantize(wq, s, b, group_size=gs, bits=4).astype(mx.float32)
        want = x.astype(mx.float32) @ deq.T
        got = product(x, wq, s, b, gs)
        assert got.shape == (m, n) and got.dtype == dtype
        _close(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_gemv(shape, dtype):
    check_quantized_product(gpu_gemv.quantized_gemv, shape, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_float_gemv(shape, dtype):
    check_float_product(gpu_gemv.gemv, shape, dtype)


def check_step_matches_model(step, model, prompts, steps: int = 3) -> None:
    """A GPU decode step, fed greedy tokens, gives the model's own logits for
    ``prompts`` (prefilled both ways) at each of ``steps`` steps (also
    tests/backends/cuda/test_gpu_mma.py's and tests/backends/cuda/test_gpu_qstream.py's)."""
    from tests.helpers.models import prefilled_batch

    mine, theirs = prefilled_batch(model, prompts), prefilled_batch(model, prompts)
    tokens = mx.array([[1]] * len(prompts), dtype=mx.int32)
    for _ in range(steps):
        got = step(tokens, mine).astype(mx.float32)
        want = model(tokens, cache=theirs)[:, -1, :].astype(mx.float32)
        _close(got, want)
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)


def check_float_product(product, shape, dtype):
    """``product(x, w)`` equals x @ w.T in float32 (also tests/backends/cuda/test_gpu_mma.py's)."""
    m, n, k = shape
    rng = np.random.default_rng(m * 11 + n)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = product(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, want)


@pytest.mark.parametrize("quantize", [False, True])
def test_decode_step_with_gemv_plans_equals_model(quantize):
    """The GPU decode step (bf16, 4-bit or not) with the kernel plans gives the model's
    logits within bf16 rounding, on a ragged batch of 3 rows."""
    from engine.backends.cuda import linear as gpu_linear
    from engine.loading import build_random_model
    from engine.model.decode_step import make_decode_step
    from tests.helpers.models import LLAMA_HD64, RAGGED_PROMPTS, prefilled_batch

    quant = dict(quantize_bits=4, group_size=64) if quantize else {}
    model = build_random_model("llama", LLAMA_HD64, seed=1, **quant).model
    model.set_dtype(mx.bfloat16)  # activations, norms, scales and biases; 4-bit stays
    mx.eval(model.parameters())
    prompts = RAGGED_PROMPTS

    tokens = mx.array([[11], [12], [13]])
    want = model(tokens, cache=prefilled_batch(model, prompts))[:, -1, :].astype(mx.float32)
    gpu_linear.set_plans("1:gemv", "1:qgemv")
    try:
        step = make_decode_step(model)
        got = step(tokens, prefilled_batch(model, prompts)).astype(mx.float32)
        _close(got, want)
    finally:
        gpu_linear.reset_plans()
