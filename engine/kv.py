"""Key/value caches of attention layers that plug into mlx-lm's model modules.

mlx-lm layers call ``cache.update_and_fetch(keys, values)``, read ``cache.offset``
for RoPE and ask ``cache.make_mask(N, window_size=..., return_array=...)`` for the
attention mask. Three forms implement that protocol, one for each thing the engine
does with a sequence:

- ``SequenceKV``: one sequence, used while its prompt is prefilled chunk by chunk.
- ``PromptBatchKV``: the last prompt chunks of several sequences (new prompts, or the
  tails after cached prefixes) in one forward, handed on to each one's ``SequenceKV``.
- ``BatchKV``: the running batch, rows left-padded to a common time axis so one
  forward decodes one token for every row. Each row keeps its own RoPE position
  (``offset`` is a per-row array) and the mask hides its padding, so a row's
  result does not depend on what else is in the batch.

Each form serves a full-attention layer (mlx-lm's ``KVCache``) or, with ``window``
set, a sliding-window layer (``RotatingKVCache(max_size=window)``): the mask keeps
each query to the last ``window`` positions (the layer's own window when the model
does not pass one). A windowed ``BatchKV`` also drops the keys no row can see any
more (``compact``, between steps), so a sliding layer holds about two windows per
row however long the sequence; a prompt keeps all of its keys until it joins the
batch, so the prefix cache can store every block of it. Keys are kept in time order
(no ring buffer): a row holds positions ``[base, offset)``, and ``base`` is 0 until
compaction drops the front.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

_GROW = 256  # time steps allocated at a time: amortises the copy when a cache grows


@dataclass(frozen=True)
class KVRows:
    """One sequence's keys and values of one layer, [1, H, L, D] each, for positions
    ``[base, base + L)``: what moves between a sequence, the batch and the prefix cache."""

    keys: mx.array
    values: mx.array
    base: int = 0

    @property
    def end(self) -> int:
        return self.base + self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _grow(buf: mx.array | None, used: int, need: int, like: mx.array) -> mx.array:
    """Return a buffer with room for ``need`` time steps, keeping ``used`` of ``buf``."""
    if buf is not None and need <= buf.shape[2]:
        return buf
    batch, heads, _, dim = like.shape
    size = ((need + _GROW - 1) // _GROW) * _GROW
    fresh = mx.zeros((batch, heads, size, dim), dtype=like.dtype)
    if buf is not None and used:
        fresh[:, :, :used, :] = buf[:, :, :used, :]
    return fresh


def window_of(asked: int | None, own: int | None) -> int | None:
    """The window a mask applies: the one the model asks for, else the layer's own.
    A model asking for a wider window than its sliding layer's cache keeps (mlx-lm's
    ``RotatingKVCache(max_size)``) is refused: mlx-lm's own result then depends on
    where a prompt's chunks begin, which no batched form can reproduce."""
    if asked is not None and own is not None and asked > own:
        raise ValueError(
            f"the model masks a window of {asked} positions over a sliding-window cache "
            f"of {own}: mlx-lm's own result then depends on how a prompt is chunked"
        )
    return asked or own


def causal_mask(n: int, offset: int, base: int, window: int | None, return_array: bool):
    """The mask of ``n`` queries at positions ``[offset, offset + n)`` over keys at
    ``[base, offset + n)``, as mlx-lm's caches give it: None or "causal" where no
    array is needed (one query, or no window reached)."""
    if window is not None and offset + n - 1 - base < window:
        window = None  # every key is inside every query's window
    if window is None and not return_array:
        return None if n == 1 else "causal"
    q = mx.arange(offset, offset + n)[:, None]
    k = mx.arange(base, offset + n)[None]
    mask = q >= k
    if window is not None:
        mask = mask & (q < k + window)
    return mask


