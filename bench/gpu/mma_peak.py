"""What ``mma.sync`` and the 4-bit dequantization cost on this GPU, alone: the ceiling
engine/backends/cuda/products/qgemm.py and engine/backends/cuda/products/mma.py work under.

Why: at 128 rows the 4-bit products ran at ~130-155 TFLOP/s (H100, 2026-12-05), and
neither a deeper load pipeline nor more warps an SM made them faster. If ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate) itself tops
out near ~300 TFLOP/s here, the kernels are at half of what their instruction can give
and the way on is Hopper's ``wgmma``; if it reaches ~600, the dequantization and the
instruction mix are what to cut. Each form runs register-only loops (no memory in the
loop) on every SM:

- ``mma``: ``CH`` independent accumulator chains of m16n8k16 a warp;
- ``deq``: the same MMAs plus qgemm's dequantization at its ratio (one ``mb_deq2``, two
  bf16 weights, for every two MMAs: 16 pairs per 32 MMAs, as a warp with 2 m-tiles and 8
  n-tiles does a half k-step), from words that change every iteration;
- ``deqonly``: the dequantization alone, 2 pairs a chain an iteration (its issue cost;
  the column reads as "MMAs' worth": pairs / 2 per the ``deq`` ratio);
- ``imma``: ``mma.sync.m16n8k32`` on int8 (s32 accumulate), for a W4A8 estimate.

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/mma_peak.py [--warps 4,8] [--chains 4,8]

Prints TFLOP/s (TOP/s for int8) per form, from CUPTI kernel durations. On a CPU it
prints the forms only; bench/gpu/nvrtc_check.py does not cover this file (it is a
measurement, not a kernel of the engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

ITERS = 4096  # loop iterations a warp (runtime value: nothing folds)

_SOURCE = r"""
  const int lane = threadIdx.x & 31;
  const uint32_t seed = (uint32_t)(blockIdx.x * blockDim.x + threadIdx.x);
  const int iters = n_iters[0];
  float c[CH][4];
  int ci[CH][4];
#pragma unroll
  for (int h = 0; h < CH; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      c[h][e] = 0.f;
      ci[h][e] = 0;
    }
  }
  // operands from the thread index (bf16 pairs near 1, int8 quads)
  uint32_t a0 = 0x3f803f80u ^ (seed & 0x00070007u), a1 = a0 ^ 0x00010000u;
  uint32_t a2 = a0 ^ 0x00000001u, a3 = a0 ^ 0x00010001u;
  uint32_t b0 = 0x3f803f80u ^ ((seed >> 3) & 0x00070007u), b1 = b0 ^ 0x00010001u;
  uint32_t w = 0x76543210u ^ seed;  // 4-bit words for the dequantization
  const uint32_t s2 = 0x3c003c00u, z2 = 0xbc00bc00u;  // bf16 pairs (1/128, -1/128)
  for (int it = 0; it < iters; ++it) {
    if constexpr (FORM == 0 || FORM == 1) {
      if constexpr (FORM == 1) {
        // 16 dequantized pairs for 32 MMAs: a0..a3 of each 2-MMA group come from them
        w = w * 1664525u + 1013904223u;
        a0 = mb_deq2(w, s2, z2, __nv_bfloat16{});
        a1 = mb_deq2(w >> 8, s2, z2, __nv_bfloat16{});
      }
#pragma unroll
      for (int h = 0; h < CH; ++h) {
        mb_mma(c[h], a0, a1, a2, a3, b0, b1, __nv_bfloat16{});
      }
    } else if constexpr (FORM == 2) {
      // CH independent words: the issue cost, not one dependency chain's latency
#pragma unroll
      for (int h = 0; h < CH; ++h) {
        const uint32_t wh = w + (uint32_t)h * 0x11111111u;
        ci[h][0] ^= (int)mb_deq2(wh, s2, z2, __nv_bfloat16{});
        ci[h][1] ^= (int)mb_deq2(wh >> 8, s2, z2, __nv_bfloat16{});
      }
      w = w * 1664525u + 1013904223u;
    } else {
#pragma unroll
      for (int h = 0; h < CH; ++h) {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+r"(ci[h][0]), "+r"(ci[h][1]), "+r"(ci[h][2]), "+r"(ci[h][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
  }
  float acc = (float)(a0 ^ a1);
#pragma unroll
  for (int h = 0; h < CH; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc += c[h][e] + (float)ci[h][e];
    }
  }
  y[blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""

FORMS = {"mma": 0, "deq": 1, "deqonly": 2, "imma": 3}


def kernel(form: str, chains: int):
    from engine.backends.cuda.kernels import Baked, KernelSpec
    from engine.backends.cuda.products.mma import _HEADER

    # FORM 1 makes 2 dequantized pairs an iteration for CH MMAs: 16 pairs per 32 MMAs
    # needs CH = 4; with 8 chains the deq rows have one pair for every four MMAs
    spec = KernelSpec("mb_mma_peak", [("n_iters", "int32", 1)], [("y", "float32")], _SOURCE,
                      _HEADER)  # fmt: skip
    baked = Baked(lambda: {"k": spec}, ensure_row_contiguous=True)
    return baked("k", (("FORM", FORMS[form]), ("CH", chains)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default="mma,deq,deqonly,imma")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--chains", default="4,8")
    ap.add_argument("--blocks-per-sm", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not mx.cuda.is_available():
        print("forms:", args.forms, "(needs MLX's CUDA backend to run)")
        return
    from q4_bench import cupti_us

    from engine.backends.cuda.kernels import one_output_call

    sms = 132
    n_iters = mx.array([ITERS], dtype=mx.int32)
    rows = []
    print("| form | warps a block | chains | us | TFLOP/s (TOP/s int8) |")
    print("|---|---:|---:|---:|---:|")
    for form in args.forms.split(","):
        for warps in [int(w) for w in args.warps.split(",")]:
            for ch in [int(c) for c in args.chains.split(",")]:
                fn = kernel(form, ch)
                blocks = sms * args.blocks_per_sm
                threads = warps * 32

                call = one_output_call(fn, (blocks * threads, 1, 1), (threads, 1, 1),
                                       (blocks * threads,), mx.float32)  # fmt: skip

                def one(call=call):
                    return call([n_iters])

                mx.eval(one())
                us = statistics.median(cupti_us(one, 5, "mb_mma_peak"))
                # deqonly: 2 pairs a chain an iteration = the deq form's pairs for 4 MMAs
                mmas = blocks * warps * ITERS * ch * (4 if form == "deqonly" else 1)
                flop = mmas * (2 * 16 * 8 * (32 if form == "imma" else 16))
                rate = flop / (us * 1e-6) / 1e12
                print(f"| {form} | {warps} | {ch} | {us:.1f} | {rate:.0f} |")
                rows.append(dict(form=form, warps=warps, chains=ch, us=us, tflops=rate))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(engine="mma-peak", rows=rows), indent=1))


if __name__ == "__main__":
    main()
