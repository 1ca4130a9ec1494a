"""Sampling cost a decode step, markbase's batched sampler against mlx-lm's.

Why: every request without ``temperature`` samples (the OpenAI default is 1.0), so
the sampler runs every step for every such row. A sampler that loops over rows
(per-row Gumbel noise over the vocabulary, a full sort per top-p row) takes, on a
2-core AMD EPYC at B=32 over SmolLM2's 49k tokens, ~20 ms a step with a temperature
and ~205 ms with top-p 0.9, against a ~100-200 ms decode step. The peer is mlx-lm's
``make_sampler`` (the sampler ``mlx_lm.server`` uses: one setting for the whole
batch, a full sort for top-p), on the same logits in the same process.

    .venv/bin/python bench/cpu/sampler_bench.py [--vocab 49152] [--batches 1,8,32] [--reps 10]

Prints ms a step (median of reps) per batch size and setting for markbase's sampler,
that per-row form (``per_row``) and mlx-lm's, with the ratios; on a
CUDA GPU also markbase's MLX ops without engine/backends/cuda/sampler.py's kernel (``ops``).
``--dtype bfloat16``: logits as a bf16 model's output layer gives them.
Logits are random normal x 3 (at temperature 0.7, top-p 0.9 keeps 1-485 tokens a row,
median ~145 at B=32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from engine import sampler  # noqa: E402
from engine.sampler import RowSampler, sample_batch  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

SETTINGS = {
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top-k 50": dict(temperature=0.7, top_k=50),
}


def per_row(logits, settings: dict, keys: list):
    """A per-row sampler (a loop of ops per row: Gumbel noise over the whole
    vocabulary, a full sort per top-k/top-p row), for the same-run ratio."""
    t, top_p, top_k = settings["temperature"], settings.get("top_p", 1.0), settings.get("top_k", 0)
    drawn = []
    for i, key in enumerate(keys):
        row = logits[i] / t
        if top_p < 1.0 or top_k > 0:
            order = mx.argsort(-row)
            srt = row[order]
            keep = mx.ones(srt.shape, dtype=mx.bool_)
            if top_k > 0:
                keep = keep & (mx.arange(srt.shape[0]) < top_k)
            if top_p < 1.0:
                probs = mx.softmax(srt, axis=-1)
                keep = keep & (mx.cumsum(probs, axis=-1) - probs < top_p)
            out = mx.full(row.shape, -mx.inf, dtype=row.dtype)
            out[order] = mx.where(keep, srt, -mx.inf)
            row = out
        noise = mx.random.gumbel(shape=row.shape, key=key)
        drawn.append(mx.argmax(row + noise, axis=-1))
    return mx.stack(drawn).astype(mx.int32)


def timed(fn, reps: int) -> float:
    mx.eval(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    cuda = mx.cuda.is_available()
    print(f"device {mx.default_device()}, vocab {args.vocab}, {args.dtype} logits, "
          f"ms a step (median of {args.reps})")  # fmt: skip
    ops_col = " markbase ops (no kernel) |" if cuda else ""
    print(f"| B | setting | markbase |{ops_col} per-row sampler | mlx-lm make_sampler "
          "| per-row / markbase | mlx-lm / markbase |")  # fmt: skip
    print("|---:|---|---:|" + ("---:|" if cuda else "") + "---:|---:|---:|---:|")
    for b in [int(v) for v in args.batches.split(",")]:
        logits = (mx.random.normal((b, args.vocab)) * 3).astype(getattr(mx, args.dtype))
        # mlx-lm samples from log-probabilities (its generate step makes them first);
        # made here, outside its timing
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logits, logprobs)
        for name, kw in SETTINGS.items():
            rows = [RowSampler.from_params(SamplingParams(seed=i, **kw)) for i in range(b)]
            ours = timed(lambda rows=rows, x=logits: sample_batch(x, rows), args.reps)
            ops = ""
            if cuda:
                sampler.use_kernel_on_gpu = False
                ms = timed(lambda rows=rows, x=logits: sample_batch(x, rows), args.reps)
                sampler.use_kernel_on_gpu = True
                ops = f" {ms:.2f} |"
            peer_sampler = make_sampler(
                temp=kw["temperature"], top_p=kw.get("top_p", 0.0), top_k=kw.get("top_k", 0)
            )
            peer = timed(lambda s=peer_sampler, x=logprobs: s(x), args.reps)
            keys = [mx.random.key(i) for i in range(b)]
            before = timed(lambda x=logits, kw=kw, keys=keys: per_row(x, kw, keys), args.reps)
            print(f"| {b} | {name} | {ours:.2f} |{ops} {before:.2f} | {peer:.2f} "
                  f"| {before / ours:.2f}x | {peer / ours:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