class SequenceKV:
    """KV of one sequence (batch 1, no padding): positions ``[base, offset)``."""

    def __init__(self, window: int | None = None) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # position of the next token
        self.base = 0  # position of the first key held
        self.window = window
        self.stage = False  # queue the forward so far here (ModelRunner.prefill's stages)

    @property
    def held(self) -> int:
        return self.offset - self.base

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.stage:
            mx.async_eval(keys, values)
        start, n = self.offset - self.base, keys.shape[2]
        self.keys = _grow(self.keys, start, start + n, keys)
        self.values = _grow(self.values, start, start + n, values)
        self.keys[:, :, start : start + n, :] = keys
        self.values[:, :, start : start + n, :] = values
        self.offset += n
        return self.keys[:, :, : start + n, :], self.values[:, :, : start + n, :]

    def keys_and_values(self):
        """What the last ``update_and_fetch`` returned (KV-sharing layers read it)."""
        return self.kv()

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        window = window_of(window_size, self.window)
        return causal_mask(n, self.offset, self.base, window, return_array)

    def kv(self) -> tuple[mx.array, mx.array]:
        """Keys and values without spare capacity: [1, H, held, D]."""
        held = self.offset - self.base
        return self.keys[:, :, :held, :], self.values[:, :, :held, :]

    def rows(self) -> KVRows:
        keys, values = self.kv()
        return KVRows(keys, values, self.base)

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @classmethod
    def from_kv(
        cls, keys: mx.array, values: mx.array, base: int = 0, window: int | None = None
    ) -> SequenceKV:
        cache = cls(window)
        cache.keys, cache.values = keys, values
        cache.base, cache.offset = base, base + keys.shape[2]
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class PromptBatchKV:
    """One layer's cache for prompt chunks of several sequences in one forward
    (``ModelRunner.prefill_together``): the chunks right-padded to one width, each the
    rest of its prompt after the prefix its ``SequenceKV`` already holds (none for a
    new prompt, the cached prefix for one that hit the prefix cache).

    Each sequence's own cache keeps only its real positions. Without cached prefixes
    the forward attends over the padded chunk itself ("causal": every row starts at
    position 0, so a real position never sees a pad). With them, a row's keys are laid
    out as [left pad, its cached prefix, its chunk], the chunks all starting at index
    ``width`` (the longest prefix held); RoPE takes each row's own start position, and
    an array mask hides the left pads, the future and what is outside a window."""

    def __init__(self, caches: list[SequenceKV], lengths: list[int]) -> None:
        self.caches = caches
        self.lengths = lengths
        self.held = [c.offset - c.base for c in caches]  # keys each row holds already
        self.width = max(self.held)
        starts = [c.offset for c in caches]  # each row's first position this chunk
        self.offset = mx.array(starts, dtype=mx.int32) if any(starts) else 0
        self.window = caches[0].window
        self.stage = False  # as SequenceKV.stage
        self._fetched: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.stage:
            mx.async_eval(keys, values)
        rows_k, rows_v = [], []
        for i, (cache, n, held) in enumerate(zip(self.caches, self.lengths, self.held)):
            cache.update_and_fetch(keys[i : i + 1, :, :n, :], values[i : i + 1, :, :n, :])
            if self.width:
                rows_k.append(self._row(cache.keys, held, keys[i : i + 1]))
                rows_v.append(self._row(cache.values, held, values[i : i + 1]))
        if self.width:
            keys, values = mx.concatenate(rows_k, axis=0), mx.concatenate(rows_v, axis=0)
        self._fetched = (keys, values)
        return keys, values

    def keys_and_values(self):
        return self._fetched

    def _row(self, buf: mx.array, held: int, chunk: mx.array) -> mx.array:
        """[left pad, the cached prefix, the padded chunk] of one row: [1, H, width + L, D]."""
        parts = [buf[:, :, :held, :], chunk]
        if held < self.width:
            pad = mx.zeros((1, chunk.shape[1], self.width - held, chunk.shape[3]), chunk.dtype)
            parts.insert(0, pad)
        return mx.concatenate(parts, axis=2)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        window = window_of(window_size, self.window)
        if not self.width:
            return causal_mask(n, 0, 0, window, return_array)
        q = (self.width + mx.arange(n))[:, None]
        k = mx.arange(self.width + n)[None]
        mask = k <= q
        if window is not None:
            mask = mask & (q < k + window)
        first = self.width - mx.array(self.held, dtype=mx.int32)  # each row's left pad
        return mask[None, None] & (k[None, None] >= first[:, None, None, None])


