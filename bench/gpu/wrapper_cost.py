"""Python time a decode-step product spends in markbase's own code, before MLX.

Without the compiled step, a 1b decode step on an H200 was host-bound: ~1.1-1.7 ms of
Python graph building and ~1.2-1.5 ms of MLX encoding for 182 kernels (2026-12-03). Four of
a layer's ~11 kernels are engine/backends/cuda/products/mma.py products reached through
engine/backends/cuda/linear.py (plan lookup, support check, template, launch geometry). This
measures that wrapper cost on any machine: the CUDA kernel launch is replaced by a
stand-in that returns its first input, so what is left is markbase's Python per call,
next to one real MLX op (an add of the same shape) for scale.

    .venv/bin/python bench/gpu/wrapper_cost.py                # this tree
    .venv/bin/python bench/gpu/wrapper_cost.py --compare REV  # and REV's engine, same run

Each case: median of 7 rounds of 3,000 calls, us a call; each tree in its own process,
rounds of the two alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROWS = (1, 8, 32)


def measure(calls: int) -> dict:
    import mlx.core as mx

    from engine.backends.cuda import linear as gpu_linear
    from engine.backends.cuda.products import mma as gpu_mma

    class StandIn:  # gpu_mma's kernel objects: the launch returns x, no CUDA needed
        def __call__(self, kind, template):
            return lambda **kw: [kw["inputs"][0]]

    gpu_mma._kernel = StandIn()
    gpu_linear._float_kernel_ok = lambda *a: True
    gpu_linear.GpuQuantizedLinear._kernel_ok = lambda self, form, dtype: True
    gpu_linear.set_plans("1:mma", "1:qmma")
    d, bf16 = 2048, mx.bfloat16
    w = mx.zeros((d, d), dtype=bf16)
    wq, sc, bi = mx.quantize(mx.zeros((d, d), dtype=bf16), group_size=64, bits=4)
    lin = gpu_linear.GpuLinear(w)
    qlin = gpu_linear.GpuQuantizedLinear(wq, sc, bi, 64, 4, "affine")
    out = {}
    for rows in ROWS:
        x = mx.zeros((rows, d), dtype=bf16)
        r = mx.zeros((rows, d), dtype=bf16)
        cases = {
            "MLX add (one op)": lambda x=x, r=r: x + r,
            "float product": lambda x=x: lin(x),
            "float + residual": lambda x=x, r=r: lin.fused(x, residual=r),
            "float SwiGLU": lambda x=x: lin.fused(x, glu=True),
            "4-bit + residual": lambda x=x, r=r: qlin.fused(x, residual=r),
        }
        for name, fn in cases.items():
            for _ in range(300):
                fn()
            samples = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t) / calls * 1e6)
            out[f"{name}|{rows}"] = statistics.median(samples)
    return out


def run_tree(root: str, calls: int) -> dict:
    cmd = [sys.executable, __file__, "--json", "--engine-root", root, "--calls", str(calls)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def run_revision(rev: str, calls: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="wrapper-cost-") as tmp:
        archive = subprocess.run(
            ["git", "archive", rev, "engine"], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        return run_tree(tmp, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", metavar="REV", help="also measure REV's engine (git revision)")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best counts")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        sys.path.insert(0, args.engine_root or str(REPO))
        print(json.dumps(measure(args.calls)))
        return
    before: dict = {}
    after: dict = {}
    for _ in range(args.rounds):
        if args.compare:
            got = run_revision(args.compare, args.calls)
            before = {k: min(v, before.get(k, v)) for k, v in got.items()}
        got = run_tree(str(REPO), args.calls)
        after = {k: min(v, after.get(k, v)) for k, v in got.items()}
    head = "| case | rows | " + (f"{args.compare} us | " if args.compare else "") + "now us |"
    print(head)
    print("|---|---:|" + ("---:|" if args.compare else "") + "---:|")
    for key, now in after.items():
        name, rows = key.split("|")
        old = f" {before[key]:.2f} |" if args.compare else ""
        print(f"| {name} | {rows} |{old} {now:.2f} |")


if __name__ == "__main__":
    main()
