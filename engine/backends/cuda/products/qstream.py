"""4-bit products of one row (the single-stream decode step), their weights streamed
through shared memory by ``cp.async``, on CUDA cores (form ``q4``, the default: measured
fastest) or tensor cores (form ``mma``).

Why: at 8b 4-bit B=1 the products are ~2.4 ms of a ~3.5 ms step on engine/backends/cuda/products/mma.py's
kernel, reading the weights at 1.5-1.8 TB/s on the H200, where a copy reaches 2.5
(MLX) to 4.3 TB/s (PyTorch) (bench/gpu/NOTES.md, sessions 8-9). That kernel holds a
lane's in-flight loads in registers, so more loads in flight cost occupancy (session 9
measured more loads a lane slower), and its blocks are short (16 rows, then a
reduction through shared memory). Here a lane's loads go to its own ring of
``STAGES`` slots in shared memory (``cp.async``: no register holds a load in flight),
a warp owns whole output rows and walks them to the end, and nothing is block-wide
after the prologue.

The CUDA-core form (``_BODY``, session 10's first try): a warp owns one output row at
a time, lane ``l`` its 32-input chunks ``l, l + 32, ...``; a 4-bit value becomes a
float with the exponent trick on its place in the word (``(w & 0xF << 4k) |
0x4B000000`` is 2^23 + q * 16^k, exact), one accumulator per k: a LOP3, an FADD and an
FFMA a value, ~5 instructions a weight with the rest (SASS); that puts its issue time
at ~20 us of the 8b gate_up's 31.5 (36.9 on engine/backends/cuda/products/mma.py), so it is likely
issue-bound. It also takes shapes the tensor-core form does not (N not a multiple of
16).

The tensor-core form (``_MMA_BODY``): see the comment above it; about 1.8 instructions
a weight, yet measured slower (8b gate_up 40 us, down_proj 35 us): something else
limits it (suspects: 32 dependent MMAs a block; few m-tiles for the smaller
products, so few warps: down_proj's 256 m-tiles fill 64 SMs). For scale: a plain MLX
read kernel gets 4.5 TB/s over 1 GB (bench/gpu/read_bw.py). Both forms do their math
in float32 on the exact 4-bit values.

Limits (``supported``): bf16/fp16 x of one row, 4-bit affine with biases, group size
32/64/128, K a multiple of 1024 and at most 16384 (x lives in shared memory).
``bench/gpu/nvrtc_check.py`` compiles the sources without a GPU,
``bench/gpu/qstream_emulation.py`` checks the tensor-core form's index logic in numpy,
``tests/backends/cuda/test_gpu_qstream.py`` checks both forms against MLX on a GPU.
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import SMS, Baked, KernelSpec, for_dtype, one_output_call

WARPS = 8
STAGES = 8  # a lane's slots: STAGES - 1 chunks in flight while it computes one
# shared memory an SM gives its blocks, by compute capability (the CUDA programming
# guide's table; a block may use all but 1 KB): H100/H200/B200 228 KB, A100 164 KB,
# the rest (sm_86/89/120) 100 KB
SMEM_BY_ARCH = {(9, 0): 228 << 10, (10, 0): 228 << 10, (8, 0): 164 << 10, (8, 7): 164 << 10}
SMEM_OTHER = 100 << 10
MAX_K = 16384

_HEADER = r"""
__device__ __forceinline__ void mb_cp16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void mb_cp4(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void mb_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mb_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// a lane's ring of S shared-memory slots: chunk q is asked for (issue(q): its cp.async
// copies) S - 1 chunks before compute(q's slot) uses it, one commit group a chunk, so
// the slot written is always the one the chunk before used
template <int S, typename Issue>
__device__ __forceinline__ void mb_ring_start(const int total, Issue& issue) {
#pragma unroll
  for (int p = 0; p < S - 1; ++p) {
    if (p < total) {
      issue(p);
    }
    mb_commit();
  }
}
// STARTED: the caller has run mb_ring_start already (its loads in flight while it did
// other work: the integer form's x conversion)
template <int S, bool STARTED = false, typename Issue, typename Compute>
__device__ __forceinline__ void mb_ring(const int total, Issue& issue, Compute&& compute) {
  if constexpr (!STARTED) {
    mb_ring_start<S>(total, issue);
  }
  for (int q = 0; q < total; ++q) {
    if (q + S - 1 < total) {
      issue(q + S - 1);
    }
    mb_commit();
    mb_wait<S - 1>();  // chunk q's group is complete
    compute(q % S);
  }
}
// one of the two 16-bit values of a word (hi: the upper) as float
__device__ __forceinline__ float mb_half_of(uint32_t v, bool hi, __nv_bfloat16) {
  return __uint_as_float(hi ? (v & 0xffff0000u) : (v << 16));
}
__device__ __forceinline__ float mb_half_of(uint32_t v, bool hi, __half) {
  const uint16_t h = static_cast<uint16_t>(hi ? (v >> 16) : (v & 0xffffu));
  return __half2float(*reinterpret_cast<const __half*>(&h));
}
__device__ __forceinline__ constexpr bool mb_is_half(__half) { return true; }
__device__ __forceinline__ constexpr bool mb_is_half(__nv_bfloat16) { return false; }
// a + two 16 x 8-bit products: the int16 pair of x with bytes 0, 1 (lo) or 2, 3 (hi) of b
__device__ __forceinline__ int mb_dp2a_lo(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int mb_dp2a_hi(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
// the same with b's bytes unsigned (0..255)
__device__ __forceinline__ int mb_dp2a_lo_u(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int mb_dp2a_hi_u(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
// 2^23 + (w & mask) as float (magic: 0x4B000000), minus 2^23: the masked bits' value, exact
__device__ __forceinline__ float mb_nib(uint32_t w, uint32_t mask, uint32_t magic) {
  return __uint_as_float((w & mask) | magic) - 8388608.f;
}
"""

_BODY = r"""
  constexpr int NT = WARPS * 32;
  constexpr int CPR = K / 32;       // 32-input chunks a row
  constexpr int J = CPR / 32;       // a lane's chunks a row
  constexpr int G = K / GS;         // quantization groups a row
  constexpr int XC = 9;             // float4s a chunk of x takes: 8 and one of padding
  extern __shared__ __align__(16) unsigned char mb_smem[];
  float4* xs = reinterpret_cast<float4*>(mb_smem);                         // [CPR * XC]
  float* xsum = reinterpret_cast<float*>(mb_smem + CPR * XC * 16);         // [CPR]
  uint4* wslot = reinterpret_cast<uint4*>(mb_smem + CPR * XC * 16 + CPR * 4);  // [STAGES][NT]
  uint32_t* sslot = reinterpret_cast<uint32_t*>(wslot + STAGES * NT);       // [STAGES][NT]
  uint32_t* bslot = sslot + STAGES * NT;                                     // [STAGES][NT]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int gw = blockIdx.x * WARPS + (tid >> 5);
  const int TW = gridDim.x * WARPS;
  const int N = GLU ? w_shape[0] / 2 : w_shape[0];  // outputs
  // 0 at run time, unknown to the compiler: keeps the exponent-trick constant in a
  // register (ptxas otherwise rematerializes the masks before every LOP3)
  const uint32_t magic = 0x4B000000u | (static_cast<uint32_t>(N) >> 31);

  // x as float32 in shared memory, a chunk every 144 bytes: the 8 lanes of a 16-byte
  // load phase (chunks l..l+7) then hit 8 different bank groups
  for (int c = tid; c < CPR; c += NT) {
    float s = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + c * 32 + p * 8);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = mb_half_of(h[i], false, T{});
        f[2 * i + 1] = mb_half_of(h[i], true, T{});
        s += f[2 * i] + f[2 * i + 1];
      }
      xs[c * XC + 2 * p] = make_float4(f[0], f[1], f[2], f[3]);
      xs[c * XC + 2 * p + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    xsum[c] = s;
  }
  __syncthreads();

  // this lane's walk: outputs o = gw, gw + TW, ...; per output its rows (gate, up);
  // per row the chunks lane + 32 j
  const int units = gw < N ? (N - 1 - gw) / TW + 1 : 0;
  const int total = units * J * (GLU ? 2 : 1);
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(biases);
  int i_o = gw, i_rr = 0, i_j = 0;  // the next chunk to load
  auto issue = [&](int q) {
    const uint32_t row = static_cast<uint32_t>(i_o + (GLU && i_rr ? N : 0));
    const int s = (q % STAGES) * NT + tid;
    // 32-bit indices (a weight of up to 2^31 words), the chunk's group: two groups'
    // values a 4-byte word (G is even)
    const uint32_t wi = row * (K / 8) + lane * 4 + i_j * 128;
    const uint32_t gi = row * G + (lane * 32) / GS + i_j * (1024 / GS);
    mb_cp16(&wslot[s], w + wi);
    mb_cp4(&sslot[s], sw + (gi >> 1));
    mb_cp4(&bslot[s], bw + (gi >> 1));
    if (++i_j == J) {
      i_j = 0;
      if (GLU && i_rr == 0) {
        i_rr = 1;
      } else {
        i_rr = 0;
        i_o += TW;
      }
    }
  };
  int c_o = gw, c_rr = 0, c_j = 0;  // the chunk to compute
  float acc = 0.f, gate = 0.f;
  mb_ring<STAGES>(total, issue, [&](const int s) {  // s: the slot of this chunk
    const uint4 wv = wslot[s * NT + tid];
    const uint32_t sv = sslot[s * NT + tid];
    const uint32_t bv = bslot[s * NT + tid];
    const int col = lane + 32 * c_j;
    const float4* xc = xs + col * XC;
    const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
    // p[k]: sum of x * q * 16^k over the values at nibble k of a half word
    float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 xa = xc[2 * i];
      const float4 xb = xc[2 * i + 1];
      const uint32_t lo = ws[i];
      const uint32_t hi = ws[i] >> 16;
      p0 = fmaf(xa.x, mb_nib(lo, 0xFu, magic), p0);
      p1 = fmaf(xa.y, mb_nib(lo, 0xF0u, magic), p1);
      p2 = fmaf(xa.z, mb_nib(lo, 0xF00u, magic), p2);
      p3 = fmaf(xa.w, mb_nib(lo, 0xF000u, magic), p3);
      p0 = fmaf(xb.x, mb_nib(hi, 0xFu, magic), p0);
      p1 = fmaf(xb.y, mb_nib(hi, 0xF0u, magic), p1);
      p2 = fmaf(xb.z, mb_nib(hi, 0xF00u, magic), p2);
      p3 = fmaf(xb.w, mb_nib(hi, 0xF000u, magic), p3);
    }
    const float dot = p0 + p1 * 0.0625f + p2 * 0.00390625f + p3 * 0.000244140625f;
    const bool hi_half = (((lane * 32) / GS + c_j * (1024 / GS)) & 1) != 0;
    const float sc = mb_half_of(sv, hi_half, T{});
    const float bi = mb_half_of(bv, hi_half, T{});
    acc = fmaf(sc, dot, fmaf(bi, xsum[col], acc));
    if (++c_j == J) {  // the row's last chunk: its sum, across the warp
      c_j = 0;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
      }
      if (GLU && c_rr == 0) {
        gate = acc;
        c_rr = 1;
      } else {
        if (lane == 0) {
          float v = acc;
          if constexpr (GLU) {
            v = gate / (1.f + __expf(-gate)) * acc;
          }
          if constexpr (RES) {
            v += static_cast<float>(r[c_o]);
          }
          y[c_o] = static_cast<T>(v);
        }
        c_rr = 0;
        c_o += TW;
      }
      acc = 0.f;
    }
  });
"""


# The integer form (``q4i``, session 11, the default): the same ring and walk as
# ``_BODY``, but x is held as int16 with a power-of-two scale per 32-input chunk
# (2^(14 - e), e the exponent of the chunk's largest |x|: every bf16 value within 2^7
# of that largest, every fp16 one within 2^4, becomes an integer exactly; smaller ones
# are rounded at 2^-15 of it), and a chunk's dot product is integer arithmetic. A
# weight word's 8 values become two words of bytes by one LOP3 each (w & 0x0F0F0F0F:
# values 0, 2, 4, 6; w & 0xF0F0F0F0: 16 x values 1, 3, 5, 7, read as unsigned bytes,
# so no shift), and each of those meets two int16 pairs of x in a DP2A (two 16 x 8-bit
# products added to an int32). Both sums stay below 2^23 (after the 16 comes off),
# so they convert to float exactly; scale, bias and x's chunk sum (float32) go on as
# before. A slot holds CPS chunks of a lane, so the ring's bookkeeping is paid once for
# them. SASS (bench/gpu/nvrtc_check.py --sass): ~74 instructions a 32-weight chunk
# (2.3 a weight) against ~170 for ``_BODY``.
_IBODY = r"""
  constexpr int NT = WARPS * 32;
  constexpr int CPR = K / 32;       // 32-input chunks a row
  constexpr int J = CPR / 32;       // a lane's chunks a row
  constexpr int G = K / GS;         // quantization groups a row
  // uint4s a chunk of x takes: its 4 weight words' int16 pairs, then (1 / scale, sum
  // of x); 80 bytes, so the 8 lanes of a 16-byte load phase hit 8 different bank groups
  constexpr int XC = 5;
  extern __shared__ __align__(16) unsigned char mb_smem[];
  uint4* xq = reinterpret_cast<uint4*>(mb_smem);                         // [CPR * XC]
  uint4* wslot = xq + CPR * XC;                                      // [STAGES][CPS][NT]
  uint32_t* sslot = reinterpret_cast<uint32_t*>(wslot + STAGES * CPS * NT);  // [STAGES][CPS][NT]
  uint32_t* bslot = sslot + STAGES * CPS * NT;                               // [STAGES][CPS][NT]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int gw = blockIdx.x * WARPS + (tid >> 5);
  const int TW = gridDim.x * WARPS;
  const int N = GLU ? w_shape[0] / 2 : w_shape[0];  // outputs

  // a slot holds CPS chunks of a lane (j, j + 1, ...: CPS cp.async each, one commit
  // group), so the ring's bookkeeping is paid once for CPS chunks
  constexpr int JS = J / CPS;       // a lane's slots a row
  static_assert(J % CPS == 0, "CPS must divide K / 1024");
  const int units = gw < N ? (N - 1 - gw) / TW + 1 : 0;
  const int total = units * JS * (GLU ? 2 : 1);
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(biases);
  int i_o = gw, i_rr = 0, i_j = 0;  // the next slot to load: output, gate/up, first chunk
  auto issue = [&](int q) {
    const uint32_t row = static_cast<uint32_t>(i_o + (GLU && i_rr ? N : 0));
    const int s = (q % STAGES) * CPS * NT + tid;
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      const uint32_t wi = row * (K / 8) + lane * 4 + (i_j + c) * 128;
      const uint32_t gi = row * G + (lane * 32) / GS + (i_j + c) * (1024 / GS);
      mb_cp16(&wslot[s + c * NT], w + wi);
      mb_cp4(&sslot[s + c * NT], sw + (gi >> 1));
      mb_cp4(&bslot[s + c * NT], bw + (gi >> 1));
    }
    i_j += CPS;
    if (i_j == J) {
      i_j = 0;
      if (GLU && i_rr == 0) {
        i_rr = 1;
      } else {
        i_rr = 0;
        i_o += TW;
      }
    }
  };
  // EARLY: the ring's first loads go out before x's conversion (they do not need it),
  // so the weights' HBM latency runs under the prologue instead of after it
  if constexpr (EARLY) {
    mb_ring_start<STAGES>(total, issue);
  }

  // NORM: x's sum of squares over this thread's chunks (the block's total makes the
  // RMSNorm's 1 / rms, which goes on each output at the end: the product is linear in
  // x), and the chunks hold x times the norm's weight
  float ss = 0.f;
  for (int c = tid; c < CPR; c += NT) {
    float f[32];
    float s = 0.f, amax = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + c * 32 + p * 8);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[8 * p + 2 * i] = mb_half_of(h[i], false, T{});
        f[8 * p + 2 * i + 1] = mb_half_of(h[i], true, T{});
      }
      if constexpr (NORM) {
        const uint4 gv = *reinterpret_cast<const uint4*>(nw + c * 32 + p * 8);
        const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float& f0 = f[8 * p + 2 * i];
          float& f1 = f[8 * p + 2 * i + 1];
          ss = fmaf(f0, f0, fmaf(f1, f1, ss));
          f0 *= mb_half_of(g[i], false, T{});
          f1 *= mb_half_of(g[i], true, T{});
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      s += f[i];
      amax = fmaxf(amax, fabsf(f[i]));
    }
    // up = 2^(141 - e) puts the largest |x| in [2^14, 2^15); 1 / up = 2^(e - 141);
    // e clamped so that both are normal floats; NaN or Inf in the chunk (fmaxf skips
    // NaN, the sum does not): 1 / up is NaN, so the chunk's dot product is
    const int e = min(max(static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu), 15), 254);
    const float up = __uint_as_float(static_cast<uint32_t>(268 - e) << 23);
    const float down = fabsf(s) <= 3.0e38f
                           ? __uint_as_float(static_cast<uint32_t>(e - 14) << 23)
                           : __uint_as_float(0x7fc00000u);
    uint32_t q16[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      q16[i] = static_cast<uint32_t>(__float2int_rn(f[i] * up)) & 0xFFFFu;
    }
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      const uint32_t* qw = q16 + 8 * wd;
      xq[c * XC + wd] = make_uint4(qw[0] | (qw[2] << 16), qw[4] | (qw[6] << 16),
                                   qw[1] | (qw[3] << 16), qw[5] | (qw[7] << 16));
    }
    xq[c * XC + 4] = make_uint4(__float_as_uint(down), __float_as_uint(s), 0u, 0u);
  }
  __shared__ float mb_ss[WARPS];
  if constexpr (NORM) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      ss += __shfl_xor_sync(0xffffffffu, ss, off);
    }
    if (lane == 0) {
      mb_ss[tid >> 5] = ss;
    }
  }
  __syncthreads();
  float rn = 1.f;  // NORM: 1 / rms of x, as MLX's rms_norm: rsqrt(mean(x^2) + eps)
  if constexpr (NORM) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      t += mb_ss[i];
    }
    rn = rsqrtf(t / static_cast<float>(K) + eps[0]);
  }

  int c_o = gw, c_rr = 0, c_j = 0;  // the slot to compute
  float acc = 0.f, gate = 0.f;
  mb_ring<STAGES, EARLY>(total, issue, [&](const int s) {  // s: the slot
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      const int si = (s * CPS + c) * NT + tid;
      const uint4 wv = wslot[si];
      const uint32_t sv = sslot[si];
      const uint32_t bv = bslot[si];
      if constexpr (ABL) {  // bench only: the stream without the math (is it issue-bound?)
        acc += __uint_as_float((wv.x ^ wv.y ^ wv.z ^ wv.w ^ sv ^ bv) & 0x3f7fffffu);
        continue;
      }
      const int col = lane + 32 * (c_j + c);
      const uint4* xc = xq + col * XC;
      const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
      // de: x times values 0, 2, 4, 6 of each word (bytes of w & 0x0F0F0F0F); dd: x times
      // 16 x values 1, 3, 5, 7 (bytes of w & 0xF0F0F0F0, unsigned: no shift needed)
      int de = 0, dd = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 xv = xc[i];
        const uint32_t even = ws[i] & 0x0F0F0F0Fu;
        const uint32_t odd = ws[i] & 0xF0F0F0F0u;
        de = mb_dp2a_lo(xv.x, even, de);
        de = mb_dp2a_hi(xv.y, even, de);
        dd = mb_dp2a_lo_u(xv.z, odd, dd);
        dd = mb_dp2a_hi_u(xv.w, odd, dd);
      }
      const uint2 ds = *reinterpret_cast<const uint2*>(xc + 4);  // (1 / scale, sum of x)
      // |de| and |dd| / 16 are below 2^23, their sum below 2^24: exact in float
      const float dot = fmaf(static_cast<float>(dd), 0.0625f, static_cast<float>(de)) *
                        __uint_as_float(ds.x);
      const bool hi_half = (((lane * 32) / GS + (c_j + c) * (1024 / GS)) & 1) != 0;
      const float sc = mb_half_of(sv, hi_half, T{});
      const float bi = mb_half_of(bv, hi_half, T{});
      acc = fmaf(sc, dot, fmaf(bi, __uint_as_float(ds.y), acc));
    }
    c_j += CPS;
    if (c_j == J) {  // the row's last chunk: its sum, across the warp
      c_j = 0;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
      }
      acc *= rn;
      if (GLU && c_rr == 0) {
        gate = acc;
        c_rr = 1;
      } else {
        if (lane == 0) {
          float v = acc;
          if constexpr (GLU) {
            v = gate / (1.f + __expf(-gate)) * acc;
          }
          if constexpr (RES) {
            v += static_cast<float>(r[c_o]);
          }
          y[c_o] = static_cast<T>(v);
        }
        c_rr = 0;
        c_o += TW;
      }
      acc = 0.f;
    }
  });
