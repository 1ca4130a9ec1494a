"""Attention on the CPU with the masked softmax inside the score product.

Why: MLX's CPU ``scaled_dot_product_attention`` (and ``mx.softmax``) computes the
scores, then their softmax, whose exp runs one element at a time (~20 ns an element
here). The sgemm
shim (engine/backends/cpu/native/blas_shim.c) takes ``mx.addmm(mask, q, k^T, alpha=A,
beta=1)`` with its softmax alpha ``A`` as "add the mask, then softmax each row" with an
AVX2 exp, in the same pass as the product; the lean decode step uses it
(engine/backends/cpu/step.py), and ``sdpa`` here serves every other call the
model makes: prompt chunks of every family, and decode steps of the families the lean
step does not compute. The query heads of a group are folded into the rows of one
product against their shared K/V head, so K and V are read once a group.

One SmolLM2-135M layer (9 query heads, 3 KV heads of 64), 2 Zen 3 cores, 2026-12-07
(`scaled_dot_product_attention` against ``sdpa``, median of 20): a
128-token prompt 5.3 against 1.35 ms, 53 new tokens after 128 cached 3.2 against
0.81 ms, 128 after 384 cached 17.7 against 3.4 ms; the largest difference in the
outputs 1e-6 (the shim's exp is within 2 ulp of float's).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import mlx.core as mx

log = logging.getLogger("markbase.cpu_attention")

_lock = threading.Lock()
_alpha: list = []  # [alpha or None] once probed


def softmax_alpha() -> float | None:
    """The ``alpha`` that makes ``mx.addmm(mask, q, k^T, alpha, beta=1)`` the masked
    softmax of the scores (native/blas_shim.c), when MLX's matmuls reach the shim in
    this process; else None. Checked once with a probe: MLX bound to another BLAS
    would return alpha * scores + mask instead."""
    with _lock:
        if not _alpha:
            _alpha.append(_probe())
        return _alpha[0]


def _probe() -> float | None:
    from engine.backends.cpu.blas import shim_library

    lib = shim_library()
    if lib is None or not hasattr(lib, "markbase_softmax_alpha"):
        return None
    lib.markbase_softmax_alpha.restype = ctypes.c_float
    alpha = float(lib.markbase_softmax_alpha())
    q = mx.array([[[[0.5, -1.0], [2.0, 0.25]]]])  # [1, 1, 2, 2]
    k = mx.array([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])  # [1, 1, 3, 2]
    mask = mx.array([[[[0.0, -mx.inf, 0.0], [0.0, 0.0, 0.0]]]])
    got = mx.addmm(mask, q, k.swapaxes(-1, -2), alpha=alpha, beta=1.0)
    want = mx.softmax(q @ k.swapaxes(-1, -2) + mask, axis=-1, precise=True)
    if not mx.allclose(got, want, rtol=1e-6, atol=1e-7).item():
        log.info("softmax in the score product not used: MLX's matmuls do not reach the shim")
        return None
    return alpha


def sdpa_supported(q: mx.array, k: mx.array, v: mx.array, mask) -> bool:
    """Whether ``sdpa`` takes this call: float32, grouped heads, a mask that is None,
    "causal" or one array for every head ([L, T] or [B or 1, 1, L, T])."""
    if q.dtype != mx.float32 or k.dtype != mx.float32 or v.dtype != mx.float32:
        return False
    if q.ndim != 4 or q.shape[1] % k.shape[1]:
        return False
    if isinstance(mask, str):
        if mask != "causal":
            return False
    elif mask is not None and mask.ndim != 2 and (mask.ndim != 4 or mask.shape[1] != 1):
        return False
    return softmax_alpha() is not None


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v for q [B, Hq, L, D], k [B, Hkv, T, D], v [B, Hkv,
    T, Dv]; ``mask`` None, "causal" (the last L of T positions: a prompt chunk after
    T - L cached ones) or boolean / additive [L, T] or [B or 1, 1, L, T]. Returns
    [B, Hq, L, Dv]."""
    b, hq, length, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    if isinstance(mask, str):
        rows = mx.arange(t - length, t, dtype=mx.int32)[:, None]
        mask = mx.where(mx.arange(t, dtype=mx.int32)[None] <= rows, 0.0, -mx.inf)
    elif mask is None:
        mask = mx.zeros((length, t), dtype=mx.float32)
    elif mask.dtype == mx.bool_:
        mask = mx.where(mask, 0.0, -mx.inf)
    mask = mask.astype(mx.float32)
    if mask.ndim == 4:  # [B or 1, 1, L, T] -> [B or 1, 1, 1, L, T]
        mask = mx.expand_dims(mask, 2)
    # rows of a group's product: its query heads one after the other, L positions each
    c = mx.broadcast_to(mask, (b, hkv, g, length, t)).reshape(b, hkv, g * length, t)
    qg = (q * scale).reshape(b, hkv, g * length, d)
    probs = mx.addmm(c, qg, k.swapaxes(-1, -2), alpha=softmax_alpha(), beta=1.0)
    return (probs @ v).reshape(b, hq, length, v.shape[-1])
