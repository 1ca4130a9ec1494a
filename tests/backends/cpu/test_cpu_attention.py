"""engine/backends/cpu/attention.py: attention with the softmax inside the score
product (the sgemm shim) equals MLX's ``scaled_dot_product_attention`` to float32
rounding, for prompt chunks and decode steps and every mask form the models pass, and
takes only what it can."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from engine.backends.cpu import attention  # noqa: E402
from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()
pytestmark = pytest.mark.skipif(
    attention.softmax_alpha() is None, reason="MLX's matmuls do not reach the sgemm shim here"
)


def _qkv(b, hq, hkv, length, t, d=16, dv=16, seed=0):
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    return (
        mx.random.normal((b, hq, length, d), key=k1),
        mx.random.normal((b, hkv, t, d), key=k2),
        mx.random.normal((b, hkv, t, dv), key=k3),
    )


def _close(got, want):
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 2e-6 * max(1.0, mx.abs(want).max().item())


@pytest.mark.parametrize("length,t", [(1, 9), (5, 5), (7, 20), (33, 33)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
def test_causal_chunk_after_cached_positions(length, t, hq, hkv):
    q, k, v = _qkv(1, hq, hkv, length, t)
    assert attention.sdpa_supported(q, k, v, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    _close(attention.sdpa(q, k, v, 0.25, "causal"), want)


def test_array_masks_of_a_batch():
    # rows of different lengths prefilled together: boolean [B, 1, L, T] and additive,
    # [L, T] for all rows, and no mask; values wider than queries (MLA's form)
    q, k, v = _qkv(2, 6, 2, 4, 9, dv=24, seed=1)
    keep = mx.arange(9)[None, None, None, :] <= (mx.arange(4)[:, None] + 5)
    keep = mx.concatenate([keep, keep & (mx.arange(9) >= 2)], axis=0)  # row 1 left-padded
    for mask in (keep, mx.where(keep, 0.0, -mx.inf), keep[0, 0], None):
        assert attention.sdpa_supported(q, k, v, mask)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        _close(attention.sdpa(q, k, v, 0.3, mask), want)


def test_what_it_leaves_to_mlx():
    q, k, v = _qkv(1, 4, 2, 3, 3)
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert not attention.sdpa_supported(*half, "causal")
    per_head = mx.zeros((1, 4, 3, 3))
    assert not attention.sdpa_supported(q, k, v, per_head)
