"""Prefill of the default model on the CPU: the last chunk in one pass (engine/runner.py's
``output_head``: every row through the layers, the output layer on the last row) against
the two-pass fallback (all rows but the last, then the last token through the whole
model), interleaved in one process, median of 6 after a warm-up.

    .venv/bin/python bench/cpu_prefill_ab.py [--lengths 32,128,512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cpu_blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.loading import load_model  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32,128,512")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    lm = load_model("smollm2-135m-instruct", weight_format="float32")
    runner = ModelRunner(lm.model, lm.cpu_shadows)
    head = runner.head
    if head is None:
        raise SystemExit("this model's family has no one-pass head: nothing to compare")
    print("| prompt tokens | one pass ms | two passes ms | ratio |")
    print("|---:|---:|---:|---:|")
    for n in [int(v) for v in args.lengths.split(",") if v]:
        prompt = [(i * 7 + 13) % 40000 + 100 for i in range(n)]
        times: dict[str, list[float]] = {"one": [], "two": []}
        for _ in range(args.reps):
            for name in ("one", "two"):
                runner.head = head if name == "one" else None
                kv = runner.new_sequence_kv()
                t = time.perf_counter()
                mx.eval(runner.prefill(kv, prompt, True))
                times[name].append(time.perf_counter() - t)
        one, two = (statistics.median(times[k][1:]) for k in ("one", "two"))
        print(f"| {n} | {one * 1e3:.1f} | {two * 1e3:.1f} | {one / two:.2f} |")
    runner.head = head


if __name__ == "__main__":
    main()
