"""engine/backends/cuda/prefetch.py: the L2 prefetch kernel beside the one-row attention hands
back the layer's input unchanged (what o_proj takes as its residual), whatever rows it
is asked to prefetch; the decode step with it on (the default) gives the model's
logits; it applies only to one row of 4-bit products.

The GPU tests need MLX's CUDA backend (skipped elsewhere); on the H200 after
bench/gpu/env.sh: ``python3 -m pytest -q tests/backends/cuda/test_gpu_prefetch.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda import prefetch as gpu_prefetch  # noqa: E402


def _quantized(n: int, k: int, dtype, seed: int) -> nn.QuantizedLinear:
    rng = np.random.default_rng(seed)
    lin = nn.Linear(k, n, bias=False)
    lin.weight = mx.array(rng.standard_normal((n, k)).astype(np.float32) / 30).astype(dtype)
    q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    q.scales, q.biases = q.scales.astype(dtype), q.biases.astype(dtype)
    return q


@pytest.mark.cpu
def test_switch_and_rows(monkeypatch):
    """On unless MARKBASE_GPU_L2_PREFETCH=0; the gate/up rows follow the MB knob (two
    halves, each row's weight words, scales and biases)."""
    monkeypatch.delenv("MARKBASE_GPU_L2_PREFETCH", raising=False)
    assert gpu_prefetch.enabled()
    monkeypatch.setenv("MARKBASE_GPU_L2_PREFETCH", "0")
    assert not gpu_prefetch.enabled()
    gu = _quantized(2 * 256, 1024, mx.bfloat16, 1)
    row = 1024 // 8 * 4 + 2 * (1024 // 64) * 2  # 576 bytes
    monkeypatch.setenv("MARKBASE_GPU_L2_PREFETCH_MB", "1")
    assert gpu_prefetch.gate_up_rows(gu) == (1 << 20) // (2 * row)
    monkeypatch.setenv("MARKBASE_GPU_L2_PREFETCH_MB", "0")
    assert gpu_prefetch.gate_up_rows(gu) == 0


@pytest.mark.cpu
def test_takes_only_one_row_of_4_bit_products():
    o, gu = _quantized(256, 256, mx.bfloat16, 2), _quantized(512, 256, mx.bfloat16, 3)
    lin = nn.Linear(256, 256, bias=False)
    one = mx.zeros((1, 256), dtype=mx.bfloat16)
    assert not gpu_prefetch.takes(mx.zeros((2, 256), dtype=mx.bfloat16), o, gu)
    assert not gpu_prefetch.takes(one, lin, gu)
    assert gpu_prefetch.takes(one, o, gu) == mx.cuda.is_available()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [0, 100, 10**6])
def test_kernel_hands_back_the_layer_input(dtype, rows):
    """Prefetching none, some or more rows than gate/up has: the output is x, bit for bit."""
    o, gu = _quantized(512, 1024, dtype, 4), _quantized(2 * 768, 512, dtype, 5)
    rng = np.random.default_rng(6)
    x = mx.array(rng.standard_normal((1, 512)).astype(np.float32)).astype(dtype)
    dep = mx.array(rng.standard_normal((1, 96)).astype(np.float32)).astype(dtype)
    got = gpu_prefetch.residual_after(x, dep, o, gu, rows)
    assert got.dtype == dtype and got.shape == x.shape
    assert mx.array_equal(got, x).item()


def test_decode_step_with_prefetch_matches_the_model(monkeypatch):
    """The GPU decode step at one row with the prefetch kernel beside each attention
    (its copy of x as o_proj's residual) equals the model's own call."""
    from test_gpu_gemv import check_step_matches_model

    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep

    cfg = dict(hidden_size=1024, num_hidden_layers=2, intermediate_size=2048,
               num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=7, quantize_bits=4, group_size=64).model
    model.set_dtype(mx.bfloat16)
    monkeypatch.setenv("MARKBASE_GPU_L2_PREFETCH", "1")
    monkeypatch.setenv("MARKBASE_GPU_L2_PREFETCH_MB", "1")
    try:
        gpu_linear.set_plans("1:xwt,2:mma,33:xwt", "1:qstream,2:qmma")
        step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
        assert step.l2_prefetch
        step.warm_up()
        check_step_matches_model(step, model, ([5, 6, 7, 8, 9, 10],))
    finally:
        gpu_linear.reset_plans()
