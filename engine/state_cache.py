"""Recurrent state of linear-attention and SSM layers (mlx-lm's ``ArraysCache``).

Hybrid models (qwen3_next, qwen3_5, falcon_h1, nemotron_h, lfm2, ...) keep, in their
non-attention layers, a few arrays per sequence instead of keys and values: a
convolution's last inputs and a recurrent state. mlx-lm's layers read and write them
as ``cache[i]``, and honour ``cache.lengths`` (each row's real length when rows are
right-padded) and ``cache.make_mask(N)``. The state has no time axis, so its forms
are simple:

- ``SequenceState``: one sequence while its prompt is prefilled.
- ``PromptBatchState``: several sequences' last prompt chunks, right-padded, in one
  forward: ``lengths`` keeps each row's state at its real end, and every array the
  model writes goes back to the rows' own ``SequenceState``.
- ``BatchState``: the running batch, one row per sequence (rows joining and leaving
  are a concatenate and a gather).

A state holds exactly one position, the end of what was fed: a prefix can be reused
only where a state was kept for that exact length (see engine/prefix_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


@dataclass(frozen=True)
class StateRows:
    """One sequence's arrays of one layer (batch 1 each; None where the layer has
    not written that slot), after ``length`` tokens."""

    arrays: tuple[mx.array | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


class _StateProtocol(ArraysCache):
    """What mlx-lm's layers use of an ``ArraysCache`` (a subclass of it: some layers
    check ``isinstance(cache, ArraysCache)`` before they store their state)."""

    cache: list
    lengths: mx.array | None = None
    left_padding: mx.array | None = None
    stage = False  # prefill stages mark layers; a state layer has nothing to queue

    def __getitem__(self, idx: int):
        return self.cache[idx]

    def __setitem__(self, idx: int, value) -> None:
        self.cache[idx] = value

    def advance(self, n: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - n

    def make_mask(self, n: int):
        if self.lengths is None:
            return None
        return mx.arange(n)[None] < self.lengths[:, None]

    def empty(self) -> bool:
        return self.cache[0] is None

    def arrays(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache if a is not None)


class SequenceState(_StateProtocol):
    def __init__(self, size: int) -> None:
        self.cache = [None] * size

    def rows(self) -> StateRows:
        return StateRows(tuple(self.cache))

    @classmethod
    def from_rows(cls, rows: StateRows) -> SequenceState:
        state = cls(len(rows.arrays))
        state.cache = list(rows.arrays)
        return state


def _stack(parts: list[mx.array | None]) -> mx.array | None:
    """Rows' arrays along axis 0; zeros for rows that have none (the layer's own
    start) when others do; None when no row has one."""
    like = next((p for p in parts if p is not None), None)
    if like is None:
        return None
    zero = mx.zeros((1, *like.shape[1:]), like.dtype)
    return mx.concatenate([zero if p is None else p for p in parts], axis=0)


class PromptBatchState(_StateProtocol):
    def __init__(self, rows: list[SequenceState], lengths: list[int]) -> None:
        self.rows = rows
        size = len(rows[0].cache)
        self.cache = [_stack([r.cache[i] for r in rows]) for i in range(size)]
        padded = len(set(lengths)) > 1
        self.lengths = mx.array(lengths, dtype=mx.int32) if padded else None

    def __setitem__(self, idx: int, value) -> None:
        self.cache[idx] = value
        for r, row in enumerate(self.rows):
            row.cache[idx] = value[r : r + 1]


class BatchState(_StateProtocol):
    def __init__(self, size: int) -> None:
        self.cache = [None] * size
        self.n_rows = 0

    def add(self, rows: StateRows) -> None:
        if self.n_rows == 0:
            self.cache = list(rows.arrays)
        else:
            size = len(self.cache)
            fill = [None] * self.n_rows
            self.cache = [
                _stack(([self.cache[i]] if self.cache[i] is not None else fill) + [rows.arrays[i]])
                if self.cache[i] is not None or rows.arrays[i] is not None
                else None
                for i in range(size)
            ]
        self.n_rows += 1

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.cache = [None] * len(self.cache)
            self.n_rows = 0
            return
        idx = mx.array(rows, dtype=mx.int32)
        self.cache = [None if a is None else a[idx] for a in self.cache]
        self.n_rows = len(rows)

    def row_rows(self, row: int) -> StateRows:
        return StateRows(tuple(None if a is None else a[row : row + 1] for a in self.cache))
