"""engine/gpu_mma.py: the tensor-core few-row products equal float32 products of the
same (dequantized) weights, for 1-40 rows (every n-tile count, more than one call),
every input-dim step (U), 4-bit group sizes 32/64/128, bf16 and fp16; and the plan
forms ``mma``/``qmma`` of engine/gpu_linear.py reach them.

Needs MLX's CUDA backend (skipped elsewhere). On the H200, after bench/gpu/env.sh:
``python3 -m pytest -q tests/test_gpu_mma.py``. ``bench/gpu/nvrtc_check.py`` compiles
the kernels without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine import gpu_linear, gpu_mma  # noqa: E402

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

# (rows, N, K): K picks U (float: 128 -> 4, 64 -> 2, 32 -> 1; 4-bit: 256 -> 2, 128 -> 1)
SHAPES = [(1, 4096, 4096), (2, 64, 256), (3, 128, 1024), (7, 16, 96), (8, 6144, 2048),
          (9, 32, 384), (16, 4096, 14336), (17, 48, 640), (31, 2048, 8192), (32, 256, 512),
          (33, 64, 256), (40, 16, 128)]  # fmt: skip


def _close(got, want):
    got = np.array(got.astype(mx.float32))
    want = np.array(want)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_float_mma(shape, dtype):
    m, n, k = shape
    rng = np.random.default_rng(m * 11 + n)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = gpu_mma.matmul(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, want)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] % 128 == 0])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_mma(shape, dtype):
    m, n, k = shape
    rng = np.random.default_rng(m * 7 + n)
    for gs in (64, 32, 128):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=gs, bits=4)
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
        deq = mx.dequantize(wq, s, b, group_size=gs, bits=4).astype(mx.float32)
        want = x.astype(mx.float32) @ deq.T
        got = gpu_mma.quantized_matmul(x, wq, s, b, gs)
        assert got.shape == (m, n) and got.dtype == dtype
        _close(got, want)


def test_exact_on_small_integers():
    """Integer weights and inputs small enough to be exact in bf16 and float32: the
    kernel's sum must equal the exact one (a layout error cannot hide in tolerance)."""
    rng = np.random.default_rng(3)
    for m in (1, 5, 8, 12, 24, 32):
        w = rng.integers(-3, 4, (64, 256)).astype(np.float32)
        x = rng.integers(-3, 4, (m, 256)).astype(np.float32)
        got = gpu_mma.matmul(mx.array(x).astype(mx.bfloat16), mx.array(w).astype(mx.bfloat16))
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), x @ w.T)


def test_plan_forms_reach_the_kernels():
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((256, 512)).astype(np.float32) / 20).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((12, 512)).astype(np.float32)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    try:
        gpu_linear.set_plans("1:mma", "1:qmma")
        got = gpu_linear.GpuLinear(w)(x)
        _close(got, x.astype(mx.float32) @ w.astype(mx.float32).T)
        q = gpu_linear.GpuQuantizedLinear(wq, s, b, 64, 4, "affine")
        got = q(x[:, None, :])  # [B, 1, K] as the model's modules see it
        assert got.shape == (12, 1, 256)
        deq = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
        _close(got[:, 0], x.astype(mx.float32) @ deq.T)
        assert gpu_linear.uses("mma") and gpu_linear.uses("qmma")
    finally:
        gpu_linear.reset_plans()


def test_warm_compiles_without_error():
    gpu_mma.warm(mx.bfloat16, (32, 64, 128))
    gpu_mma.warm(mx.float16, (64,), quantized=True, float_=False)
