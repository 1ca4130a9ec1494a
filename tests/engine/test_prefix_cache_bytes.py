"""The prefix cache accounts the bytes of the KV it holds (``bytes_held``, in the
worker's stats and /health as ``prefix_cache_bytes``): what it adds to the
process's memory, which bench/serve/hostile.py compares with the RSS drift of a soak."""

from __future__ import annotations

import asyncio

import mlx.core as mx

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
    cache.insert(list(range(1000, 1048)), kv(48))  # 3 more blocks, 3 evicted
    assert cache.tokens_held == 64 and cache.bytes_held == 4 * block_bytes
    cache.clear()
    assert cache.tokens_held == 0 and cache.bytes_held == 0


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
    finally:
        client.shutdown()
