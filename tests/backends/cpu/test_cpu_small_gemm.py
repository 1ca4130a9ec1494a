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
