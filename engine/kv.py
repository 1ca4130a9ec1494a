"""KV caches that plug into mlx-lm's model modules.

mlx-lm layers call ``cache.update_and_fetch(keys, values)``, read ``cache.offset``
for RoPE and ask ``cache.make_mask(N, window_size=..., return_array=...)`` for the
attention mask. Two caches implement that protocol:

- ``SequenceKV``: one sequence, used while its prompt is prefilled chunk by chunk.
- ``PromptBatchKV``: the last prompt chunks of several sequences (new prompts, or the
  tails after cached prefixes) in one forward, handed on to each one's ``SequenceKV``.
- ``BatchKV``: the running batch, rows left-padded to a common time axis so one
  forward decodes one token for every row. Each row keeps its own RoPE position
  (``offset`` is a per-row array) and the mask hides its padding, so a row's
  result does not depend on what else is in the batch.

Sliding-window layers (Gemma 3) keep full-length KV and get the window through the
mask: simpler than ring buffers and exact, at the memory of full-length KV for those
layers (docs/architecture.md).
"""

from __future__ import annotations

import mlx.core as mx

_GROW = 256  # time steps allocated at a time: amortises the copy when a cache grows


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


class SequenceKV:
    """KV of one sequence (batch 1, no padding)."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.stage = False  # queue the forward so far here (ModelRunner.prefill's stages)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.stage:
            mx.async_eval(keys, values)
        start, n = self.offset, keys.shape[2]
        self.keys = _grow(self.keys, start, start + n, keys)
        self.values = _grow(self.values, start, start + n, values)
        self.keys[:, :, start : start + n, :] = keys
        self.values[:, :, start : start + n, :] = values
        self.offset = start + n
        return self.keys[:, :, : self.offset, :], self.values[:, :, : self.offset, :]

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        if window_size is None and not return_array:
            return None if n == 1 else "causal"
        q = mx.arange(self.offset, self.offset + n)[:, None]
        k = mx.arange(self.offset + n)[None]
        mask = q >= k
        if window_size is not None:
            mask = mask & (q < k + window_size)
        return mask

    def kv(self) -> tuple[mx.array, mx.array]:
        """Keys and values without spare capacity: [1, H, offset, D]."""
        return self.keys[:, :, : self.offset, :], self.values[:, :, : self.offset, :]

    @classmethod
    def from_kv(cls, keys: mx.array, values: mx.array) -> SequenceKV:
        cache = cls()
        cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
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
    ``width`` (the longest prefix); RoPE takes each row's own start position, and an
    array mask hides the left pads and the future."""

    def __init__(self, caches: list[SequenceKV], lengths: list[int]) -> None:
        self.caches = caches
        self.lengths = lengths
        self.starts = [c.offset for c in caches]  # each row's first position this chunk
        self.width = max(self.starts)
        self.offset = mx.array(self.starts, dtype=mx.int32) if self.width else 0
        self.stage = False  # as SequenceKV.stage

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.stage:
            mx.async_eval(keys, values)
        rows_k, rows_v = [], []
        for i, (cache, n, start) in enumerate(zip(self.caches, self.lengths, self.starts)):
            cache.update_and_fetch(keys[i : i + 1, :, :n, :], values[i : i + 1, :, :n, :])
            if self.width:
                rows_k.append(self._row(cache.keys, start, keys[i : i + 1]))
                rows_v.append(self._row(cache.values, start, values[i : i + 1]))
        if not self.width:
            return keys, values
        return mx.concatenate(rows_k, axis=0), mx.concatenate(rows_v, axis=0)

    def _row(self, buf: mx.array, start: int, chunk: mx.array) -> mx.array:
        """[left pad, the cached prefix, the padded chunk] of one row: [1, H, width + L, D]."""
        parts = [buf[:, :, :start, :], chunk]
        if start < self.width:
            pad = mx.zeros((1, chunk.shape[1], self.width - start, chunk.shape[3]), chunk.dtype)
            parts.insert(0, pad)
        return mx.concatenate(parts, axis=2)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        if not self.width:
            return SequenceKV.make_mask(self, n, window_size=window_size, return_array=return_array)
        q = (self.width + mx.arange(n))[:, None]
        k = mx.arange(self.width + n)[None]
        mask = k <= q
        if window_size is not None:
            mask = mask & (q < k + window_size)
        first = self.width - mx.array(self.starts, dtype=mx.int32)  # each row's left pad
        return mask[None, None] & (k[None, None] >= first[:, None, None, None])


class BatchKV:
    """One layer's KV for the running batch.

    Row ``i`` holds its tokens at time indices ``[pad[i], length)``; ``offset[i]`` is
    the position of the next token of row ``i`` (``length - pad[i]``).
    """

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = 0
        self.pad: list[int] = []
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
            self._offset = mx.array([self.length - p for p in self.pad], dtype=mx.int32)
        return self._offset

    @property
    def start(self) -> mx.array:
        """Per-row first valid time index ([B] int32): the row's left padding."""
        return self._pad_arr

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        if n == 1 and window_size is None and not any(self.pad):
            return None
        k = mx.arange(self.length + n)
        q = mx.arange(self.length, self.length + n)
        mask = (q[:, None] >= k[None]) & (k[None, None] >= self._pad_arr[:, None, None])
        if window_size is not None:
            mask = mask & (q[None, :, None] < k[None, None] + window_size)
        return mask[:, None]  # [B, 1, n, T]

    # -- batch membership ----------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.pad)

    def _set_pad(self, pad: list[int]) -> None:
        self.pad = pad
        self._pad_arr = mx.array(pad, dtype=mx.int32)
        self._offset = None

    def add(self, keys: mx.array, values: mx.array) -> None:
        """Append one sequence's KV ([1, H, L, D]) as a new last row."""
        n = keys.shape[2]
        if self.keys is None or self.batch_size == 0:
            self.keys, self.values, self.length = keys, values, n
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
        self._set_pad(old_pad + [lead])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); drop padding no row needs any more."""
        if not rows:
            self.keys = self.values = None
            self.length = 0
            self._set_pad([])
            return
        pad = [self.pad[i] for i in rows]
        idx = mx.array(rows, dtype=mx.int32)
        trim = min(pad)
        self.keys = self.keys[idx, :, trim : self.length, :]
        self.values = self.values[idx, :, trim : self.length, :]
        self.length -= trim
        self._set_pad([p - trim for p in pad])

    def row_kv(self, row: int, tokens: int | None = None) -> tuple[mx.array, mx.array]:
        """One row's KV without padding: [1, H, L, D], only its first ``tokens`` if
        given (a pipelined step may already have written one more)."""
        p = self.pad[row]
        end = self.length if tokens is None else min(self.length, p + tokens)
        return (
            self.keys[row : row + 1, :, p:end, :],
            self.values[row : row + 1, :, p:end, :],
        )

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
