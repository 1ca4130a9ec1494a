"""Read bandwidth an MLX process gets from HBM on this GPU: a plain streaming-read
kernel (mx.fast.cuda_kernel), by loads in flight a thread, over device memory (an
array a GPU op made) and managed memory (an array made from host data, as weights
loaded from disk are), against PyTorch's sum over the same bytes in the same process
(on the GPU machine, docs/gpu-development.md).

Why: every 1-row 4-bit product kernel tried (engine/backends/cuda/products/mma.py, engine/backends/cuda/products/qstream.py's
two forms) topped out at 1.6-2.1 TB/s however its loads were kept in flight (H200,
2026-12-04), where PyTorch's copy measured 4.3 TB/s. This says whether that is the
kernels or what an MLX kernel can read here at all.

    python3 bench/gpu/read_bw.py --out $OUT/read_bw.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from q4_bench import cupti_us  # noqa: E402

SOURCE = r"""
  // a grid-stride walk over n uint4s, U loads in flight a thread; what was read
  // decides a store, so that nothing is optimized away
  const int64_t n = a_shape[0] / 4;
  const uint4* p = reinterpret_cast<const uint4*>(a);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0u;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[u] = __ldcs(p + i + u * stride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  for (; i < n; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0u) {  // (rare) so that the loads stay, without a write per thread
    out[(int64_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
  }
"""


def kernel():
    return mx.fast.cuda_kernel(
        name="mb_read_bw", input_names=["a"], output_names=["out"], source=SOURCE
    )


def reads(fn, parts: list, nbytes: int, u: int, threads: int, blocks_per_sm: int):
    """``run()`` -> one read kernel a buffer of ``parts``: ``blocks_per_sm`` blocks of
    ``threads`` an SM with ``u`` loads in flight a thread, or (0) one thread a 16 bytes."""
    if blocks_per_sm:
        grid = 132 * blocks_per_sm * threads
    else:
        grid = -(-nbytes // (16 * threads)) * threads

    def run():
        return [
            fn(inputs=[p], template=[("U", u)], grid=(grid, 1, 1),
               threadgroup=(threads, 1, 1), output_shapes=[(grid,)],
               output_dtypes=[mx.uint32])[0]
            for p in parts
        ]  # fmt: skip

    return run


def sized(fn, sizes_mb: list, steps: int) -> list:
    """The fastest a plain read kernel gets through one buffer of each size in one
    launch (8 distinct buffers, or as many as fill ~600 MB, so L2 holds none of them):
    what one product kernel of that size could take at best, its start and end included
    (H100, 2026-12-06: the 1-row products ran at ~2.3-2.7 TB/s, a copy at ~4.2)."""
    rows = []
    for mb in sizes_mb:
        nbytes = int(mb * (1 << 20)) // 64 * 64
        count = max(2, min(8, int(600 // mb)))
        parts = [
            mx.random.randint(0, 1 << 30, (nbytes // 4,), dtype=mx.uint32) for _ in range(count)
        ]
        mx.eval(parts)
        for u, threads, blocks_per_sm in ((4, 256, 8), (8, 256, 4), (8, 512, 4), (1, 256, 0)):
            run = reads(fn, parts, nbytes, u, threads, blocks_per_sm)
            mx.eval(run())
            us = statistics.median(cupti_us(run, steps, "mb_read_bw"))  # a kernel
            tb = nbytes / us / 1e6
            shape = f"x {blocks_per_sm} a SM" if blocks_per_sm else "one load each"
            rows.append(dict(mb=mb, u=u, threads=threads, blocks_per_sm=blocks_per_sm,
                             us=us, tb_s=tb))  # fmt: skip
            print(f"{mb:8.1f} MB U={u} {threads:4d} threads {shape}: {us:8.1f} us a call"
                  f"  {tb:.2f} TB/s", flush=True)  # fmt: skip
        del parts
        mx.clear_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--sizes-mb",
        default="",
        help="only time one read kernel a buffer of each of these sizes (e.g. the 8b 4-bit "
        "products with scales and biases, MiB: 9.0,13.5,31.5,63.0,281.8), distinct buffers a call",
    )
    args = ap.parse_args()
    fn = kernel()
    if args.sizes_mb:
        rows = sized(fn, [float(v) for v in args.sizes_mb.split(",")], args.steps)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(stage="read_sizes", rows=rows), indent=1))
        return
    n = args.mb * (1 << 20) // 4
    arrays = {
        "device": mx.random.randint(0, 1 << 30, (n,), dtype=mx.uint32),
        "managed": mx.array(np.random.default_rng(0).integers(0, 1 << 30, n, dtype=np.uint32)),
        "device58MBx8": None,
    }
    mx.eval([a for a in arrays.values() if a is not None])
    rows = []
    for name, a in arrays.items():
        # (loads in flight a thread, threads a block, blocks an SM); 0 blocks an SM: one
        # thread per 16 bytes, so no thread makes dependent loads and what is left is the
        # kernel's own start and end
        for u, threads, blocks_per_sm in ((1, 256, 8), (2, 256, 8), (4, 256, 8), (8, 256, 4),
                                          (4, 1024, 2), (8, 512, 4), (1, 256, 0)):  # fmt: skip
            if name == "device58MBx8":  # 8 distinct 58 MB buffers, one call each
                parts = [
                    mx.random.randint(0, 1 << 30, (58 << 18,), dtype=mx.uint32) for _ in range(8)
                ]
                mx.eval(parts)
                nbytes = parts[0].nbytes
            else:
                parts, nbytes = [a], a.nbytes
            run = reads(fn, parts, nbytes, u, threads, blocks_per_sm)
            mx.eval(run())
            us = statistics.median(cupti_us(run, args.steps, "mb_read_bw"))
            tb = nbytes / us / 1e6
            rows.append(dict(memory=name, u=u, threads=threads, blocks_per_sm=blocks_per_sm,
                             us=us, tb_s=tb))  # fmt: skip
            shape = f"x {blocks_per_sm} a SM" if blocks_per_sm else "one load each"
            print(f"{name:>13} U={u} {threads:4d} threads {shape}: "
                  f"{us:9.1f} us  {tb:.2f} TB/s", flush=True)  # fmt: skip
    import torch

    t = torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda")
    for _ in range(3):
        t.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        t.sum()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.steps
    rows.append(dict(memory="torch-sum", us=us, tb_s=t.numel() * 4 / us / 1e6))
    print(f"torch sum: {us:9.1f} us  {rows[-1]['tb_s']:.2f} TB/s", flush=True)
    c = torch.empty_like(t)
    start.record()
    for _ in range(args.steps):
        c.copy_(t)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.steps
    rows.append(dict(memory="torch-copy", us=us, tb_s=2 * t.numel() * 4 / us / 1e6))
    print(f"torch copy (read+write): {us:9.1f} us  {rows[-1]['tb_s']:.2f} TB/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(stage="read_bw", rows=rows), indent=1))


if __name__ == "__main__":
    main()
