"""Batched sampling with per-row settings, on the device.

Each running sequence owns a ``RowSampler`` (its temperature, top-p/top-k and its
own random stream). ``sample_batch`` draws the next token for every row of a decode
step with array ops over the whole batch, not a loop of ops per row. A seeded row
draws from its own stream, so its tokens do not depend on which other requests share
the batch.

How a row is drawn (inverse CDF with two uniforms from the row's stream): the
temperature-scaled logits are exponentiated against the row's max; one uniform picks
a block of BLOCK tokens with probability its share of the mass, the other a token in
that block. Two levels keep float32 cumulative sums short (BLOCK terms, then
V/BLOCK), so late tokens are not mis-weighted by rounding in a 128k-token cumsum.
Top-k/top-p rows on the CPU sort only their CANDIDATES largest logits
(``argpartition``) and draw from the kept ones; a top-p row whose candidates hold less
than top_p of the mass (a flat distribution) is redone over its whole sorted row, so
the nucleus is exact. On a GPU they sort whole rows (fast there, and lazy). On the
CPU the same draw runs in numpy (``_sample_numpy``: MLX's CPU exp and argpartition
are 3-4x slower than numpy's, bench/sampler_bench.py). Why not a Gumbel draw per row: per-row noise over the whole vocabulary cost a
loop of ops per row, and on MLX's CPU backend its transcendental ops run at ~12 ns an
element: at B=32 over SmolLM2's 49k tokens sampling took 20 ms a step with a
temperature and 205 ms with top-p 0.9 (its per-row full sort), against a ~100 ms step.

Later per-row features (constrained-decoding masks, logit bias, penalties) slot in
as extra per-row terms added to the logits before the draw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import numpy as np

from engine.types import SamplingParams

BLOCK = 256  # tokens a block of the two-level draw
CANDIDATES = 1024  # logits a top-k/top-p row sorts on the CPU (more where its top_k asks)


@dataclass
class RowSampler:
    temperature: float
    top_p: float
    top_k: int
    rng: np.random.Generator | None = field(default=None, repr=False)

    @classmethod
    def from_params(cls, params: SamplingParams) -> RowSampler:
        greedy = params.temperature <= 0.0
        rng = None
        if not greedy:
            seed = (
                params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
            )
            rng = np.random.default_rng(seed)
        return cls(params.temperature, params.top_p, params.top_k, rng)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def filters(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0

    def draw(self) -> tuple[float, float]:
        """This step's two uniforms in (0, 1]: never 0, so a draw never lands on a
        token of zero weight before the first one that has weight."""
        u = self.rng.random(2)
        return 1.0 - float(u[0]), 1.0 - float(u[1])


def sample_batch(logits: mx.array, rows: list[RowSampler]) -> mx.array:
    """Next token for each row of ``logits`` ([B, V]); returns int32 [B]: lazily on a
    GPU, computed here on the CPU (``_sample_numpy``) when any row samples."""
    logits = logits.astype(mx.float32)
    live = [i for i, r in enumerate(rows) if not r.greedy]
    out = None if len(live) == len(rows) else mx.argmax(logits, axis=-1).astype(mx.int32)
    if not live:
        return out
    draws = [rows[i].draw() for i in live]
    if numpy_route():
        return _sample_numpy(logits, rows, live, draws)
    plain = [j for j, i in enumerate(live) if not rows[i].filters]
    filtered = [j for j, i in enumerate(live) if rows[i].filters]
    for group, drawer in ((plain, _draw_full), (filtered, _draw_filtered)):
        if not group:
            continue
        idx = [live[j] for j in group]
        whole = len(idx) == len(rows)
        sub = logits if whole else logits[mx.array(idx, dtype=mx.int32)]
        inv_t = mx.array([[1.0 / rows[i].temperature] for i in idx], dtype=mx.float32)
        u = mx.array([draws[j] for j in group], dtype=mx.float32)  # [n, 2]
        tokens = drawer(sub, inv_t, u, [rows[i] for i in idx])
        if whole:
            return tokens
        if out is None:  # every row samples, in two groups
            out = mx.zeros((len(rows),), dtype=mx.int32)
        out[mx.array(idx, dtype=mx.int32)] = tokens
    return out


def _exp_below(x: mx.array, m: mx.array, inv_t: mx.array) -> mx.array:
    """``exp((x - m) * inv_t)`` for x <= m (the row's max), exactly 0 at -inf: the
    softmax weights of the logits at temperature 1 / inv_t. On the CPU as one compiled
    kernel through engine/fast_math.py (MLX's CPU exp is ~12 ns an element, 10x its
    multiplies; relative error below 4e-6); a GPU's own exp is fast."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return _compiled_cpu_exp()(x, m, inv_t)
    return mx.exp((x - m) * inv_t)


_cpu_exp: list = []


def _compiled_cpu_exp():
    if not _cpu_exp:
        from engine import fast_math

        def shifted(x, m, inv_t):
            d = (x - m) * inv_t
            return mx.where(d > -87.0, fast_math.exp(d), 0.0)

        _cpu_exp.append(mx.compile(shifted))
    return _cpu_exp[0]


def _pick(cum, u, xp=mx):
    """Index of the first cumulative weight reaching ``u`` of the row's total ([n, m]
    cumulative sums, u [n] in (0, 1]): never a zero-weight entry, never past the end.
    ``xp``: the array module (mx, or numpy on the CPU's route)."""
    target = u[:, None] * cum[:, -1:]
    return xp.minimum((cum < target).sum(axis=-1), cum.shape[-1] - 1).astype(xp.int32)


def _draw_full(x, inv_t, u, rows=None, xp=mx):
    """One token a row of logits ``x`` [n, V] from its softmax at temperature
    1 / ``inv_t`` [n, 1] (two uniforms a row in ``u`` [n, 2]): a block of BLOCK tokens
    by its mass, then a token in it. ``xp``: mx, or numpy (``_sample_numpy``)."""
    n, v = x.shape
    weights = _np_weights if xp is np else _exp_below
    e = weights(x, x.max(axis=-1, keepdims=True), inv_t)
    nb = -(-v // BLOCK)
    if nb * BLOCK != v:
        e = xp.pad(e, [(0, 0), (0, nb * BLOCK - v)])
    blocks = e.reshape(n, nb, BLOCK)
    blk = _pick(xp.cumsum(blocks.sum(axis=-1), axis=-1), u[:, 0], xp)
    inner = xp.take_along_axis(blocks, xp.broadcast_to(blk[:, None, None], (n, 1, BLOCK)), axis=1)
    pos = _pick(xp.cumsum(inner[:, 0, :], axis=-1), u[:, 1], xp)
    return blk * BLOCK + pos


def _draw_filtered(
    x: mx.array, inv_t: mx.array, u: mx.array, rows: list[RowSampler], full: bool | None = None
):
    """One token a row from its top-k / top-p set (nucleus: the fewest largest tokens
    whose mass reaches top_p, as ``before < top_p`` over the sorted probabilities).
    On the CPU, sorts the CANDIDATES largest; top-p rows without top-k whose
    candidates hold less than top_p are redone with ``full`` (the whole row sorted).
    That check reads on the host, so it evaluates the logits, only when such a row is
    in the batch. On a GPU (``full`` None: by device) every row is sorted whole: a GPU
    sorts them fast, and a host check would stall the worker's pipelined step (the
    next step's graph is built while this one runs)."""
    if full is None:
        full = mx.default_device().type != mx.DeviceType.cpu
    n, v = x.shape
    kmax = max(r.top_k for r in rows)
    k = v if full else min(v, max(CANDIDATES, kmax))
    m = x.max(axis=-1, keepdims=True)
    if k < v:
        idx = mx.argpartition(-x, k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(x, idx, axis=-1)
    else:
        idx = mx.broadcast_to(mx.arange(v, dtype=mx.uint32)[None], (n, v))
        vals = x
    order = mx.argsort(-vals, axis=-1)
    idx = mx.take_along_axis(idx, order, axis=-1)
    vals = mx.take_along_axis(vals, order, axis=-1)
    total = mx.sum(_exp_below(x, m, inv_t), axis=-1, keepdims=True)
    p = _exp_below(vals, m, inv_t) / total
    top_p = mx.array([[r.top_p] for r in rows], dtype=mx.float32)
    top_k = mx.array([[r.top_k if r.top_k > 0 else k] for r in rows], dtype=mx.int32)
    keep = (mx.cumsum(p, axis=-1) - p < top_p) & (mx.arange(k)[None] < top_k)
    # a top-p row without top-k may need more than the candidates (a top-k row's set
    # is inside them: k >= its top_k)
    open_rows = [r.top_p < 1.0 and r.top_k == 0 for r in rows]
    if k < v and any(open_rows):
        short = (p.sum(axis=-1) < top_p[:, 0]).tolist()  # the nucleus passes the candidates
        if any(s and o for s, o in zip(short, open_rows)):
            redo = [i for i, (s, o) in enumerate(zip(short, open_rows)) if s and o]
            sel = mx.array(redo, dtype=mx.int32)
            again = _draw_filtered(x[sel], inv_t[sel], u[sel], [rows[i] for i in redo], full=True)
            out = _finish(idx, p, keep, u)
            if len(redo) == n:
                return again
            out[sel] = again
            return out
    return _finish(idx, p, keep, u)


def _finish(idx: mx.array, p: mx.array, keep: mx.array, u: mx.array) -> mx.array:
    pick = _pick(mx.cumsum(mx.where(keep, p, 0.0), axis=-1), u[:, 0])
    return mx.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(mx.int32)


# -- the CPU's route: the same draw in numpy ------------------------------------------
# Why: on MLX's CPU backend exp costs ~12 ns an element (~5 through fast_math) and
# argpartition ~13 ms for 32 rows of 49k, where numpy's SIMD exp and introselect take
# 2.8 and 3.1 ms. The CPU's decode loop is not pipelined (engine/config.py), so reading
# the logits here loses no overlap; ``np.asarray`` maps them without a copy.
use_numpy_on_cpu = True  # tests switch it to run the MLX route on the CPU too


def numpy_route() -> bool:
    return use_numpy_on_cpu and mx.default_device().type == mx.DeviceType.cpu


def _sample_numpy(logits: mx.array, rows, live: list[int], draws) -> mx.array:
    x = np.asarray(logits)
    out = np.argmax(x, axis=-1).astype(np.int32)
    plain = [j for j, i in enumerate(live) if not rows[i].filters]
    filtered = [j for j, i in enumerate(live) if rows[i].filters]
    for group, drawer in ((plain, partial(_draw_full, xp=np)), (filtered, _np_filtered)):
        if not group:
            continue
        idx = np.array([live[j] for j in group])
        inv_t = np.array([[1.0 / rows[i].temperature] for i in idx], dtype=np.float32)
        u = np.array([draws[j] for j in group], dtype=np.float32)
        out[idx] = drawer(x[idx], inv_t, u, [rows[i] for i in idx])
    return mx.array(out)


def _np_weights(x: np.ndarray, m: np.ndarray, inv_t: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.exp((x - m) * inv_t, dtype=np.float32)


def _np_filtered(x: np.ndarray, inv_t: np.ndarray, u: np.ndarray, rows, full: bool = False):
    """``_draw_filtered`` in numpy (the candidates, and the whole-row redo of top-p rows
    without top-k whose candidates hold less than top_p)."""
    n, v = x.shape
    k = v if full else min(v, max(CANDIDATES, max(r.top_k for r in rows)))
    if k < v:
        idx = np.argpartition(-x, k - 1, axis=-1)[:, :k]
        vals = np.take_along_axis(x, idx, axis=-1)
    else:
        idx = np.broadcast_to(np.arange(v), (n, v))
        vals = x
    order = np.argsort(-vals, axis=-1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=-1)
    vals = np.take_along_axis(vals, order, axis=-1)
    m = x.max(axis=-1, keepdims=True)
    p = _np_weights(vals, m, inv_t) / _np_weights(x, m, inv_t).sum(axis=-1, keepdims=True)
    top_p = np.array([[r.top_p] for r in rows], dtype=np.float32)
    top_k = np.array([[r.top_k if r.top_k > 0 else k] for r in rows])
    keep = (np.cumsum(p, axis=-1) - p < top_p) & (np.arange(k)[None] < top_k)
    pick = _pick(np.cumsum(np.where(keep, p, 0.0), axis=-1), u[:, 0], np)
    out = idx[np.arange(n), pick]
    if k < v:
        redo = [
            i for i, r in enumerate(rows) if r.top_p < 1.0 and r.top_k == 0 and p[i].sum() < r.top_p
        ]
        if redo:
            out[redo] = _np_filtered(x[redo], inv_t[redo], u[redo], [rows[i] for i in redo], True)
    return out
