"""Prefill of the default model on the CPU, two ways interleaved in one process, median
of 6 after a warm-up. ``--ab pass`` (default): the last chunk in one pass
(engine/runner.py's ``output_head``: every row through the layers, the output layer on
the last row) against the two-pass fallback (all rows but the last, then the last token
through the whole model). ``--ab async``: the prompt in chunks of ``--chunk`` (the CPU's
default 128), the chunks before the last queued (``mx.async_eval``, the GPU's default)
against waited on (the CPU's default).

    .venv/bin/python bench/cpu/prefill_ab.py [--lengths 32,128,512] [--ab async]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.loading import load_model  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32,128,512")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ab", choices=("pass", "async"), default="pass")
    ap.add_argument("--chunk", type=int, default=128)
    args = ap.parse_args()
    lm = load_model("smollm2-135m-instruct", weight_format="float32")
    runner = ModelRunner(lm.model, lm.cpu_shadows)
    head = runner.head
    if head is None:
        raise SystemExit("this model's family has no one-pass head: nothing to compare")
    names = ("one pass", "two passes") if args.ab == "pass" else ("queued", "waited on")
    print(f"| prompt tokens | {names[0]} ms | {names[1]} ms | ratio |")
    print("|---:|---:|---:|---:|")
    chunk = args.chunk if args.ab == "async" else 1 << 30
    for n in [int(v) for v in args.lengths.split(",") if v]:
        prompt = [(i * 7 + 13) % 40000 + 100 for i in range(n)]
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.reps):
            for first, name in zip((True, False), names):
                if args.ab == "pass":
                    runner.head = head if first else None
                else:
                    runner.async_prefill = first
                kv = runner.new_sequence_kv()
                t = time.perf_counter()
                for s in range(0, n, chunk):
                    last = s + chunk >= n
                    out = runner.prefill(kv, prompt[s : s + chunk], last)
                mx.eval(out)
                times[name].append(time.perf_counter() - t)
        a, b = (statistics.median(times[k][1:]) for k in names)
        print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f} |")
    runner.head = head
    runner.async_prefill = False


if __name__ == "__main__":
    main()
