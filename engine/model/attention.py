"""Decode attention for grouped-query models, installed into mlx-lm's model modules.

In a decode step every row has one query position. ``mx.fast.scaled_dot_product_attention``
handles that well on a GPU only without an array mask, and the running batch needs
one as soon as its rows differ in length (left padding). Its fallback then, and its
CPU implementation always, expands K/V per query head. Folding the query heads of a
group into the rows of one matmul against their shared K/V head reads K and V once:
measured on the H200 +53-64% decode throughput at batch 128 with ragged rows
(docs/performance.md), and fewer, larger sgemm calls on the CPU.

mlx-lm's attention layers call the module-level name ``scaled_dot_product_attention``
that each model module imported, so ``install`` rebinds that name in the module of
the model being served. On a CUDA GPU a causal prompt chunk goes to
engine/backends/cuda/attention/prefill.py's kernel (no per-length cuDNN graph, no score matrix
in memory). On the CPU, float32 calls, prompt chunks and decode steps alike, go first to
the backend's attention that ``install`` was handed (engine/backends/cpu/attention.py:
the softmax inside the score product, not MLX's one-element-at-a-time exp). Other
shapes go to the original function unchanged.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import gemma2

from engine import platform
from engine.backends import cuda

_ORIGINAL = mlx_lm_base.scaled_dot_product_attention


def grouped_decode_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    """q [B, Hq, 1, D]; k [B, Hkv, T, D]; v [B, Hkv, T, Dv]; mask None or broadcastable
    to [B, 1, 1, T]."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qg = (q * scale).reshape(b, hkv, (hq // hkv) * n, d)
    scores = qg @ k.swapaxes(-1, -2)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
        else:
            scores = scores + mask
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
    return (probs @ v).reshape(b, hq, n, v.shape[-1])  # MLA: values wider than q/k


def _use_grouped(queries: mx.array, mask) -> bool:
    if queries.shape[2] != 1 or isinstance(mask, str):
        return False
    if mask is not None and mask.ndim == 4 and mask.shape[1] != 1:
        return False  # a mask per head (MLA's RoPE scores): the heads are folded here
    if platform.on_gpu():
        # the fused kernel is best when it accepts the call: no mask at all
        return isinstance(mask, mx.array)
    return True


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    if sinks is None and not hasattr(cache, "bits"):
        if _backend is not None and _backend[0](queries, keys, values, mask):
            return _backend[1](queries, keys, values, scale, mask)
        if _use_grouped(queries, mask):
            return grouped_decode_attention(queries, keys, values, scale, mask)
        if cuda.prefill_attention_supported(queries, keys, values, mask):
            return cuda.prefill_attention(queries, keys, values, scale)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


class _Gemma2Attention(gemma2.Attention):
    """gemma2's attention with a batch's mask. It computes its scores inline with the
    query heads of a group on their own axis, [B, Hkv, repeats, L, T], so a running
    batch's [B, 1, L, T] mask broadcast its rows against the KV heads (one row's mask
    on another's scores, or a shape error from 3 rows on). mlx-lm's own cache gives
    one row, where both shapes mean the same."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mx.expand_dims(mask, 2)
        return super().__call__(x, mask, cache)


# a backend's (supported(q, k, v, mask), attention(q, k, v, scale, mask)), or None
_backend: tuple | None = None


def install(model, backend: tuple | None = None) -> bool:
    """Route the decode attention of ``model``'s mlx-lm modules through ours: the
    model's own module and those its layers come from (a wrapper family such as
    gemma3 or qwen3_5 runs another family's attention layers). ``backend``: a
    backend's own attention, ``(supported, attention)``, first for the calls it takes
    (the CPU's)."""
    global _backend
    if backend is not None:
        _backend = backend
    for m in model.modules():
        if type(m) is gemma2.Attention:
            m.__class__ = _Gemma2Attention
    names = {type(model).__module__} | {type(m).__module__ for m in model.modules()}
    done = False
    for name in names:
        module = sys.modules.get(name)
        if (
            module is not None
            and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL
        ):
            module.scaled_dot_product_attention = scaled_dot_product_attention
            _installed.add(module)
            done = True
    return done


_installed: set = set()


@contextmanager
def original():
    """mlx-lm's own attention in every module ``install`` routed, for as long as the
    block runs (a reference computed by mlx-lm alone, in tests)."""
    modules = list(_installed)
    for module in modules:
        module.scaled_dot_product_attention = _ORIGINAL
    try:
        yield
    finally:
        for module in modules:
            module.scaled_dot_product_attention = scaled_dot_product_attention
