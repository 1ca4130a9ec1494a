"""The continuous batcher, driven through EngineClient with real models.

Tiny random-weight models make the batching invariants cheap to check; the real
default model checks them on real text.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.loading import build_random_model
from engine.types import (
    ContextLengthError,
    FinishReason,
    GenerationRequest,
    OverloadedError,
    SamplingParams,
)
from tests.helpers.models import RANDOM_LLAMA

TINY_LLAMA = RANDOM_LLAMA


def make_client(loaded, **cfg) -> EngineClient:
    return EngineClient.from_loaded([(loaded, None)], EngineConfig(**cfg))


_ids = iter(range(10**9))


async def generate(client, model, prompt_tokens, **params):
    req = GenerationRequest(
        request_id=f"r{next(_ids)}",
        model=model,
        prompt_tokens=list(prompt_tokens),
        params=SamplingParams(**params),
    )
    tokens, text, last = [], "", None
    async for ev in client.generate(req):
        tokens.extend(ev.token_ids)
        text += ev.text
        last = ev
    return tokens, text, last


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "pipelined"])
def tiny(request):
    """Every test on it runs twice: decode steps read back one by one (the CPU's
    default) and pipelined (the GPU's: step i+1 queued before step i is read)."""
    loaded = build_random_model("llama", TINY_LLAMA, seed=1)
    client = make_client(
        loaded, max_num_seqs=8, prefill_chunk_tokens=8, pipeline_decode=request.param
    )
    yield loaded.name, client
    client.shutdown()


PROMPTS = [list(range(1, 6)), [7] * 40, list(range(30, 90)), [200, 3, 5, 9, 11, 13, 2]]


def test_batched_greedy_equals_alone(tiny):
    """Greedy tokens must not depend on what else shares the batch."""
    model, client = tiny

    lengths = [24, 5, 13, 24]  # rows leave the batch at different steps

    async def main():
        alone = [
            (await generate(client, model, p, max_tokens=n, temperature=0, ignore_eos=True))[0]
            for p, n in zip(PROMPTS, lengths)
        ]
        together = await asyncio.gather(
            *[
                generate(client, model, p, max_tokens=n, temperature=0, ignore_eos=True)
                for p, n in zip(PROMPTS, lengths)
            ]
        )
        return alone, [t[0] for t in together], [t[2] for t in together]

    alone, together, lasts = asyncio.run(main())
    assert together == alone
    for last, n in zip(lasts, lengths):
        assert last.finish_reason is FinishReason.LENGTH
        assert last.completion_tokens == n


def test_staggered_arrivals_join_running_batch(tiny):
    """Requests that arrive while others decode join between steps, same result."""
    model, client = tiny

    async def main():
        ref = (
            await generate(client, model, PROMPTS[2], max_tokens=30, temperature=0, ignore_eos=True)
        )[0]

        async def late(delay):
            await asyncio.sleep(delay)
            return await generate(
                client, model, PROMPTS[2], max_tokens=30, temperature=0, ignore_eos=True
            )

        results = await asyncio.gather(*(late(d) for d in (0, 0.01, 0.03, 0.05)))
        return ref, [r[0] for r in results]

    ref, results = asyncio.run(main())
    assert all(r == ref for r in results)


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    model, client = tiny

    async def main():
        a = await generate(
            client, model, PROMPTS[0], max_tokens=20, temperature=1.0, seed=42, ignore_eos=True
        )
        b, _ = await asyncio.gather(
            generate(
                client, model, PROMPTS[0], max_tokens=20, temperature=1.0, seed=42, ignore_eos=True
            ),
            generate(
                client,
                model,
                PROMPTS[1],
                max_tokens=20,
                temperature=0.8,
                top_p=0.9,
                seed=7,
                ignore_eos=True,
            ),
        )
        c = await generate(
            client, model, PROMPTS[0], max_tokens=20, temperature=1.0, seed=43, ignore_eos=True
        )
        return a[0], b[0], c[0]

    a, b, c = asyncio.run(main())
    assert a == b
    assert a != c


def test_metrics_count_every_token(tiny):
    """Every token counts once in the generation counter; each sequence's first in
    the time-to-first-token histogram, every later one in the inter-token histogram
    (a decode step records its rows' gaps together)."""
    from prometheus_client import REGISTRY

    model, client = tiny
    names = (
        "markbase_generation_tokens_total",
        "markbase_time_to_first_token_seconds_count",
        "markbase_inter_token_latency_seconds_count",
        "markbase_inter_token_latency_seconds_sum",
        "markbase_inter_token_latency_seconds_bucket",
    )

    def values():
        get = REGISTRY.get_sample_value
        out = {n: get(n, {"model": model}) or 0.0 for n in names[:-1]}
        out[names[-1]] = get(names[-1], {"model": model, "le": "+Inf"}) or 0.0
        return out

    lengths = [24, 5, 13, 1]
    before = values()

    async def main():
        return await asyncio.gather(
            *[
                generate(client, model, p, max_tokens=n, temperature=0, ignore_eos=True)
                for p, n in zip(PROMPTS, lengths)
            ]
        )

    results = asyncio.run(main())
    after = values()
    delta = {n: after[n] - before[n] for n in names}
    total = sum(len(r[0]) for r in results)
    assert total == sum(lengths)
    assert delta["markbase_generation_tokens_total"] == total
    assert delta["markbase_time_to_first_token_seconds_count"] == len(lengths)
    assert delta["markbase_inter_token_latency_seconds_count"] == total - len(lengths)
    assert delta["markbase_inter_token_latency_seconds_bucket"] == total - len(lengths)
    assert delta["markbase_inter_token_latency_seconds_sum"] > 0


def test_prefix_cache_hit_gives_identical_output(tiny):
    model, client = tiny
    prompt = list(range(100, 164)) + [5, 6, 7]

    async def main():
        cold = await generate(client, model, prompt, max_tokens=16, temperature=0, ignore_eos=True)
        warm = await generate(client, model, prompt, max_tokens=16, temperature=0, ignore_eos=True)
        return cold, warm

    cold, warm = asyncio.run(main())
    assert warm[0] == cold[0]
    assert warm[2].cached_tokens >= 48
    assert warm[2].prompt_tokens == len(prompt)


def test_next_turn_reuses_the_reply_kv(tiny):
    """A finished reply's KV is kept (prompt + reply, the last token never fed), so
    the next turn of the chat prefills only its new tokens, and its output equals a
    run with the prefix cache off (in both decode modes: a pipelined step has
    already written one more token when the reply ends)."""
    model, client = tiny
    loaded = build_random_model("llama", TINY_LLAMA, seed=1)
    cold_client = make_client(loaded, max_num_seqs=8, prefill_chunk_tokens=8, prefix_cache_tokens=0)
    first = [11, 12, 13] * 11  # 33 tokens

    async def turns(c, name):
        reply, _, _ = await generate(c, name, first, max_tokens=20, temperature=0, ignore_eos=True)
        second = first + reply + [4, 5, 6]
        tokens, _, last = await generate(
            c, name, second, max_tokens=12, temperature=0, ignore_eos=True
        )
        return reply, tokens, last

    try:
        reply, warm, last = asyncio.run(turns(client, model))
        cold_reply, cold, _ = asyncio.run(turns(cold_client, loaded.name))
    finally:
        cold_client.shutdown()
    assert reply == cold_reply and warm == cold
    fed = len(first) + len(reply) - 1
    assert last.cached_tokens == fed - fed % 16  # whole 16-token blocks of what was fed


def test_cancel_frees_the_slot(tiny):
    """Closing the stream aborts the sequence within a step and returns its KV budget."""
    model, client = tiny
    worker = client.worker(model)

    async def main():
        req = GenerationRequest(
            "cancel-me",
            model,
            list(range(1, 20)),
            SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True),
        )
        agen = client.generate(req)
        got = 0
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            s = worker.stats()
            if s["running"] == 0 and s["prefilling"] == 0 and s["kv_reserved_tokens"] == 0:
                return s
            await asyncio.sleep(0.01)
        return worker.stats()

    stats = asyncio.run(main())
    assert stats["running"] == 0 and stats["kv_reserved_tokens"] == 0