"""


# The tensor-core form (``mma``): a warp owns 16 weight rows (an m-tile; with the SwiGLU
# 8 gate rows and their 8 up rows) and walks K in blocks of 8 quantization groups. In
# one mma.sync.m16n8k16 the 16 k of a lane's A pairs are 2 values from each of the
# block's 8 groups (k pair 2j, 2j+1 <- group j), and B's column n holds x only for the
# k of group n, so C[row, n] sums group n alone: the scale and bias of each group go on
# once a block (C's 8 columns are the 8 groups), and the weight enters the MMA as the
# raw 4-bit value plus a constant (one LOP3 for two values: (w >> 4s) & 0x000F000F |
# 0x43004300 is the bf16 pair 128 + q_s, 128 + q_{s+4}); the constant comes off with
# the group's sum of x. About one instruction a weight, against ~5 on CUDA cores.
_MMA_BODY = r"""
  constexpr int NT = WARPS * 32;
  constexpr int NG = K / GS;        // quantization groups a row
  constexpr int KB = NG / 8;        // blocks of 8 groups a row
  constexpr int GW = GS / 8;        // 32-bit words (8 values) a group
  constexpr int SEGC = GS / 32;     // 16-byte chunks of one group's weights
  constexpr int CH = 4 * SEGC;      // chunks a lane loads a block: rows g, g+8 x groups t, t+4
  constexpr int XG = GS / 2 + 4;    // words of x pairs a group takes in shared memory
  extern __shared__ __align__(16) unsigned char mb_smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(mb_smem);                  // [NG * XG]
  float* xsum = reinterpret_cast<float*>(xp + NG * XG);                 // [NG]
  uint4* zero4 = reinterpret_cast<uint4*>(xsum + NG);                   // [1]
  uint4* wslot = zero4 + 1;                                             // [STAGES][CH][NT]
  uint32_t* sbslot = reinterpret_cast<uint32_t*>(wslot + STAGES * CH * NT);  // [STAGES][4][NT]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int gw = blockIdx.x * WARPS + (tid >> 5);
  const int TW = gridDim.x * WARPS;
  const int NW = w_shape[0];
  const int N = GLU ? NW / 2 : NW;  // outputs
  const int tiles = GLU ? N / 8 : N / 16;
  // the exponent-trick constant of T (bf16: 128 + q, fp16: 1024 + q), from a value the
  // compiler cannot see, so that it stays in a register
  const uint32_t hz = static_cast<uint32_t>(NW) >> 31;
  const uint32_t magic = (mb_is_half(T{}) ? 0x64006400u : 0x43004300u) | hz;
  const float qoff = mb_is_half(T{}) ? 1024.f : 128.f;

  // x in shared memory as the MMA's B pairs: group j's word m = (x[8(m/4) + m%4],
  // x[8(m/4) + m%4 + 4]) of the group, the pair a LOP3 makes of weight word m/4 shifted
  // by 4(m%4); groups XG words apart (4 of padding: the 8 lanes that read x in one
  // load hit different banks); and each group's sum of x
  for (int j = tid; j < NG; j += NT) {
    float sum = 0.f;
#pragma unroll
    for (int wd = 0; wd < GW; ++wd) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + j * GS + wd * 8);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sum += mb_half_of(h[i], false, T{}) + mb_half_of(h[i], true, T{});
      }
      uint4 o;
      o.x = __byte_perm(h[0], h[2], 0x5410);  // (e0, e4)
      o.y = __byte_perm(h[0], h[2], 0x7632);  // (e1, e5)
      o.z = __byte_perm(h[1], h[3], 0x5410);  // (e2, e6)
      o.w = __byte_perm(h[1], h[3], 0x7632);  // (e3, e7)
      *reinterpret_cast<uint4*>(xp + j * XG + wd * 4) = o;
    }
    xsum[j] = sum;
  }
  if (tid == 0) {
    zero4[0] = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();

  const int units = gw < tiles ? (tiles - 1 - gw) / TW + 1 : 0;
  const int total = units * KB;
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(biases);
  auto rows_of = [&](int u, uint32_t& r0, uint32_t& r1) {
    r0 = static_cast<uint32_t>(GLU ? u * 8 + g : u * 16 + g);
    r1 = static_cast<uint32_t>(GLU ? N + u * 8 + g : u * 16 + g + 8);
  };
  int i_u = gw, i_kb = 0;  // the next stage to load: m-tile, block
  auto issue = [&](int q) {
    uint32_t r0, r1;
    rows_of(i_u, r0, r1);
    const int s = q % STAGES;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
#pragma unroll
      for (int gi = 0; gi < 2; ++gi) {
        const uint32_t row = ri ? r1 : r0;
        const uint32_t base = row * (K / 8) + (i_kb * 8 + t + 4 * gi) * GW;
#pragma unroll
        for (int c = 0; c < SEGC; ++c) {
          mb_cp16(&wslot[(s * CH + (ri * 2 + gi) * SEGC + c) * NT + tid], w + base + c * 4);
        }
      }
    }
    // the scales and biases of C's columns 2t, 2t+1 (groups 2t, 2t+1 of the block):
    // one 4-byte word a row
    const uint32_t gs0 = (r0 * NG + i_kb * 8 + 2 * t) >> 1;
    const uint32_t gs1 = (r1 * NG + i_kb * 8 + 2 * t) >> 1;
    mb_cp4(&sbslot[(s * 4 + 0) * NT + tid], sw + gs0);
    mb_cp4(&sbslot[(s * 4 + 1) * NT + tid], sw + gs1);
    mb_cp4(&sbslot[(s * 4 + 2) * NT + tid], bw + gs0);
    mb_cp4(&sbslot[(s * 4 + 3) * NT + tid], bw + gs1);
    if (++i_kb == KB) {
      i_kb = 0;
      i_u += TW;
    }
  };
  // B's sources: lane (g, t) holds x in b0 only when g == t (k pair 2t, 2t+1 is group
  // t = n) and in b1 only when g == t + 4; the others read a zero word
  const bool real0 = g == t;
  const bool real1 = g == t + 4;
  int c_u = gw, c_kb = 0;
  float acc0 = 0.f, acc1 = 0.f;
  mb_ring<STAGES>(total, issue, [&](const int s) {
    const uint4* xq0 = real0 ? reinterpret_cast<const uint4*>(xp + (c_kb * 8 + g) * XG) : zero4;
    const uint4* xq1 = real1 ? reinterpret_cast<const uint4*>(xp + (c_kb * 8 + g) * XG) : zero4;
    const int st0 = real0 ? 1 : 0;
    const int st1 = real1 ? 1 : 0;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c4 = 0; c4 < SEGC; ++c4) {
      // 4 words of each segment aRG: row g (R 0) or g+8 (R 1), group t (G 0) or t+4 (G 1)
      // (the slots hold segment R * 2 + G)
      const uint4 a00 = wslot[(s * CH + 0 * SEGC + c4) * NT + tid];
      const uint4 a01 = wslot[(s * CH + 1 * SEGC + c4) * NT + tid];
      const uint4 a10 = wslot[(s * CH + 2 * SEGC + c4) * NT + tid];
      const uint4 a11 = wslot[(s * CH + 3 * SEGC + c4) * NT + tid];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int wd = c4 * 4 + i;  // the word of the group
        const uint32_t w00 = mb_word(a00, i), w01 = mb_word(a01, i);
        const uint32_t w10 = mb_word(a10, i), w11 = mb_word(a11, i);
        const uint4 x0 = xq0[wd * st0];
        const uint4 x1 = xq1[wd * st1];
#pragma unroll
        for (int sh = 0; sh < 4; ++sh) {
          const uint32_t p00 = ((w00 >> (4 * sh)) & 0x000F000Fu) | magic;
          const uint32_t p01 = ((w01 >> (4 * sh)) & 0x000F000Fu) | magic;
          const uint32_t p10 = ((w10 >> (4 * sh)) & 0x000F000Fu) | magic;
          const uint32_t p11 = ((w11 >> (4 * sh)) & 0x000F000Fu) | magic;
          // A: a0 row g, k 2t..2t+1 (group t); a1 row g+8, same k; a2 row g, k 2t+8..2t+9
          // (group t+4); a3 row g+8, group t+4
          mb_mma(c, p00, p10, p01, p11, mb_word(x0, sh), mb_word(x1, sh), T{});
        }
      }
    }
    // C[row][n] = sum over group n of x * (qoff + q): y += s * C + X * (b - qoff * s)
    const uint32_t s0w = sbslot[(s * 4 + 0) * NT + tid];
    const uint32_t s1w = sbslot[(s * 4 + 1) * NT + tid];
    const uint32_t b0w = sbslot[(s * 4 + 2) * NT + tid];
    const uint32_t b1w = sbslot[(s * 4 + 3) * NT + tid];
    const float xa = xsum[c_kb * 8 + 2 * t];
    const float xb = xsum[c_kb * 8 + 2 * t + 1];
    {
      const float s00 = mb_half_of(s0w, false, T{}), s01 = mb_half_of(s0w, true, T{});
      const float s10 = mb_half_of(s1w, false, T{}), s11 = mb_half_of(s1w, true, T{});
      const float b00 = mb_half_of(b0w, false, T{}), b01 = mb_half_of(b0w, true, T{});
      const float b10 = mb_half_of(b1w, false, T{}), b11 = mb_half_of(b1w, true, T{});
      acc0 = fmaf(s00, c[0], fmaf(xa, fmaf(-qoff, s00, b00), acc0));
      acc0 = fmaf(s01, c[1], fmaf(xb, fmaf(-qoff, s01, b01), acc0));
      acc1 = fmaf(s10, c[2], fmaf(xa, fmaf(-qoff, s10, b10), acc1));
      acc1 = fmaf(s11, c[3], fmaf(xb, fmaf(-qoff, s11, b11), acc1));
    }
    if (++c_kb == KB) {  // the m-tile's last block: the 4 lanes of a row group add up
      c_kb = 0;
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
      if (t == 0) {
        uint32_t r0, r1;
        rows_of(c_u, r0, r1);
        if constexpr (GLU) {
          y[r0] = static_cast<T>(acc0 / (1.f + __expf(-acc0)) * acc1);
        } else {
          float v0 = acc0, v1 = acc1;
          if constexpr (RES) {
            v0 += static_cast<float>(r[r0]);
            v1 += static_cast<float>(r[r1]);
          }
          y[r0] = static_cast<T>(v0);
          y[r1] = static_cast<T>(v1);
        }
      }
      acc0 = 0.f;
      acc1 = 0.f;
      c_u += TW;
    }
  });
