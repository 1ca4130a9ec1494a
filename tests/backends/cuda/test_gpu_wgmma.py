"""engine/backends/cuda/products/wgmma.py: 4-bit products of 33-128 rows on Hopper's warpgroup MMA equal
the exact products on small integers (64- and 128-row blocks, rows past M, several row
chunks, split K and not, plain / residual / SwiGLU, bf16 and fp16), the float products
of MLX's dequantized weights, deterministically; the decode step with the kernel on
equals the model.

The launch arithmetic is checked on any machine; the rest needs an sm_90 GPU. On the
GPU machine, after bench/gpu/env.sh: ``python3 -m pytest -q tests/backends/cuda/test_gpu_wgmma.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.products import qgemm as gpu_qgemm
from engine.backends.cuda.products import wgmma as gpu_wgmma  # noqa: E402
from tests.backends.cuda.emulation.qgemm import pack  # noqa: E402  (MLX's 4-bit packing)

needs_hopper = pytest.mark.skipif(
    not (mx.cuda.is_available() and gpu_wgmma.hopper()), reason="needs an sm_90 GPU (wgmma)"
)


@pytest.mark.cpu
def test_splits_fill_the_slots_within_the_partials():
    """8b shapes on 132 SMs x 2 blocks: gate/up's 224 tiles run unsplit, o_proj's and
    down_proj's 32 tiles split 8 ways, never below MIN_SPLIT_STEPS k-steps a split, and
    never more partials than the room given."""
    slots, values, room = 264, 64 * 256, 132 * 256 * 2 * 64
    assert gpu_wgmma.splits(224, 64, slots, values, room) == 1
    assert gpu_wgmma.splits(32, 224, slots, values, room) == 8
    assert gpu_wgmma.splits(32, 64, slots, values, room) == 8
    assert gpu_wgmma.splits(48, 64, slots, values, room) == 5
    assert gpu_wgmma.splits(2, 8, slots, values, room) == 2  # 4 k-steps a split at least
    assert gpu_wgmma.splits(2, 8, slots, values, 2 * values) == 1  # partials must fit
    for tiles in (1, 3, 32, 100, 1000):
        for steps in (1, 4, 64, 224):
            s = gpu_wgmma.splits(tiles, steps, slots, values, room)
            assert s >= 1 and (s == 1 or steps // s >= gpu_wgmma.MIN_SPLIT_STEPS)
            assert s == 1 or tiles * s * values <= room


@pytest.mark.cpu
def test_geometry_and_shared_memory(monkeypatch):
    """64-row blocks to 64 rows, 128 above; four warpgroups by default, only where the
    weight rows split into 256s (else two); two blocks of two warpgroups an SM at 3 x
    stages (the launch bounds say so), and at the default 4; every form within a block's
    227 KB."""
    monkeypatch.delenv(gpu_wgmma.WG_ENV, raising=False)
    monkeypatch.delenv(gpu_wgmma.NX_ENV, raising=False)
    assert gpu_wgmma.geometry(33, 4096).bn == 64 and gpu_wgmma.geometry(64, 4096).bn == 64
    assert gpu_wgmma.geometry(65, 4096).bn == 128 and gpu_wgmma.geometry(128, 4096).bn == 128
    assert gpu_wgmma.geometry(128, 4096) == gpu_wgmma.Geometry(128, 4, 4)  # x 2 steps ahead
    assert gpu_wgmma.geometry(128, 6272).wgs == 2  # 6,272 rows: 128s, not 256s
    assert gpu_wgmma.Geometry(128, 3, 2).per_sm == 2 and gpu_wgmma.Geometry(128, 3, 4).per_sm == 1
    assert gpu_wgmma.Geometry(128, 4, 2).per_sm == 2
    monkeypatch.setenv(gpu_wgmma.WG_ENV, "2")
    assert gpu_wgmma.geometry(128, 4096).wgs == 2
    for bn in (64, 128):
        for nx in (3, 4, 5):
            for wgs in (2, 4):
                geo = gpu_wgmma.Geometry(bn, nx, wgs)
                assert geo.shared_bytes <= 227 * 1024 and geo.per_sm in (1, 2)


@pytest.mark.cpu
def test_emulated_addressing_equals_the_product():
    """The kernel's shared-memory writes, descriptor reads, fragments, split K and
    epilogues, transcribed to numpy (bench/gpu/wgmma_emulation.py), give the product,
    the residual and SwiGLU forms; the descriptor's offsets exchanged do not."""
    from tests.backends.cuda.emulation.wgmma import main, run

    main()
    rng = np.random.default_rng(1)
    x, q = rng.standard_normal((64, 128)), rng.integers(0, 16, (128, 128)).astype(float)
    s, b = np.ones((128, 2)), np.zeros((128, 2))
    got = run(x, q, s, b, 64, bn=64, swap=True)
    assert not np.allclose(got, x @ q.T, atol=1e-6)


