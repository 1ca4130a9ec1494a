"""Host time per product call on MLX's CUDA backend: building the graph node in
Python, and MLX's encoding + launch (``mx.async_eval``), per formulation.

Why: without the compiled step, the decode step was host-bound on an H200 from 1b B=1
to 8b B=8 (2026-12-03), so a kernel that is faster on the GPU can still
make the step slower if its call costs more host time. Shapes are tiny (256 x 1024)
so the GPU time is negligible; each figure is the median over repeats of 200
independent calls, in microseconds per call.

    python3 bench/gpu/call_cost.py [--rows 1,8,32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from engine.backends.cuda.products import gemv as gpu_gemv  # noqa: E402
from engine.backends.cuda.products import mma as gpu_mma  # noqa: E402
from engine.backends.cuda.products import qstream as gpu_qstream  # noqa: E402

now = time.perf_counter
CALLS = 200


def forms(rows: int):
    k, n = 1024, 256
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    g = mx.ones((k,), dtype=mx.bfloat16)
    w = (mx.random.normal((n, k)) / 16).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    body = "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n  o[i] = a[i];\n"

    def copy_kernel(pad_kb: int):
        """The 2-line kernel with ``pad_kb`` KB of comment lines after it: MLX rebuilds
        and hashes a custom kernel's whole source on every call, so does the host time
        grow with its length?"""
        pad = ("// " + "x" * 60 + "\n") * (pad_kb * 16)
        try:
            return mx.fast.cuda_kernel(
                name=f"mb_cost_copy_{pad_kb}",
                input_names=["a"],
                output_names=["o"],
                source=body + pad,
            )
        except RuntimeError:  # not a CUDA build (a CPU dry run): its rows fail, the rest run

            def nothing(**kw):
                raise RuntimeError("no CUDA back-end")

            return nothing

    def copy_call(kern):
        return lambda: kern(
            inputs=[x],
            grid=(x.size, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0]

    tiny = copy_kernel(0)

    mx.eval(x, w, wq, s, b)
    return {
        "add (MLX op)": lambda: x + 1,
        "x @ w.T (MLX)": lambda: x @ w.T,
        "quantized_matmul (MLX)": lambda: mx.quantized_matmul(
            x, wq, scales=s, biases=b, transpose=True, group_size=64, bits=4
        ),
        "cuda_kernel, 2-line source": lambda: tiny(
            inputs=[x],
            grid=(x.size, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0],
        "cuda_kernel, + 8 KB comments": copy_call(copy_kernel(8)),
        "cuda_kernel, + 32 KB comments": copy_call(copy_kernel(32)),
        "cuda_kernel, + 128 KB comments": copy_call(copy_kernel(128)),
        "gpu_qstream q4i_glu_norm (1 row)": lambda: gpu_qstream.quantized_matmul(
            x[:1], wq, s, b, 64, glu=True, norm=(g, 1e-5)
        ),
        "gpu_gemv.gemv": lambda: gpu_gemv.gemv(x, w),
        "gpu_gemv.quantized_gemv": lambda: gpu_gemv.quantized_gemv(x, wq, s, b, 64),
        "gpu_mma.matmul": lambda: gpu_mma.matmul(x, w),
        "gpu_mma.quantized_matmul": lambda: gpu_mma.quantized_matmul(x, wq, s, b, 64),
    }


def measure(fn, repeats: int) -> tuple[float, float]:
    mx.eval(fn())  # compile
    builds, encodes = [], []
    for _ in range(repeats):
        t0 = now()
        outs = [fn() for _ in range(CALLS)]
        t1 = now()
        mx.async_eval(outs)
        t2 = now()
        mx.synchronize()
        builds.append((t1 - t0) / CALLS * 1e6)
        encodes.append((t2 - t1) / CALLS * 1e6)
    return statistics.median(builds), statistics.median(encodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    print(f"{'rows':>4}  {'formulation':<28} {'build us':>9} {'encode us':>10} {'total':>7}")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, fn in forms(rows).items():
            try:
                b, e = measure(fn, args.repeats)
            except Exception as exc:  # a form that cannot run here: say so, go on
                print(f"{rows:>4}  {name:<28} failed: {exc!r}")
                continue
            results.append({"rows": rows, "form": name, "build_us": b, "encode_us": e})
            print(f"{rows:>4}  {name:<28} {b:>9.1f} {e:>10.1f} {b + e:>7.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"calls": results}, indent=1))


if __name__ == "__main__":
    main()
