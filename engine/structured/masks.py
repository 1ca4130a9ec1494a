"""Token masks for the constrained rows of a step: filled on the host, applied to the logits.

A mask is llguidance's bitmask: int32 words, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed. ``MaskFiller`` fills one row per constrained sequence with
llguidance's parallel fill (its own threads, the GIL released), started in a thread of
its own (``start``) so the worker thread can wait for the model's forward meanwhile;
``apply_token_masks`` then sets disallowed logits to -inf in those rows only.

Applying: on the CPU route the words are unpacked with numpy (``np.unpackbits``, a few
microseconds a row) into a boolean array and applied with one ``mx.where``; on a GPU the
words go to the device (V/8 bytes a row) and are unpacked there with a shift and an
and, so a step moves 32x less than a boolean mask would. llguidance's own numpy apply
helper is ~10x slower (measured in /work/shared/README.md) and is not used.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from engine.structured.compiler import SequenceGrammar


@dataclass
class TokenMasks:
    """This step's masks: row ``rows[k]`` of the batch may only take the tokens set in
    ``words[k]`` (int32 [len(rows), ceil(V / 32)])."""

    rows: list[int]
    words: np.ndarray

    def row(self, i: int) -> TokenMasks | None:
        """The mask of batch row ``i`` alone, as row 0 (the sampler's row-by-row retry)."""
        if i not in self.rows:
            return None
        k = self.rows.index(i)
        return TokenMasks([0], self.words[k : k + 1])


class MaskFiller:
    """Fills the masks of a step's constrained rows; one per model worker."""

    def __init__(self, vocab_size: int, eos_ids=(), parallel: bool = True) -> None:
        self.n_words = (int(vocab_size) + 31) // 32
        self._eos = [int(i) for i in eos_ids if 0 <= int(i) < self.n_words * 32]
        self.parallel = parallel
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None

    def fill(self, rows: list[tuple[int, SequenceGrammar]]) -> TokenMasks:
        """Masks for ``rows`` ((batch row, its grammar), in any order), computed now:
        with llguidance's thread pool (``parallel``), or row after row in this thread."""
        words = np.empty((len(rows), self.n_words), dtype=np.int32)
        if self.parallel:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(g.matcher, k) for k, (_, g) in enumerate(rows)], words
            )
        else:
            for k, (_, g) in enumerate(rows):
                llguidance.numpy.fill_next_token_bitmask(g.matcher, words, k)
        empty = ~words.any(axis=1)
        if empty.any():  # a grammar in error allows nothing: let the row end instead
            words[empty] = 0
            for t in self._eos:
                words[empty, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            if not self._eos:
                words[empty] = -1
        return TokenMasks([i for i, _ in rows], words)

    def start(self, rows: list[tuple[int, SequenceGrammar]]) -> Future | None:
        """``fill`` in the background (None when no row is constrained): the caller
        evaluates the model's forward meanwhile and takes ``.result()`` to sample."""
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self.fill, rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def apply_token_masks(logits: mx.array, masks: TokenMasks, on_host: bool) -> mx.array:
    """``logits`` [B, V] float32 with every token the masks disallow at -inf in the masked
    rows (other rows unchanged). ``on_host``: unpack the bits with numpy (the CPU route);
    otherwise on the device."""
    b, v = logits.shape
    n = len(masks.rows)
    if on_host:
        bits = np.unpackbits(masks.words.view(np.uint8), axis=1, bitorder="little")
        bits = bits[:, :v].astype(bool)
        if n == b and masks.rows == list(range(b)):
            allowed = bits
        else:
            allowed = np.ones((b, v), dtype=bool)
            allowed[masks.rows] = bits
        return mx.where(mx.array(allowed), logits, -mx.inf)
    # made here, on the worker's thread: an array made at import belongs to the
    # importing thread's stream, and on a GPU the worker cannot evaluate it
    shifts = mx.arange(32, dtype=mx.int32)
    words = mx.array(masks.words)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(n, -1)[:, :v].astype(mx.bool_)
    if n == b and masks.rows == list(range(b)):
        allowed = bits
    else:
        allowed = mx.ones((b, v), dtype=mx.bool_)
        allowed[mx.array(masks.rows, dtype=mx.int32)] = bits
    return mx.where(allowed, logits, -mx.inf)
