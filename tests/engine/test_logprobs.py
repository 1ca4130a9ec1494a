"""Log-probabilities (engine/logprobs.py): the raw model log-softmax of the logits the
sampler was handed, for the rows that ask, in a mixed batch.

First the batched op against a float64 reference on random logits (both routes: the
CPU's numpy and MLX ops); then through the engine with a tiny random model, each
token's logprob against ``log_softmax`` of the model's own forward pass over the same
tokens, greedy and seeded rows, penalties on (they do not move the logprobs), the
prompt's logprobs over several prefill chunks, decode steps read back one by one and
pipelined."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from engine import sampler
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.loading import build_random_model
from engine.logprobs import step_logprobs
from engine.types import GenerationRequest, SamplingParams
from tests.helpers.models import RANDOM_LLAMA, sequence_logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(params=["numpy", "mlx"])
def route(request, monkeypatch):
    monkeypatch.setattr(sampler, "use_numpy_on_cpu", request.param == "numpy")
    return request.param


def test_step_logprobs_match_log_softmax_for_the_rows_that_ask(route):
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(5, 3000)) * 4).astype(np.float32)
    tokens = np.array([7, 2999, 0, 1234, 5], dtype=np.int32)
    wants = [3, None, 0, 20, None]
    step = step_logprobs(mx.array(logits), wants, mx.array(tokens))
    assert step.rows == [0, 2, 3] and step.ks == [3, 0, 20]
    got = step.for_rows(5)
    assert got[1] is None and got[4] is None
    ref = log_softmax(logits)
    for i in (0, 2, 3):
        lp = got[i]
        assert abs(lp.logprob - ref[i, tokens[i]]) < 1e-4
        assert len(lp.top) == wants[i]
        order = np.argsort(-ref[i])[: wants[i]]
        assert [t for t, _ in lp.top] == order.tolist()
        assert np.allclose([v for _, v in lp.top], ref[i, order], atol=1e-4)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    assert step_logprobs(mx.array(logits), [None] * 5, mx.array(tokens)) is None


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "pipelined"])
def tiny(request):
    loaded = build_random_model("llama", RANDOM_LLAMA, seed=3)
    client = EngineClient.from_loaded(
        [(loaded, None)],
        EngineConfig(max_num_seqs=8, prefill_chunk_tokens=8, pipeline_decode=request.param),
    )
    yield loaded, client
    client.shutdown()


async def run(client, name, prompt, **params):
    req = GenerationRequest(
        request_id=f"lp-{id(params)}-{len(prompt)}",
        model=name,
        prompt_tokens=prompt,
        params=SamplingParams(ignore_eos=True, **params),
    )
    ids, lps, prompt_lps = [], [], None
    async for ev in client.generate(req):
        ids += ev.token_ids
        if ev.logprobs is not None:
            assert len(ev.logprobs) == len(ev.token_ids)
            lps += ev.logprobs
        if ev.prompt_logprobs is not None:
            assert prompt_lps is None  # once, with the first event
            prompt_lps = ev.prompt_logprobs
    return ids, lps, prompt_lps


def test_engine_logprobs_are_the_models_log_softmax(tiny):
    loaded, client = tiny
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 30, 12, 9)]
    jobs = [
        dict(max_tokens=10, temperature=0.0, logprobs=5),
        dict(
            max_tokens=10,
            temperature=1.0,
            seed=4,
            logprobs=2,
            frequency_penalty=1.0,
            repetition_penalty=1.3,
            logit_bias=((65, 3.0),),
        ),
        dict(max_tokens=10, temperature=0.0, prompt_logprobs=3, logprobs=0),
        dict(max_tokens=10, temperature=0.7, seed=9),  # asks for nothing
    ]

    async def main():
        return await asyncio.gather(
            *(run(client, loaded.name, p, **j) for p, j in zip(prompts, jobs))
        )

    results = asyncio.run(main())
    for (ids, lps, prompt_lps), prompt, job in zip(results, prompts, jobs):
        assert len(ids) == 10
        if job.get("logprobs") is None:
            assert lps == [] and prompt_lps is None
            continue
        ref = log_softmax(sequence_logits(loaded, prompt + ids[:-1]))
        for j, (tok, lp) in enumerate(zip(ids, lps)):
            row = ref[len(prompt) - 1 + j]
            assert abs(lp.logprob - row[tok]) < 1e-3, (j, lp.logprob, row[tok])
            k = job["logprobs"]
            assert len(lp.top) == k
            assert [t for t, _ in lp.top] == np.argsort(-row)[:k].tolist()
            if job["temperature"] == 0.0 and k:
                assert lp.top[0][0] == tok  # greedy: the argmax, the top entry
        if job.get("prompt_logprobs") is not None:
            assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
            for j in range(1, len(prompt)):
                lp, row = prompt_lps[j], ref[j - 1]
                assert abs(lp.logprob - row[prompt[j]]) < 1e-3
                assert [t for t, _ in lp.top] == np.argsort(-row)[:3].tolist()
        else:
            assert prompt_lps is None


def test_min_tokens_holds_back_the_end_tokens(tiny):
    """Greedy's first token made a stop token ends the sequence at once; with
    min_tokens 5 the same request runs at least 5 tokens, none of the first 4 that
    token, and ends on it when it comes."""
    loaded, client = tiny
    prompt = [10, 20, 30, 40]

    async def main():
        first = (await run(client, loaded.name, prompt, max_tokens=20, temperature=0.0))[0][0]
        plain = await run(
            client, loaded.name, prompt, max_tokens=20, temperature=0.0, stop_token_ids=(first,)
        )
        held = await run(
            client,
            loaded.name,
            prompt,
            max_tokens=20,
            temperature=0.0,
            stop_token_ids=(first,),
            min_tokens=5,
        )
        return first, plain[0], held[0]

    first, plain, held = asyncio.run(main())
    assert plain == [first]
    assert len(held) >= 5 and first not in held[:4]
    assert len(held) == 20 or held[-1] == first