@pytest.mark.cpu
def test_switches(monkeypatch):
    monkeypatch.delenv(gpu_wgmma.ENV, raising=False)
    assert gpu_wgmma.mode() == "auto"
    monkeypatch.setenv(gpu_wgmma.ENV, "2")
    with pytest.raises(ValueError, match=gpu_wgmma.ENV):
        gpu_wgmma.enabled()
    monkeypatch.setenv(gpu_wgmma.ENV, "0")
    assert not gpu_wgmma.takes(128, 28672, 4096)
    monkeypatch.delenv(gpu_wgmma.NX_ENV, raising=False)
    assert gpu_wgmma.x_stages() == 4  # default (measured)
    monkeypatch.setenv(gpu_wgmma.NX_ENV, "5")
    assert gpu_wgmma.x_stages() == 5
    monkeypatch.setenv(gpu_wgmma.NX_ENV, "6")
    with pytest.raises(ValueError, match=gpu_wgmma.NX_ENV):
        gpu_wgmma.x_stages()
    monkeypatch.delenv(gpu_wgmma.WEARLY_ENV, raising=False)
    assert gpu_wgmma.weights_early()  # default (measured)
    monkeypatch.setenv(gpu_wgmma.WEARLY_ENV, "0")
    assert not gpu_wgmma.weights_early()
    monkeypatch.setenv(gpu_wgmma.WEARLY_ENV, "yes")
    with pytest.raises(ValueError, match=gpu_wgmma.WEARLY_ENV):
        gpu_wgmma.weights_early()


