"""Log-probabilities of sampled (and prompt) tokens, batched over the rows that ask.

Which ones: the model's raw distribution, ``log_softmax`` of the logits the sampler
was handed, before any penalty, logit bias, min_p, temperature or top-k/top-p (vLLM's
default, ``raw_logprobs``; OpenAI documents none). So a token's logprob does not move
with the sampling settings, greedy's token is the first of the top list, and the
numbers are those of a plain forward pass over the same text.

One step's rows that ask are computed together (one log-sum-exp, one gather, one
partial sort for all of them, with the largest k any of them asked for); rows that
do not ask are not touched, and a step where none asks costs one list scan. On the
CPU the numpy route runs them (MLX's CPU exp is 3-4x slower than numpy's, as for
the draw, engine/sampler.py); elsewhere MLX ops, lazily, read back with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.sampler import numpy_route
from engine.types import TokenLogprob


@dataclass
class StepLogprobs:
    """Log-probabilities of one sampling call's rows that asked (``rows``, in order):
    the sampled token's (``chosen`` [n]) and the ``k`` most likely (``top_ids``,
    ``top_values`` [n, k], most likely first), each row keeping its own ``ks[j]``."""

    rows: list[int]
    ks: list[int]
    chosen: object  # xp float32 [n]
    top_ids: object  # xp int32 [n, k] (k = max(ks); None when 0)
    top_values: object

    def arrays(self) -> list:
        """The arrays to evaluate (a pipelined step queues them with its tokens)."""
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def for_rows(self, batch: int) -> list[TokenLogprob | None]:
        """One entry per row of the batch (None where the row did not ask); reads the
        arrays back to the host."""
        chosen = np.asarray(self.chosen).tolist()
        ids = np.asarray(self.top_ids).tolist() if self.top_ids is not None else None
        vals = np.asarray(self.top_values).tolist() if self.top_values is not None else None
        out: list[TokenLogprob | None] = [None] * batch
        for j, (i, k) in enumerate(zip(self.rows, self.ks)):
            top = tuple(zip(ids[j][:k], vals[j][:k])) if k and ids is not None else ()
            out[i] = TokenLogprob(chosen[j], top)
        return out


def step_logprobs(logits: mx.array, wants: list[int | None], tokens: mx.array):
    """``StepLogprobs`` of the rows whose ``wants[i]`` is not None (k top tokens each)
    for the tokens ``tokens`` ([B] int32) drawn from ``logits`` ([B, V]), or None when
    no row asks."""
    rows = [i for i, k in enumerate(wants) if k is not None]
    if not rows:
        return None
    ks = [wants[i] for i in rows]
    xp = np if numpy_route() else mx
    x = logits.astype(mx.float32)
    every = len(rows) == logits.shape[0]
    if xp is np:
        x = np.asarray(x)
        targets = np.asarray(tokens)
        if not every:
            x, targets = x[rows], targets[rows]
    else:
        if not every:
            pick = mx.array(rows)
            x, targets = x[pick], tokens[pick]
        else:
            targets = tokens
    chosen, top_ids, top_values = token_logprobs(x, targets, max(ks), xp)
    return StepLogprobs(rows, ks, chosen, top_ids, top_values)


def token_logprobs(x, targets, k: int, xp):
    """For float32 logits ``x`` [n, V] and token ids ``targets`` [n]: the targets'
    logprobs [n], and the k largest logprobs' ids and values [n, k], largest first
    (None, None when k is 0)."""
    if xp is np:
        m = x.max(axis=-1, keepdims=True)
        buf = np.subtract(x, m, dtype=np.float32)
        with np.errstate(under="ignore"):
            np.exp(buf, out=buf)
        lse = m + np.log(buf.sum(axis=-1, keepdims=True))
    else:
        lse = mx.logsumexp(x, axis=-1, keepdims=True)
    targets = targets.astype(xp.int32).reshape(-1, 1)
    chosen = (xp.take_along_axis(x, targets, axis=-1) - lse)[:, 0]
    if k <= 0:
        return chosen, None, None
    k = min(k, x.shape[-1])
    if xp is np:
        ids, vals = _top_k_numpy(x, k)
        return chosen, ids, vals - lse
    part = mx.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(x, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids = mx.take_along_axis(part, order, axis=-1).astype(mx.int32)
    vals = mx.take_along_axis(vals, order, axis=-1) - lse
    return chosen, ids, vals


TOP_BLOCK = 64  # tokens a block of _top_k_numpy's first pass


def _top_k_numpy(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row of ``x`` [n, V], largest first (ties in any order).
    The k largest lie in the k blocks (of TOP_BLOCK tokens) with the largest maxima,
    so one pass takes the blocks' maxima, a partition over those picks k blocks, and
    only their k x TOP_BLOCK entries are sorted: ~0.3 ms at [8, 49152] on the 2-core
    CPU, where ``argpartition`` over the rows took 3-10 ms and ``partition`` plus
    ``nonzero`` 2.4 ms. Returns (ids int32 [n, k], values [n, k])."""
    n, v = x.shape
    nb = -(-v // TOP_BLOCK)
    if nb * TOP_BLOCK != v:
        x = np.pad(x, [(0, 0), (0, nb * TOP_BLOCK - v)], constant_values=-np.inf)
    blocks = x.reshape(n, nb, TOP_BLOCK)
    kb = min(k, nb)
    best = np.argpartition(blocks.max(axis=-1), nb - kb, axis=-1)[:, nb - kb :]  # [n, kb]
    cand = np.take_along_axis(blocks, best[:, :, None], axis=1).reshape(n, -1)
    ids = (best[:, :, None] * TOP_BLOCK + np.arange(TOP_BLOCK)).reshape(n, -1)
    if cand.shape[1] > k:
        part = np.argpartition(-cand, k - 1, axis=-1)[:, :k]
        cand, ids = np.take_along_axis(cand, part, axis=-1), np.take_along_axis(ids, part, axis=-1)
    order = np.argsort(-cand, axis=-1)
    return np.take_along_axis(ids, order, axis=-1).astype(np.int32), np.take_along_axis(
        cand, order, axis=-1
    )


def prompt_logprobs(logits: mx.array, prompt: list[int], start: int, k: int) -> list[TokenLogprob]:
    """Log-probabilities of prompt tokens ``start + 1 .. start + n`` (those that exist)
    from a chunk's logits [n, V] at positions ``start .. start + n - 1``."""
    n = min(logits.shape[0], len(prompt) - start - 1)
    if n <= 0:
        return []
    xp = np if numpy_route() else mx
    x = logits[:n].astype(mx.float32)
    targets = prompt[start + 1 : start + 1 + n]
    if xp is np:
        x, targets = np.asarray(x), np.array(targets, dtype=np.int32)
    else:
        targets = mx.array(targets, dtype=mx.int32)
    chosen, ids, vals = token_logprobs(x, targets, k, xp)
    step = StepLogprobs(list(range(n)), [k] * n, chosen, ids, vals)
    return step.for_rows(n)
