"""Per-row logit adjustments before the draw: penalties, logit bias, min_tokens, min_p.

A row's adjustments come from its request (``SamplingParams``); ``LogitAdjust`` holds
them and the state they need, and ``plan`` gathers, for one sampling call, the rows
that adjust anything. Rows without adjustments are not touched and pay nothing: with
none in the batch ``plan`` returns None and the sampler never copies its logits.

The adjusted rows are changed together, one array op per kind for all of them (not a
loop of ops per row), in vLLM's order:

1. ``min_tokens``: the row's end tokens (EOS and its ``stop_token_ids``) get -inf
   until it has generated ``min_tokens`` tokens (stop strings still apply);
2. ``logit_bias``: the given value added to each listed token's logit (OpenAI:
   -100..100, where +-100 in effect forces or bans the token);
3. ``repetition_penalty`` (Hugging Face / vLLM): every token of the prompt or the
   output so far has its logit divided by the penalty when positive and multiplied
   by it when negative (> 1 discourages repeats);
4. ``frequency_penalty`` and ``presence_penalty`` (OpenAI): the logit of each token
   generated so far loses ``frequency x its count + presence`` (negative values
   encourage repeats); the prompt does not count;
5. ``min_p`` (sampled rows only): tokens whose probability at the row's temperature
   is below ``min_p`` x the most likely one's get -inf.

Penalty state, updated by ``StepAdjust.record`` with the tokens just drawn. On the
CPU's numpy route, sparse: each row's generated tokens and their counts (and for
``repetition_penalty`` the distinct ids of prompt and output), so a step touches only
the tokens the rows have seen, one gather/scatter for all rows (dense arrays over the
vocabulary cost ~2-3 ms a step at B=8 there). On the MLX route, dense: a float32
count over the vocabulary per row (and a mask of its prompt tokens), made at the
row's first step from the logits' width and updated lazily from the sampled array, so
a GPU's pipelined step (tokens not yet on the host) still counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.types import SamplingParams


@dataclass
class LogitAdjust:
    """One row's adjustments and the state they keep (see the module's docstring)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    end_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    prompt: tuple[int, ...] = ()  # only kept for repetition_penalty
    generated: int = 0  # tokens drawn so far (prefill's first included)
    # numpy route: generated token -> count; prompt + generated ids (repetition only)
    token_counts: dict[int, int] = field(default_factory=dict, repr=False)
    seen: set[int] | None = field(default=None, repr=False)
    _seen_ids: np.ndarray | None = field(default=None, repr=False)  # ``seen`` as an array
    # MLX route: [V] float32 generated-token counts, [V] bool prompt tokens
    counts: object = field(default=None, repr=False)
    prompt_mask: object = field(default=None, repr=False)

    @classmethod
    def from_params(cls, params: SamplingParams, prompt=(), end_ids=()) -> LogitAdjust | None:
        """The row's adjustments, or None when every one is at its neutral value."""
        ends = tuple(sorted(end_ids)) if params.min_tokens > 0 else ()
        adjust = cls(
            frequency=params.frequency_penalty,
            presence=params.presence_penalty,
            repetition=params.repetition_penalty,
            bias_ids=tuple(i for i, _ in params.logit_bias),
            bias_values=tuple(v for _, v in params.logit_bias),
            min_p=params.min_p if params.temperature > 0 else 0.0,
            min_tokens=params.min_tokens if ends else 0,
            end_ids=ends,
            temperature=params.temperature,
            prompt=tuple(prompt) if params.repetition_penalty != 1.0 else (),
        )
        active = adjust.penalized or adjust.bias_ids or adjust.min_p > 0.0 or adjust.min_tokens > 0
        return adjust if active else None

    @property
    def penalized(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0

    def masks_ends(self) -> bool:
        return self.generated < self.min_tokens

    def _init_dense(self, vocab: int) -> None:
        """The MLX route's state, at the row's first step."""
        self.counts = mx.zeros((vocab,), dtype=mx.float32)
        if self.repetition != 1.0:
            mask = np.zeros(vocab, dtype=np.bool_)
            mask[np.array([t for t in self.prompt if 0 <= t < vocab], dtype=np.int64)] = True
            self.prompt_mask = mx.array(mask)

    def seen_ids(self, vocab: int) -> np.ndarray:
        """The numpy route's prompt + generated distinct ids (repetition_penalty)."""
        if self.seen is None:
            self.seen = {t for t in self.prompt if 0 <= t < vocab}
            self._seen_ids = None
        if self._seen_ids is None:
            self._seen_ids = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
        return self._seen_ids

    def count(self, token: int) -> None:
        """The numpy route's record of one drawn token."""
        self.token_counts[token] = self.token_counts.get(token, 0) + 1
        if self.seen is not None and token not in self.seen:
            self.seen.add(token)
            self._seen_ids = None


def plan(rows) -> StepAdjust | None:
    """This call's adjusted rows (``rows``: RowSamplers), or None when none adjusts."""
    idx = [i for i, r in enumerate(rows) if r.adjust is not None]
    if not idx:
        return None
    return StepAdjust(idx, [rows[i].adjust for i in idx])


def _on_rows(x, rows: list[int], total: int, fn, xp):
    """``fn`` applied to rows ``rows`` of ``x`` (of ``total`` rows), the others kept:
    ``fn(x)`` itself when every row is in ``rows``. numpy writes into ``x``; MLX
    returns a new array."""
    if len(rows) == total:
        return fn(x)
    index = xp.array(rows) if xp is mx else rows
    x[index] = fn(x[index])
    return x


class StepAdjust:
    """The adjustments of one sampling call: ``apply`` to the logits before the draw,
    ``record`` the drawn tokens after it."""

    def __init__(self, idx: list[int], adjusts: list[LogitAdjust]) -> None:
        self.idx = idx
        self.adjusts = adjusts
        self.penalized = [j for j, a in enumerate(adjusts) if a.penalized]
        self._counts = None  # the penalized rows' counts, stacked by apply (MLX route)

    def apply(self, x, xp):
        """``x`` float32 [B, V] (numpy: a copy this may write in) with the adjusted rows
        changed; MLX returns a new array."""

        def adjust(sub):
            sub = self._bias(self._mask_ends(sub, xp), xp)
            if self.penalized:
                sub = self._penalize(sub, xp)
            return self._min_p(sub, xp)

        return _on_rows(x, self.idx, x.shape[0], adjust, xp)

    def record(self, tokens, xp) -> None:
        """Count the tokens just drawn (``tokens``: int32 [B], all rows)."""
        for a in self.adjusts:
            a.generated += 1
        if not self.penalized:
            return
        pos = [self.idx[j] for j in self.penalized]
        if xp is np:
            drawn = np.asarray(tokens).tolist()
            for j, i in zip(self.penalized, pos):
                self.adjusts[j].count(drawn[i])
            return
        drawn = tokens[mx.array(pos)] if len(pos) < tokens.shape[0] else tokens
        counts = self._counts.at[mx.arange(len(pos)), drawn].add(1.0)
        for k, j in enumerate(self.penalized):
            self.adjusts[j].counts = counts[k]

    # -- the kinds, each one op for all its rows -----------------------------------
    def _mask_ends(self, sub, xp):
        r, c = [], []
        vocab = sub.shape[1]
        for j, a in enumerate(self.adjusts):
            if a.masks_ends():
                ends = [t for t in a.end_ids if t < vocab]  # past the logits: never drawn
                r += [j] * len(ends)
                c += ends
        if not r:
            return sub
        if xp is mx:
            sub[mx.array(r), mx.array(c)] = -math.inf
        else:
            sub[r, c] = -np.inf
        return sub

    def _bias(self, sub, xp):
        r, c, v = [], [], []
        vocab = sub.shape[1]
        for j, a in enumerate(self.adjusts):
            for t, value in zip(a.bias_ids, a.bias_values):
                if t < vocab:  # the server checks ids against the tokenizer's vocabulary
                    r.append(j)
                    c.append(t)
                    v.append(value)
        if not r:
            return sub
        if xp is mx:
            return sub.at[mx.array(r), mx.array(c)].add(mx.array(v, dtype=mx.float32))
        np.add.at(sub, (np.array(r), np.array(c)), np.array(v, dtype=np.float32))
        return sub

    def _penalize(self, sub, xp):
        return self._penalize_sparse(sub) if xp is np else self._penalize_dense(sub)

    def _penalize_dense(self, sub):
        """MLX: the penalized rows' counts over the whole vocabulary, stacked (kept
        for ``record``), a few element-wise ops for all rows."""
        pen = [self.adjusts[j] for j in self.penalized]
        for a in pen:
            if a.counts is None:
                a._init_dense(sub.shape[1])
        every = len(pen) == len(self.adjusts)
        y = sub if every else sub[mx.array(self.penalized)]
        counts = self._counts = mx.stack([a.counts for a in pen])
        out = counts > 0
        if any(a.repetition != 1.0 for a in pen):
            rep = mx.array([[a.repetition] for a in pen], dtype=mx.float32)
            masks = [
                a.prompt_mask if a.prompt_mask is not None else out[k] for k, a in enumerate(pen)
            ]
            seen = out | mx.stack(masks)
            y = mx.where(seen, mx.where(y > 0, y / rep, y * rep), y)
        if any(a.frequency != 0.0 or a.presence != 0.0 for a in pen):
            freq = mx.array([[a.frequency] for a in pen], dtype=mx.float32)
            pres = mx.array([[a.presence] for a in pen], dtype=mx.float32)
            y = y - counts * freq - out.astype(mx.float32) * pres
        if every:
            return y
        sub[mx.array(self.penalized)] = y
        return sub

    def _penalize_sparse(self, sub):
        """numpy: the penalized rows' seen tokens only, one gather/scatter per kind for
        all rows (rows j of ``sub``, each token once a row)."""
        vocab = sub.shape[1]
        rep_r, rep_c, rep_v, pen_r, pen_c, pen_v = [], [], [], [], [], []
        for j in self.penalized:
            a = self.adjusts[j]
            if a.repetition != 1.0:
                ids = a.seen_ids(vocab)
                rep_r.append(np.full(len(ids), j))
                rep_c.append(ids)
                rep_v.append(np.full(len(ids), a.repetition, dtype=np.float32))
            if (a.frequency != 0.0 or a.presence != 0.0) and a.token_counts:
                counts = a.token_counts
                ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
                n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                pen_r.append(np.full(len(ids), j))
                pen_c.append(ids)
                pen_v.append(n * np.float32(a.frequency) + np.float32(a.presence))
        if rep_r:
            r, c, v = np.concatenate(rep_r), np.concatenate(rep_c), np.concatenate(rep_v)
            y = sub[r, c]
            sub[r, c] = np.where(y > 0, y / v, y * v)
        if pen_r:
            r, c = np.concatenate(pen_r), np.concatenate(pen_c)
            sub[r, c] -= np.concatenate(pen_v)
        return sub

    def _min_p(self, sub, xp):
        rows = [j for j, a in enumerate(self.adjusts) if a.min_p > 0.0]
        if not rows:
            return sub
        # p_i >= min_p * p_max  <=>  (x_i - x_max) / T >= log(min_p)
        floor = xp.array(
            [[self.adjusts[j].temperature * math.log(self.adjusts[j].min_p)] for j in rows],
            dtype=xp.float32,
        )
        return _on_rows(
            sub,
            rows,
            len(self.adjusts),
            lambda y: xp.where(y - y.max(axis=-1, keepdims=True) < floor, -xp.inf, y),
            xp,
        )