def test_prompt_over_context_is_rejected(tiny):
    model, client = tiny
    limit = client.get_model(model).context_length
    with pytest.raises(ContextLengthError) as err:
        asyncio.run(generate(client, model, [1] * (limit + 5), max_tokens=4))
    assert str(limit) in str(err.value) and str(limit + 5) in str(err.value)


def test_queue_limit_answers_overloaded():
    loaded = build_random_model("llama", TINY_LLAMA, seed=2)
    client = make_client(loaded, max_num_seqs=1, max_queued_requests=2, prefill_chunk_tokens=8)
    try:

        async def main():
            tasks = [
                asyncio.create_task(
                    generate(
                        client,
                        loaded.name,
                        [1, 2, 3],
                        max_tokens=200,
                        temperature=0,
                        ignore_eos=True,
                    )
                )
                for _ in range(6)
            ]
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        overloaded = [r for r in results if isinstance(r, OverloadedError)]
        done = [r for r in results if isinstance(r, tuple)]
        assert overloaded, results
        assert done and all(r[2].completion_tokens == 200 for r in done)
        assert "max_queued_requests=2" in str(overloaded[0])
    finally:
        client.shutdown()


def test_max_num_seqs_bounds_the_batch():
    loaded = build_random_model("llama", TINY_LLAMA, seed=3)
    client = make_client(loaded, max_num_seqs=2, prefill_chunk_tokens=8)
    worker = client.worker(loaded.name)
    seen = []
    try:

        async def watch():
            while True:
                seen.append(len(worker.running) + len(worker.prefilling))
                await asyncio.sleep(0.002)

        async def main():
            w = asyncio.create_task(watch())
            res = await asyncio.gather(
                *[
                    generate(
                        client,
                        loaded.name,
                        [i + 1] * 5,
                        max_tokens=30,
                        temperature=0,
                        ignore_eos=True,
                    )
                    for i in range(5)
                ]
            )
            w.cancel()
            return res

        res = asyncio.run(main())
        assert all(r[2].completion_tokens == 30 for r in res)
        assert max(seen) <= 2
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    "arch,config",
    [
        (
            "gemma3_text",
            dict(
                hidden_size=64,
                num_hidden_layers=3,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=16,
                vocab_size=256,
                sliding_window=8,
                sliding_window_pattern=2,
                query_pre_attn_scalar=16,
            ),
        ),
    ],
)
def test_sliding_window_model_batched_equals_alone(arch, config):
    """Gemma 3's local layers see their window through the mask, also in a padded batch."""
    loaded = build_random_model(arch, config, seed=4)
    client = make_client(loaded, max_num_seqs=4, prefill_chunk_tokens=8)
    try:
        prompts = [list(range(1, 30)), [9, 8, 7], list(range(50, 70))]

        async def main():
            alone = [
                (
                    await generate(
                        client, loaded.name, p, max_tokens=20, temperature=0, ignore_eos=True
                    )
                )[0]
                for p in prompts
            ]
            together = await asyncio.gather(
                *[
                    generate(client, loaded.name, p, max_tokens=20, temperature=0, ignore_eos=True)
                    for p in prompts
                ]
            )
            return alone, [t[0] for t in together]

        alone, together = asyncio.run(main())
        assert together == alone
    finally:
        client.shutdown()


