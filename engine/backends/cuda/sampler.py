"""One CUDA kernel for a decode step's plain draws: temperature-only and greedy rows.

Why: engine/sampler.py's two-level draw as MLX ops is ~20 kernels over the whole
[B, V] logits (a float32 copy, the max, x - max, the scaling, exp, block sums, two
cumulative sums, the picks). On an H100 with the llama-3 vocabulary that took 0.23 ms
a step at B=1 and 0.85 ms at B=128, against mlx-lm's Gumbel draw at 0.19 and 0.26
(bench/sampler_bench.py, session 25): at 1b B=128 a ~3.4 ms step pays a quarter more
when its rows sample, and OpenAI's default temperature is 1.0.

Here one block of ``THREADS`` threads draws one row, reading the logits in their own
dtype: the row's max (and its first index, the greedy token), each 256-token block's
mass, the first block whose running mass reaches u0 of the total, then the first
token in it whose running mass reaches u1 of the block's: the same two-level inverse
CDF with the same two uniforms as the MLX ops (engine/sampler.py), summed in another
order, so a draw within a rounding of a boundary may land on the neighbouring token.
A row with ``inv_t`` 0 is greedy (the max's first index, as ``mx.argmax``). Rounding
never picks a token of zero weight: a pick falls back to the last block / token
with weight. Rows' settings come in one float32 [B, 4] array (inv_t, u0, u1, 0: 16
bytes a row, out of MLX's pool of tiny arrays, engine/gpu_mma.device_scalar) and the
tokens leave in an int32 [B, 4] array, column 0 (the same reason).

Measured (H100, session 25, bf16 logits of 128,256 tokens, ``bash bench/gpu/suite.sh
sampler``, ms a step, this kernel / the MLX ops / mlx-lm): B=1 0.32 / 0.20 / 0.19,
B=8 0.18 / 0.30 / 0.10, B=32 0.14 / 0.77 / 0.11, B=128 0.53 / 0.84 / 0.23. So it runs
from ``MIN_ROWS`` rows. That form reads its row twice (the max, then the blocks'
masses), one element a thread a load: latency-bound, ~0.15 ms a row. The one-pass
form (``ONEPASS``, ``MARKBASE_GPU_SAMPLER_ONEPASS=1``, off) reads it once, 16 bytes a
lane a load, two blocks' loads in flight a warp: each 256-token block's max, first
argmax and mass against its own max, rescaled to the row's max afterwards. Predicted
~20-30 us a step; measured (session 26, a noisier host, wall ms a step, one-pass /
two-pass / mlx-lm): B=8 0.20 / 0.53 / 0.10, B=32 0.60 / 0.50 / 0.13, B=128 0.54 /
0.66 / 0.23: not ahead of mlx-lm, not clearly ahead of the two-pass form.

Top-k/top-p rows still sort on the MLX route. ``MARKBASE_GPU_SAMPLER_KERNEL=0`` turns
this off; ``MARKBASE_GPU_SAMPLER_MIN_ROWS`` moves the threshold.
"""

from __future__ import annotations

import os
from functools import cache

from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype, one_output_call

THREADS = 1024
BLOCK = 256  # tokens a block of the two-level draw (engine/sampler.py's too)
MAX_BLOCKS = 2048  # so vocabularies up to 524,288 tokens
MIN_ROWS = int(os.environ.get("MARKBASE_GPU_SAMPLER_MIN_ROWS", "8"))  # measured: above

_HEADER = r"""
__device__ __forceinline__ float mb_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// the larger value, the smaller index on a tie (mx.argmax takes the first max)
__device__ __forceinline__ void mb_argmax_merge(float& v, int& i, const float v2, const int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}
// 8 consecutive logits from index i0 as floats (-inf past the row's end): one 16-byte
// load (two for float32) where the row is 16-byte aligned
template <typename T>
__device__ __forceinline__ void mb_load8(const T* row, const int i0, const int v, const bool vec,
                                         float (&f)[8]) {
  if (vec && i0 + 8 <= v) {
    if constexpr (sizeof(T) == 2) {
      const uint4 w = *reinterpret_cast<const uint4*>(row + i0);
      const T* h = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(h[j]);
    } else {
      const float4 a = *reinterpret_cast<const float4*>(row + i0);
      const float4 b = *reinterpret_cast<const float4*>(row + i0 + 4);
      f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
      f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = i0 + j < v ? static_cast<float>(row[i0 + j]) : -INFINITY;
  }
}
// one 256-token block held 8 a lane: its max, the max's first index and its mass
// against its own max (lane 0 writes them)
__device__ __forceinline__ void mb_block_stats(const float (&f)[8], const int i0, const int lane,
                                               const float inv_t, const int b, float* bmax,
                                               int* barg, float* bsum) {
  float bm = -INFINITY;
  int bi = i0;
#pragma unroll
  for (int j = 0; j < 8; ++j) mb_argmax_merge(bm, bi, f[j], i0 + j);
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, bm, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
    mb_argmax_merge(bm, bi, m2, i2);
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += f[j] == -INFINITY ? 0.0f : __expf((f[j] - bm) * inv_t);
  s = mb_warp_sum(s);
  if (lane == 0) {
    bmax[b] = bm;
    barg[b] = bi;
    bsum[b] = s;
  }
}
__device__ __forceinline__ float mb_warp_scan(float c, const int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, c, o);
    if (lane >= o) c += y;
  }
  return c;
}
"""

