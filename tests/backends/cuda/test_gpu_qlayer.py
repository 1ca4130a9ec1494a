"""engine/backends/cuda/products/qlayer.py: a layer's products after the attention as one kernel (o_proj +
residual, RMSNorm, gate_up + SwiGLU, down_proj + residual, grid-wide barriers between)
equal engine/backends/cuda/products/qstream.py's separate kernels, leave their barrier ready for the next
launch, and the decode step with it equals the model (also under the compiled step).

Needs MLX's CUDA backend on a GPU with a known SM count (skipped elsewhere). On the
H200, after bench/gpu/env.sh: ``python3 -m pytest -q tests/backends/cuda/test_gpu_qlayer.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.products import qlayer as gpu_qlayer
from engine.backends.cuda.products import qstream as gpu_qstream  # noqa: E402

pytestmark = pytest.mark.skipif(
    not mx.cuda.is_available() or gpu_qlayer.sm_count() is None,
    reason="needs MLX's CUDA backend on a GPU of known SM count",
)


class _Q:
    """A 4-bit affine product's arrays, as gpu_qlayer.post reads them."""

    def __init__(self, n: int, k: int, gs: int, dtype, rng) -> None:
        w = mx.array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
        self.weight, self.scales, self.biases = mx.quantize(w, group_size=gs, bits=4)
        self.scales, self.biases = self.scales.astype(dtype), self.biases.astype(dtype)
        self.group_size, self.bits, self.mode = gs, 4, "affine"
        mx.eval(self.weight, self.scales, self.biases)