"""


def _specs() -> dict[str, KernelSpec]:
    """Forms ``q4i``/``q4`` (CUDA cores) and ``mma`` (tensor cores), each plain,
    ``_res`` (a residual ``r`` [1, N] added: o_proj/down_proj) and ``_glu`` (w = [gate;
    up], output silu(gate) * up, [1, N/2]: gate_up); the integer form also ``_norm`` and
    ``_glu_norm`` (x through an RMSNorm first: its weight ``nw`` [K] and ``eps`` [1]:
    qkv, gate_up and the lm_head, one kernel a norm fewer)."""
    from engine.backends.cuda.products import mma as gpu_mma

    inputs = [("x", "T", 2), ("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)]
    out = {}
    for form, body, header in (
        ("q4", _BODY, _HEADER),
        ("q4i", _IBODY, _HEADER),
        ("mma", _MMA_BODY, gpu_mma._HEADER + _HEADER),
    ):
        kinds = [("", False, False, False), ("_res", False, True, False)]
        kinds += [("_glu", True, False, False)]
        if form in NORM_FORMS:
            kinds += [("_norm", False, False, True), ("_glu_norm", True, False, True)]
        if form == "q4i":  # bench/gpu/q4_bench.py's ablation: the stream without the math
            kinds += [(k + "_abl", g, r, nm) for k, g, r, nm in kinds]
        for suffix, glu, res, norm in kinds:
            flags = "".join(
                f"  constexpr bool {name} = {'true' if on else 'false'};\n"
                for name, on in (("GLU", glu), ("RES", res), ("NORM", norm))
            )
            if form == "q4i":
                flags += (
                    f"  constexpr bool ABL = {'true' if suffix.endswith('_abl') else 'false'};\n"
                )
            if not res:
                flags += "  const T* r = nullptr;\n"
            if not norm:
                flags += "  const T* nw = nullptr;\n  const float* eps = nullptr;\n"
            extra = [("r", "T", 2)] if res else []
            extra += [("nw", "T", 1), ("eps", "float32", 1)] if norm else []
            name = {"q4": "mb_qstream", "q4i": "mb_qstream_i", "mma": "mb_qstream_mma"}[form]
            out[form + suffix] = KernelSpec(
                name + suffix, inputs + extra, [("y", "T")], flags + body, header
            )
    return out


def smem_bytes(form: str, k: int, gs: int, stages: int, warps: int, cps: int = 1) -> int:
    """Dynamic shared memory a block needs: x, its chunk or group sums, the lanes' slots
    (``cps``: chunks a slot, the integer form's)."""
    if form == "q4":  # x as float32, 144 bytes a 32-input chunk; 16 + 4 + 4 bytes a slot
        return (k // 32) * (9 * 16 + 4) + stages * warps * 32 * (16 + 4 + 4)
    if form == "q4i":  # x as int16 + (scale, sum), 80 bytes a chunk; cps x 24 bytes a slot
        return (k // 32) * 80 + stages * cps * warps * 32 * (16 + 4 + 4)
    ng = k // gs  # x as bf16/fp16 pairs, 8 bytes of padding a group; 4 segments + 16 a slot
    return ng * (gs // 2 + 4) * 4 + ng * 4 + 16 + stages * warps * 32 * (4 * gs // 2 + 16)


# one kernel object per kind and template (its dynamic shared memory follows from them)
_kernel = Baked(_specs, ensure_row_contiguous=True)


def supported(x_dtype, rows: int, n: int, k: int, bits: int, group_size: int, mode, biases):
    import mlx.core as mx

    return (
        platform.cuda_available()
        and rows == 1
        and x_dtype in (mx.bfloat16, mx.float16)
        and bits == 4
        and mode == "affine"
        and biases is not None
        and group_size in (32, 64, 128)
        and k % 1024 == 0
        and 0 < k <= MAX_K
        and n > 0
        and _fits("q4", k, group_size, 2, 4)  # the smallest block fits this GPU's SM
    )


# per form: slots a lane, warps a block (the CUDA-core forms: 16 warps from K > 8192,
# where x's shared memory leaves one block an SM); the integer form's slots hold
# CPS chunks each (2 where a lane's chunks a row are even; else 1, and twice the slots)
DEFAULTS = {"q4": (STAGES, WARPS), "q4i": (4, WARPS), "mma": (4, 4)}
CPS = 2
FORMS = tuple(DEFAULTS)
# measured (bench/gpu/q4_bench.py, NOTES.md sessions 10-11; 8b, us a layer's 4 products):
# engine/backends/cuda/products/mma.py 75.6, the float CUDA-core form 65.2, the tensor-core form 97-131;
# MARKBASE_GPU_QSTREAM_FORM picks another for A/B runs
DEFAULT_FORM = "q4i"
# the forms whose kernels can take the RMSNorm before them (its cost: one more K-vector
# read from L2 and a block-wide sum in the prologue, where each block holds all of x anyway)
NORM_FORMS = ("q4i",)
_knobs: dict = {}


def set_knobs(
    form: str | None = None,
    stages: int | None = None,
    warps: int | None = None,
    cps: int | None = None,
    early: bool | None = None,
    abl: bool | None = None,
):
    """Launchers made from now on use ``form`` ("q4i": CUDA cores, integer dot products;
    "q4": CUDA cores, float; "mma": tensor cores), ``stages``/``warps``/``cps`` (chunks
    a slot, the integer form's; None: the defaults), ``early`` (``early_issue``; None:
    the environment's), ``abl`` (the integer form without its math: wrong outputs, for
    timing only); bench/gpu/q4_bench.py's variants."""
    if form is not None and form not in FORMS:
        raise ValueError(f"gpu_qstream: unknown form {form!r} (one of {', '.join(FORMS)})")
    _knobs.clear()
    pairs = (("form", form), ("stages", stages), ("warps", warps), ("cps", cps))
    pairs += (("early", early), ("abl", abl))
    _knobs.update({k: v for k, v in pairs if v is not None})


def early_issue() -> bool:
    """Whether the integer form issues its ring's first weight loads before converting x
    (default; MARKBASE_GPU_QSTREAM_EARLY=0 turns it off). Why: each block converts all
    of x (K/32 chunks, a block-wide barrier) before its first load, so every 1-row
    product started with its HBM idle for that prologue plus a load's latency, ~129
    times a step at 8b. H100 (bench/gpu/NOTES.md, session 23): a layer's four products
    alone 60.4 -> 57.3 us; with engine/backends/cuda/prefetch.py, the served 8b 4-bit single
    stream 2.668 -> 2.564-2.583 ms a step."""
    if _knobs.get("early") is not None:
        return bool(_knobs["early"])
    return envs.MARKBASE_GPU_QSTREAM_EARLY


def default_form() -> str:
    form = envs.MARKBASE_GPU_QSTREAM_FORM or DEFAULT_FORM
    if form not in FORMS:
        raise ValueError(
            f"MARKBASE_GPU_QSTREAM_FORM={form!r}: not a form (one of {', '.join(FORMS)})"
        )
    return form


def form_for(n: int, glu: bool) -> str:
    """The tensor-core form needs whole m-tiles (16 rows; with the SwiGLU 8 outputs):
    other shapes take the integer CUDA-core form."""
    want = _knobs.get("form") or default_form()
    if want == "mma" and n % 16:  # (with the SwiGLU: N/2 outputs in 8s, the same test)
        return "q4i"
    return want


_smem: list[int] = []


def smem_per_sm() -> int:
    """This GPU's shared memory an SM (``SMEM_BY_ARCH``; the smallest when unknown)."""
    if not _smem:
        arch = platform.compute_capability()  # None: no GPU, or unknown (the smallest)
        _smem.append(SMEM_BY_ARCH.get(arch, SMEM_OTHER))
    return _smem[0]


def _fits(form: str, k: int, gs: int, stages: int, warps: int, cps: int = 1) -> bool:
    return smem_bytes(form, k, gs, stages, warps, cps) + 1024 <= smem_per_sm()


def cps_for(form: str, k: int) -> int:
    """Chunks a slot: the knob (or ``CPS``) where it divides a lane's chunks a row
    (K / 1024), else 1; 1 for the forms without it."""
    if form != "q4i":
        return 1
    want = _knobs.get("cps", CPS)
    return want if (k // 1024) % want == 0 else 1


def shape_for(form: str, k: int, gs: int = 64) -> tuple[int, int]:
    """(slots a lane, warps a block): the knobs, else the defaults (16 warps for the
    CUDA-core forms from K > 8192, where x's shared memory leaves one block an SM; the
    integer form twice the slots where they hold one chunk), halving the warps, then
    the slots, until a block fits this GPU's SM."""
    stages, warps = DEFAULTS[form]
    if "stages" in _knobs or "warps" in _knobs:
        return _knobs.get("stages", stages), _knobs.get("warps", warps)
    cps = cps_for(form, k)
    if form == "q4i" and cps == 1:
        stages *= CPS
    if form in ("q4", "q4i") and k > 8192:
        warps *= 2
    while not _fits(form, k, gs, stages, warps, cps) and warps > 4:
        warps //= 2
    while not _fits(form, k, gs, stages, warps, cps) and stages > 2:
        stages //= 2
    return stages, warps


@cache
def _grid_blocks(
    form: str, units: int, k: int, gs: int, stages: int, warps: int, cps: int = 1
) -> int:
    """Blocks: as many warps as the SMs hold at once (shared memory bounds the blocks
    an SM), then no more than the work units (rows, or m-tiles) need with every warp
    taking the same count."""
    smem = smem_bytes(form, k, gs, stages, warps, cps)
    per_sm = max(1, min(2048 // (warps * 32), smem_per_sm() // (smem + 1024)))
    max_warps = SMS * per_sm * warps
    per_warp = -(-units // max_warps)
    want_warps = -(-units // per_warp)
    return -(-want_warps // warps)


def takes_norm(n: int, glu: bool) -> bool:
    """Whether the kernel for these outputs folds the RMSNorm before it in: the form has
    it and MARKBASE_GPU_QSTREAM_NORM is not 0 (on by default since session 24). Until
    then it was off: inside the step the norm forms ran 2-3x slower than alone (H200,
    session 12: GPU time 2.74 -> 4.01 ms). The cause was their epsilon, a [1] array in
    MLX's pool of tiny arrays (managed memory), which every block read: one such read
    costs a 9 MiB read kernel ~11 us (H100, bench/gpu/pool_cost.py). With the epsilon in
    device memory (``gpu_mma.device_scalar``) the fold takes 65 launches out of a step: 8b
    4-bit B=1 2.584 -> 2.455 ms, 1b 4-bit 956 -> 1,072 tok/s (H100, NOTES.md session 24)."""
    return form_for(n, glu) in NORM_FORMS and envs.MARKBASE_GPU_QSTREAM_NORM


def launcher(
    dtype, n: int, k: int, gs: int, residual: bool = False, glu: bool = False, norm: bool = False
):
    """``call(inputs) -> y`` [1, N] (``glu``: [1, N/2]) for x [1, K] and a 4-bit weight of
    ``n`` rows; ``inputs``: x, w, scales, biases, then the residual (``residual``) or the
    RMSNorm's weight [K] and epsilon [1] float32 (``norm``: ``takes_norm`` must say so)."""
    if glu and residual:
        raise ValueError("gpu_qstream: glu and residual together are not a kernel")
    if norm and residual:
        raise ValueError("gpu_qstream: norm and residual together are not a kernel")
    form = form_for(n, glu)
    if norm and form not in NORM_FORMS:
        raise ValueError(f"gpu_qstream: form {form} does not take the RMSNorm")
    stages, warps = shape_for(form, k, gs)
    cps = cps_for(form, k)
    kind = form + ("_glu" if glu else "_res" if residual else "") + ("_norm" if norm else "")
    if form == "q4i" and _knobs.get("abl"):
        kind += "_abl"
    template = (("T", dtype), ("K", k), ("GS", gs), ("STAGES", stages), ("WARPS", warps))
    if form == "q4i":
        template += (("CPS", cps), ("EARLY", early_issue()))
    smem = smem_bytes(form, k, gs, stages, warps, cps)
    if smem + 1024 > smem_per_sm():
        raise ValueError(
            f"gpu_qstream: {stages} slots x {warps} warps at K={k} need {smem} bytes of "
            f"shared memory a block, more than an SM has ({smem_per_sm()})"
        )
    fn = _kernel(kind, template, smem)
    n_out = n // 2 if glu else n
    units = n_out if form != "mma" else (n_out // 8 if glu else n_out // 16)
    blocks = _grid_blocks(form, units, k, gs, stages, warps, cps)
    return one_output_call(fn, (blocks * warps * 32, 1, 1), (warps * 32, 1, 1), (1, n_out), dtype)


def quantized_matmul(
    x, w, scales, biases, group_size: int, residual=None, glu: bool = False, norm=None
):
    """``x @ dequantize(w).T`` for one row x [1, K] and a 4-bit affine ``w`` [N, K/8];
    ``residual`` [1, N] added; ``glu``: w = [gate; up], the result silu(gate) * up;
    ``norm`` = (weight [K], eps): x through that RMSNorm first."""
    from engine.backends.cuda.products.mma import device_scalar

    n, k = w.shape[0], w.shape[1] * 8
    inputs = [x, w, scales, biases] + ([residual] if residual is not None else [])
    if norm is not None:
        inputs += [norm[0], device_scalar(float(norm[1]))]
    run = launcher(x.dtype, n, k, group_size, residual is not None, glu, norm is not None)
    return run(inputs)


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call: ``products`` = (group size,
    K, residual, glu[, norm]) per kind of 1-row product (NVRTC ~1 s each; MLX keeps the
    PTX on disk)."""
    import mlx.core as mx

    from engine.backends.cuda.products.mma import device_scalar

    outs = []
    for gs, k, residual, glu, *rest in sorted(set(products)):
        norm = bool(rest and rest[0])
        n = 16  # one m-tile (the tensor-core form's; the CUDA-core form takes any)
        s = mx.ones((n, k // gs), dtype=dtype)
        ins = [mx.zeros((1, k), dtype=dtype), mx.zeros((n, k // 8), dtype=mx.uint32), s, s]
        if residual:
            ins.append(mx.zeros((1, n), dtype=dtype))
        if norm:
            ins += [mx.ones((k,), dtype=dtype), device_scalar(1e-5)]
        outs.append(launcher(dtype, n, k, gs, residual, glu, norm)(ins))
    mx.eval(outs)


def kernel_specs_for_check() -> list[KernelSpec]:
    out = []
    for spec in _specs().values():
        for dtype in ("bfloat16", "float16"):
            for k, gs, stages, warps in ((4096, 64, 8, 8), (14336, 32, 4, 16), (1024, 128, 12, 4)):
                tmpl = [("T", dtype), ("K", k), ("GS", gs), ("STAGES", stages), ("WARPS", warps)]
                name = f"{spec.name}_{dtype}_{k}_{gs}_{stages}"
                if spec.name.startswith("mb_qstream_i"):  # chunks a slot: 2 where K allows
                    cps = 2 if (k // 1024) % 2 == 0 else 1
                    tmpl += [("CPS", cps), ("EARLY", stages != 4)]
                    name += f"_c{cps}" + ("_e" if stages != 4 else "")
                out.append(for_dtype(spec, dtype, name, tmpl))
    return out
