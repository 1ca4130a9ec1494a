"""Who runs this step: admission under the limits, and the prefill token budget.

The worker asks the ``Scheduler`` twice per step and gets plain data back; the
scheduler mutates nothing itself:

1. ``admit``: which waiting sequences start now (FIFO, within ``max_num_seqs`` and
   the KV token budget, so memory is bounded before any work is done);
2. ``plan_prefill``: how many prompt tokens each prefilling sequence computes this
   step. Running sequences always decode one token; the prefill budget bounds how
   much prompt work joins a step, so a long prompt cannot stall running streams.
3. ``prompt_groups`` / ``defer_shared_starts``: which whole new prompts of the plan
   run as one forward, and which wait a step for a prefix an earlier one will cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.config import EngineConfig, default_prefill_chunk_tokens
from engine.sequence import Sequence


def kv_need(seq: Sequence, kv_tokens: Callable[[int, int], int] | None = None) -> int:
    """KV tokens a sequence may come to hold: its prompt plus all it may generate, as
    the model's cache layout counts them (``CacheLayout.kv_tokens``: sliding windows
    and state layers hold other amounts than a token each)."""
    total = min(len(seq.prompt) + seq.params.max_tokens, seq.max_len)
    return total if kv_tokens is None else kv_tokens(len(seq.prompt), total)


@dataclass
class PrefillPlan:
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens)
    budget: int = 0  # prompt tokens this step may compute


# Prompts that begin with the same this-many tokens are not prefilled together: the
# later one waits a step and then finds the earlier one's prefix in the prefix cache
# (a shared system prompt), which saves more than batching would.
SHARED_PREFIX_TOKENS = 32


def defer_shared_starts(seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """(to run now, to defer a step): a prompt whose first ``SHARED_PREFIX_TOKENS``
    tokens an earlier one of ``seqs`` has waits, to reuse that one's cached prefix."""
    seen: set[tuple[int, ...]] = set()
    keep, deferred = [], []
    for seq in seqs:
        if len(seq.prompt) > SHARED_PREFIX_TOKENS:
            head = tuple(seq.prompt[:SHARED_PREFIX_TOKENS])
            if head in seen:
                deferred.append(seq)
                continue
            seen.add(head)
        keep.append(seq)
    return keep, deferred


def prompt_groups(seqs: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Prompts to finish together, by the tokens each has left (``prompt`` past
    ``prefilled``), longest first: each group's right-padded size (members x its
    longest) within ``budget``; groups of one included (the caller runs those alone)."""

    def left(seq: Sequence) -> int:
        return len(seq.prompt) - seq.prefilled

    groups: list[list[Sequence]] = []
    for seq in sorted(seqs, key=left, reverse=True):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * left(group[0]) <= budget:
            group.append(seq)
        else:
            groups.append([seq])
    return groups


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_tokens: Callable[[int, int], int] | None = None
    ) -> None:
        self.config = config
        self.chunk_tokens = config.prefill_chunk_tokens or default_prefill_chunk_tokens()
        self.kv_tokens = kv_tokens

    def kv_need(self, seq: Sequence) -> int:
        """``kv_need`` in this model's count, at most the whole budget (a sequence the
        context length admits can always run alone)."""
        return min(kv_need(seq, self.kv_tokens), self.config.max_kv_tokens)

    def admit(self, waiting: Iterable[Sequence], active: int, kv_reserved: int) -> list[Sequence]:
        cfg = self.config
        chosen = []
        for seq in waiting:  # FIFO: the head blocks later ones, so nobody starves
            need = self.kv_need(seq)
            if active >= cfg.max_num_seqs or kv_reserved + need > cfg.max_kv_tokens:
                break
            chosen.append(seq)
            active += 1
            kv_reserved += need
        return chosen

    def plan_prefill(self, prefilling: list[Sequence], decoding: bool) -> PrefillPlan:
        # With nothing decoding there is no stream to protect: take bigger chunks.
        budget = self.chunk_tokens * (1 if decoding else 4)
        plan = PrefillPlan(budget=budget)
        for seq in prefilling:
            if budget <= 0:
                break
            take = min(len(seq.prompt) - seq.prefilled, budget)
            plan.chunks.append((seq, take))
            budget -= take
        return plan
