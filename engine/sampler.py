"""Batched sampling with per-row settings, on the device.

Each running sequence owns a ``RowSampler`` (its temperature, top-p/top-k and its
own random key). ``sample_batch`` draws the next token for every row of a decode
step in a few array ops. A seeded row draws from its own key chain, so its tokens
do not depend on which other requests share the batch.

Later per-row features (constrained-decoding masks, logit bias, penalties) slot in
as extra per-row terms added to the logits before the draw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx

from engine.types import SamplingParams


@dataclass
class RowSampler:
    temperature: float
    top_p: float
    top_k: int
    key: mx.array | None = field(default=None, repr=False)

    @classmethod
    def from_params(cls, params: SamplingParams) -> RowSampler:
        greedy = params.temperature <= 0.0
        key = None
        if not greedy:
            seed = (
                params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
            )
            key = mx.random.key(seed)
        return cls(params.temperature, params.top_p, params.top_k, key)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def filters(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def _filter_row(logits: mx.array, top_p: float, top_k: int) -> mx.array:
    """Set logits outside the top-k / nucleus of one row ([V]) to -inf."""
    order = mx.argsort(-logits)
    sorted_logits = logits[order]
    keep = mx.ones(sorted_logits.shape, dtype=mx.bool_)
    if top_k > 0:
        keep = keep & (mx.arange(sorted_logits.shape[0]) < top_k)
    if top_p < 1.0:
        probs = mx.softmax(sorted_logits, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        keep = keep & (before < top_p)
    filtered_sorted = mx.where(keep, sorted_logits, -mx.inf)
    out = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
    out[order] = filtered_sorted
    return out


def sample_batch(logits: mx.array, rows: list[RowSampler]) -> mx.array:
    """Next token for each row of ``logits`` ([B, V]); returns int32 [B], lazily."""
    logits = logits.astype(mx.float32)
    greedy_tokens = mx.argmax(logits, axis=-1)
    if all(r.greedy for r in rows):
        return greedy_tokens.astype(mx.int32)
    drawn = []
    for i, r in enumerate(rows):
        if r.greedy:
            drawn.append(greedy_tokens[i])
            continue
        row = logits[i] / r.temperature
        if r.filters:
            row = _filter_row(row, r.top_p, r.top_k)
        noise = mx.random.gumbel(shape=row.shape, key=r.next_key())
        drawn.append(mx.argmax(row + noise, axis=-1))
    return mx.stack(drawn).astype(mx.int32)
