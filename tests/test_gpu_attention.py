"""engine/gpu_attention.py: the decode attention kernel equals grouped attention under
the batch's mask, for ragged rows, split and unsplit time axes, bf16 and float32.

The kernel tests need MLX's CUDA backend (skipped elsewhere; on the H200:
``python3 -m pytest -q tests/test_gpu_attention.py`` after bench/gpu/env.sh); the
split and support rules are plain Python and run everywhere. ``bench/gpu/nvrtc_check.py``
compiles the kernels without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine import gpu_attention  # noqa: E402
from engine.attention import grouped_decode_attention  # noqa: E402

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


def test_splits_give_enough_blocks_and_enough_work_per_block():
    # one row of an 8-KV-head model at 600 positions: 5 blocks of ~120 positions per head
    assert gpu_attention.splits(1, 8, 600) == 5
    # many rows already fill the GPU: no split, no merge kernel
    assert gpu_attention.splits(128, 8, 600) == 1
    assert gpu_attention.splits(32, 8, 4000) == 2
    # short rows never split below ~128 positions a block
    assert gpu_attention.splits(1, 8, 100) == 1
    assert gpu_attention.splits(1, 1, 100_000) == 64


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


@cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_grouped_attention(case, dtype):
    b, hq, hkv, t, d, starts = case
    got, want = _case(b, hq, hkv, t, d, dtype, starts, capacity=t + 64)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@cuda
def test_decode_step_with_kernel_equals_model():
    """The fused GPU decode step with the kernel gives the model's own logits on a
    ragged batch (head_dim 64, so the kernel is used)."""
    from conftest_loading import LLAMA_HD64, RAGGED_PROMPTS, prefilled_batch

    from engine.decode_step import make_decode_step
    from engine.loading import build_random_model

    model = build_random_model("llama", LLAMA_HD64, seed=0).model
    prompts = RAGGED_PROMPTS

    tokens = mx.array([[11], [12], [13]])
    want = model(tokens, cache=prefilled_batch(model, prompts))[:, -1, :]
    step = make_decode_step(model)
    assert step.attention_kernel
    got = step(tokens, prefilled_batch(model, prompts))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3, rtol=1e-3)
