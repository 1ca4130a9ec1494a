"""A burst of new prompts through the engine: wall time until every request has its
first token, with whole prompts of a step prefilled together (the default) and one by
one (``MARKBASE_PREFILL_TOGETHER=0``), interleaved in one process, median of the reps.

    .venv/bin/python bench/serve/prefill_burst.py [--model smollm2-135m-instruct] [--burst 16]
        [--lengths 16,64,200] [--reps 5] [--shared 0]

``--shared N``: every prompt starts with the same N tokens (a chat's system prompt),
the case where the later prompts wait a step for the first one's cached prefix.
Prints a markdown table (ms to the last first token; median TTFT) and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

from engine.client import EngineClient  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402

SWITCH = "MARKBASE_PREFILL_TOGETHER"


async def burst(client, model: str, prompts: list[list[int]], tag: str) -> tuple[float, float]:
    """Seconds until the last request's first token, and the median TTFT."""

    async def one(i: int, prompt: list[int]) -> float:
        req = GenerationRequest(
            request_id=f"{tag}-{i}",
            model=model,
            prompt_tokens=prompt,
            params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        t0 = time.perf_counter()
        async for ev in client.generate(req):
            if ev.token_ids:
                return time.perf_counter() - t0
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, statistics.median(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--lengths", default="16,64,200")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shared", type=int, default=0, help="tokens every prompt starts with")
    args = ap.parse_args()
    lm = load_model(args.model)
    vocab = (lm.config or {}).get("vocab_size", 32000)
    conf = EngineConfig(
        max_num_seqs=max(args.burst, 8), prefix_cache_tokens=0 if not args.shared else 32768
    )
    client = EngineClient.from_loaded([(lm, None)], conf)
    print(
        f"model {lm.name}, burst of {args.burst}, shared start {args.shared} tokens, {args.reps} reps"
    )
    print(
        "| prompt tokens | together: last first token ms | one by one ms | ratio | median TTFT ms (together / one by one) |"
    )
    print("|---:|---:|---:|---:|---:|")
    serial = 0
    try:
        for n in [int(v) for v in args.lengths.split(",") if v]:
            res: dict[str, list[tuple[float, float]]] = {"1": [], "0": []}
            for rep in range(args.reps + 1):  # the first round warms the shapes up
                for flag in ("1", "0"):
                    os.environ[SWITCH] = flag
                    serial += 1
                    shared = [(j * 11 + 5) % (vocab - 200) + 100 for j in range(args.shared)]
                    prompts = [
                        shared
                        + [
                            (serial * 7919 + i * 104729 + j * 31) % (vocab - 200) + 100
                            for j in range(n)
                        ]
                        for i in range(args.burst)
                    ]
                    out = asyncio.run(burst(client, lm.name, prompts, f"b{serial}"))
                    if rep:
                        res[flag].append(out)
            on = statistics.median(r[0] for r in res["1"])
            off = statistics.median(r[0] for r in res["0"])
            ton = statistics.median(r[1] for r in res["1"])
            toff = statistics.median(r[1] for r in res["0"])
            print(
                f"| {n + args.shared} | {on * 1e3:.0f} | {off * 1e3:.0f} | {off / on:.2f}x | "
                f"{ton * 1e3:.0f} / {toff * 1e3:.0f} |"
            )
    finally:
        os.environ.pop(SWITCH, None)
        client.shutdown()


if __name__ == "__main__":
    main()
