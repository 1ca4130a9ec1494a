"""engine/backends/cuda/products/qgemm.py: 4-bit products of many rows with x staged in shared memory equal
float32 products of the dequantized weights (33-257 rows: 64- and 128-row blocks, 1-8
warps, rows past the last block's), exactly on small integers; the residual and SwiGLU
forms; the stream-K form (exact, deterministic, its counters left at zero); the plan
form ``qgemm``; the decode step with it equals the model.

The launch geometry and the kernel's index logic (bench/gpu/qgemm_emulation.py, lane by
lane in numpy) are checked on any machine; the rest needs MLX's CUDA backend. On the
GPU machine, after bench/gpu/env.sh: ``python3 -m pytest -q tests/backends/cuda/test_gpu_qgemm.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_gpu_gemv import _close, check_quantized_product, check_step_matches_model  # noqa: E402

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.products import qgemm as gpu_qgemm  # noqa: E402

# (rows, N, K)
SHAPES = [(33, 256, 512), (64, 64, 256), (65, 2048, 1024), (100, 16, 128), (128, 6144, 4096),
          (130, 256, 384), (257, 512, 256), (8, 256, 512)]  # fmt: skip


@pytest.mark.cpu
def test_geometry_keeps_the_gpu_busy(monkeypatch):
    """64-row blocks of 8 warps x 2 m-tiles where the m-tiles split so (4 warps with
    MARKBASE_GPU_QGEMM_PAIR_WARPS=4); otherwise 128-row blocks from 65 rows, 8 warps for
    large weights, fewer warps (then 64-row blocks) until there are MIN_BLOCKS blocks, a
    divisor of the m-tiles always."""
    monkeypatch.delenv(gpu_qgemm.PAIR_WARPS_ENV, raising=False)
    assert gpu_qgemm.geometry(128, 28672 // 16) == (64, 8, 2)  # 8b gate_up
    assert gpu_qgemm.geometry(128, 1800) == (64, 4, 2)  # 1800 m-tiles: 8s, not 16s
    monkeypatch.setenv(gpu_qgemm.PAIR_WARPS_ENV, "4")
    assert gpu_qgemm.geometry(128, 28672 // 16) == (64, 4, 2)
    assert gpu_qgemm.geometry(128, 4096 // 16) == (64, 4, 2)  # 8b o_proj
    assert gpu_qgemm.geometry(128, 2048 // 16) == (64, 4, 2)  # 1b o_proj
    assert gpu_qgemm.geometry(128, 1796) == (128, 4, 1)  # 4 x 2 do not divide 1796 m-tiles
    assert gpu_qgemm.geometry(40, 6) == (64, 1, 1)  # too small for MIN_BLOCKS: the most blocks
    for rows in (33, 64, 65, 128, 300):
        for tiles in (1, 2, 3, 6, 96, 128, 1792):
            bm, wm, mt = gpu_qgemm.geometry(rows, tiles)
            assert bm in (64, 128) and tiles % (wm * mt) == 0
            assert mt == 1 or bm == 64  # 128-row blocks with 2 m-tiles a warp spill


@pytest.mark.cpu
def test_emulated_layout_equals_the_product():
    """The kernel's copies, fragments and epilogue, lane by lane (numpy), give the
    product, the residual form and the SwiGLU form (64- and 128-row blocks)."""
    from tests.backends.cuda.emulation.qgemm import pack, run

    rng = np.random.default_rng(1)
    for m, nw, k, gs, shape in [(70, 64, 256, 64, (128, 2)), (40, 32, 128, 32, (64, 1))]:
        x = 0.1 * rng.standard_normal((m, k))
        q = rng.integers(0, 16, (nw, k))
        s, b = 0.1 * rng.standard_normal((nw, k // gs)), 0.1 * rng.standard_normal((nw, k // gs))
        wd = q * np.repeat(s, gs, axis=1) + np.repeat(b, gs, axis=1)
        res = rng.standard_normal((m, nw))
        np.testing.assert_allclose(run(x, pack(q), s, b, gs, shape), x @ wd.T, atol=1e-9)
        got = run(x, pack(q), s, b, gs, shape, residual=res)
        np.testing.assert_allclose(got, res + x @ wd.T, atol=1e-9)
        gate, up = x @ wd[: nw // 2].T, x @ wd[nw // 2 :].T
        got = run(x, pack(q), s, b, gs, shape, glu=True)
        np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, atol=1e-9)
    # stream-K: 2 tiles of 4 k-steps over 3 blocks (cut tiles, a block with two cut
    # passes), the blocks in two orders: the same sums to the bit, and the product
    x = 0.1 * rng.standard_normal((40, 512))
    q = rng.integers(0, 16, (128, 512))
    s, b = 0.1 * rng.standard_normal((128, 8)), 0.1 * rng.standard_normal((128, 8))
    wd = q * np.repeat(s, 64, axis=1) + np.repeat(b, 64, axis=1)
    res = rng.standard_normal((40, 128))
    first, second = (run(x, pack(q), s, b, 64, (64, 2, 2), res, sk_grid=3, seed=i) for i in (0, 1))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, res + x @ wd.T, atol=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_qgemm(shape, dtype):
    check_quantized_product(gpu_qgemm.quantized_matmul, shape, dtype)


@pytest.mark.cpu
def test_wide_enough_and_stages_switch(monkeypatch):
    """One tile a block (MARKBASE_GPU_QGEMM_SK=0, 4 warps a pair block): qgemm only for
    products whose blocks get 4+ warps (the 8b model's gate/up at 128 rows, not its
    o_proj); the stage count comes from the environment, checked."""
    monkeypatch.setenv(gpu_qgemm.SK_ENV, "0")
    monkeypatch.setenv(gpu_qgemm.PAIR_WARPS_ENV, "4")
    assert gpu_qgemm.wide_enough(128, 28672 // 16)  # 8b gate/up: 448 blocks
    assert gpu_qgemm.wide_enough(64, 28672 // 16)  # 224
    assert not gpu_qgemm.wide_enough(128, 4096 // 16)  # 8b o_proj: 64 blocks
    assert not gpu_qgemm.wide_enough(128, 6144 // 16)  # 8b qkv: 96
    assert not gpu_qgemm.wide_enough(1024, 126)  # 126 m-tiles: 64-row blocks of 1 warp
    assert gpu_qgemm.takes(128, 28672 // 16, glu=True)
    monkeypatch.delenv(gpu_qgemm.PLAIN_ENV, raising=False)
    assert gpu_qgemm.takes(128, 128256 // 16, False, 4096)  # 8b's output layer
    assert not gpu_qgemm.takes(128, 32000 // 16, False, 2048)  # 1b's: K too short
    assert not gpu_qgemm.takes(128, 4096 // 16, False, 14336, residual=True)  # down_proj
    monkeypatch.setenv(gpu_qgemm.PLAIN_ENV, "0")  # off: the output layer on qmma
    assert not gpu_qgemm.takes(128, 128256 // 16, False, 4096)
    monkeypatch.delenv(gpu_qgemm.PLAIN_ENV)
    with pytest.raises(ValueError, match="do not split"):
        gpu_qgemm._launch(mx.bfloat16, 64, 16 * 6, 64, False, False, 64, 4, mt=2)
    monkeypatch.setenv(gpu_qgemm.STAGES_ENV, "2")
    assert gpu_qgemm.stages() == 2
    monkeypatch.setenv(gpu_qgemm.STAGES_ENV, "4")
    with pytest.raises(ValueError, match="want 2 or 3"):
        gpu_qgemm.stages()
    monkeypatch.delenv(gpu_qgemm.STAGES_ENV)
    assert gpu_qgemm.stages() == 3
    assert gpu_qgemm.stages(mt=2) == 2


@pytest.mark.parametrize("stages", ["2", "3"])
@pytest.mark.parametrize("k", [128, 256, 384, 640])
def test_exact_on_small_integers(k, stages, monkeypatch):
    """4-bit values with scale 1 and bias -8 and small integer inputs: every product
    and sum is exact in float32, so the kernel must equal the exact result rounded
    once to bf16 (a layout error cannot hide in a tolerance). K from 1 step (fewer
    than the pipeline's depth) to 5, both pipeline depths."""
    from tests.backends.cuda.emulation.qgemm import pack

    monkeypatch.setenv(gpu_qgemm.STAGES_ENV, stages)
    rng = np.random.default_rng(4)
    n = 256
    q = rng.integers(0, 16, (n, k))
    wq = mx.array(pack(q))
    s = mx.ones((n, k // 64), dtype=mx.bfloat16)
    b = mx.full((n, k // 64), -8.0, dtype=mx.bfloat16)
    for m in (33, 64, 77, 128, 160):
        x = rng.integers(-3, 4, (m, k)).astype(np.float32)
        got = gpu_qgemm.quantized_matmul(mx.array(x).astype(mx.bfloat16), wq, s, b, 64)
        want = mx.array(x @ (q - 8).T.astype(np.float32)).astype(mx.bfloat16)
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        )


@pytest.mark.parametrize("stages", ["2", "3"])
@pytest.mark.parametrize("shape", [(64, 4), (64, 8), (64, 1)])
def test_two_m_tiles_a_warp_exact(shape, stages, monkeypatch):
    """``mt=2`` (bench/gpu/qgemm_sweep.py's form: each x fragment feeds two weight
    tiles): exact on small integers, plain, residual and SwiGLU, 1-3 row chunks."""
    from tests.backends.cuda.emulation.qgemm import pack

    monkeypatch.setenv(gpu_qgemm.STAGES_ENV, stages)
    bm, wm = shape
    rng = np.random.default_rng(9)
    k, n = 384, 16 * wm * 2 * 2  # two blocks' worth of m-tiles
    q = rng.integers(0, 16, (n, k))
    ins = [mx.array(pack(q)), mx.ones((n, k // 64), dtype=mx.bfloat16)]
    ins.append(mx.full((n, k // 64), -8.0, dtype=mx.bfloat16))
    wint = (q - 8).astype(np.float32)
    for m in (33, 64, 150):
        x = rng.integers(-3, 4, (m, k)).astype(np.float32)
        xb = mx.array(x).astype(mx.bfloat16)
        r = rng.integers(-3, 4, (m, n)).astype(np.float32)
        got = gpu_qgemm._launch(mx.bfloat16, m, n, 64, False, False, bm, wm, mt=2)([xb, *ins])
        want = x @ wint.T
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), _bf16(want))
        res = gpu_qgemm._launch(mx.bfloat16, m, n, 64, True, False, bm, wm, mt=2)(
            [xb, *ins, mx.array(r).astype(mx.bfloat16)]
        )
        np.testing.assert_array_equal(np.array(res.astype(mx.float32)), _bf16(want + r))
        glu = gpu_qgemm._launch(mx.bfloat16, m, n, 64, False, True, bm, wm, mt=2)([xb, *ins])
        gate, up = want[:, : n // 2], want[:, n // 2 :]
        _close(glu, mx.array(gate / (1 + np.exp(-gate)) * up))


@pytest.mark.cpu
def test_stream_k_switch(monkeypatch):
    """``MARKBASE_GPU_QGEMM_SK``: 0/1/2, checked; at 2 every product whose m-tiles
    split into the 2-m-tile geometry is the kernel's (o_proj and down_proj too); the
    grid is the SMs' slots, never more blocks than k-steps; the form needs K."""
    monkeypatch.delenv(gpu_qgemm.SK_ENV, raising=False)
    assert gpu_qgemm.stream_k() == 3  # the default
    monkeypatch.setenv(gpu_qgemm.SK_ENV, "0")
    monkeypatch.setenv(gpu_qgemm.PAIR_WARPS_ENV, "4")
    assert not gpu_qgemm.takes(128, 4096 // 16, False, 14336, residual=True)
    monkeypatch.setenv(gpu_qgemm.SK_ENV, "2")
    assert gpu_qgemm.takes(128, 4096 // 16, False, 14336, residual=True)  # down_proj
    assert gpu_qgemm.takes(40, 6144 // 16, False, 4096)  # qkv
    assert not gpu_qgemm.takes(128, 1796, glu=True)  # 4 x 2 do not divide 1796 m-tiles
    monkeypatch.setenv(gpu_qgemm.SK_ENV, "4")
    with pytest.raises(ValueError, match="want 0, 1, 2 or 3"):
        gpu_qgemm.stream_k()
    # 3: where the sweep saw it win (8 warps a block, 132 SMs)
    monkeypatch.setattr(gpu_qgemm, "stream_k_slots", lambda wm, mt: 132 * (2 if wm == 4 else 1))
    monkeypatch.setenv(gpu_qgemm.SK_ENV, "3")
    monkeypatch.setenv(gpu_qgemm.PAIR_WARPS_ENV, "8")
    assert gpu_qgemm.takes(64, 28672 // 16, True, 4096)  # 8b gate/up
    assert gpu_qgemm.takes(64, 6144 // 16, False, 4096)  # 8b qkv
    assert not gpu_qgemm.takes(128, 3072 // 16, False, 2048)  # 1b qkv
    assert gpu_qgemm.takes(64, 32000 // 16, False, 2048)  # 1b output layer
    assert gpu_qgemm.takes(128, 4096 // 16, False, 14336, residual=True)  # 8b down_proj
    assert not gpu_qgemm.takes(64, 4096 // 16, False, 14336, residual=True)
    assert not gpu_qgemm.takes(128, 4096 // 16, False, 4096, residual=True)  # 8b o_proj
    assert not gpu_qgemm.takes(128, 2048 // 16, False, 8192, residual=True)  # 1b down_proj
    monkeypatch.undo()
    monkeypatch.delenv(gpu_qgemm.PAIR_WARPS_ENV, raising=False)
    monkeypatch.setenv(gpu_qgemm.SK_ENV, "1")
    assert gpu_qgemm.takes(128, 28672 // 16, glu=True)
    assert not gpu_qgemm.takes(128, 4096 // 16, False, 14336, residual=True)
    from engine import platform

    slots = (platform.sm_count() or gpu_qgemm.SMS) * 2
    assert gpu_qgemm.stream_k_grid(448, 32, 4, 2) == slots  # 8b gate/up at 128 rows
    assert gpu_qgemm.stream_k_grid(2, 3, 4, 2) == 6  # a k-step a block at least
    with pytest.raises(ValueError, match="needs the input size"):
        gpu_qgemm._launch(mx.bfloat16, 64, 128, 64, False, False, 64, 4, mt=2, sk=True)
    # 8 warps a block of the 2-m-tile geometry: where the m-tiles split into 16
    monkeypatch.setenv(gpu_qgemm.PAIR_WARPS_ENV, "8")
    assert gpu_qgemm.geometry(128, 28672 // 16) == (64, 8, 2)
    assert gpu_qgemm.stream_k_grid(224, 32, 8, 2) == slots // 2  # one block an SM
    assert gpu_qgemm.geometry(128, 1800) != (64, 8, 2)  # 1800 m-tiles: not 16s
    monkeypatch.setenv(gpu_qgemm.PAIR_WARPS_ENV, "6")
    with pytest.raises(ValueError, match="want 4 or 8"):
        gpu_qgemm.pair_warps()


@pytest.mark.parametrize("grid", [1, 3, 0])  # 0: as the launch sizes it
@pytest.mark.parametrize("shape", [(64, 4, 2), (64, 8, 2), (128, 8, 1), (64, 2, 1)])
def test_stream_k_exact(shape, grid, monkeypatch):
    """The stream-K form (``sk``): exact on small integers with scales and biases that
    differ by row and group, plain, residual and SwiGLU, 1-5 k-steps, 33-150 rows, with
    one block doing every tile, 3 blocks cutting tiles, and the SMs' worth; called
    twice in a row (the tile counters are left at zero for the next launch) and equal
    to the bit each time; the thread's counters are all zero after."""
    from tests.backends.cuda.emulation.qgemm import pack

    if grid:
        # never more blocks than k-steps in all: the kernel's contract (stream_k_grid)
        monkeypatch.setattr(
            gpu_qgemm, "stream_k_grid", lambda tiles, steps, wm, mt: min(grid, tiles * steps)
        )
    bm, wm, mt = shape
    rng = np.random.default_rng(13)
    n = 16 * wm * mt * 2  # two blocks' worth of m-tiles
    for k in (128, 640):
        q = rng.integers(0, 16, (n, k))
        s = 2.0 ** rng.integers(-1, 2, (n, k // 64))
        b = rng.integers(-8, 1, (n, k // 64)).astype(np.float64)
        wint = (q * np.repeat(s, 64, axis=1) + np.repeat(b, 64, axis=1)).astype(np.float32)
        ins = [mx.array(pack(q)), mx.array(s).astype(mx.bfloat16), mx.array(b).astype(mx.bfloat16)]
        for m in (33, 150):
            x = rng.integers(-3, 4, (m, k)).astype(np.float32)
            xb = mx.array(x).astype(mx.bfloat16)
            r = mx.array(rng.integers(-3, 4, (m, n)).astype(np.float32)).astype(mx.bfloat16)
            want = x @ wint.T

            fns = {
                (res, glu): gpu_qgemm._launch(mx.bfloat16, m, n, 64, res, glu, bm, wm, mt, True, k)
                for res, glu in ((False, False), (True, False), (False, True))
            }
            got = _twice(fns[False, False], [xb, *ins])
            np.testing.assert_array_equal(got, _bf16(want))
            got = _twice(fns[True, False], [xb, *ins, r])
            np.testing.assert_array_equal(got, _bf16(want + np.array(r.astype(mx.float32))))
            gate, up = want[:, : n // 2], want[:, n // 2 :]
            got = _twice(fns[False, True], [xb, *ins])
            _close(mx.array(got), mx.array(gate / (1 + np.exp(-gate)) * up))
    counters, _ = gpu_qgemm.stream_k_buffers()
    assert int(mx.abs(counters).sum().item()) == 0


def test_stream_k_equals_one_tile_a_block_on_model_shapes(monkeypatch):
    """8b-like gate/up (28,672 x 4,096) and down_proj (4,096 x 14,336, residual) at 128
    and 64 rows, random weights: the stream-K form within a rounding of the one-tile
    form, deterministic over three calls."""
    rng = np.random.default_rng(17)
    for n, k, residual, glu in ((28672, 4096, False, True), (4096, 14336, True, False)):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        for m in (128, 64):
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)
            ins = [x, wq, s, b]
            if residual:
                ins.append(mx.array(rng.standard_normal((m, n)).astype(np.float32)).astype(x.dtype))
            bm, wm, mt = gpu_qgemm.geometry(m, n // 16)
            one = gpu_qgemm._launch(mx.bfloat16, m, n, 64, residual, glu, bm, wm, mt)(ins)
            sk = gpu_qgemm._launch(mx.bfloat16, m, n, 64, residual, glu, bm, wm, mt, True, k)
            outs = []
            for _ in range(3):
                outs.append(sk(ins))
                mx.eval(outs[-1])
            for o in outs[1:]:
                assert mx.array_equal(o, outs[0]).item()
            _close(outs[0], one.astype(mx.float32))


def _twice(fn, inputs) -> np.ndarray:
    """``fn(inputs)`` twice, one evaluation at a time (the stream-K launches share the
    thread's tile counters), equal to the bit; the first as float32 numpy."""
    first = fn(inputs)
    mx.eval(first)
    second = fn(inputs)
    mx.eval(second)
    a, b = (np.array(o.astype(mx.float32)) for o in (first, second))
    np.testing.assert_array_equal(a, b)
    return a


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))


@pytest.mark.parametrize("m", [33, 64, 100, 128, 200])
def test_residual_and_glu(m):
    rng = np.random.default_rng(m)
    n, k = 512, 512
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    wf = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)
    r = mx.array(rng.standard_normal((m, n)).astype(np.float32)).astype(mx.bfloat16)
    x32 = x.astype(mx.float32)
    got = gpu_qgemm.quantized_matmul(x, wq, s, b, 64, residual=r)
    _close(got, r.astype(mx.float32) + x32 @ wf.T)
    got = gpu_qgemm.quantized_matmul(x, wq, s, b, 64, glu=True)
    assert got.shape == (m, n // 2)
    gate, up = x32 @ wf[: n // 2].T, x32 @ wf[n // 2 :].T
    _close(got, gate * mx.sigmoid(gate) * up)
    with pytest.raises(ValueError, match="glu and residual"):
        gpu_qgemm.quantized_matmul(x, wq, s, b, 64, residual=r, glu=True)


def test_plan_form_reaches_the_kernel_for_gate_up_only(monkeypatch):
    """The plan's ``qgemm`` runs a SwiGLU gate/up product with enough blocks (16384
    weight rows at 40 rows: 128 blocks); a plain product (the module route) goes to
    qmma, and both give the product."""
    rng = np.random.default_rng(6)
    calls = []
    real = gpu_qgemm.launcher

    def spy(*args, **kwargs):
        calls.append(args[6] if len(args) > 6 else kwargs.get("glu", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_qgemm, "launcher", spy)
    w = mx.array(rng.standard_normal((16384, 256)).astype(np.float32) / 20).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((40, 256)).astype(np.float32)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    deq = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    xf = x.astype(mx.float32)
    try:
        gpu_linear.set_plans(None, "1:qmm,33:qgemm")
        q = gpu_linear.GpuQuantizedLinear(wq, s, b, 64, 4, "affine")
        run = q._launcher(mx.bfloat16, 40, residual=False, glu=True, norm=False)
        gate, up = xf @ deq[:8192].T, xf @ deq[8192:].T
        _close(run([x, wq, s, b]), gate * mx.sigmoid(gate) * up)
        assert calls == [True]
        _close(q(x), xf @ deq.T)  # the [B, D] module route: plain, on qmma
        assert calls == [True]
    finally:
        gpu_linear.reset_plans()


def test_warm_compiles_without_error():
    gpu_qgemm.warm(mx.bfloat16, [(64, 512, 4096, True, False), (64, 512, 28672, False, True)])


@pytest.mark.parametrize("sk", ["0", "2", "3"])
@pytest.mark.parametrize("head_on_kernel", [False, True])
def test_gpu_decode_step_with_the_kernel_matches_the_model(head_on_kernel, sk, monkeypatch):
    """The GPU decode step with its gate/up product of 33+ rows on this kernel (the
    SwiGLU in it; 16,384 intermediate dims give it 128 blocks of the 8-warp pair form at
    40 rows) equals the model's own call, 40 ragged rows; ``head_on_kernel``: the output
    layer too (a 32,768-word vocabulary: 128 blocks at 40 rows; its K lowered to this
    model's 256);
    ``sk`` 2: every product in the stream-K form (qkv, o_proj, down_proj too); 3: the
    default's choice."""
    monkeypatch.setenv(gpu_qgemm.SK_ENV, sk)
    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep

    cfg = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=16384,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=32768 if head_on_kernel else 512,
               tie_word_embeddings=False)  # fmt: skip
    assert gpu_qgemm.takes(40, 2 * 16384 // 16, glu=True, k=256)
    monkeypatch.setattr(gpu_qgemm, "PLAIN_MIN_K", 256 if head_on_kernel else 1 << 30)
    if sk == "0":
        assert gpu_qgemm.takes(40, cfg["vocab_size"] // 16, False, 256) == head_on_kernel
    model = build_random_model("llama", cfg, seed=9, quantize_bits=4, group_size=64).model
    model.set_dtype(mx.bfloat16)
    try:
        gpu_linear.set_plans(None, "1:qmm,2:qmma,33:qgemm")
        step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
        step.warm_up()
        prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 6)] for i in range(40)]
        check_step_matches_model(step, model, prompts)
    finally:
        gpu_linear.reset_plans()


@pytest.mark.cpu
def test_counters_and_partials_are_per_thread():
    """The attention's split counters and the stream-K buffers are one set per thread
    (each model's worker thread has its own MLX stream, whose launches may run at the
    same time as another's), the same set on every call of one thread, zeros when made."""
    import threading

    from engine.backends.cuda.attention import decode as gpu_attention

    mine = (gpu_attention._counters(100, 0), gpu_qgemm.stream_k_buffers())
    assert gpu_attention._counters(100, 0) is mine[0]
    assert gpu_qgemm.stream_k_buffers()[0] is mine[1][0]
    other: list = []

    def work():
        other.append((gpu_attention._counters(100, 0), gpu_qgemm.stream_k_buffers()))
        mx.synchronize()
        mx.clear_streams()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert other[0][0] is not mine[0]
    assert all(a is not b for a, b in zip(other[0][1], mine[1]))
    assert int(mx.abs(other[0][0]).sum().item()) == 0
    assert int(mx.abs(other[0][1][0]).sum().item()) == 0
