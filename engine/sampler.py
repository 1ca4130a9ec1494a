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
Top-k/top-p rows sort their logits and draw from the kept ones.

Two routes run the same draw (``xp``): on a GPU, MLX ops, lazily, every filtered row
sorted whole (fast there; a host check would stall the worker's pipelined step), and
on a CUDA GPU the temperature-only and greedy rows in one kernel of our own
(engine/backends/cuda/sampler.py: the same draw, ~20 MLX kernels fewer); on
the CPU, numpy on the logits in place, where MLX's CPU exp and argpartition are 3-4x
slower than numpy's and the decode loop is not pipelined (engine/config.py), so
reading the logits costs nothing. There a filtered row sorts only its CANDIDATES
largest logits (``argpartition``); a top-p row whose candidates hold less than top_p
of the mass (a flat distribution) is redone over its whole sorted row, so the nucleus
is exact. Why not a Gumbel draw per row: per-row noise over the whole vocabulary
costs a loop of ops per row, and MLX's CPU transcendental ops run at
~12 ns an element: at B=32 over SmolLM2's 49k tokens such a sampler takes 20 ms a step
with a temperature and 205 ms with top-p 0.9 (a full sort per row), against a ~100 ms
step (bench/cpu/sampler_bench.py).

Penalties, logit bias, min_tokens and min_p (engine/penalties.py) change the logits
of the rows that ask for them before the draw, all such rows together; a batch
without any pays nothing for them. Log-probabilities are not the sampler's: the
worker takes them from the raw logits (engine/logprobs.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine import penalties, platform
from engine.backends import cuda
from engine.penalties import LogitAdjust
from engine.structured.masks import TokenMasks, apply_token_masks
from engine.types import DRAW_BLOCK, SamplingParams

BLOCK = DRAW_BLOCK  # tokens a block of the two-level draw (the CUDA kernel's too)
CANDIDATES = 1024  # logits a top-k/top-p row sorts on the CPU (more where its top_k asks)


@dataclass
class RowSampler:
    temperature: float
    top_p: float
    top_k: int
    rng: np.random.Generator | None = field(default=None, repr=False)
    adjust: LogitAdjust | None = None  # penalties, bias, min_tokens, min_p: None = none

    @classmethod
    def from_params(cls, params: SamplingParams, prompt=(), end_ids=()) -> RowSampler:
        """``prompt`` (token ids) and ``end_ids`` (tokens that end the sequence) are
        only read for ``repetition_penalty`` and ``min_tokens``."""
        greedy = params.temperature <= 0.0
        rng = None
        if not greedy:
            seed = (
                params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
            )
            rng = np.random.default_rng(seed)
        adjust = LogitAdjust.from_params(params, prompt, end_ids)
        return cls(params.temperature, params.top_p, params.top_k, rng, adjust)

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


def sample_batch(
    logits: mx.array, rows: list[RowSampler], masks: TokenMasks | None = None
) -> mx.array:
    """Next token for each row of ``logits`` ([B, V]); returns int32 [B]: lazily on a
    GPU, computed here on the CPU (the numpy route) when any row samples. ``masks``:
    the grammar masks of the constrained rows (engine/structured), applied first. Rows
    with logit adjustments (engine/penalties.py) draw from their adjusted logits, which
    are a copy: ``logits`` itself is never changed."""
    xp = np if numpy_route() else mx
    if masks is not None:
        logits = apply_token_masks(logits.astype(mx.float32), masks, on_host=xp is np)
    adjust = penalties.plan(rows)
    if adjust is None:
        return _sample(logits, rows, xp)
    x = logits.astype(mx.float32)
    tokens = _sample(adjust.apply(np.array(x) if xp is np else x, xp), rows, xp)
    adjust.record(tokens, xp)
    return tokens


def _sample(logits, rows: list[RowSampler], xp) -> mx.array:
    """``sample_batch`` on ``logits``: an MLX array, or on the numpy route a float32
    numpy array (adjusted logits)."""
    if isinstance(logits, np.ndarray):
        logits_np = logits
        raw = logits = None
    else:
        raw = logits  # the kernel route reads the logits in their own dtype
        logits = logits.astype(mx.float32)
        logits_np = None
    live = [i for i, r in enumerate(rows) if not r.greedy]
    if not live:
        if logits_np is not None:
            return mx.array(np.argmax(logits_np, axis=-1).astype(np.int32))
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    draws = [rows[i].draw() for i in live]
    kernel = xp is mx and use_kernel_on_gpu and cuda.sampler_enabled()
    whole = kernel and cuda.sampler_takes(raw) and not any(rows[i].filters for i in live)
    if whole:  # one kernel for the whole step
        return cuda.sampler_draw(raw, _kernel_params(rows, range(len(rows)), draws))
    if xp is np:
        x = logits_np if logits_np is not None else np.asarray(logits)
    else:
        x = logits
    if len(live) < len(rows):
        out = xp.argmax(x, axis=-1).astype(xp.int32)
    else:  # every row samples, in one group or two
        out = xp.zeros((len(rows),), dtype=xp.int32)
    plain = [j for j, i in enumerate(live) if not rows[i].filters]
    filtered = [j for j, i in enumerate(live) if rows[i].filters]
    for group, drawer in ((plain, _draw_full), (filtered, _draw_filtered)):
        if not group:
            continue
        idx = [live[j] for j in group]
        sub = x if len(idx) == len(rows) else x[xp.array(idx)]
        if kernel and drawer is _draw_full and cuda.sampler_takes(sub):
            tokens = cuda.sampler_draw(sub, _kernel_params(rows, idx, [draws[j] for j in group]))
        else:
            inv_t = xp.array([[1.0 / rows[i].temperature] for i in idx], dtype=xp.float32)
            u = xp.array([draws[j] for j in group], dtype=xp.float32)  # [n, 2]
            tokens = drawer(sub, inv_t, u, [rows[i] for i in idx], xp)
        if len(idx) == len(rows):
            out = tokens
        else:
            out[xp.array(idx)] = tokens
    return mx.array(out) if xp is np else out


use_numpy_on_cpu = True  # tests switch it off to run the MLX route on the CPU too
use_kernel_on_gpu = True  # tests switch it off to run the MLX ops on a GPU too


def _kernel_params(rows: list[RowSampler], idx, draws: list) -> mx.array:
    """engine/backends/cuda/sampler.py's float32 [n, 4] settings for rows ``idx`` (in order):
    1 / temperature (0: greedy) and the two uniforms of those that sample (``draws``,
    one pair a sampled row, in order)."""
    out, it = [], iter(draws)
    for i in idx:
        if rows[i].greedy:
            out.append((0.0, 1.0, 1.0, 0.0))
        else:
            u0, u1 = next(it)
            out.append((1.0 / rows[i].temperature, u0, u1, 0.0))
    return mx.array(out, dtype=mx.float32)


def numpy_route() -> bool:
    return use_numpy_on_cpu and platform.on_cpu()


def _weights(x, m, inv_t, xp):
    """``exp((x - m) * inv_t)`` for x <= m (the row's max), exactly 0 at -inf: the
    softmax weights of the logits at temperature 1 / inv_t."""
    if xp is mx:
        return mx.exp((x - m) * inv_t)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.exp((x - m) * inv_t, dtype=np.float32)


def _pick(cum, u, xp=mx):
    """Index of the first cumulative weight reaching ``u`` of the row's total ([n, m]
    cumulative sums, u [n] in (0, 1]): never a zero-weight entry, never past the end."""
    target = u[:, None] * cum[:, -1:]
    return xp.minimum((cum < target).sum(axis=-1), cum.shape[-1] - 1).astype(xp.int32)


def _draw_full(x, inv_t, u, rows, xp=mx):
    """One token a row of logits ``x`` [n, V] from its softmax at temperature
    1 / ``inv_t`` [n, 1] (two uniforms a row in ``u`` [n, 2]): a block of BLOCK tokens
    by its mass, then a token in it."""
    n, v = x.shape
    e = _weights(x, x.max(axis=-1, keepdims=True), inv_t, xp)
    nb = -(-v // BLOCK)
    if nb * BLOCK != v:
        e = xp.pad(e, [(0, 0), (0, nb * BLOCK - v)])
    blocks = e.reshape(n, nb, BLOCK)
    blk = _pick(xp.cumsum(blocks.sum(axis=-1), axis=-1), u[:, 0], xp)
    inner = xp.take_along_axis(blocks, xp.broadcast_to(blk[:, None, None], (n, 1, BLOCK)), axis=1)
    pos = _pick(xp.cumsum(inner[:, 0, :], axis=-1), u[:, 1], xp)
    return blk * BLOCK + pos


def _draw_filtered(x, inv_t, u, rows: list[RowSampler], xp=mx, full: bool = False):
    """One token a row from its top-k / top-p set (nucleus: the fewest largest tokens
    whose mass reaches top_p, as ``before < top_p`` over the sorted probabilities).
    MLX (a GPU) sorts whole rows; numpy (the CPU) the CANDIDATES largest unless
    ``full``, and redoes with ``full`` the top-p rows without top-k whose candidates
    hold less than top_p (a top-k row's set is inside them: k >= its top_k)."""
    n, v = x.shape
    k = v if full or xp is mx else min(v, max(CANDIDATES, max(r.top_k for r in rows)))
    if k < v:
        cand = xp.argpartition(-x, k - 1, axis=-1)[:, :k]
        vals = xp.take_along_axis(x, cand, axis=-1)
    else:
        cand, vals = None, x
    order = xp.argsort(-vals, axis=-1)
    idx = order if cand is None else xp.take_along_axis(cand, order, axis=-1)
    vals = xp.take_along_axis(vals, order, axis=-1)
    m = x.max(axis=-1, keepdims=True)
    p = _weights(vals, m, inv_t, xp) / _weights(x, m, inv_t, xp).sum(axis=-1, keepdims=True)
    top_p = xp.array([[r.top_p] for r in rows], dtype=xp.float32)
    top_k = xp.array([[r.top_k if r.top_k > 0 else k] for r in rows], dtype=xp.int32)
    keep = (xp.cumsum(p, axis=-1) - p < top_p) & (xp.arange(k)[None] < top_k)
    pick = _pick(xp.cumsum(xp.where(keep, p, 0.0), axis=-1), u[:, 0], xp)
    out = xp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(xp.int32)
    if k < v:  # numpy only: the host check is free there
        redo = [i for i, r in enumerate(rows) if r.top_p < 1.0 and r.top_k == 0]
        redo = [i for i in redo if p[i].sum() < rows[i].top_p]
        if redo:
            out[redo] = _draw_filtered(
                x[redo], inv_t[redo], u[redo], [rows[i] for i in redo], xp, True
            )
    return out
