"""engine/backends/cuda/attention/decode.py: the decode attention kernel equals grouped attention under
the batch's mask, for ragged rows, split and unsplit time axes, bf16 and float32.

The kernel tests need MLX's CUDA backend (skipped elsewhere; on the H200:
``python3 -m pytest -q tests/backends/cuda/test_gpu_attention.py`` after bench/gpu/env.sh); the
split and support rules are plain Python and run everywhere. ``bench/gpu/nvrtc_check.py``
compiles the kernels without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine.backends.cuda.attention import decode as gpu_attention  # noqa: E402
from engine.model.attention import grouped_decode_attention  # noqa: E402


@pytest.fixture(autouse=True)
def default_loop_shape():
    """Each test starts and ends with the loop shape from the environment."""
    gpu_attention.set_loop_shape(None)
    yield
    gpu_attention.set_loop_shape(None)


@pytest.mark.cpu
def test_splits_give_enough_blocks_and_enough_work_per_block():
    # one row of an 8-KV-head model at 600 positions: 5 blocks of ~120 positions per head
    assert gpu_attention.splits(1, 8, 600) == 5
    # many rows already fill the GPU: no split, no merge kernel
    assert gpu_attention.splits(128, 8, 600) == 1
    assert gpu_attention.splits(32, 8, 4000) == 2
    # short rows never split below ~128 positions a block
    assert gpu_attention.splits(1, 8, 100) == 1
    assert gpu_attention.splits(1, 1, 100_000) == 64


@pytest.mark.cpu
def test_supported_shapes():
    assert gpu_attention.supported(32, 8, 128, mx.bfloat16) is None
    assert gpu_attention.supported(32, 8, 64, mx.float32) is None
    assert gpu_attention.supported(4, 2, 16, mx.float32) is not None  # head_dim 16
    assert gpu_attention.supported(6, 4, 64, mx.float16) is not None  # 6 over 4
    assert gpu_attention.supported(64, 2, 128, mx.bfloat16) is not None  # group 32
    assert gpu_attention.supported(32, 8, 128, mx.int8) is not None


def _case(b, hq, hkv, t, d, dtype, starts, seed=0, capacity=None):
    rng = np.random.default_rng(seed)
    cap = capacity or t
    q = mx.array(rng.standard_normal((b, hq, 1, d)).astype(np.float32)).astype(dtype)
    kbuf = mx.array(rng.standard_normal((b, hkv, cap, d)).astype(np.float32)).astype(dtype)
    vbuf = mx.array(rng.standard_normal((b, hkv, cap, d)).astype(np.float32)).astype(dtype)
    # views [:, :, :t] of capacity buffers, as BatchKV.update_and_fetch returns them
    k, v = kbuf[:, :, :t, :], vbuf[:, :, :t, :]
    start = mx.array(starts, dtype=mx.int32)
    pos = mx.arange(t)
    mask = (pos[None, :] >= start[:, None])[:, None, None, :]
    scale = d**-0.5
    want = grouped_decode_attention(q, k, v, scale, mask)
    got = gpu_attention.decode_attention(q, k, v, start, scale)
    return np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))


CASES = [
    # (B, Hq, Hkv, T, D, starts): unsplit and split, ragged and equal rows
    (1, 32, 8, 600, 128, [0]),
    (1, 8, 8, 37, 64, [0]),
    (3, 32, 8, 300, 64, [0, 17, 299]),
    (8, 16, 4, 1000, 128, [0, 1, 2, 500, 900, 998, 999, 3]),
    (40, 32, 8, 200, 64, [i * 4 for i in range(40)]),
    (2, 64, 8, 130, 128, [0, 129]),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_grouped_attention(case, dtype):
    """Split rows merged by their last block."""
    gpu_attention.set_loop_shape(gpu_attention.LoopShape())
    b, hq, hkv, t, d, starts = case
    got, want = _case(b, hq, hkv, t, d, dtype, starts, capacity=t + 64)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_decode_step_with_kernel_equals_model():
    """The fused GPU decode step with the kernel gives the model's own logits on a
    ragged batch (head_dim 64, so the kernel is used)."""
    from engine.loading import build_random_model
    from engine.model.decode_step import make_decode_step
    from tests.helpers.models import LLAMA_HD64, RAGGED_PROMPTS, prefilled_batch

    model = build_random_model("llama", LLAMA_HD64, seed=0).model
    prompts = RAGGED_PROMPTS

    tokens = mx.array([[11], [12], [13]])
    want = model(tokens, cache=prefilled_batch(model, prompts))[:, -1, :]
    step = make_decode_step(model)
    assert step.attention_kernel
    got = step(tokens, prefilled_batch(model, prompts))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3, rtol=1e-3)


def _ropes():
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    return {
        "plain": lambda d: nn.RoPE(d, base=10000.0),
        "traditional": lambda d: nn.RoPE(d, traditional=True, base=500000.0),
        "scaled": lambda d: nn.RoPE(d, base=10000.0, scale=0.25),
        "llama3": lambda d: Llama3RoPE(d, base=500000.0, scaling_config=llama3),
    }


def _rotate(x, table, pos):
    """The kernel's RoPE in numpy: x [B, H, D] float64, pos [B]."""
    inv = np.array(table.inv_freq)
    # the angle in float32 as the kernel (and MLX's rope) forms it
    p = (np.float32(table.scale) * pos.astype(np.float32))[:, None, None]
    ang = (p * inv[None, None, :]).astype(np.float64)  # [B, 1, D/2]
    c, s = np.cos(ang), np.sin(ang)
    if table.traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["plain", "traditional", "scaled", "llama3"])
