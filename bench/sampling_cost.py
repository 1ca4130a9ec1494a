"""What penalties, biases and logprobs cost a decode step, against plain sampling.

Two tables from one run, every ratio against the plain setting measured in the same run:

1. the sampling call alone (``engine.sampler.sample_batch`` plus, for logprobs,
   ``engine.logprobs.step_logprobs``) on random logits of SmolLM2's 49,152-token
   vocabulary, ms a step (median and fastest of the reps: on a shared host the
   fastest is the steadier), for B rows all with the setting;
2. whole decode steps of the real default model (SmolLM2-135M-Instruct, the server's
   weight format) through ``EngineClient``: B requests at once, ``--tokens`` tokens
   each with ``ignore_eos``, decode tok/s from the last first token to the last token,
   the same setting on every row.

Settings: temperature 0.7 (plain); + frequency 0.5 / presence 0.5; + repetition 1.2 (a
200-token prompt marked); + 20 logit_bias entries; + min_p 0.05; + min_tokens; all of
them; logprobs with top 5 (chat's top_logprobs 5); all of them with logprobs.

    .venv/bin/python bench/sampling_cost.py [--batch 8] [--tokens 32] [--reps 10] [--rounds 3]

Settings run interleaved, ``--rounds`` times each (a busy host slows them alike), and
each cell is the median. Bounded: a few minutes on a 2-core CPU at the defaults. Pass
``--no-engine`` for table 1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.logprobs import step_logprobs  # noqa: E402
from engine.sampler import RowSampler, sample_batch  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402

PLAIN = dict(temperature=0.7)
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.5)
ALL = dict(
    **PENALTIES,
    repetition_penalty=1.2,
    logit_bias=tuple((i * 97, 1.0) for i in range(20)),
    min_p=0.05,
    min_tokens=4,
)
SETTINGS: dict[str, tuple[dict, int | None]] = {
    "plain (temperature 0.7)": (PLAIN, None),
    "+ frequency/presence": ({**PLAIN, **PENALTIES}, None),
    "+ repetition 1.2": ({**PLAIN, "repetition_penalty": 1.2}, None),
    "+ 20 logit_bias": ({**PLAIN, "logit_bias": ALL["logit_bias"]}, None),
    "+ min_p 0.05": ({**PLAIN, "min_p": 0.05}, None),
    "+ min_tokens": ({**PLAIN, "min_tokens": 10**6}, None),
    "all adjustments": ({**PLAIN, **ALL}, None),
    "logprobs, top 5": (PLAIN, 5),
    "all adjustments + logprobs top 5": ({**PLAIN, **ALL}, 5),
}


def sampler_table(batch: int, vocab: int, reps: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, size=200).tolist()
    steps = [mx.array((rng.normal(size=(batch, vocab)) * 3).astype(np.float32)) for _ in range(8)]
    mx.eval(steps)
    rows = {
        name: [
            RowSampler.from_params(SamplingParams(seed=i, **kw), prompt, (0, 2))
            for i in range(batch)
        ]
        for name, (kw, _) in SETTINGS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):  # settings interleaved: a busy host slows them alike
        for name, (_, top) in SETTINGS.items():
            wants = [top] * batch
            for r in range(reps + 2):
                logits = steps[r % len(steps)]
                t = time.perf_counter()
                tokens = sample_batch(logits, rows[name])
                out = step_logprobs(logits, wants, tokens) if top is not None else None
                mx.eval(tokens)
                if out is not None:
                    out.for_rows(batch)
                if r >= 2:
                    times[name].append((time.perf_counter() - t) * 1e3)
    print(f"\n1. sampling call, B={batch}, vocab {vocab}, {mx.default_device()}, "
          f"ms a step (median of {rounds} x {reps})")  # fmt: skip
    print("| setting | median ms | / plain | fastest ms | / plain |")
    print("|---|---:|---:|---:|---:|")
    first = next(iter(SETTINGS))
    base, base_min = statistics.median(times[first]), min(times[first])
    for name in SETTINGS:
        ms, fastest = statistics.median(times[name]), min(times[name])
        print(
            f"| {name} | {ms:.2f} | {ms / base:.2f}x | {fastest:.2f} | {fastest / base_min:.2f}x |"
        )


ENGINE_SETTINGS = [
    "plain (temperature 0.7)",
    "+ frequency/presence",
    "+ repetition 1.2",
    "all adjustments",
    "logprobs, top 5",
    "all adjustments + logprobs top 5",
]


def engine_table(batch: int, tokens: int, rounds: int) -> None:
    from engine.client import EngineClient
    from engine.config import EngineConfig
    from engine.loading import load_model

    loaded = load_model("smollm2-135m-instruct")
    client = EngineClient.from_loaded([(loaded, None)], EngineConfig(max_num_seqs=batch))
    prompt = loaded.tokenizer.encode("Write a long story about a dragon who learns to fly.")
    ids = iter(range(10**9))

    async def one(kw, top):
        params = SamplingParams(
            max_tokens=tokens, ignore_eos=True, seed=next(ids), logprobs=top, **kw
        )
        req = GenerationRequest(f"b{next(ids)}", loaded.name, prompt, params)
        first = last = None
        n = 0
        async for ev in client.generate(req):
            now = time.perf_counter()
            first = first or now
            last = now
            n = ev.completion_tokens
        return first, last, n

    async def run(kw, top):
        out = await asyncio.gather(*(one(kw, top) for _ in range(batch)))
        start = max(f for f, _, _ in out)  # every row prefilled: decode steps only
        end = max(e for _, e, _ in out)
        return sum(n - 1 for _, _, n in out) / (end - start)

    asyncio.run(run(PLAIN, None))  # warm
    rates: dict[str, list[float]] = {name: [] for name in ENGINE_SETTINGS}
    for _ in range(rounds):
        for name in ENGINE_SETTINGS:
            rates[name].append(asyncio.run(run(*SETTINGS[name])))
    client.shutdown()
    print(f"\n2. decode, SmolLM2-135M-Instruct ({loaded.weight_format}), B={batch}, "
          f"{tokens} tokens a row, {mx.default_device()}, median of {rounds}")  # fmt: skip
    print("| setting | tok/s | / plain |")
    print("|---|---:|---:|")
    base = statistics.median(rates[ENGINE_SETTINGS[0]])
    for name in ENGINE_SETTINGS:
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-engine", action="store_true")
    args = ap.parse_args()
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    sampler_table(args.batch, args.vocab, args.reps, args.rounds)
    if not args.no_engine:
        engine_table(args.batch, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
