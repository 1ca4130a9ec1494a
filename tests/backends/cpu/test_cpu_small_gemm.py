"""The sgemm shim's loops for decode attention's small products (few query rows
against a row's keys or values): real MLX matmuls, in the shapes and strides the
decode step uses, against float64, and counted so a test cannot pass by accident."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from engine.backends.cpu.blas import shim_library  # noqa: E402


def _lib():
    lib = shim_library()
    if lib is None or not hasattr(lib, "markbase_blas_small_calls"):
        pytest.skip("the sgemm shim is not loaded here")
    if mx.default_device() != mx.cpu:
        pytest.skip("MLX runs on a GPU")
    lib.markbase_blas_small_calls.restype = ctypes.c_long
    return lib


def _close(got, want):
    got = np.asarray(got, dtype=np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() / scale < 1e-5


@pytest.mark.parametrize(
    "g,d,t", [(3, 64, 300), (1, 64, 17), (4, 64, 1), (16, 128, 40), (3, 12, 9)]
)
def test_attention_products_match_float64(g, d, t):
    lib = _lib()
    b, h, cap = 2, 3, t + 37  # keys live in a larger buffer, as in BatchKV
    buf = mx.random.normal((b, h, cap, d), key=mx.random.key(t))
    q = mx.random.normal((b, h, g, d), key=mx.random.key(d))
    keys = buf[:, :, :t, :]
    before = lib.markbase_blas_small_calls()
    scores = q @ keys.swapaxes(-1, -2)
    probs = mx.softmax(scores, axis=-1)
    out = probs @ keys
    mx.eval(scores, out)
    assert lib.markbase_blas_small_calls() > before, "the products did not take the small route"
    q64, k64 = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    _close(scores, q64 @ np.swapaxes(k64, -1, -2))
    _close(out, np.asarray(probs, np.float64) @ k64)


def test_beta_and_alpha_are_honoured():
    """addmm (C + A B) with a few rows: beta = 1 through the small loops."""
    _lib()
    c = mx.random.normal((5, 40), key=mx.random.key(1))
    a = mx.random.normal((5, 64), key=mx.random.key(2))
    w = mx.random.normal((40, 64), key=mx.random.key(3))
    got = mx.addmm(c, a, w.T, alpha=0.5, beta=2.0)
    want = (
        2.0 * np.asarray(c, np.float64)
        + 0.5 * np.asarray(a, np.float64) @ np.asarray(w, np.float64).T
    )
    _close(got, want)


def test_switch_off_gives_the_same_values():
    lib = _lib()
    lib.markbase_blas_set_small.argtypes = [ctypes.c_int]
    q = mx.random.normal((4, 3, 64), key=mx.random.key(5))
    k = mx.random.normal((4, 100, 64), key=mx.random.key(6))
    on = q @ k.swapaxes(-1, -2)
    mx.eval(on)
    lib.markbase_blas_set_small(0)
    try:
        before = lib.markbase_blas_small_calls()
        off = q @ k.swapaxes(-1, -2)
        mx.eval(off)
        assert lib.markbase_blas_small_calls() == before
    finally:
        lib.markbase_blas_set_small(1)
    assert np.allclose(np.asarray(on), np.asarray(off), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g,d,t", [(3, 64, 300), (1, 64, 5), (16, 128, 40), (2, 320, 33)])
def test_softmax_inside_the_score_product(g, d, t):
    """``addmm(mask, q, k^T, alpha=markbase_softmax_alpha(), beta=1)`` is the masked
    softmax of the scores (the lean decode step's attention), through the small loops
    and, for a head wider than they take (320), through the real BLAS; positions the
    mask hides get exactly 0, as in MLX's softmax."""
    from engine.backends.cpu.attention import softmax_alpha

    _lib()
    alpha = softmax_alpha()
    assert alpha is not None, "MLX's matmuls reach the shim here, so the step would use it"
    b, h, cap = 2, 3, t + 11
    buf = mx.random.normal((b, h, cap, d), key=mx.random.key(t)) * 0.5
    q = mx.random.normal((b, h, g, d), key=mx.random.key(d))
    keys = buf[:, :, :t, :]
    pad = mx.array([0, t // 3])  # row 1 left-padded, as in a running batch
    visible = mx.arange(t)[None, :] >= pad[:, None]
    mask = mx.where(visible, 0.0, -mx.inf)[:, None, None, :]
    mask = mx.broadcast_to(mask, (b, h, g, t)) + 0
    got = mx.addmm(mask, q, keys.swapaxes(-1, -2), alpha=alpha, beta=1.0)
    want = mx.softmax(q @ keys.swapaxes(-1, -2) + mask, axis=-1, precise=True)
    got, want = np.asarray(got), np.asarray(want)
    assert np.abs(got - want).max() < 1e-6
    assert np.allclose(got.sum(axis=-1), 1.0, atol=1e-5)
    assert (got[1, :, :, : t // 3] == 0).all()


@pytest.mark.parametrize("g,d,t", [(3, 64, 1024), (4, 256, 300), (5, 64, 1021)])
def test_attention_products_on_the_pool_keep_their_bits(g, d, t):
    """Long enough rows go to the shim's thread pool (scores split by key rows, the
    weighted values by query rows): the same bits as one thread, softmax included."""
    from engine.backends.cpu.attention import softmax_alpha

    lib = _lib()
    lib.markbase_blas_set_small_par.argtypes = [ctypes.c_int]
    b, h = 2, 3
    q = mx.random.normal((b, h, g, d), key=mx.random.key(1))
    k = mx.random.normal((b, h, t, d), key=mx.random.key(2))
    v = mx.random.normal((b, h, t, d), key=mx.random.key(3))
    mask = mx.zeros((b, h, g, t))
    alpha = softmax_alpha()

    def attend():
        scores = q @ k.swapaxes(-1, -2)
        out = [scores, scores.swapaxes(-1, -2).swapaxes(-1, -2) @ v]
        if alpha is not None:
            out.append(mx.addmm(mask, q, k.swapaxes(-1, -2), alpha=alpha, beta=1.0) @ v)
        mx.eval(out)
        return [np.array(o) for o in out]

    stats = (ctypes.c_long * 3)()

    def pool_jobs():
        lib.markbase_qw_pool_stats(stats)
        return stats[0], stats[2]

    try:
        lib.markbase_blas_set_small_par(0)
        alone = attend()
        lib.markbase_blas_set_small_par(1)
        jobs, _ = pool_jobs()
        pooled = attend()
        after, helpers = pool_jobs()
    finally:
        lib.markbase_blas_set_small_par(1)
    if helpers:  # a machine with one CPU has no pool: both runs are one thread's
        assert after - jobs >= 2 * b * h  # every (row, head) product of both kinds
    for a, p in zip(alone, pooled):
        assert np.array_equal(a, p)
    want = np.einsum("bhgd,bhtd->bhgt", np.array(q, np.float64), np.array(k, np.float64))
    _close(pooled[0], want)