def test_rope_table_is_the_modules_rope(kind):
    """The table the append kernel uses rotates like the module itself (runs on any
    backend: the kernel's arithmetic in numpy against mx.fast.rope)."""
    d = 128
    rope = _ropes()[kind](d)
    table = gpu_attention.rope_table(rope, d)
    assert table is not None and table.traditional == (kind == "traditional")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, d)).astype(np.float32)
    pos = np.array([0, 7, 1000, 30000])
    want = rope(mx.array(x)[:, :, None, :], offset=mx.array(pos, dtype=mx.int32))[:, :, 0, :]
    got = _rotate(x.astype(np.float64), table, pos)
    # exact up to how the float32 angle rounds (~1e-7 of it: ~3e-3 rad at 30,000)
    np.testing.assert_allclose(got[:2], np.array(want)[:2], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, np.array(want), atol=1e-2, rtol=0)


# the loop shapes bench/gpu/attn_bench.py compares: lanes a position, positions in flight,
# vector loads, positions a block, warps a block
SHAPES = [
    "l32u2",
    "l32u8",
    "l32u4v",
    "l32u8v",
    "l16u2v",
    "l16u4",
    "l8u2vp32",
    "l16u4vw4",
    "l32u4p16w2",
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[5]])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_loop_shapes_give_the_same_attention(shape, case, dtype):
    """Every loop shape computes the same attention, split and unsplit, ragged rows."""
    gpu_attention.set_loop_shape(gpu_attention.LoopShape.parse(shape))
    b, hq, hkv, t, d, starts = case
    got, want = _case(b, hq, hkv, t, d, dtype, starts, capacity=t + 64)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.cpu
def test_loop_shape_knobs(monkeypatch):
    for name in ("U", "VEC", "LANES", "PPB", "WARPS"):
        monkeypatch.delenv(f"MARKBASE_GPU_ATTN_{name}", raising=False)
    gpu_attention.set_loop_shape(None)
    assert gpu_attention.fixed_shape() is None  # each launch: auto_shape
    monkeypatch.setenv("MARKBASE_GPU_ATTN_U", "8")
    monkeypatch.setenv("MARKBASE_GPU_ATTN_VEC", "1")
    monkeypatch.setenv("MARKBASE_GPU_ATTN_LANES", "16")
    from engine.backends.cuda.attention import decode_tc as tc

    monkeypatch.setenv(tc.ENV, "0")
    monkeypatch.setenv(tc.SPLIT_ENV, "0")
    gpu_attention.set_loop_shape(None)
    want = gpu_attention.LoopShape(lanes=16, u=8, vec=True)
    assert gpu_attention.fixed_shape() == want == gpu_attention.LoopShape.parse("l16u8v")
    # a shape from the environment keeps the tensor-core forms as their switches say
    monkeypatch.delenv(tc.ENV)
    monkeypatch.delenv(tc.SPLIT_ENV)
    gpu_attention.set_loop_shape(None)
    assert gpu_attention.fixed_shape() == gpu_attention.LoopShape.parse("l16u8vcs")
    want = gpu_attention.LoopShape(lanes=8, u=2, ppb=64, warps=4)
    assert gpu_attention.LoopShape.parse("l8u2p64w4") == want
    monkeypatch.setenv("MARKBASE_GPU_ATTN_U", "3")
    gpu_attention.set_loop_shape(None)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        gpu_attention.fixed_shape()
    with pytest.raises(ValueError, match="x3"):
        gpu_attention.LoopShape.parse("l16x3")