def _f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "d,f,gs", [(1024, 2048, 64), (2048, 3072, 32), (1024, 1024, 128), (4096, 14336, 64)]
)
def test_layer_kernel_equals_the_separate_kernels(d, f, gs, dtype):
    rng = np.random.default_rng(d + f + gs)
    wo, wgu, wd = _Q(d, d, gs, dtype, rng), _Q(2 * f, d, gs, dtype, rng), _Q(d, f, gs, dtype, rng)
    o = mx.array(rng.standard_normal((1, d)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((1, d)).astype(np.float32)).astype(dtype)
    nw = mx.array(rng.uniform(0.5, 1.5, (d,)).astype(np.float32)).astype(dtype)
    eps = 1e-5

    def qmm(q, v, **kw):
        return gpu_qstream.quantized_matmul(v, q.weight, q.scales, q.biases, gs, **kw)

    h = qmm(wo, o, residual=x)
    z = qmm(wgu, h, glu=True, norm=(nw, eps))
    y = qmm(wd, z, residual=h)
    slot = 1000 + d + f + gs  # a barrier of its own (shared by the two dtypes' runs)
    gen0 = np.array(gpu_qlayer.barrier(slot)).tolist()[1]
    # one launch at a time: two launches of one barrier must not run side by side (MLX's
    # CUDA graphs run nodes without a data dependency concurrently)
    got = gpu_qlayer.post(o, x, wo, wgu, wd, nw, eps, slot=slot)
    mx.eval(got)
    got_h, got_z = gpu_qlayer.post(o, x, wo, wgu, wd, nw, eps, slot=slot, all_outputs=True)[1:]
    mx.eval(got_h, got_z, y)
    assert got.shape == (1, d) and got.dtype == dtype
    # o_proj: the same arithmetic a row as the separate kernel (bit for bit)
    np.testing.assert_array_equal(_f32(got_h), _f32(h))
    # the RMSNorm's sum of squares adds in another order (16 warps, not 8): 1/rms may
    # differ in its last bit, so z and y by a rounding of their dtype
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    np.testing.assert_allclose(_f32(got_z), _f32(z), rtol=tol, atol=tol)
    np.testing.assert_allclose(_f32(got), _f32(y), rtol=tol, atol=tol * 4)
    # with the next layer's RMSNorm + q/k/v product as a fourth phase
    wq = _Q(d + d // 2, d, gs, dtype, rng)
    nw1 = mx.array(rng.uniform(0.5, 1.5, (d,)).astype(np.float32)).astype(dtype)
    y2, qkv = gpu_qlayer.post(o, x, wo, wgu, wd, nw, eps, slot=slot, next_qkv=(wq, nw1, eps))
    mx.eval(y2, qkv)
    np.testing.assert_array_equal(_f32(y2), _f32(got))
    want_qkv = qmm(wq, y2, norm=(nw1, eps))
    np.testing.assert_allclose(_f32(qkv), _f32(want_qkv), rtol=tol, atol=tol)
    bar = np.array(gpu_qlayer.barrier(slot))
    # launches of 2, 2 and 3 barriers: the count back to 0, the generation 7 further
    # on, no block waited past the limit
    assert bar.tolist()[:3] == [0, gen0 + 7, 0]
    assert not gpu_qlayer.timed_out()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("t,first", [(50, 3), (600, 0), (1, 0), (300, 300)])
def test_block_kernel_equals_attention_then_tail(t, first, dtype):
    """engine/backends/cuda/products/qblock.py: the whole layer in one kernel (attention over the whole
    cache buffer with T = pos + start + 1, its splits merged, the tail, the next q/k/v
    product) equals gpu_attention's append kernel followed by gpu_qlayer's tail, and
    writes the same k and v into the cache; rows starting late (first = T - 1: only
    the new position) included."""
    import mlx.nn as nn

    from engine.backends.cuda.attention import decode as gpu_attention
    from engine.backends.cuda.products import qblock as gpu_qblock

    rng = np.random.default_rng(t + first)
    d, f, gs, hq, hkv, hd = 1024, 2048, 64, 8, 2, 128
    cap = t + 40

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    qkv = arr(1, (hq + 2 * hkv) * hd)
    kbuf, vbuf = arr(1, hkv, cap, hd), arr(1, hkv, cap, hd)
    first = min(first, t - 1)
    start = mx.array([first], dtype=mx.int32)
    pos = mx.array([t - 1 - first], dtype=mx.int32)  # the new slot: pos + start = T - 1
    table = gpu_attention.rope_table(nn.RoPE(hd, base=10000.0), hd)
    scale = hd**-0.5
    wo, wgu, wd = _Q(d, d, gs, dtype, rng), _Q(2 * f, d, gs, dtype, rng), _Q(d, f, gs, dtype, rng)
    wq = _Q((hq + 2 * hkv) * hd, d, gs, dtype, rng)
    x = arr(1, d)
    nw = mx.array(rng.uniform(0.5, 1.5, (d,)).astype(np.float32)).astype(dtype)
    assert gpu_qblock.attention_supported(hq, hkv, hd, d, table)

    k1, v1 = mx.array(kbuf), mx.array(vbuf)
    mx.eval(k1, v1)
    o = gpu_attention.decode_attention_append(
        qkv, k1[:, :, :t], v1[:, :, :t], start, pos, table, scale, hq
    )
    y_ref = gpu_qlayer.post(o.reshape(1, -1), x, wo, wgu, wd, nw, 1e-5, slot=2000)
    mx.eval(y_ref)
    q_ref = gpu_qstream.quantized_matmul(
        y_ref, wq.weight, wq.scales, wq.biases, gs, norm=(nw, 1e-5)
    )
    mx.eval(q_ref)

    k2, v2 = mx.array(kbuf), mx.array(vbuf)
    mx.eval(k2, v2)
    outs = gpu_qblock.block(qkv, k2, v2, start, pos, table, scale, hq, x, wo, wgu, wd, nw, 1e-5,
                            slot=2001, next_qkv=(wq, nw, 1e-5), all_outputs=True)  # fmt: skip
    mx.eval(outs)
    y, attn, q_next = outs[0], outs[3], outs[7]
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    # the splits merge in another order (16 a KV head here): within a rounding
    np.testing.assert_allclose(_f32(attn), _f32(o.reshape(1, -1)), rtol=tol, atol=tol)
    np.testing.assert_allclose(_f32(y), _f32(y_ref), rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(_f32(q_next), _f32(q_ref), rtol=4 * tol, atol=4 * tol)
    # the same new k and v in the cache (the same RoPE code), nothing else changed
    np.testing.assert_array_equal(_f32(k2), _f32(k1))
    np.testing.assert_array_equal(_f32(v2), _f32(v1))
    assert not gpu_qlayer.timed_out()


@pytest.mark.parametrize("compiled", ["0", "1"])
@pytest.mark.parametrize("kind", ["1", "2", "3"])
def test_decode_step_with_the_layer_kernel_matches_the_model(monkeypatch, compiled, kind):
    """The GPU decode step at one row with each layer's tail on the one kernel (kind 2:
    with the next layer's q/k/v product in it too; and with the whole step under
    mx.compile) equals the model's own call."""
    from test_gpu_gemv import check_step_matches_model

    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep

    cfg = dict(hidden_size=1024, num_hidden_layers=2, intermediate_size=2048,
               num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=8, quantize_bits=4, group_size=64).model
    model.set_dtype(mx.bfloat16)
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_LAYER", kind)
    monkeypatch.setenv("MARKBASE_GPU_STEP_COMPILE", compiled)
    try:
        gpu_linear.set_plans("1:xwt,2:mma,33:xwt", "1:qstream,2:qmma")
        step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
        assert step.qlayer and all(step._qlayer_ok)
        assert step.qlayer_next == (kind != "1") and step._next_ok == [True, False]
        assert step.qblock == (kind == "3") and step._block_ok == [True, True]
        assert step.step_compile == (compiled == "1")
        step.warm_up()
        check_step_matches_model(step, model, ([5, 6, 7, 8, 9, 10],), steps=4)
        assert not gpu_qlayer.timed_out()
    finally:
        gpu_linear.reset_plans()


def test_unsupported_layers_are_refused():
    rng = np.random.default_rng(0)
    bf16 = mx.bfloat16
    wo, wgu, wd = (
        _Q(1024, 1024, 64, bf16, rng),
        _Q(2048, 1024, 64, bf16, rng),
        _Q(1024, 1024, 64, bf16, rng),
    )
    assert gpu_qlayer.supported(bf16, 1, 1024, 1024, wo, wgu, wd)
    assert not gpu_qlayer.supported(bf16, 2, 1024, 1024, wo, wgu, wd)  # one row only
    assert not gpu_qlayer.supported(mx.float32, 1, 1024, 1024, wo, wgu, wd)
    assert not gpu_qlayer.supported(bf16, 1, 1024, 2048, wo, wgu, wd)  # shapes disagree
    wd.biases = None
    assert not gpu_qlayer.supported(bf16, 1, 1024, 1024, wo, wgu, wd)
