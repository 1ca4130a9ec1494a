"""Reuse of prompt caches across requests: a trie over fixed-size token blocks.

A node stands for one block of ``block`` tokens, reached by the blocks before it, and
holds, per leaf of the model's cache layout (engine/cache_layout.py), what that leaf
needs to continue from the end of the block:

- attention leaves: the block's keys and values (reuse at any block end: the blocks
  of the path, concatenated);
- window leaves: the block's keys and values too, where the sequence still held them
  (a prompt holds all of its own; a finished row of the running batch only its last
  window); reuse at a block end needs only the blocks that cover the last
  ``window - 1`` positions before it;
- state leaves (SSM / linear attention): the state after exactly this block's end,
  where one was kept. A state is known only at the end of what was fed, so the worker
  splits a prompt's prefill at its last block end and keeps the state there: a prompt
  that repeats or extends an earlier one (the next turn of a chat) reuses it; a
  prompt that only shares a shorter start with it does not.

``lookup`` returns the deepest node of the longest matching path where every leaf can
continue. For models whose leaves are all full attention it then takes, from the child
of that node that shares most of the next block, those first shared tokens too (a
shared system prompt rarely ends at a block end: the block holding its end and the
start of each user message is stored once per request, and the next request reuses
the system prompt's part of any of them).

Leaves are evicted least-recently-used when the cache holds more than
``budget_tokens``, counted as the layout counts the KV budget (a block of a
full-attention model costs ``block`` tokens), so it never grows without bound.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import mlx.core as mx

from engine.cache_layout import ATTENTION, STATE, WINDOW, CacheLayout, LeafSpec
from engine.kv import KVRows
from engine.state_cache import StateRows

Block = tuple[mx.array, mx.array]  # one leaf's keys, values of one block: [1, H, block, D]


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    parent: _Node | None
    kv: list[Block | None] = field(default_factory=list)  # per leaf (None: not held)
    states: list[StateRows | None] | None = None  # per leaf, after this block (state leaves)
    cost: int = 0  # budget tokens this node holds
    nbytes: int = 0  # bytes of the arrays it holds
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(
        self, budget_tokens: int, block: int = 16, layout: CacheLayout | None = None
    ) -> None:
        self.budget_tokens = budget_tokens
        self.block = block
        self.layout = layout
        self.root = _Node((), None)
        self.tokens_held = 0
        self.bytes_held = 0  # of the arrays in the cache: what it adds to the process's memory
        self.freed_bytes = 0  # of the arrays evicted or cleared so far (engine/heap.py)
        self._clock = itertools.count(1)
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget_tokens >= self.block

    def _specs(self, n: int) -> list[LeafSpec]:
        if self.layout is None:
            return [LeafSpec(ATTENTION)] * n
        return self.layout.leaves

    def _blocks(self, tokens: list[int], limit: int):
        b = self.block
        for start in range(0, limit - b + 1, b):
            yield tuple(tokens[start : start + b])

    # -- lookup ----------------------------------------------------------------------
    def lookup(self, tokens: list[int]) -> tuple[int, list[KVRows | StateRows] | None]:
        """Longest usable cached prefix of ``tokens`` (leaving at least one token to
        compute): the number of tokens matched and what each leaf holds after them."""
        self.query_tokens += len(tokens)
        if not self.enabled:
            return 0, None
        path: list[_Node] = []
        node = self.root
        for key in self._blocks(tokens, len(tokens) - 1):
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        depth, firsts = len(path), None
        if path:
            specs = self._specs(len(path[0].kv))
            for depth in range(len(path), 0, -1):
                firsts = self._usable(path, depth, specs)
                if firsts is not None:
                    break
            else:
                depth = 0
        # the next block's shared start, where the whole path was usable
        tail, extra = (None, 0) if depth < len(path) else self._partial(tokens, depth, node)
        if depth == 0 and tail is None:
            return 0, None
        now = next(self._clock)
        for n in path[:depth]:
            n.last_used = now
        if tail is not None:
            tail.last_used = now
        if not path:  # only a shared start of a first block
            specs, firsts = self._specs(len(tail.kv)), [0] * len(tail.kv)
        out: list[KVRows | StateRows] = []
        for i, (spec, first) in enumerate(zip(specs, firsts)):
            if spec.kind == STATE:
                out.append(path[depth - 1].states[i])
                continue
            blocks = [n.kv[i] for n in path[first:depth]]
            if tail is not None:
                k, v = tail.kv[i]
                blocks.append((k[:, :, :extra, :], v[:, :, :extra, :]))
            out.append(
                KVRows(
                    mx.concatenate([b[0] for b in blocks], axis=2),
                    mx.concatenate([b[1] for b in blocks], axis=2),
                    first * self.block,
                )
            )
        matched = depth * self.block + extra
        self.hit_tokens += matched
        return matched, out

    def _partial(self, tokens: list[int], depth: int, node: _Node) -> tuple[_Node | None, int]:
        """The child of ``node`` (reached by ``depth`` full blocks) whose block starts with
        the longest run of the next tokens, and that run's length (< block, leaving the
        last token to compute); (None, 0) when none shares a token, or when a leaf is not
        full attention (window and state leaves continue only at block ends)."""
        if not (self.layout is None or self.layout.plain):
            return None, 0
        start = depth * self.block
        rest = tokens[start : len(tokens) - 1][: self.block - 1]
        best, best_n = None, 0
        for key, child in node.children.items() if rest else ():
            n = 0
            for a, b in zip(key, rest):
                if a != b:
                    break
                n += 1
            if n > best_n and all(k is not None for k in child.kv):
                best, best_n = child, n
        return best, best_n

    def _usable(self, path: list[_Node], depth: int, specs: list[LeafSpec]) -> list[int] | None:
        """Per leaf, the first block it needs to continue after ``depth`` blocks, or
        None when some leaf cannot continue there."""
        if self.layout is None or self.layout.plain:
            return [0] * len(specs)
        end = depth * self.block
        firsts = []
        last = path[depth - 1]
        for i, spec in enumerate(specs):
            if spec.kind == STATE:
                if last.states is None or last.states[i] is None:
                    return None
                firsts.append(depth)
                continue
            first = 0
            if spec.kind == WINDOW:
                first = max(0, end - (spec.window - 1)) // self.block
            if any(n.kv[i] is None for n in path[first:depth]):
                return None
            firsts.append(first)
        return firsts

    # -- insert ----------------------------------------------------------------------
    def insert(
        self,
        tokens: list[int],
        rows: list[KVRows | StateRows | tuple | None],
        state: tuple[int, list[StateRows | None]] | None = None,
    ) -> None:
        """Store the full blocks of ``tokens`` that ``rows`` hold: per leaf a
        ``KVRows`` (or (keys, values) from position 0), None for state leaves; and
        ``state = (position, per-leaf states)``, kept at the node ending there if
        ``position`` is a block end."""
        if not self.enabled:
            return
        rows = [KVRows(*r) if isinstance(r, tuple) else r for r in rows]
        specs = self._specs(len(rows))
        kv_ends = [r.end for r, s in zip(rows, specs) if s.kind == ATTENTION]
        limit = min([len(tokens), *kv_ends])  # every node holds every attention leaf
        node = self.root
        now = next(self._clock)
        added: list[mx.array] = []
        b = self.block
        for i, key in enumerate(self._blocks(tokens, limit)):
            s, e = i * b, (i + 1) * b
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node, [None] * len(rows))
                node.children[key] = child
            for j, (spec, r) in enumerate(zip(specs, rows)):
                if spec.kind == STATE or child.kv[j] is not None:
                    continue
                if r is not None and r.base <= s and e <= r.end:
                    lo, hi = s - r.base, e - r.base
                    blk = (
                        mx.contiguous(r.keys[:, :, lo:hi, :]),
                        mx.contiguous(r.values[:, :, lo:hi, :]),
                    )
                    child.kv[j] = blk
                    added += blk
            if state is not None and state[0] == e and child.states is None:
                child.states = list(state[1])
                added += [
                    a for st in state[1] if st is not None for a in st.arrays if a is not None
                ]
            self._recost(child)
            child.last_used = now
            node = child
        if added:
            mx.eval(added)
        self._evict()

    def _recost(self, node: _Node) -> None:
        """The node's bytes and budget tokens after what it holds changed."""
        nbytes = sum(a.nbytes + v.nbytes for a, v in (k for k in node.kv if k is not None))
        if node.states is not None:
            nbytes += sum(s.nbytes for s in node.states if s is not None)
        if self.layout is None or self.layout.plain:
            cost = self.block
        else:
            cost = max(1, self.layout.cost_tokens(nbytes))  # every node counts: none is free
        self.tokens_held += cost - node.cost
        self.bytes_held += nbytes - node.nbytes
        node.cost, node.nbytes = cost, nbytes

    def _evict(self) -> None:
        while self.tokens_held > self.budget_tokens:
            leaves = [n for n in self._iter_nodes() if not n.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.key]
            self.tokens_held -= victim.cost
            self.bytes_held -= victim.nbytes
            self.freed_bytes += victim.nbytes

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        self.root = _Node((), None)
        self.tokens_held = 0
        self.freed_bytes += self.bytes_held
        self.bytes_held = 0
