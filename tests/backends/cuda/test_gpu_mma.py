"""engine/backends/cuda/products/mma.py: the tensor-core few-row products equal float32 products of the
same (dequantized) weights, for 1-40 rows (every n-tile count, more than one call),
every input-dim step (U), 4-bit group sizes 32/64/128, bf16 and fp16; and the plan
forms ``mma``/``qmma`` of engine/backends/cuda/linear.py reach them.

Needs MLX's CUDA backend (skipped elsewhere). On the H200, after bench/gpu/env.sh:
``python3 -m pytest -q tests/backends/cuda/test_gpu_mma.py``. ``bench/gpu/nvrtc_check.py`` compiles
the kernels without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_gpu_gemv import (  # noqa: E402  (the checks shared with the gemv kernels)
    _close,
    check_float_product,
    check_quantized_product,
    check_step_matches_model,
)

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.products import mma as gpu_mma  # noqa: E402

# (rows, N, K): K picks U (float: 128 -> 4, 64 -> 2, 32 -> 1; 4-bit: 256 -> 2, 128 -> 1)
SHAPES = [(1, 4096, 4096), (2, 64, 256), (3, 128, 1024), (7, 16, 96), (8, 6144, 2048),
          (9, 32, 384), (16, 4096, 14336), (17, 48, 640), (31, 2048, 8192), (32, 256, 512),
          (33, 64, 256), (40, 16, 128)]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_float_mma(shape, dtype):
    check_float_product(gpu_mma.matmul, shape, dtype)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] % 128 == 0])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_mma(shape, dtype):
    check_quantized_product(gpu_mma.quantized_matmul, shape, dtype)


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
    gpu_mma.warm(
        mx.bfloat16,
        [(0, 256, 64, False, False), (64, 512, 28672, False, True), (32, 384, 4096, True, False)],
    )
    gpu_mma.warm(mx.float16, [(128, 1024, 4096, False, False), (0, 96, 32, False, True)])
    with pytest.raises(ValueError, match="glu and residual"):
        gpu_mma.warm(mx.float16, [(0, 96, 32, True, True)])


def _check_forms(n: int, k: int, m: int, quantized: bool, seed: int) -> None:
    """The plain product, the o_proj form (``residual``) and the gate_up form (w =
    [gate; up], ``glu``: silu(gate) * up) against the same math in float32."""
    rng = np.random.default_rng(seed)
    dtype = mx.bfloat16
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
    r = mx.array(rng.standard_normal((m, n)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    if quantized:
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        wf = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)

        def run(inp, **kw):
            return gpu_mma.quantized_matmul(inp, wq, s, b, 64, **kw)
    else:
        wf = w.astype(mx.float32)

        def run(inp, **kw):
            return gpu_mma.matmul(inp, w, **kw)

    x32 = x.astype(mx.float32)
    _close(run(x), x32 @ wf.T)
    _close(run(x, residual=r), r.astype(mx.float32) + x32 @ wf.T)
    gate, up = x32 @ wf[: n // 2].T, x32 @ wf[n // 2 :].T
    got = run(x, glu=True)
    assert got.shape == (m, n // 2)
    _close(got, gate * mx.sigmoid(gate) * up)


@pytest.mark.parametrize("cap", [2, 4])
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("m", [1, 9, 32, 70])
def test_several_m_tiles_a_block(cap, quantized, m, monkeypatch):
    """Blocks of 2 and 4 m-tiles (32/64 weight rows; the SwiGLU's gate and up halves
    interleaved per m-tile) give the same products, residual adds and SwiGLU: small
    weights forced onto them (MIN_BLOCKS 1)."""
    monkeypatch.setattr(gpu_mma, "MIN_BLOCKS", 1)
    monkeypatch.setattr(gpu_mma, "_max_m_tiles", lambda: cap)
    n, k = 192 if cap == 2 else 256, 512
    assert gpu_mma.m_tiles(n, m) == (cap if m > 16 else 1)
    _check_forms(n, k, m, quantized, seed=m + 10 * cap + 100 * quantized)
    if not quantized:  # exact on small integers: no layout error hides in the tolerance
        rng = np.random.default_rng(m)
        wi = rng.integers(-3, 4, (n, k)).astype(np.float32)
        xi = rng.integers(-3, 4, (m, k)).astype(np.float32)
        bf16 = mx.bfloat16
        got = gpu_mma.matmul(mx.array(xi).astype(bf16), mx.array(wi).astype(bf16))
        # the float32 sums are exact; sums past 256 round once, to bf16, like this
        want = mx.array(xi @ wi.T).astype(bf16).astype(mx.float32)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want))


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("m", [1, 5, 8, 12, 32, 40, 100])
def test_residual_and_glu(quantized, m):
    """The o_proj and gate_up forms at every n-tile count and past 32 rows."""
    _check_forms(256, 512, m, quantized, seed=m + 100 * quantized)


@pytest.mark.parametrize("quantized", [False, True])
def test_gpu_decode_step_with_the_kernels_matches_the_model(quantized):
    """The GPU decode step with every product of 2-32 rows on these kernels (residual adds
    folded into o_proj/down_proj, the SwiGLU into gate_up) equals the model's own call,
    ragged rows."""
    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep

    cfg = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    kw = {"quantize_bits": 4, "group_size": 64} if quantized else {}
    model = build_random_model("llama", cfg, seed=7, **kw).model
    model.set_dtype(mx.bfloat16)
    try:
        gpu_linear.set_plans("1:xwt,2:mma,33:xwt", "1:qmm,2:qmma")
        step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
        step.warm_up()
        prompts = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [1, 2, 3, 4], [9] * 9)
        check_step_matches_model(step, model, prompts)
    finally:
        gpu_linear.reset_plans()


@pytest.mark.parametrize(
    "knobs",
    [dict(u=4, xl=True), dict(u=2, warps=4, xl=True), dict(u=1, warps=16), dict(u=4, warps=4)],
)
def test_few_row_4bit_launch_shapes(knobs):
    """bench/gpu/q4_bench.py's launch shapes for 1-8 row 4-bit products (loads in
    flight, warps a block, x read where used) compute the same products: plain,
    residual and SwiGLU forms."""
    gpu_mma.set_q4_few_rows(**knobs)
    try:
        for shape in [(1, 4096, 4096), (1, 256, 14336), (5, 128, 1024)]:
            check_quantized_product(gpu_mma.quantized_matmul, shape, mx.bfloat16)
        for m in (1, 6):
            _check_forms(256, 512, m, True, seed=7 + m)
    finally:
        gpu_mma.set_q4_few_rows()
