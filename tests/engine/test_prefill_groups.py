"""Whole new prompts of one step prefilled together (engine/worker.py,
``ModelRunner.prefill_together``): the grouping rules, and through the real engine that
a burst of prompts gets the tokens each gets alone, in fewer forwards, while prompts
that share their start still reuse the prefix cache."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from test_engine import generate, make_client

from engine import metrics
from engine.loading.random_model import build_random_model
from engine.scheduler import SHARED_PREFIX_TOKENS, defer_shared_starts, prompt_groups
from tests.helpers.models import TINY_LLAMA


def _seq(n: int, start: int = 0):
    return SimpleNamespace(prompt=list(range(start, start + n)), prefilled=0)


def test_groups_fit_the_padded_budget_longest_first():
    seqs = [_seq(n, 100 * i) for i, n in enumerate([5, 30, 12, 12, 3, 31])]
    groups = prompt_groups(seqs, budget=64)
    assert [[len(s.prompt) for s in g] for g in groups] == [[31, 30], [12, 12, 5, 3]]
    for g in groups:
        assert len(g) * len(g[0].prompt) <= 64
    # a prompt as long as the budget goes alone; nothing is dropped
    groups = prompt_groups([_seq(64), _seq(2, 500)], budget=64)
    assert [[len(s.prompt) for s in g] for g in groups] == [[64], [2]]


def test_a_prompt_starting_like_an_earlier_one_waits():
    system = list(range(SHARED_PREFIX_TOKENS))
    a, b, c = (SimpleNamespace(prompt=system + [1000 + i]) for i in range(3))
    short = SimpleNamespace(prompt=system[:5])  # too short to be worth a wait
    other = _seq(SHARED_PREFIX_TOKENS + 4, 7)
    keep, deferred = defer_shared_starts([a, short, b, other, c, short])
    assert keep == [a, short, other, short]
    assert deferred == [b, c]


# a running request keeps the worker in decode steps (each ~1 ms on the tiny model)
# while a burst arrives, so the burst's requests meet in a step or two
BLOCKER_TOKENS = 400


def _observed(histogram, model: str) -> tuple[float, float]:
    """(sum, count) of a per-model histogram, from its Prometheus samples."""
    total = count = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return total, count


async def _alone_then_burst(client, model: str, prompts, max_tokens: int):
    """Greedy tokens of each prompt alone, then of all of them sent at once while a
    long request keeps the worker in decode steps (each ~1 ms on the tiny model), so
    the burst meets in a step or two; and the (prompts, groups) the burst added to
    ``markbase_prefill_group_size``."""
    params = dict(temperature=0, ignore_eos=True)
    alone = [
        (await generate(client, model, p, max_tokens=max_tokens, **params))[0] for p in prompts
    ]
    before = _observed(metrics.prefill_group_size, model)
    blocker = asyncio.ensure_future(
        generate(client, model, [5, 6, 7], max_tokens=BLOCKER_TOKENS, **params)
    )
    await asyncio.sleep(0.01)
    together = await asyncio.gather(
        *(generate(client, model, p, max_tokens=max_tokens, **params) for p in prompts)
    )
    await blocker
    after = _observed(metrics.prefill_group_size, model)
    return alone, [t[0] for t in together], after[0] - before[0], after[1] - before[1]


@pytest.fixture(scope="module")
def engine():
    loaded = build_random_model("llama", TINY_LLAMA, seed=11)
    client = make_client(loaded, max_num_seqs=16, prefill_chunk_tokens=64)
    yield loaded.name, client
    client.shutdown()


def test_a_burst_is_prefilled_in_groups_with_the_tokens_each_gets_alone(engine):
    model, client = engine
    prompts = [[(7 * i + j * 13) % 200 + 1 for j in range(3 + 2 * i)] for i in range(10)]

    alone, together, grouped, groups = asyncio.run(_alone_then_burst(client, model, prompts, 6))
    assert together == alone
    # prompts that met in a step went through the grouping, and some shared a forward
    assert 2 <= grouped <= len(prompts)
    assert groups < grouped


def test_prompts_sharing_a_start_still_reuse_the_prefix_cache(engine):
    model, client = engine
    system = [(5 * j) % 190 + 3 for j in range(SHARED_PREFIX_TOKENS + 8)]
    prompts = [system + [200 + i, 201 + i] for i in range(4)]

    async def main():
        before = metrics.prefix_cache_hits.labels(model)._value.get()
        together = await asyncio.gather(
            *(
                generate(client, model, p, max_tokens=5, temperature=0, ignore_eos=True)
                for p in prompts
            )
        )
        hits = metrics.prefix_cache_hits.labels(model)._value.get() - before
        alone = [
            (await generate(client, model, p, max_tokens=5, temperature=0, ignore_eos=True))[0]
            for p in prompts
        ]
        return [t[0] for t in together], alone, hits

    together, alone, hits = asyncio.run(main())
    assert together == alone
    # the three that started like the first waited a step and took its cached prefix
    assert hits >= 3 * 16


@pytest.fixture(scope="module")
def roomy_engine():
    """A prefill budget of 256 tokens a step while others decode: the plan counts a
    prompt's whole length before its cached prefix is looked up, so several ~55-token
    prompts fit one step."""
    loaded = build_random_model("llama", TINY_LLAMA, seed=12)
    client = make_client(loaded, max_num_seqs=16, prefill_chunk_tokens=256)
    yield loaded.name, client
    client.shutdown()


def test_tails_after_a_cached_prefix_are_prefilled_together(roomy_engine):
    """A chat burst: every prompt starts with a system prompt already in the prefix
    cache; their different tails run in shared forwards, with the tokens each gets
    alone."""
    model, client = roomy_engine
    system = [(3 * j) % 180 + 9 for j in range(48)]
    prompts = [system + [(11 * i + j) % 150 + 20 for j in range(2 + i)] for i in range(6)]

    hits0 = metrics.prefix_cache_hits.labels(model)._value.get()
    # the alone runs leave the system prompt cached for the burst
    alone, together, grouped, groups = asyncio.run(_alone_then_burst(client, model, prompts, 4))
    hits = metrics.prefix_cache_hits.labels(model)._value.get() - hits0
    assert together == alone
    assert hits >= (2 * len(prompts) - 1) * 48  # every request but the very first
    assert groups < grouped
