"""The prefix cache accounts the bytes of the KV it holds (``bytes_held``, in the
worker's stats and /health as ``prefix_cache_bytes``): what it adds to the
process's memory, which bench/serve/hostile.py compares with the RSS drift of a soak.
What it evicts is counted (``freed_bytes``), and the engine gives the heap's free
pages back to the system after evictions and when it goes idle (engine/heap.py)."""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
import pytest

from engine import heap
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.loading import build_random_model
from engine.prefix_cache import PrefixCache
from engine.types import GenerationRequest, SamplingParams
from tests.helpers.models import RANDOM_LLAMA


def kv(tokens: int, layers: int = 2, heads: int = 2, dim: int = 8):
    return [
        (mx.ones((1, heads, tokens, dim), mx.float32), mx.ones((1, heads, tokens, dim), mx.float32))
        for _ in range(layers)
    ]


def test_bytes_follow_inserts_evictions_and_clear():
    block_bytes = 2 * 2 * (2 * 16 * 8 * 4)  # layers * (k, v) * heads*block*dim*float32
    cache = PrefixCache(budget_tokens=64, block=16)
    cache.insert(list(range(80)), kv(80))  # 5 blocks, one evicted
    assert cache.tokens_held == 64 and cache.bytes_held == 4 * block_bytes
    assert cache.freed_bytes == block_bytes
    cache.insert(list(range(1000, 1048)), kv(48))  # 3 more blocks, 3 evicted
    assert cache.tokens_held == 64 and cache.bytes_held == 4 * block_bytes
    assert cache.freed_bytes == 4 * block_bytes
    cache.clear()
    assert cache.tokens_held == 0 and cache.bytes_held == 0
    assert cache.freed_bytes == 8 * block_bytes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.skipif(heap._TRIM is None, reason="no malloc_trim (not glibc)")
def test_trims_after_enough_is_freed_or_on_idle_and_not_too_often():
    clock = Clock()
    t = heap.HeapTrimmer(min_freed=1000, min_interval_s=10.0, clock=clock)
    assert not t.maybe_trim(0, idle=True)  # nothing happened yet
    assert not t.maybe_trim(999, idle=False)  # not enough freed
    assert t.maybe_trim(1000, idle=False) and t.trims == 1
    clock.t += 5
    assert not t.maybe_trim(5000, idle=False)  # too soon
    clock.t += 5
    assert t.maybe_trim(5000, idle=False) and t.trims == 2
    clock.t += 60
    assert not t.maybe_trim(5000, idle=True)  # idle, but nothing done since
    t.worked()
    assert not t.maybe_trim(5000, idle=False)  # working, little freed: wait
    assert t.maybe_trim(5000, idle=True) and t.trims == 3  # idle after work
    assert t.seconds > 0


def test_worker_reports_the_bytes_of_what_it_keeps():
    loaded = build_random_model("llama", RANDOM_LLAMA, seed=1)
    client = EngineClient.from_loaded([(loaded, None)], EngineConfig(max_num_seqs=4))
    try:

        async def run():
            req = GenerationRequest(
                request_id="r1",
                model=loaded.name,
                prompt_tokens=list(range(100, 164)),
                params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            )
            async for _ in client.generate(req):
                pass

        asyncio.run(run())
        stats = client.health()["models"][loaded.name]
        assert stats["prefix_cache_tokens"] >= 48
        held = client.worker(loaded.name).prefix_cache
        arrays = sum(k.nbytes + v.nbytes for n in held._iter_nodes() for k, v in n.kv)
        assert stats["prefix_cache_bytes"] == arrays > 0
        if heap._TRIM is not None:  # idle after work: the loop gives free pages back
            deadline = time.monotonic() + 5
            while client.health()["models"][loaded.name]["heap_trims"] < 1:
                assert time.monotonic() < deadline, "the idle engine never trimmed the heap"
                time.sleep(0.05)
    finally:
        client.shutdown()
