"""Which cache each layer of a model keeps, and the engine's forms of it.

A model says what it needs through mlx-lm's ``make_cache()``: one entry per layer
that keeps state (layers that reuse another layer's keys and values, as Gemma 3n's
and Gemma 4's KV-shared layers do, have none), each one of the classes of
``mlx_lm.models.cache``. The engine maps every entry to a *leaf* of one kind:

==================  ====================================  ==============================
mlx-lm class        engine kind                           engine forms
==================  ====================================  ==============================
KVCache             ATTENTION: keys/values of every        SequenceKV, PromptBatchKV,
                    position (also MLA's latents:          BatchKV (engine/kv.py)
                    deepseek_v3 stores them as K/V)
RotatingKVCache     WINDOW: the last ``window`` positions  the same, with ``window``
ArraysCache         STATE: a few arrays, no time axis      SequenceState, PromptBatchState,
                    (SSM / gated-delta / conv state)       BatchState (engine/state_cache.py)
CacheList           several leaves for one layer           a ``CacheGroup`` of them
==================  ====================================  ==============================

Any other class (quantized KV, chunked attention, a model's own cache class) has no
engine form: ``CacheLayout.of`` refuses the model at load with a message naming the
family and the class, instead of failing in the middle of a request.

``Caches`` is what the model is called with: a list with one object per
``make_cache()`` entry, and ``.leaves``, the flat list of leaf forms the engine
moves around (joins, leaves, prefix reuse, memory). For the plain case (one
attention leaf per layer) both are the same list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.kv import BatchKV, KVRows, PromptBatchKV, SequenceKV
from engine.state_cache import BatchState, PromptBatchState, SequenceState, StateRows

ATTENTION, WINDOW, STATE = "attention", "window", "state"


class UnsupportedCache(Exception):
    """The model keeps a cache the engine has no form for."""


@dataclass(frozen=True)
class LeafSpec:
    kind: str
    window: int | None = None  # WINDOW: positions a query sees (itself included)
    slots: int = 0  # STATE: arrays per layer

    def describe(self) -> str:
        if self.kind == WINDOW:
            return f"window({self.window})"
        if self.kind == STATE:
            return f"state({self.slots})"
        return ATTENTION


class CacheGroup:
    """Several leaves of one layer (mlx-lm's ``CacheList``): ``group[i]``."""

    stage = False

    def __init__(self, caches) -> None:
        self.caches = tuple(caches)

    def __getitem__(self, idx: int):
        return self.caches[idx]

    def __len__(self) -> int:
        return len(self.caches)


class Caches(list):
    """One model call's caches: ``self`` is what the model gets, ``leaves`` the flat
    forms (see the module docstring)."""

    def __init__(self, view, leaves=None) -> None:
        super().__init__(view)
        self.leaves = self if leaves is None else leaves

    def arrays(self) -> list:
        return [a for leaf in self.leaves for a in leaf.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    # -- a sequence's forms ----------------------------------------------------------
    def rows(self) -> list[KVRows | StateRows]:
        """Every leaf's content (``SequenceKV``/``SequenceState``)."""
        return [leaf.rows() for leaf in self.leaves]

    # -- the batch's forms -----------------------------------------------------------
    def add(self, rows: list[KVRows | StateRows]) -> None:
        """Append one sequence as the last row of every leaf."""
        for leaf, r in zip(self.leaves, rows):
            if isinstance(leaf, BatchKV):
                leaf.add(r.keys, r.values, r.base)
            else:
                leaf.add(r)

    def keep(self, rows: list[int]) -> None:
        for leaf in self.leaves:
            leaf.keep(rows)

    def row(self, row: int, tokens: int | None = None) -> list[KVRows | StateRows]:
        """One row's content per leaf; KV only up to position ``tokens``."""
        return [
            leaf.row_rows(row, tokens) if isinstance(leaf, BatchKV) else leaf.row_rows(row)
            for leaf in self.leaves
        ]

    def compact(self) -> None:
        for leaf in self.leaves:
            if isinstance(leaf, BatchKV) and leaf.window is not None:
                leaf.compact()


@dataclass
class CacheLayout:
    """The leaves of a model and how its ``make_cache()`` entries group them."""

    family: str
    leaves: list[LeafSpec]
    groups: list[int | tuple[int, ...]]  # per make_cache() entry: a leaf or a CacheList
    # Bytes a sequence keeps, measured once (ModelRunner's load check): per leaf,
    # bytes per position (ATTENTION, WINDOW) or in all (STATE).
    leaf_bytes: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, model, family: str) -> CacheLayout:
        """The layout of ``model``'s own ``make_cache()`` (one ``KVCache`` per layer
        when it has none, as mlx-lm does); raises ``UnsupportedCache``."""
        from mlx_lm.models import cache as mc

        entries = model.make_cache() if hasattr(model, "make_cache") else None
        if entries is None:
            entries = [mc.KVCache() for _ in model.layers]
        leaves: list[LeafSpec] = []
        groups: list[int | tuple[int, ...]] = []

        def leaf(c, where: str) -> int:
            t = type(c)
            if t in (mc.KVCache, mc.ConcatenateKVCache):
                spec = LeafSpec(ATTENTION)
            elif t is mc.RotatingKVCache and not c.keep:
                spec = LeafSpec(WINDOW, window=int(c.max_size))
            elif t is mc.ArraysCache:
                spec = LeafSpec(STATE, slots=len(c.cache))
            else:
                extra = f" keep={c.keep}" if t is mc.RotatingKVCache else ""
                raise UnsupportedCache(
                    f"model family '{family}' is not supported: {where} keeps a "
                    f"{t.__module__.rsplit('.', 1)[-1]}.{t.__name__}{extra} cache, which "
                    "the engine has no batched form for"
                )
            leaves.append(spec)
            return len(leaves) - 1

        for i, c in enumerate(entries):
            if type(c) is mc.CacheList:
                groups.append(
                    tuple(leaf(s, f"cache entry {i}.{j}") for j, s in enumerate(c.caches))
                )
            else:
                groups.append(leaf(c, f"cache entry {i}"))
        return cls(family, leaves, groups)

    # -- what the layout is ----------------------------------------------------------
    @property
    def plain(self) -> bool:
        """One full-attention leaf per entry: today's llama-shaped case, which the fast
        decode steps and the plain ``Caches`` (view == leaves) serve."""
        return all(isinstance(g, int) for g in self.groups) and all(
            s.kind == ATTENTION for s in self.leaves
        )

    @property
    def has_state(self) -> bool:
        return any(s.kind == STATE for s in self.leaves)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for s in self.leaves:
            counts[s.describe()] = counts.get(s.describe(), 0) + 1
        return ", ".join(f"{n} x {k}" for k, n in counts.items())

    # -- the forms ---------------------------------------------------------------------
    def _view(self, leaves: list) -> Caches:
        if self.plain:
            return Caches(leaves)
        view = [
            leaves[g] if isinstance(g, int) else CacheGroup(leaves[i] for i in g)
            for g in self.groups
        ]
        return Caches(view, leaves)

    def sequence(self) -> Caches:
        return self._view(
            [
                SequenceState(s.slots) if s.kind == STATE else SequenceKV(s.window)
                for s in self.leaves
            ]
        )

    def sequence_from(self, rows: list[KVRows | StateRows]) -> Caches:
        """A sequence holding ``rows`` (one per leaf, as the prefix cache returns them)."""
        return self._view(
            [
                SequenceState.from_rows(r)
                if s.kind == STATE
                else SequenceKV.from_kv(r.keys, r.values, r.base, s.window)
                for s, r in zip(self.leaves, rows)
            ]
        )

    def batch(self) -> Caches:
        return self._view(
            [BatchState(s.slots) if s.kind == STATE else BatchKV(s.window) for s in self.leaves]
        )

    def prompt_batch(self, seqs: list[Caches], lengths: list[int]) -> Caches:
        """The forms for ``ModelRunner.prefill_together``: row ``i`` continues ``seqs[i]``
        with a chunk of ``lengths[i]`` tokens."""
        forms = []
        for i, s in enumerate(self.leaves):
            rows = [seq.leaves[i] for seq in seqs]
            if s.kind == STATE:
                forms.append(PromptBatchState(rows, lengths))
            else:
                forms.append(PromptBatchKV(rows, lengths))
        return self._view(forms)

    # -- memory --------------------------------------------------------------------------
    def measure(self, seq: Caches) -> None:
        """Record the bytes per position (KV leaves) and per sequence (state leaves)
        from a sequence that has been fed at least one token."""
        out = []
        for s, leaf in zip(self.leaves, seq.leaves):
            if s.kind == STATE:
                out.append(leaf.nbytes)
            else:
                keys, values = leaf.kv()
                out.append((keys.nbytes + values.nbytes) // max(1, keys.shape[2]))
        self.leaf_bytes = out

    @property
    def unit_bytes(self) -> int:
        """The bytes one budget token stands for: a position in every KV leaf (what a
        token costs a full-attention model), or, for a model with no KV leaves, one
        sequence's state."""
        if not self.leaf_bytes:
            return 0
        kv = sum(b for s, b in zip(self.leaves, self.leaf_bytes) if s.kind != STATE)
        return kv or sum(self.leaf_bytes)

    def kv_tokens(self, prompt: int, total: int) -> int:
        """Budget tokens a sequence of ``prompt`` + up to ``total`` positions may hold:
        ``total`` for full-attention models (the budget's own unit); fewer where
        sliding windows drop old keys (a window holds at most the prompt while it is
        prefilled, then about two windows); plus the state leaves' fixed bytes."""
        if self.plain or not self.leaf_bytes:
            return total
        used = 0
        for s, b in zip(self.leaves, self.leaf_bytes):
            if s.kind == ATTENTION:
                used += b * total
            elif s.kind == WINDOW:
                used += b * min(total, max(prompt, s.window + max(s.window, 16)))
            else:
                used += b
        return math.ceil(used / self.unit_bytes)

    def cost_tokens(self, nbytes: int) -> int:
        """``nbytes`` of cached content in budget tokens (the prefix cache's unit)."""
        unit = self.unit_bytes
        return math.ceil(nbytes / unit) if unit else 0