@pytest.mark.cpu
def test_auto_shape_follows_the_measurements():
    """Few blocks (one row split over time): 8 positions in flight, scalar loads, 8
    warps; many: vector loads, with 8 in flight and 4 warps at head_dim 128."""
    shape = gpu_attention.auto_shape
    assert shape(40, 128) == gpu_attention.LoopShape(u=8)
    assert shape(1024, 128) == gpu_attention.LoopShape(u=8, vec=True, warps=4)
    assert shape(1024, 64) == gpu_attention.LoopShape(u=4, vec=True)
    assert len(gpu_attention.auto_shapes(128)) == 2


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_automatic_shapes_give_the_same_attention(case, dtype):
    """What the engine runs by default: the shape auto_shape picks per launch."""
    gpu_attention.set_loop_shape(None)
    if gpu_attention.fixed_shape() is not None:
        pytest.skip("MARKBASE_GPU_ATTN_* set: the fixed shape is tested elsewhere")
    b, hq, hkv, t, d, starts = case
    got, want = _case(b, hq, hkv, t, d, dtype, starts, capacity=t + 64)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.cpu
def test_rope_table_refuses_what_the_kernel_cannot_apply():
    import mlx.nn as nn

    assert gpu_attention.rope_table(nn.RoPE(64), 128) is None  # partial rotary
    assert gpu_attention.rope_table(nn.RoPE(32, traditional=True), 32) is None
    assert gpu_attention.rope_table(object(), 128) is None


APPEND_CASES = [
    # (B, Hq, Hkv, T already cached, D, starts): unsplit and split, ragged rows, a row
    # whose only valid position is the new one
    (1, 32, 8, 600, 128, [0]),
    (3, 32, 8, 300, 64, [0, 17, 300]),
    (8, 16, 4, 1000, 128, [0, 1, 2, 500, 900, 998, 1000, 3]),
    (40, 32, 8, 200, 64, [i * 4 for i in range(40)]),
    (2, 8, 8, 0, 64, [0, 0]),
]


