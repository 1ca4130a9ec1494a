"""Prefill's weight expansion alone: MLX's ``affine_dequantize`` against
engine/backends/cuda/products/dequant.py's kernel, per product of the 8b and 1b models (CUPTI kernel
time, and the bytes moved a second: the 4-bit words, scales and biases read, the
bf16 weights written).

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/dequant_bench.py --out $OUT/dequant.json

On a CPU it only checks that the two give the same weights (tiny shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from q4_bench import GS, products, weights  # noqa: E402
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda.products import dequant as gpu_dequant  # noqa: E402


def _rotating(copies):
    """``call() -> the next copy's dequantized weight``."""
    state = {"i": 0}

    def one():
        state["i"] += 1
        wq, s, b = copies[state["i"] % len(copies)]
        return gpu_dequant.dequantize(wq, s, b, GS, 4)

    return one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    on_gpu = mx.cuda.is_available()
    rows = []
    print("| model | product | MLX us | TB/s | markbase us | TB/s | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in a.models.split(",") if on_gpu else ["tiny"]:
        cfg = CONFIGS[name]
        for pname, n, k, _, _ in products(cfg, head=True):
            copies = weights(n, k, 3)  # rotating copies: L2 holds none of them
            moved = n * k // 2 + 2 * (n * k // GS) * 2 + n * k * 2
            times = {}
            for form in ("mlx", "markbase"):
                os.environ[gpu_dequant.ENV] = "1" if form == "markbase" else "0"
                one = _rotating(copies)

                if not on_gpu:
                    mx.eval(one())
                    times[form] = float("nan")
                    continue
                from q4_bench import cupti_us

                mx.eval(one())  # compile
                part = "mb_dequant4" if form == "markbase" else "affine_dequantize"
                durs = cupti_us(one, a.calls, part)
                times[form] = statistics.median(durs) if durs else float("nan")
            wq, s, b = copies[0]
            os.environ[gpu_dequant.ENV] = "1"
            same = mx.array_equal(
                gpu_dequant.dequantize(wq, s, b, GS, 4),
                mx.dequantize(wq, s, b, group_size=GS, bits=4),
            ).item()
            os.environ.pop(gpu_dequant.ENV, None)
            tm, tk = times["mlx"], times["markbase"]
            print(
                f"| {name} | {pname} | {tm:.1f} | {moved / tm / 1e6:.2f} | {tk:.1f} | "
                f"{moved / tk / 1e6:.2f} | {tk / tm:.2f} |" + ("" if same else " DIFFERENT")
            )
            rows.append(
                dict(
                    model=name,
                    product=pname,
                    n=n,
                    k=k,
                    mlx_us=tm,
                    markbase_us=tk,
                    bytes=moved,
                    same=bool(same),
                )  # fmt: skip
            )
    if a.out:
        Path(a.out).write_text(json.dumps(dict(engine="dequant", rows=rows), indent=1))


if __name__ == "__main__":
    main()