_BODY = r"""
  constexpr int NW = NT / 32;
  __shared__ float mass[MAXB];
  __shared__ float bmax[ONEPASS ? MAXB : 1];  // one pass: each block's max and its index
  __shared__ int barg[ONEPASS ? MAXB : 1];
  __shared__ float red_v[NW];
  __shared__ int red_i[NW];
  __shared__ int pick;
  const int row = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int v = x_shape[1];
  const int nb = (v + BLK - 1) / BLK;
  const T* xr = x + static_cast<size_t>(row) * v;
  const float inv_t = p[row * 4 + 0];
  const float u0 = p[row * 4 + 1];
  const float u1 = p[row * 4 + 2];

  // 1. the row's max and its first index
  float m = -INFINITY;
  int mi = 0;  // a row of -inf only: token 0, as mx.argmax
  if constexpr (ONEPASS) {
    // one pass: warp w takes blocks w, w + NW, ... two at a time (both loads in
    // flight), each block's max, argmax and mass against its own max
    const bool vec = (reinterpret_cast<size_t>(xr) & 15) == 0;
    for (int b = warp; b < nb; b += 2 * NW) {
      const int b1 = b + NW;
      float f0[8], f1[8];
      mb_load8(xr, b * BLK + lane * 8, v, vec, f0);
      if (b1 < nb) mb_load8(xr, b1 * BLK + lane * 8, v, vec, f1);
      mb_block_stats(f0, b * BLK + lane * 8, lane, inv_t, b, bmax, barg, mass);
      if (b1 < nb) mb_block_stats(f1, b1 * BLK + lane * 8, lane, inv_t, b1, bmax, barg, mass);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += NT) mb_argmax_merge(m, mi, bmax[b], barg[b]);
  } else {
    for (int i = threadIdx.x; i < v; i += NT) {
      mb_argmax_merge(m, mi, static_cast<float>(xr[i]), i);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, mi, o);
    mb_argmax_merge(m, mi, m2, i2);
  }
  if (lane == 0) {
    red_v[warp] = m;
    red_i[warp] = mi;
  }
  __syncthreads();
  m = red_v[0];
  mi = red_i[0];
  for (int w = 1; w < NW; ++w) mb_argmax_merge(m, mi, red_v[w], red_i[w]);
  if (inv_t <= 0.0f) {  // greedy (block-uniform)
    if (threadIdx.x == 0) out[row * 4] = mi;
    return;
  }

  // 2. each block's mass against the row's max
  if constexpr (ONEPASS) {  // (its mass against its own max, rescaled)
    for (int b = threadIdx.x; b < nb; b += NT) mass[b] *= __expf((bmax[b] - m) * inv_t);
  } else {  // warp w takes blocks w, w + NW, ...
    for (int b = warp; b < nb; b += NW) {
      float s = 0.0f;
      for (int k = lane; k < BLK; k += 32) {
        const int i = b * BLK + k;
        if (i < v) s += __expf((static_cast<float>(xr[i]) - m) * inv_t);
      }
      s = mb_warp_sum(s);
      if (lane == 0) mass[b] = s;
    }
  }
  __syncthreads();

  // 3. warp 0: the first block whose running mass reaches u0 of the total
  if (warp == 0) {
    float t = 0.0f;
    int last = 0;  // the last block with mass (a fallback past rounding)
    for (int b = lane; b < nb; b += 32) {
      t += mass[b];
      if (mass[b] > 0.0f) last = b;
    }
    t = mb_warp_sum(t);
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    const float target = u0 * t;
    float carry = 0.0f;
    int found = last;
    for (int b0 = 0; b0 < nb; b0 += 32) {
      const int b = b0 + lane;
      const float mb = b < nb ? mass[b] : 0.0f;
      const float c = mb_warp_scan(mb, lane) + carry;
      const unsigned hit = __ballot_sync(0xffffffffu, b < nb && mb > 0.0f && c >= target);
      if (hit) {
        found = b0 + __ffs(hit) - 1;
        break;
      }
      carry = __shfl_sync(0xffffffffu, c, 31);
    }
    if (lane == 0) pick = found;
  }
  __syncthreads();

  // 4. warp 0: the token in that block, 8 consecutive tokens a lane
  if (warp == 0) {
    const int base = pick * BLK + lane * (BLK / 32);
    float e[BLK / 32];
    float s = 0.0f;
    int last = -1;  // this lane's last token with weight
    for (int j = 0; j < BLK / 32; ++j) {
      const int i = base + j;
      e[j] = i < v ? __expf((static_cast<float>(xr[i]) - m) * inv_t) : 0.0f;
      s += e[j];
      if (e[j] > 0.0f) last = j;
    }
    const float c = mb_warp_scan(s, lane);
    const float target = u1 * __shfl_sync(0xffffffffu, c, 31);
    const unsigned hit = __ballot_sync(0xffffffffu, s > 0.0f && c >= target);
    const unsigned any = __ballot_sync(0xffffffffu, s > 0.0f);
    // the lane where the running mass crosses the target, else the last lane with mass
    const int l = hit ? __ffs(hit) - 1 : (any ? 31 - __clz(any) : 0);
    if (lane == l) {
      float run = c - s;
      int pos = last;
      for (int j = 0; j < BLK / 32; ++j) {
        run += e[j];
        if (e[j] > 0.0f && run >= target) {
          pos = j;
          break;
        }
      }
      out[row * 4] = base + max(pos, 0);
    }
  }
"""

