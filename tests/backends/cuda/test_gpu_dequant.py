"""engine/backends/cuda/products/dequant.py: the 4-bit dequantize kernel for prefill's products gives
``mx.dequantize``'s weights bit for bit (bf16/fp16, groups of 32/64/128, word counts
that do not fill the last warp), and the prefill route with it gives
``quantized_matmul``'s products. The switch and the fallback run anywhere; the kernel
needs MLX's CUDA backend (on the GPU machine: ``python3 -m pytest -q
tests/backends/cuda/test_gpu_dequant.py``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.backends.cuda import prefill as gpu_prefill
from engine.backends.cuda.products import dequant as gpu_dequant


def _quantized(n: int, k: int, group_size: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=4)


@pytest.mark.cpu
def test_switch_and_fallback(monkeypatch):
    """On unless MARKBASE_GPU_DEQUANT=0 (checked); where the kernel does not apply (no
    CUDA, 8 bits, no biases) the result is mx.dequantize's."""
    monkeypatch.delenv(gpu_dequant.ENV, raising=False)
    assert gpu_dequant.enabled()
    monkeypatch.setenv(gpu_dequant.ENV, "0")
    assert not gpu_dequant.enabled()
    monkeypatch.setenv(gpu_dequant.ENV, "yes")
    with pytest.raises(ValueError, match="want 0 or 1"):
        gpu_dequant.enabled()
    monkeypatch.setenv(gpu_dequant.ENV, "1")
    wq, s, b = _quantized(32, 256, 64, mx.bfloat16)
    assert gpu_dequant.supported(wq, s, b, 64, 4, "affine") == mx.cuda.is_available()
    assert not gpu_dequant.supported(wq, s, None, 64, 4, "affine")
    assert not gpu_dequant.supported(wq, s, b, 64, 8, "affine")
    got = gpu_dequant.dequantize(wq, s, b, 64, 4)
    assert mx.array_equal(got, mx.dequantize(wq, s, b, group_size=64, bits=4)).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("shape", [(7, 256), (96, 1024), (2048, 640), (4096, 4096)])
def test_kernel_equals_mx_dequantize_bit_for_bit(shape, group_size, dtype, monkeypatch):
    """7 x 256: 224 words, so the last warp's lanes past the end write nothing."""
    monkeypatch.setenv(gpu_dequant.ENV, "1")
    n, k = shape
    if k % group_size:
        pytest.skip("K not a multiple of the group")
    wq, s, b = _quantized(n, k, group_size, dtype, seed=n + k)
    got = gpu_dequant.dequantize(wq, s, b, group_size, 4)
    want = mx.dequantize(wq, s, b, group_size=group_size, bits=4)
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = int(mx.sum(got != want).item())
    assert diff == 0, f"{diff} of {got.size} weights differ from mx.dequantize"


def test_prefill_route_with_the_kernel_equals_quantized_matmul(monkeypatch):
    monkeypatch.setenv(gpu_dequant.ENV, "1")
    mx.random.seed(3)
    layer = nn.QuantizedLinear(512, 384, bias=False, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    reference = nn.QuantizedLinear(512, 384, bias=False, group_size=64, bits=4)
    reference.update(layer.parameters())
    assert gpu_prefill.install(layer, min_rows=8) == 1
    x = mx.random.normal((1, 300, 512)).astype(mx.bfloat16)
    got, want = layer(x).astype(mx.float32), reference(x).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2)