def test_a_failing_sequence_does_not_take_down_the_batch(tiny, monkeypatch):
    """A sampler error in one row fails that request only (fault injected by seed)."""
    import engine.worker as worker_mod
    from engine.sampler import RowSampler

    class FaultySampler(RowSampler):
        calls = 0

        def draw(self):
            FaultySampler.calls += 1
            if FaultySampler.calls > 3:  # fail mid-stream, inside a batched decode step
                raise RuntimeError("injected sampler fault")
            return super().draw()

    real = RowSampler.from_params

    def from_params(params, *context):
        if params.seed == 666:
            return FaultySampler(
                params.temperature, params.top_p, params.top_k, np.random.default_rng(0)
            )
        return real(params, *context)

    monkeypatch.setattr(worker_mod.RowSampler, "from_params", staticmethod(from_params))
    model, client = tiny

    async def main():
        ok_ref = await generate(
            client, model, PROMPTS[0], max_tokens=20, temperature=0, ignore_eos=True
        )
        results = await asyncio.gather(
            generate(client, model, PROMPTS[0], max_tokens=20, temperature=0, ignore_eos=True),
            generate(
                client, model, PROMPTS[1], max_tokens=20, temperature=1.0, seed=666, ignore_eos=True
            ),
            return_exceptions=True,
        )
        return ok_ref, results

    ok_ref, (ok, bad) = asyncio.run(main())
    assert ok[0] == ok_ref[0] and ok[2].finish_reason is FinishReason.LENGTH
    tokens, _, last = bad
    assert last.finish_reason is FinishReason.ERROR and "injected sampler fault" in last.error
    assert len(tokens) == 3
    assert client.health()["status"] == "ok"
