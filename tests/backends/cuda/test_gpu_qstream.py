"""engine/backends/cuda/products/qstream.py: the 1-row 4-bit products streamed through shared memory equal
float32 products of the dequantized weight (group sizes 32/64/128, bf16 and fp16,
every launch shape the benchmark tries), with the residual and SwiGLU forms; the plan
form ``qstream`` reaches them at one row and engine/backends/cuda/products/mma.py's kernel otherwise; the
decode step on it equals the model. Both of its forms (tensor cores, CUDA cores).

Needs MLX's CUDA backend (skipped elsewhere). On the H200, after bench/gpu/env.sh:
``python3 -m pytest -q tests/backends/cuda/test_gpu_qstream.py``. ``bench/gpu/nvrtc_check.py``
compiles the kernels without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_gpu_gemv import (  # noqa: E402
    _close,
    check_quantized_product,
    check_step_matches_model,
)

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.products import qstream as gpu_qstream  # noqa: E402

# (N, K): one chunk a lane a row (1024) to the 8b down_proj's 14 (14336, 16 warps);
# N from one output (most warps idle) to more outputs than the grid has warps
SHAPES = [(1, 1024), (7, 2048), (300, 1024), (4096, 4096), (4096, 14336), (8000, 3072)]


@pytest.fixture(params=["mma", "q4", "q4i"])
def form(request):
    """Each test on every form: tensor cores, CUDA cores in float, CUDA cores with
    integer dot products (the default)."""
    gpu_qstream.set_knobs(form=request.param)
    yield request.param
    gpu_qstream.set_knobs()


@pytest.mark.parametrize(
    "shape,dtype",
    [(s, mx.bfloat16) for s in SHAPES] + [(s, mx.float16) for s in SHAPES[2:4]],
)
def test_one_row_products(shape, dtype, form):
    """(N not a multiple of 16 runs the CUDA-core form whatever the knob says.)"""
    check_quantized_product(gpu_qstream.quantized_matmul, (1, *shape), dtype)


def _forms(n: int, k: int, seed: int) -> None:
    """Plain, o_proj (``residual``) and gate_up (w = [gate; up], ``glu``) forms against
    the same math in float32."""
    rng = np.random.default_rng(seed)
    dtype = mx.bfloat16
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
    r = mx.array(rng.standard_normal((1, n)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((1, k)).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    wf = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    x32 = x.astype(mx.float32)
    _close(gpu_qstream.quantized_matmul(x, wq, s, b, 64), x32 @ wf.T)
    got = gpu_qstream.quantized_matmul(x, wq, s, b, 64, residual=r)
    _close(got, r.astype(mx.float32) + x32 @ wf.T)
    gate, up = x32 @ wf[: n // 2].T, x32 @ wf[n // 2 :].T
    got = gpu_qstream.quantized_matmul(x, wq, s, b, 64, glu=True)
    assert got.shape == (1, n // 2)
    _close(got, gate * mx.sigmoid(gate) * up)


@pytest.mark.parametrize("n,k", [(256, 1024), (28672 // 4, 4096), (2048, 14336)])
def test_residual_and_glu(n, k, form):
    _forms(n, k, seed=n + k)


@pytest.mark.parametrize("form_,cps", [("mma", None), ("q4", None), ("q4i", 1), ("q4i", 2)])
@pytest.mark.parametrize("stages,warps", [(2, 8), (3, 4), (6, 4), (3, 1)])
def test_launch_shapes(form_, cps, stages, warps):
    """bench/gpu/q4_bench.py's variants (slots a lane, warps a block, chunks a slot)
    compute the same."""
    gpu_qstream.set_knobs(form=form_, stages=stages, warps=warps, cps=cps)
    try:
        for shape in [(1, 4096, 4096), (1, 300, 2048)]:
            check_quantized_product(gpu_qstream.quantized_matmul, shape, mx.bfloat16)
        _forms(512, 2048, seed=stages * warps)
    finally:
        gpu_qstream.set_knobs()


@pytest.mark.parametrize("stages,warps,cps", [(None, None, None), (2, 8, 1), (3, 4, 2), (6, 4, 2)])
def test_early_issue_computes_the_same(monkeypatch, stages, warps, cps):
    """MARKBASE_GPU_QSTREAM_EARLY=1 (the ring's first loads before x's conversion):
    plain, residual and SwiGLU products as without it, at 1-16 chunks a lane, fewer rows
    than slots in flight, K 14336 (16 warps)."""
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_EARLY", "1")
    gpu_qstream.set_knobs(form="q4i", stages=stages, warps=warps, cps=cps)
    try:
        for shape in [(1, 1, 1024), (1, 4096, 4096), (1, 300, 2048), (1, 2048, 14336)]:
            check_quantized_product(gpu_qstream.quantized_matmul, shape, mx.bfloat16)
        _forms(512, 2048, seed=7)
        _forms(2048, 14336, seed=8)
    finally:
        gpu_qstream.set_knobs()


def test_exact_on_small_integers(form):
    """Weights that quantize exactly (scale 1, bias -8: w = q - 8) and small integer
    inputs: the sum is exact in float32, so a nibble or x layout error cannot hide in
    the tolerance."""
    rng = np.random.default_rng(11)
    n, k = 96, 2048
    q = rng.integers(0, 16, (n, k))
    q[:, ::64] = 0  # every group of 64 spans 0..15, so quantize finds scale 1, bias -8
    q[:, 1::64] = 15
    w = mx.array((q - 8).astype(np.float32)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    assert np.all(np.array(s.astype(mx.float32)) == 1.0)
    x = rng.integers(-3, 4, (1, k)).astype(np.float32)
    got = gpu_qstream.quantized_matmul(
        mx.array(x).astype(mx.float32).astype(mx.bfloat16), wq, s, b, 64
    )
    want = mx.array(x @ (q - 8).T.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_integer_form_is_nearly_exact(dtype):
    """The integer form rounds only the inputs smaller than 2^-7 (fp16: 2^-4) of their
    32-input chunk's largest, at 2^-15 of it; the rest of the sum is exact until the
    float32 sums of chunks and the output's rounding. So against a float64 product it is
    off by at most that input rounding plus one rounding of the output, also with an
    outlier 1000x the others in one chunk and a chunk of zeros; NaN in x gives NaN."""
    rng = np.random.default_rng(23)
    n, k = 512, 4096
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / 64).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    wf = np.array(mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32), np.float64)
    x = rng.standard_normal(k).astype(np.float32)
    x[70] = 1000.0  # an outlier: chunk 2's other inputs lose their lowest bits
    x[96:128] = 0.0  # a chunk of zeros
    x = np.array(mx.array(x[None]).astype(dtype).astype(mx.float32), np.float64)[0]
    gpu_qstream.set_knobs(form="q4i")
    try:
        got = gpu_qstream.quantized_matmul(mx.array(x[None]).astype(dtype), wq, s, b, 64)
        got = np.array(got.astype(mx.float32), np.float64)[0]
        want = wf @ x
        amax = np.abs(x.reshape(-1, 32)).max(axis=1)  # [chunks]
        step = np.repeat(amax * 2.0**-15, 32)  # the largest rounding of an input
        # the kernel adds bias x sum(x) from the exact x: the rounding meets scale x q only
        bias = np.repeat(np.array(b.astype(mx.float32), np.float64), 64, axis=1)
        bound = np.abs(wf - bias) @ step + np.abs(want) * 2.0**-8 + 1e-5 * np.abs(want).max()
        assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
        xn = x.copy()
        xn[5] = np.nan
        got = gpu_qstream.quantized_matmul(mx.array(xn[None]).astype(dtype), wq, s, b, 64)
        assert np.all(np.isnan(np.array(got.astype(mx.float32))))
    finally:
        gpu_qstream.set_knobs()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n,k", [(512, 4096), (1024, 14336), (300, 3072)])
def test_norm_folded_in(n, k, dtype, monkeypatch):
    """The integer form with the RMSNorm inside (qkv, gate_up, lm_head): against the
    float64 product of the normalized x, off by at most the integer form's input
    rounding (of x times the norm's weight, times 1 / rms) plus one rounding of the
    output; the SwiGLU form the same; x of large and of tiny scale (the norm takes it
    out); NaN in x gives NaN."""
    rng = np.random.default_rng(n + k)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    wf = np.array(mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32), np.float64)
    bias = np.repeat(np.array(b.astype(mx.float32), np.float64), 64, axis=1)
    g = mx.array(1 + rng.standard_normal(k).astype(np.float32) / 4).astype(dtype)
    g = np.array(g.astype(mx.float32), np.float64)
    eps = 1e-5
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_NORM", "1")
    gpu_qstream.set_knobs(form="q4i")
    try:
        for xs in (1.0, 300.0, 1e-3):
            x = (rng.standard_normal(k) * xs).astype(np.float32)
            x = np.array(mx.array(x[None]).astype(dtype).astype(mx.float32), np.float64)[0]
            rn = 1 / np.sqrt(np.mean(x * x) + eps)
            xg = x * g
            want = (wf @ xg) * rn
            step = np.repeat(np.abs(xg.reshape(-1, 32)).max(axis=1) * 2.0**-15, 32) * rn
            bound = np.abs(wf - bias) @ step + np.abs(want) * 2.0**-8
            bound += 1e-5 * np.abs(want).max()
            norm = (mx.array(g).astype(dtype), eps)
            xm = mx.array(x[None]).astype(dtype)
            got = gpu_qstream.quantized_matmul(xm, wq, s, b, 64, norm=norm)
            got = np.array(got.astype(mx.float32), np.float64)[0]
            assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
            got = gpu_qstream.quantized_matmul(xm, wq, s, b, 64, glu=True, norm=norm)
            gate, up = want[: n // 2], want[n // 2 :]
            _close(got, mx.array((gate / (1 + np.exp(-gate)) * up)[None].astype(np.float32)))
        x[5] = np.nan
        got = gpu_qstream.quantized_matmul(mx.array(x[None]).astype(dtype), wq, s, b, 64, norm=norm)
        assert np.all(np.isnan(np.array(got.astype(mx.float32))))
    finally:
        gpu_qstream.set_knobs()


def test_plan_form_routes_by_rows():
    """``1:qstream,2:qmma``: one row on this kernel, more rows (and the RMSNorm folded
    in) on the tensor-core one; same products either way."""
    import mlx.nn as nn

    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((512, 2048)).astype(np.float32) / 40).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    deq = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    try:
        gpu_linear.set_plans(None, "1:qstream,2:qmma")
        lin = gpu_linear.GpuQuantizedLinear(wq, s, b, 64, 4, "affine")
        for m in (1, 3):
            x = mx.array(rng.standard_normal((m, 2048)).astype(np.float32)).astype(mx.bfloat16)
            r = mx.array(rng.standard_normal((m, 512)).astype(np.float32)).astype(mx.bfloat16)
            x32 = x.astype(mx.float32)
            _close(lin(x), x32 @ deq.T)
            _close(lin.fused(x, residual=r), r.astype(mx.float32) + x32 @ deq.T)
            gate, up = x32 @ deq[:256].T, x32 @ deq[256:].T
            _close(lin.fused(x, glu=True), gate * mx.sigmoid(gate) * up)
            norm = nn.RMSNorm(2048)
            norm.weight = (1 + mx.arange(2048) / 4096).astype(mx.bfloat16)  # as a bf16 model's
            xn = norm(x).astype(mx.float32)
            _close(lin.fused(x, norm=norm), xn @ deq.T)
        assert gpu_linear.uses("qstream")
    finally:
        gpu_linear.reset_plans()


@pytest.mark.parametrize("qnorm,early", [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")])
def test_decode_step_on_the_kernel_matches_the_model(monkeypatch, qnorm, early):
    """The GPU decode step with its 1-row 4-bit products on this kernel (o_proj and
    down_proj with the residual, gate_up with the SwiGLU; with MARKBASE_GPU_QSTREAM_NORM=1
    qkv, gate_up and the lm_head with their RMSNorm inside) equals the model's own call."""
    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep

    cfg = dict(hidden_size=1024, num_hidden_layers=2, intermediate_size=2048,
               num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=7, quantize_bits=4, group_size=64).model
    model.set_dtype(mx.bfloat16)
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_NORM", qnorm)
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_EARLY", early)
    try:
        gpu_linear.set_plans("1:xwt,2:mma,33:xwt", "1:qstream,2:qmma")
        step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
        step.warm_up()
        from engine.backends.cuda.products import warmup

        with_head = step._products + [(step._lm_head, False, False, True)]
        products = warmup._qstream_products(mx.bfloat16, with_head, step.fold)
        # qkv (and the lm_head: the same K) and gate_up with their RMSNorm inside;
        # o_proj and down_proj with the residual, no norm
        on = qnorm == "1"
        assert {p[2:] for p in products} == {
            (False, False, on),
            (False, True, on),
            (True, False, False),
        }
        prompts = ([5, 6, 7, 8, 9, 10],)
        check_step_matches_model(step, model, prompts)
    finally:
        gpu_linear.reset_plans()


def test_too_much_shared_memory_is_a_clear_error():
    with pytest.raises(ValueError, match="shared memory"):
        gpu_qstream.set_knobs(form="mma", stages=12, warps=16)
        try:
            gpu_qstream.launcher(mx.bfloat16, 4096, 4096, 64)
        finally:
            gpu_qstream.set_knobs()


def test_unsupported_shapes_are_refused():
    assert not gpu_qstream.supported(mx.bfloat16, 1, 64, 1000, 4, 64, "affine", object())
    assert not gpu_qstream.supported(mx.bfloat16, 2, 64, 1024, 4, 64, "affine", object())
    assert not gpu_qstream.supported(mx.bfloat16, 1, 64, 1024, 8, 64, "affine", object())
    assert not gpu_qstream.supported(mx.bfloat16, 1, 64, 1024, 4, 64, "affine", None)
    assert not gpu_qstream.supported(mx.float32, 1, 64, 1024, 4, 64, "affine", object())
    assert gpu_qstream.supported(mx.bfloat16, 1, 64, 1024, 4, 64, "affine", object())