@pytest.mark.parametrize("case", APPEND_CASES)
@pytest.mark.parametrize("kind", ["plain", "traditional", "llama3"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "shape", ["auto", "l16u2v", "l8u4vp32", "l32u8p16", "c", "cp100000", "cs", "csp16"]
)
def test_append_kernel_equals_rope_write_and_attention(case, kind, dtype, shape):
    """decode_attention_append == RoPE on q and k, k and v written at slot T, then the
    attention over [start, T]; and the cache buffers hold the new k and v after. Also
    for loop shapes where several positions share a warp (RoPE's pairs, the new
    position and the merge of a warp's positions then differ); and on tensor cores
    (``c``: where the launch is unsplit; ``cp100000``: every bf16 case unsplit, so one
    warp walks up to 1,000 positions, ragged starts, a row with only the new one;
    ``cs``: the split launches as one block a (row, KV head), ``csp16`` with more of
    them in that form)."""
    gpu_attention.set_loop_shape(None if shape == "auto" else gpu_attention.LoopShape.parse(shape))
    _append_case(case, kind, dtype)


def _append_case(case, kind, dtype):
    b, hq, hkv, t, d, starts = case
    rng = np.random.default_rng(3)
    cap = t + 40

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    qkv = arr(b, (hq + 2 * hkv) * d)
    kbuf, vbuf = arr(b, hkv, cap, d), arr(b, hkv, cap, d)
    start = mx.array(starts, dtype=mx.int32)
    pos = mx.array([t - s + 5 for s in starts], dtype=mx.int32)  # any positions
    rope = _ropes()[kind](d)
    table = gpu_attention.rope_table(rope, d)
    scale = d**-0.5

    q, k, v = mx.split(qkv, [hq * d, (hq + hkv) * d], axis=1)
    q = rope(q.reshape(b, hq, 1, d), offset=pos)
    k = rope(k.reshape(b, hkv, 1, d), offset=pos)
    v = v.reshape(b, hkv, 1, d)
    kref = mx.concatenate([kbuf[:, :, :t], k], axis=2)
    vref = mx.concatenate([vbuf[:, :, :t], v], axis=2)
    mask = (mx.arange(t + 1)[None, :] >= start[:, None])[:, None, None, :]
    want = grouped_decode_attention(q, kref, vref, scale, mask)

    kmine, vmine = mx.array(kbuf), mx.array(vbuf)  # copies: the kernel writes slot t
    mx.eval(kmine, vmine)
    got = gpu_attention.decode_attention_append(
        qkv, kmine[:, :, : t + 1], vmine[:, :, : t + 1], start, pos, table, scale, hq
    )
    mx.eval(got)
    tol = 5e-4 if dtype == mx.float32 else 2e-2

    def f32(a):
        return np.array(a.astype(mx.float32))

    np.testing.assert_allclose(f32(got), f32(want), atol=tol, rtol=tol)
    # MLX's rope kernel and ours round the angle's cos/sin differently at large
    # positions (~3e-4 at 1,000 in float32)
    ktol = max(tol, 2e-3)
    np.testing.assert_allclose(f32(kmine[:, :, t : t + 1]), f32(k), atol=ktol, rtol=ktol)
    np.testing.assert_array_equal(f32(vmine[:, :, t : t + 1]), f32(v))
    # the split form's counters are back to zero for the next launch
    assert all(int(c.sum().item()) == 0 for c in gpu_attention._COUNTERS.values())
    # nothing else in the buffers changed
    np.testing.assert_array_equal(f32(kmine[:, :, :t]), f32(kbuf[:, :, :t]))
    np.testing.assert_array_equal(f32(kmine[:, :, t + 1 :]), f32(kbuf[:, :, t + 1 :]))
    np.testing.assert_array_equal(f32(vmine[:, :, t + 1 :]), f32(vbuf[:, :, t + 1 :]))


TC_CASES = [
    (64, 32, 8, 700, 128, [i * 10 for i in range(64)]),  # the 8b's heads, unsplit
    (48, 32, 8, 300, 64, [0, 299, 300] + [i for i in range(45)]),  # the 1b's
    (40, 8, 8, 33, 128, [0] * 40),  # one query head a KV head
    (40, 64, 8, 100, 64, [5] * 40),  # 8 query heads a KV head
]


@pytest.mark.parametrize("case", TC_CASES)
@pytest.mark.parametrize("geometry", ["4,16", "1,32", "8,16", "2,32"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_tensor_core_append_equals_rope_write_and_attention(case, geometry, dtype, monkeypatch):
    """engine/backends/cuda/attention/decode_tc.py (MARKBASE_GPU_ATTN_TC=1) for every warps-a-block and
    keys-a-tile, GQA groups 1-8, both head dims, the launches engine/backends/cuda/attention/decode.py
    leaves unsplit (B x KV heads >= 2 x SMs)."""
    from engine.backends.cuda.attention import decode_tc as gpu_attention_tc

    warps, bk = geometry.split(",")
    monkeypatch.setenv(gpu_attention_tc.ENV, "1")
    monkeypatch.setenv(gpu_attention_tc.WARPS_ENV, warps)
    monkeypatch.setenv(gpu_attention_tc.BK_ENV, bk)
    b, hq, hkv, t, d, starts = case
    assert gpu_attention.splits(b, hkv, t + 1) == 1
    _append_case(case, "plain", dtype)


SPLIT_CASES = [
    (1, 32, 8, 600, 128, [0]),  # the 8b's one row: 5 CUDA-core splits
    (1, 32, 8, 200, 128, [150]),  # 4 tiles of 16 keys for 8 warps: warps without work
    (3, 32, 8, 1500, 64, [0, 7, 1500]),  # the 1b's heads; a row with only the new slot
    (8, 16, 4, 400, 128, [0, 1, 2, 3, 100, 200, 399, 400]),
]


@pytest.mark.parametrize("case", SPLIT_CASES)
@pytest.mark.parametrize("geometry", ["8,16", "4,32", "1,16", "2,16"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_tensor_core_split_form_equals_rope_write_and_attention(case, geometry, dtype, monkeypatch):
    """The split form (MARKBASE_GPU_ATTN_TC_SPLIT=1): a block a (row, KV head), its
    warps taking every WARPS-th tile and merged in the block, for the launches the
    CUDA-core kernel splits over time."""
    from engine.backends.cuda.attention import decode_tc as gpu_attention_tc

    warps, bk = geometry.split(",")
    monkeypatch.setenv(gpu_attention_tc.SPLIT_ENV, "1")
    monkeypatch.setenv(gpu_attention_tc.SPLIT_WARPS_ENV, warps)
    monkeypatch.setenv(gpu_attention_tc.BK_ENV, bk)
    b, hq, hkv, t, d, starts = case
    assert 1 < gpu_attention.splits(b, hkv, t + 1) <= gpu_attention_tc.MAX_SPLITS
    _append_case(case, "traditional" if d == 128 else "plain", dtype)


@pytest.mark.parametrize("stages", ["3", "4"])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_tensor_core_forms_with_more_stages(stages, split, dtype, monkeypatch):
    """``MARKBASE_GPU_ATTN_TC_STAGES`` / ``_SPLIT_STAGES`` 3 and 4 (tiles in flight a
    warp): the same results, in the cases with more tiles than warps x stages, fewer,
    and a row with only the new slot."""
    from engine.backends.cuda.attention import decode_tc as gpu_attention_tc

    monkeypatch.setenv(gpu_attention_tc.SPLIT_STAGES_ENV if split else gpu_attention_tc.STAGES_ENV,
                       stages)  # fmt: skip
    if split:
        monkeypatch.setenv(gpu_attention_tc.SPLIT_ENV, "1")
        for case in SPLIT_CASES:
            _append_case(case, "plain", dtype)
    else:
        monkeypatch.setenv(gpu_attention_tc.ENV, "1")
        for case in TC_CASES:
            _append_case(case, "plain", dtype)


@pytest.mark.cpu
def test_tensor_core_form_emulated_equals_attention():
    """bench/gpu/attn_tc_emulation.py: the tensor-core kernel's statements lane by lane
    (numpy) equal RoPE + attention, one warp a (row, KV head) and the split form (tiles
    from each row's start, the new slot patched in, a row with only it, the merge)."""
    from tests.backends.cuda.emulation.attn_tc import check

    assert check(2, 1, 4, 40, 64, [0, 30], 4, 16, True, False) < 1e-9
    assert check(2, 1, 2, 20, 64, [0, 20], 2, 16, False, True) < 1e-9


@pytest.mark.cpu
def test_tensor_core_form_rules(monkeypatch):
    """Which launches the tensor-core form takes, and its knobs, checked."""
    from engine.backends.cuda.attention import decode_tc as tc

    assert gpu_attention.LoopShape.parse("c") == gpu_attention.LoopShape(tc=True)
    assert gpu_attention.LoopShape.parse("cs").tc_split
    monkeypatch.delenv(tc.SPLIT_ENV, raising=False)
    assert tc.split_enabled()  # the default
    monkeypatch.setenv(tc.SPLIT_ENV, "0")
    assert not tc.split_enabled()
    monkeypatch.setenv(tc.SPLIT_WARPS_ENV, "8")
    assert tc.geometry(split=True)[0] == 8
    assert tc.supported(4, 128, mx.bfloat16) and tc.supported(8, 64, mx.float16)
    assert not tc.supported(4, 128, mx.float32)  # tensor cores: bf16/fp16
    assert not tc.supported(16, 128, mx.bfloat16)  # the A fragment's 8 rows
    assert not tc.supported(4, 96, mx.bfloat16)
    monkeypatch.delenv(tc.ENV, raising=False)
    assert tc.enabled()
    monkeypatch.setenv(tc.ENV, "0")
    assert not tc.enabled()
    monkeypatch.setenv(tc.WARPS_ENV, "3")
    with pytest.raises(ValueError, match="want 1, 2, 4 or 8"):
        tc.geometry()
    monkeypatch.setenv(tc.WARPS_ENV, "2")
    monkeypatch.setenv(tc.BK_ENV, "32")
    assert tc.geometry() == (2, 32)
    # 8b heads, 4 warps, 16 keys: 2 stages of K and V, q, new k and v, the RoPE's cos and
    # sin as floats: ~75 KB a block
    assert tc.shared_bytes(4, 16, 4, 128) == 4 * (4 * 16 * 136 + 8 * 128) * 2
    # stages: 2 unless set; fewer than asked where the block's shared memory would not fit
    monkeypatch.delenv(tc.SPLIT_STAGES_ENV, raising=False)
    assert tc.stages(True, 8, 16, 4, 128) == 2
    monkeypatch.setenv(tc.SPLIT_STAGES_ENV, "4")
    assert tc.stages(True, 8, 16, 4, 128) == 3  # 8 warps x 4 stages: 290 KB
    assert tc.shared_bytes(8, 16, 4, 128, 3) <= tc.MAX_SHARED
    assert tc.stages(True, 4, 16, 4, 128) == 4
    monkeypatch.setenv(tc.STAGES_ENV, "5")
    with pytest.raises(ValueError, match="want 2, 3 or 4"):
        tc.stages(False, 4, 16, 4, 128)


def test_decode_step_on_tensor_cores_equals_model(monkeypatch):
    """The bf16 decode step with MARKBASE_GPU_ATTN_TC=1 and a loop shape that never
    splits (every launch on tensor cores) gives the model's logits over
    several steps, ragged rows, and the cache the kernel filled equals the model's."""
    from engine.backends.cuda.attention import decode_tc as gpu_attention_tc
    from engine.loading import build_random_model
    from engine.model.decode_step import make_decode_step
    from tests.helpers.models import RAGGED_PROMPTS, prefilled_batch

    monkeypatch.setenv(gpu_attention_tc.ENV, "1")
    gpu_attention.set_loop_shape(gpu_attention.LoopShape(ppb=100_000, tc=True))
    cfg = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=4).model
    model.set_dtype(mx.bfloat16)
    step = make_decode_step(model)
    assert step.attention_kernel and step.rope is not None
    mine, theirs = prefilled_batch(model, RAGGED_PROMPTS), prefilled_batch(model, RAGGED_PROMPTS)
    tokens = mx.array([[11], [12], [13]], dtype=mx.int32)
    for _ in range(4):
        got = step(tokens, mine).astype(mx.float32)
        want = model(tokens, cache=theirs)[:, -1, :].astype(mx.float32)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=5e-2, rtol=5e-2)
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
    for a, b in zip(mine, theirs):
        assert a.length == b.length
        np.testing.assert_allclose(
            np.array(a.keys[:, :, : a.length].astype(mx.float32)),
            np.array(b.keys[:, :, : b.length].astype(mx.float32)),
            atol=2e-2,
            rtol=2e-2,
        )


@pytest.mark.parametrize("compiled", [True, False])
def test_warm_up_compiles_both_tensor_core_forms(compiled, monkeypatch):
    """With the tensor-core forms on (the default), the step's warm-up compiles the
    unsplit and the split one (a 200-token row at B=1 takes the split one: it must not
    wait on NVRTC), besides the CUDA-core forms of every automatic shape."""
    from engine.backends.cuda.attention import decode_tc as tc
    from engine.loading import build_random_model
    from engine.model.decode_step import make_decode_step

    for env in (tc.ENV, tc.SPLIT_ENV):
        monkeypatch.delenv(env, raising=False)
    gpu_attention.set_loop_shape(None)
    cfg = dict(hidden_size=256, num_hidden_layers=1, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False, rope_theta=12345.0)  # fmt: skip
    # head_dim 64 and 2 query heads a KV head: a shape the tensor-core kernels take
    model = build_random_model("llama", cfg, seed=5).model
    model.set_dtype(mx.bfloat16)
    step = make_decode_step(model)
    step.step_compile = compiled
    attn = model.layers[0].self_attn
    kern = tc._kernels(float(attn.scale), float(step.rope.scale))
    kern._made.clear()
    step.warm_up()
    made = {dict(t)["SPLIT"] for _, t in kern._made}
    assert made == {False, True}, made
    split_kinds = {kind for kind, t in kern._made if dict(t)["SPLIT"]}
    assert split_kinds == {"append_tc"}, split_kinds
    assert all(dict(t)["TPOS"] == compiled for _, t in kern._made)


@pytest.mark.parametrize("variant", ["default", "traditional", "llama3", "linear", "mha"])
def test_decode_step_append_form_equals_model(variant):
    """The GPU decode step with RoPE and the KV write inside the attention kernel gives
    the model's own logits over several steps (each step reads the slots the previous
    ones wrote), ragged rows, for every RoPE variant mlx-lm's llama takes; and the
    cache the kernel filled equals the one the model filled."""
    from engine.loading import build_random_model
    from engine.model.decode_step import make_decode_step
    from tests.helpers.models import RAGGED_PROMPTS, ROPES, prefilled_batch

    cfg = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", {**cfg, **ROPES[variant]}, seed=4).model
    step = make_decode_step(model)
    assert step.attention_kernel and step.rope is not None
    mine, theirs = prefilled_batch(model, RAGGED_PROMPTS), prefilled_batch(model, RAGGED_PROMPTS)
    tokens = mx.array([[11], [12], [13]], dtype=mx.int32)
    for _ in range(4):
        got = step(tokens, mine)
        want = model(tokens, cache=theirs)[:, -1, :]
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3, rtol=1e-3)
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
    for a, b in zip(mine, theirs):
        assert a.length == b.length
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            np.testing.assert_allclose(
                np.array(x[:, :, : a.length]), np.array(y[:, :, : b.length]), atol=1e-3, rtol=1e-3
            )


def test_compiled_step_equals_model_across_splits_and_growth(monkeypatch):
    """The whole decode step under one mx.compile (MARKBASE_GPU_STEP_COMPILE=1, the
    attention over the whole cache buffers with T from each row's position) gives the
    model's logits at every step while T passes the attention's split boundaries (128,
    256 positions) and the buffers grow (256 slots at a time), retracing only there."""
    from engine.loading import build_random_model
    from engine.model.decode_step import make_decode_step
    from tests.helpers.models import RAGGED_PROMPTS, prefilled_batch

    monkeypatch.setenv("MARKBASE_GPU_STEP_COMPILE", "1")
    cfg = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=5).model
    step = make_decode_step(model)
    assert step.step_compile and step._whole is not None
    traces = []

    def counted(*args):
        traces.append(args[-1])
        return step._whole_step(*args)

    step._whole = mx.compile(counted)
    mine, theirs = prefilled_batch(model, RAGGED_PROMPTS), prefilled_batch(model, RAGGED_PROMPTS)
    tokens = mx.array([[11], [12], [13]], dtype=mx.int32)
    splits = set()
    for _ in range(260):
        got = step(tokens, mine)
        want = model(tokens, cache=theirs)[:, -1, :]
        # (2e-3: the kernel's RoPE rounds cos/sin unlike MLX's at positions up to ~290)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-3, rtol=2e-3)
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
        splits.add(gpu_attention.append_splits(3, 2, mine[0].length))
    assert len(splits) >= 3  # the run crossed two split boundaries
    assert 3 <= len(traces) <= 6, traces  # one trace per split count and capacity
    for a, b in zip(mine, theirs):
        assert a.length == b.length
        np.testing.assert_allclose(
            np.array(a.keys[:, :, : a.length]), np.array(b.keys[:, :, : b.length]), atol=1e-3
        )


@pytest.mark.cpu
def test_batch_kv_reserve_counts_the_slot_and_keeps_the_rows():
    """BatchKV.reserve: the append kernel's slot is counted (length, per-row offsets),
    the buffer grows when full and keeps what it held, the views end at the new slot."""
    from engine.kv import BatchKV

    kv = BatchKV()
    k = mx.arange(2 * 1 * 3 * 4, dtype=mx.float32).reshape(2, 1, 3, 4)
    kv.add(k[:1], k[:1] + 100)
    kv.add(k[1:, :, :2], k[1:, :, :2] + 100)  # a shorter row: left-padded by one
    assert kv.length == 3 and kv.offset.tolist() == [3, 2]
    cap = kv.keys.shape[2]
    for n in range(1, cap + 2):  # past the capacity: one grow
        keys, values = kv.reserve(1)
        assert kv.length == 3 + n and keys.shape == (2, 1, 3 + n, 4) == values.shape
        assert kv.offset.tolist() == [3 + n, 2 + n]
    assert kv.keys.shape[2] > cap
    np.testing.assert_array_equal(np.array(kv.keys[:1, :, :3]), np.array(k[:1]))
    np.testing.assert_array_equal(np.array(kv.values[1:, :, 1:3]), np.array(k[1:, :, :2] + 100))
    length = kv.length
    keys, values = kv.reserve(1, views=False)  # the compiled step's form: whole buffers
    assert keys is kv.keys and values is kv.values and kv.length == length + 1
