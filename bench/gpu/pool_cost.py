"""What a kernel pays for reading one scalar out of MLX's pool of tiny arrays (on the GPU
machine, docs/gpu-development.md).

Why: MLX's CUDA allocator puts every array of 8 bytes or less in one 64 KB pool of
managed memory (mlx/backend/cuda/allocator.cpp, ``SmallSizePool``), the GPU only
"accessed by" it. At one row the step's token, offset and start are such arrays, and
the host reads the sampled token every step, so the pool's pages may sit in host memory
and every block's read of a scalar there may cross PCIe. The norm-inside 1-row kernels
(which read eps) were ~17 us a call slower inside the step than alone (H100,
2026-12-06). This times one read kernel of o_proj's size (9 MiB, one 16-byte load a
thread) whose every block also reads one int32 scalar, the scalar being: none; a
[1] array made on the host (pool); a [1] array a GPU op made (pool); a [4] array a GPU
op made (device memory); each with and without the host reading a pool array between
evaluations (as the engine reads the token).

    python3 bench/gpu/pool_cost.py --out $OUT/pool_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from q4_bench import cupti_us  # noqa: E402

SOURCE = r"""
  // one 16-byte load a thread over a, plus (SCALAR) one read of s[0] a thread: the
  // shape of a 1-row product's start (every block reads its eps/offset first)
  const int64_t n = a_shape[0] / 4;
  const uint4* p = reinterpret_cast<const uint4*>(a);
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0u;
  SCALAR
  if (i < n) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) {
    out[i] = acc;
  }
"""

THREADS = 256


def kernel(scalar: bool):
    return mx.fast.cuda_kernel(
        name="mb_pool_cost_s" if scalar else "mb_pool_cost_n",
        input_names=["a", "dep", "s"] if scalar else ["a", "dep"],
        output_names=["out"],
        source=SOURCE.replace("SCALAR", "acc = (uint32_t)s[0];" if scalar else ""),
    )


def scalars() -> dict:
    """The scalar each case reads (None: the kernel reads none)."""
    host = mx.array([7], dtype=mx.int32)  # made from host data: pool
    gpu1 = mx.zeros((1,), dtype=mx.int32) + 7  # a GPU op's [1] output: still the pool
    gpu4 = mx.zeros((4,), dtype=mx.int32) + 7  # 16 bytes: device memory
    mx.eval(host, gpu1, gpu4)
    return {"none": None, "pool-host": host, "pool-gpu": gpu1, "device16": gpu4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=9.0)
    ap.add_argument("--launches", type=int, default=16, help="read kernels an evaluation")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    nbytes = int(args.mb * (1 << 20)) // 64 * 64
    count = max(2, min(16, int(600 // args.mb)))  # distinct buffers: L2 holds none
    parts = [mx.random.randint(0, 1 << 30, (nbytes // 4,), dtype=mx.uint32) for _ in range(count)]
    mx.eval(parts)
    grid = -(-nbytes // (16 * THREADS)) * THREADS
    kern = {True: kernel(True), False: kernel(False)}
    token = mx.zeros((1,), dtype=mx.int32)
    dep0 = mx.zeros((grid,), dtype=mx.uint32)
    mx.eval(token, dep0)
    rows = []
    for touch in (False, True):
        for name, s in scalars().items():

            def run(s=s, touch=touch):
                nonlocal token
                outs = []
                prev = dep0  # each launch takes the last one's output (unread): in order
                for j in range(args.launches):
                    a = parts[j % count]
                    ins = [a, prev] if s is None else [a, prev, s]
                    o = kern[s is not None](
                        inputs=ins, grid=(grid, 1, 1), threadgroup=(THREADS, 1, 1),
                        output_shapes=[(grid,)], output_dtypes=[mx.uint32],
                    )[0]  # fmt: skip
                    outs.append(o)
                    prev = o
                if touch:  # the host reads a pool array each evaluation (the token)
                    token = (token + 1) % 1000
                    mx.eval(token)
                    token.item()
                return outs

            mx.eval(run())
            us = cupti_us(run, args.steps, "mb_pool_cost")
            med = statistics.median(us)
            row = dict(scalar=name, host_touch=touch, us=med, us_max=max(us), n=len(us))
            rows.append(row)
            print(
                f"{name:>10} host reads the pool: {'yes' if touch else 'no ':3s}"
                f"  {med:7.2f} us a launch (max {max(us):7.2f}, {len(us)} launches)",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(dict(stage="pool_cost", rows=rows), indent=1))


if __name__ == "__main__":
    main()