_INPUTS = [("x", "T", 2), ("p", "float32", 2)]


def _specs() -> dict[str, KernelSpec]:
    return {"draw": KernelSpec("mb_sample_draw", _INPUTS, [("out", "int32")], _BODY, _HEADER)}


_kernel = Baked(_specs, ensure_row_contiguous=True)
_TEMPLATE = (("NT", THREADS), ("BLK", BLOCK), ("MAXB", MAX_BLOCKS))


def one_pass() -> bool:
    """``MARKBASE_GPU_SAMPLER_ONEPASS=1``: the one-pass form (16-byte loads, each
    block's max, argmax and mass in one read of the row; measured no better, session 26)."""
    return os.environ.get("MARKBASE_GPU_SAMPLER_ONEPASS", "0") == "1"


def enabled() -> bool:
    return os.environ.get("MARKBASE_GPU_SAMPLER_KERNEL", "1") != "0"


def takes(logits) -> bool:
    """A CUDA GPU, a [B, V] float array of ``MIN_ROWS`` or more rows within
    ``MAX_BLOCKS`` blocks."""
    import mlx.core as mx

    return (
        logits.ndim == 2
        and logits.shape[0] >= MIN_ROWS
        and logits.shape[1] <= MAX_BLOCKS * BLOCK
        and logits.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and mx.cuda.is_available()
    )


def draw(logits, params):
    """int32 [B]: a token for each row of ``logits`` [B, V]; ``params`` float32 [B, 4]
    (1 / temperature, or 0 for greedy; u0; u1; unused)."""
    return _launch(logits.dtype, logits.shape[0], one_pass())([logits, params])[:, 0]


@cache
def _launch(dtype, rows: int, onepass: bool):
    """The kernel's call for ``rows`` rows, worked out once (a decode step calls it every
    step: as engine/backends/cuda/linear.py's routes, outside the per-call path)."""
    import mlx.core as mx

    kern = _kernel("draw", (("T", dtype), *_TEMPLATE, ("ONEPASS", onepass)))
    return one_output_call(kern, (rows * THREADS, 1, 1), (THREADS, 1, 1), (rows, 4), mx.int32)


def kernel_specs_for_check() -> list[KernelSpec]:
    spec = _specs()["draw"]
    return [
        for_dtype(
            spec,
            dtype,
            f"{spec.name}_{dtype}_{int(one)}",
            [("T", dtype), *_TEMPLATE, ("ONEPASS", one)],
        )
        for dtype in ("float32", "bfloat16", "float16")
        for one in (False, True)
    ]