class BatchKV:
    """One layer's KV for the running batch.

    Row ``i`` holds its keys at time indices ``[pad[i], length)``, for positions
    ``[base[i], offset[i])``; ``offset[i]`` is the position of the next token of row
    ``i`` (``length - pad[i] + base[i]``). ``base`` stays 0 for full-attention layers.
    """

    def __init__(self, window: int | None = None) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = 0
        self.pad: list[int] = []
        self.base: list[int] = []
        self.window = window
        self._pad_arr = mx.array([], dtype=mx.int32)
        self._offset: mx.array | None = None

    # -- the mlx-lm cache protocol -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, n = self.length, keys.shape[2]
        self.keys = _grow(self.keys, start, start + n, keys)
        self.values = _grow(self.values, start, start + n, values)
        self.keys[:, :, start : start + n, :] = keys
        self.values[:, :, start : start + n, :] = values
        self.length = start + n
        self._offset = None
        return self.keys[:, :, : self.length, :], self.values[:, :, : self.length, :]

    def keys_and_values(self):
        return self.keys[:, :, : self.length, :], self.values[:, :, : self.length, :]

    def reserve(self, n: int = 1, views: bool = True) -> tuple[mx.array, mx.array]:
        """Room for ``n`` more time steps, counted as written, for a kernel that
        writes them itself (engine/backends/cuda/attention/decode.py's append form: RoPE, the KV
        write and the attention in one kernel); returns the views
        ``update_and_fetch`` would, the new slots last, or with ``views=False`` the
        whole buffers (their capacity past ``length`` unused)."""
        if self.keys is None or self.values is None:
            raise ValueError("reserve() needs a cache that already holds the batch")
        start = self.length
        self.keys = _grow(self.keys, start, start + n, self.keys)
        self.values = _grow(self.values, start, start + n, self.values)
        self.length = start + n
        self._offset = None
        if not views:
            return self.keys, self.values
        return self.keys[:, :, : self.length, :], self.values[:, :, : self.length, :]

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE position of the next token ([B] int32). Made from host
        integers when read, not carried as ``offset + 1`` per layer and step: only
        the first layer's is read by the decode steps, and each add was a graph node
        (one per layer per step, ~5 us each on MLX's CPU backend)."""
        if self._offset is None:
            self._offset = mx.array(self.positions(), mx.int32)
        return self._offset

    def positions(self) -> list[int]:
        """``offset`` as host integers."""
        n = self.length
        return [n - p + b for p, b in zip(self.pad, self.base)]

    @property
    def start(self) -> mx.array:
        """Per-row first valid time index ([B] int32): the row's left padding."""
        return self._pad_arr

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        window = window_of(window_size, self.window)
        if window is not None and self.length + n - 1 < window:
            window = None  # no row holds a key outside any query's window
        if n == 1 and window is None and not any(self.pad):
            return None
        k = mx.arange(self.length + n)
        q = mx.arange(self.length, self.length + n)
        mask = (q[:, None] >= k[None]) & (k[None, None] >= self._pad_arr[:, None, None])
        if window is not None:
            mask = mask & (q[None, :, None] < k[None, None] + window)
        return mask[:, None]  # [B, 1, n, T]

    # -- batch membership ----------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.pad)

    def _set_pad(self, pad: list[int]) -> None:
        self.pad = pad
        self._pad_arr = mx.array(pad, dtype=mx.int32)
        self._offset = None

    def add(self, keys: mx.array, values: mx.array, base: int = 0) -> None:
        """Append one sequence's KV ([1, H, L, D], positions from ``base``) as a new
        last row. A windowed layer takes only the keys the row's next token can see."""
        if self.window is not None:
            keep = self.window - 1
            if keys.shape[2] > keep:
                drop = keys.shape[2] - keep
                keys, values, base = keys[:, :, drop:, :], values[:, :, drop:, :], base + drop
        n = keys.shape[2]
        if self.keys is None or self.batch_size == 0:
            self.keys, self.values, self.length = keys, values, n
            self.base = [base]
            self._set_pad([0])
            return
        if n > self.length:  # new row is longer: shift every existing row right
            shift = n - self.length
            widths = [(0, 0), (0, 0), (shift, 0), (0, 0)]
            self.keys = mx.pad(self.keys[:, :, : self.length, :], widths)
            self.values = mx.pad(self.values[:, :, : self.length, :], widths)
            self.length = n
            old_pad = [p + shift for p in self.pad]
        else:
            old_pad = list(self.pad)
            self.keys = self.keys[:, :, : self.length, :]
            self.values = self.values[:, :, : self.length, :]
        lead = self.length - n
        widths = [(0, 0), (0, 0), (lead, 0), (0, 0)]
        row_k = mx.pad(keys, widths) if lead else keys
        row_v = mx.pad(values, widths) if lead else values
        self.keys = mx.concatenate([self.keys, row_k], axis=0)
        self.values = mx.concatenate([self.values, row_v], axis=0)
        self.base = self.base + [base]
        self._set_pad(old_pad + [lead])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); drop padding no row needs any more."""
        if not rows:
            self.keys = self.values = None
            self.length = 0
            self.base = []
            self._set_pad([])
            return
        pad = [self.pad[i] for i in rows]
        idx = mx.array(rows, dtype=mx.int32)
        trim = min(pad)
        self.keys = self.keys[idx, :, trim : self.length, :]
        self.values = self.values[idx, :, trim : self.length, :]
        self.length -= trim
        self.base = [self.base[i] for i in rows]
        self._set_pad([p - trim for p in pad])

    def compact(self) -> bool:
        """Windowed layers: drop the time steps that no row's next query can see, once
        they are a window's worth (a copy of what is left, so about one key per step
        and row is copied on average). Every layer of one window holds the same time
        layout, so they all drop the same steps. Returns whether anything was dropped."""
        if self.window is None or self.keys is None:
            return False
        dead = self.length - (self.window - 1)  # the next query is at index `length`
        if dead < max(self.window, 16):
            return False
        self.keys = self.keys[:, :, dead : self.length, :]
        self.values = self.values[:, :, dead : self.length, :]
        self.length -= dead
        self.base = [b + max(0, dead - p) for p, b in zip(self.pad, self.base)]
        self._set_pad([max(0, p - dead) for p in self.pad])
        return True

    def row_rows(self, row: int, tokens: int | None = None) -> KVRows:
        """One row's KV without padding (``KVRows``), only up to position ``tokens``
        if given (a pipelined step may already have written one more)."""
        p, base = self.pad[row], self.base[row]
        end = self.length if tokens is None else min(self.length, p + tokens - base)
        end = max(end, p)
        return KVRows(
            self.keys[row : row + 1, :, p:end, :], self.values[row : row + 1, :, p:end, :], base
        )

    def row_kv(self, row: int, tokens: int | None = None) -> tuple[mx.array, mx.array]:
        """One row's KV without padding: [1, H, L, D] (see ``row_rows``)."""
        rows = self.row_rows(row, tokens)
        return rows.keys, rows.values

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
