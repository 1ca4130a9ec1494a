"""Reuse of prompt KV across requests: a trie over fixed-size token blocks.

A node holds the KV (every layer) of one block of ``block`` tokens, reached by the
blocks before it, so a prompt that starts like an earlier one (same system prompt,
the next turn of a chat) takes the cached KV for its longest cached block prefix and
prefills only the rest. Leaves are evicted least-recently-used when the cache holds
more than ``budget_tokens``, so it never grows without bound.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import mlx.core as mx

LayerKV = tuple[mx.array, mx.array]  # keys, values: [1, H, L, D]


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    parent: _Node | None
    kv: list[LayerKV] | None = None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0
    nbytes: int = 0


class PrefixCache:
    def __init__(self, budget_tokens: int, block: int = 16) -> None:
        self.budget_tokens = budget_tokens
        self.block = block
        self.root = _Node((), None)
        self.tokens_held = 0
        self.bytes_held = 0  # of the arrays in the cache: what it adds to the process's memory
        self._clock = itertools.count(1)
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget_tokens >= self.block

    def _blocks(self, tokens: list[int], limit: int):
        b = self.block
        for start in range(0, limit - b + 1, b):
            yield tuple(tokens[start : start + b])

    def lookup(self, tokens: list[int]) -> tuple[int, list[LayerKV] | None]:
        """Longest cached prefix of ``tokens`` (leaving at least one token to compute).

        Returns the number of tokens matched and their KV per layer, concatenated.
        """
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
        if not path:
            return 0, None
        now = next(self._clock)
        for n in path:
            n.last_used = now
        layers = len(path[0].kv)
        kv = [
            (
                mx.concatenate([n.kv[i][0] for n in path], axis=2),
                mx.concatenate([n.kv[i][1] for n in path], axis=2),
            )
            for i in range(layers)
        ]
        matched = len(path) * self.block
        self.hit_tokens += matched
        return matched, kv

    def insert(self, tokens: list[int], kv: list[LayerKV]) -> None:
        """Store the full blocks of ``tokens`` whose KV (per layer, [1,H,>=len,D]) is given."""
        if not self.enabled:
            return
        limit = min(len(tokens), kv[0][0].shape[2])
        node = self.root
        now = next(self._clock)
        added = []
        for i, key in enumerate(self._blocks(tokens, limit)):
            child = node.children.get(key)
            if child is None:
                s, e = i * self.block, (i + 1) * self.block
                blocks = [
                    (mx.contiguous(k[:, :, s:e, :]), mx.contiguous(v[:, :, s:e, :])) for k, v in kv
                ]
                nbytes = sum(k.nbytes + v.nbytes for k, v in blocks)
                child = _Node(key, node, blocks, nbytes=nbytes)
                node.children[key] = child
                self.tokens_held += self.block
                self.bytes_held += nbytes
                added.append(child)
            child.last_used = now
            node = child
        if added:
            mx.eval([a for n in added for kv_pair in n.kv for a in kv_pair])
        self._evict()

    def _evict(self) -> None:
        while self.tokens_held > self.budget_tokens:
            leaves = [n for n in self._iter_nodes() if not n.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.key]
            self.tokens_held -= self.block
            self.bytes_held -= victim.nbytes

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        self.root = _Node((), None)
        self.tokens_held = 0
        self.bytes_held = 0