@needs_hopper
# x buffers : warpgroups, "w": the weights' loads right after each step's wgmma
@pytest.mark.parametrize("form", ["3:2", "4:2", "3:4", "4:4", "5:4", "3:4w", "4:4w", "4:2w"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "rows,n,k,gs",
    [(128, 256, 512, 64), (40, 384, 256, 32), (100, 33792, 128, 128), (130, 256, 1024, 64),
     (64, 1024, 4096, 64), (33, 128, 64, 64)],
)  # fmt: skip
def test_exact_on_small_integers(rows, n, k, gs, dtype, form, monkeypatch):
    """4-bit values with scale 1 and bias -8, small integer inputs and residuals: every
    sum is exact in float32, so the output must equal the exact result rounded once (a
    layout error cannot hide in a tolerance). Split K (128 x 256, 130 rows: 2 row
    chunks) and not (33,792 rows: 264 tiles), 64-row blocks with rows past M."""
    nx, wgs = form.rstrip("w").split(":")
    monkeypatch.setenv(gpu_wgmma.NX_ENV, nx)
    monkeypatch.setenv(gpu_wgmma.WG_ENV, wgs)
    monkeypatch.setenv(gpu_wgmma.WEARLY_ENV, "1" if form.endswith("w") else "0")
    rng = np.random.default_rng(rows + n + k)
    q = rng.integers(0, 16, (n, k))
    wq = mx.array(pack(q))
    s = mx.ones((n, k // gs), dtype=dtype)
    b = mx.full((n, k // gs), -8.0, dtype=dtype)
    x = rng.integers(-3, 4, (rows, k)).astype(np.float32)
    exact = x @ (q - 8).T.astype(np.float32)
    xm = mx.array(x).astype(dtype)

    def as_out(a):
        return np.array(mx.array(a).astype(dtype).astype(mx.float32))

    got = gpu_wgmma.quantized_matmul(xm, wq, s, b, gs)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), as_out(exact))
    res = rng.integers(-4, 5, (rows, n)).astype(np.float32)
    got = gpu_wgmma.quantized_matmul(xm, wq, s, b, gs, residual=mx.array(res).astype(dtype))
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), as_out(exact + res))
    got = gpu_wgmma.quantized_matmul(xm, wq, s, b, gs, glu=True)
    assert got.shape == (rows, n // 2)
    gate, up = mx.array(exact[:, : n // 2]), mx.array(exact[:, n // 2 :])
    want = np.array((gate * mx.sigmoid(gate) * up).astype(mx.float32))
    got = np.array(got.astype(mx.float32))
    # silu(gate) * up of sums this large passes float16's range (65,504): compared
    # where the result fits with room for the tolerance, infinite where it is far past
    top = float(mx.finfo(dtype).max)
    fits, past = np.abs(want) < 0.9 * top, np.abs(want) > 1.1 * top
    np.testing.assert_allclose(got[fits], want[fits], rtol=2e-2, atol=1e-2)
    assert np.isinf(got[past]).all()


@needs_hopper
@pytest.mark.parametrize("rows", [33, 64, 96, 128])
def test_equals_dequantized_float_product_and_is_deterministic(rows):
    """Real-valued weights quantized by MLX: the kernel equals x @ dequantize(w).T in
    float32 within bf16 rounding, the split form gives the same bits on every call, and
    every tile counter is back to zero after the launches. Each call is evaluated
    alone: the split form's counters and partials are one set a thread, and MLX may run
    independent launches of one evaluation at the same time (the H200 run that
    evaluated three together, got unwritten outputs)."""
    rng = np.random.default_rng(rows)
    n, k = 512, 2048
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    wf = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(mx.bfloat16)
    r = mx.array(rng.standard_normal((rows, n)).astype(np.float32)).astype(mx.bfloat16)
    want = r.astype(mx.float32) + x.astype(mx.float32) @ wf.T
    outs = []
    for _ in range(3):
        outs.append(gpu_wgmma.quantized_matmul(x, wq, s, b, 64, residual=r))
        mx.eval(outs[-1])
    np.testing.assert_allclose(
        np.array(outs[0].astype(mx.float32)), np.array(want), rtol=2e-2, atol=2e-2
    )
    for o in outs[1:]:
        np.testing.assert_array_equal(
            np.array(o.astype(mx.float32)), np.array(outs[0].astype(mx.float32))
        )
    cnt, _ = gpu_qgemm.stream_k_buffers()
    assert int(mx.max(mx.abs(cnt)).item()) == 0


@needs_hopper
def test_plan_form_reaches_the_kernel(monkeypatch):
    """With the switch on, the plan's ``qgemm`` rows of a layer go to this kernel for
    every product form (an o_proj-like residual product too, which gpu_qgemm leaves
    to gpu_mma), and give the product."""
    monkeypatch.setenv(gpu_wgmma.ENV, "1")
    calls = []
    real = gpu_wgmma.launcher

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_wgmma, "launcher", spy)
    monkeypatch.setattr(gpu_wgmma, "unsplit", lambda *a: True)
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((1024, 512)).astype(np.float32) / 20).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    wf = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    x = mx.array(rng.standard_normal((100, 512)).astype(np.float32)).astype(mx.bfloat16)
    r = mx.array(rng.standard_normal((100, 1024)).astype(np.float32)).astype(mx.bfloat16)
    try:
        gpu_linear.set_plans(None, "1:qmm,33:qgemm")
        lin = gpu_linear.GpuQuantizedLinear(wq, s, b, 64, 4, "affine")
        got = lin.fused(x, residual=r)
        want = r.astype(mx.float32) + x.astype(mx.float32) @ wf.T
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)), np.array(want), rtol=2e-2, atol=2e-2
        )
        assert calls == [100]
    finally:
        gpu_linear.reset_plans()


@needs_hopper
@pytest.mark.parametrize("rows", [40, 100])
def test_gpu_decode_step_with_the_kernel_matches_the_model(rows, monkeypatch):
    """The GPU decode step with ``MARKBASE_GPU_WGMMA=1`` (every 4-bit product of 33+
    rows on this kernel: qkv, o_proj, gate/up, down_proj, the output layer) equals the
    model's own call on ragged rows."""
    from test_gpu_gemv import check_step_matches_model

    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep

    monkeypatch.setenv(gpu_wgmma.ENV, "1")
    cfg = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=1024,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=1024, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=9, quantize_bits=4, group_size=64).model
    model.set_dtype(mx.bfloat16)
    calls = []
    real = gpu_wgmma.launcher

    def spy(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_wgmma, "launcher", spy)
    monkeypatch.setattr(gpu_wgmma, "unsplit", lambda *a: True)  # the split ones too
    try:
        gpu_linear.set_plans(None, "1:qmm,2:qmma,33:qgemm")
        step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
        step.warm_up()
        prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 6)] for i in range(rows)]
        check_step_matches_model(step, model, prompts)
        assert {512, 256, 2048, 1024} <= set(calls)  # qkv, o/down, gate/up, head
    finally:
        gpu_linear.reset_plans()
