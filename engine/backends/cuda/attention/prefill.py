"""Prompt (prefill) attention as one CUDA kernel: causal, any cached prefix, GQA.

Why: MLX 0.32.4's CUDA attention for many query rows is either cuDNN's, which builds
an execution graph per (query length, key length) and so cost every prompt length
not seen before 0.1-0.6 s of time to first token on the H200, or, with cuDNN off
(what ``markbase serve`` sets, engine/backends/cuda/setup.py), separate matmul / softmax /
matmul kernels that write the whole score matrix to memory: a 2048-token prefill of
the 1b model took 37 ms against PyTorch's 13 (bench/gpu/NOTES.md, session 5). This
kernel is FlashAttention-2's forward pass: scores stay in registers, an online
softmax per row, and the lengths are runtime values, so one compiled kernel serves
every prompt length and every prefix length (a chunk after a prefix-cache hit).

Layout: a block takes 64 query rows of one query head (4 warps, 16 rows each, as
``mma.sync.m16n8k16`` A fragments held in registers for the whole pass) and walks
the keys in tiles of 64 staged through shared memory (by default two buffers: the
next tile's ``cp.async`` copies run while this one is used; ``STAGES_ENV``). Per tile a warp computes its
16 x 64 scores on tensor cores, masks past its rows' causal limit (only on the tiles
that need it), rescales its running output, and multiplies the probabilities (kept
as bf16/fp16 in the registers the score accumulators left, as the next MMA's A
operand) by the V tile. Blocks that see the most keys are launched first.

Queries ``q`` [B, Hq, L, D] and the cache's ``keys``/``values`` [B, Hkv, S, D] with
S >= L (the last L keys are this chunk's: query row i sees keys ``<= S - L + i``),
any strides with a contiguous last dim. bf16 or fp16, D of 64 or 128. Only on a CUDA
GPU; ``bench/gpu/nvrtc_check.py`` compiles the source without one and
``tests/backends/cuda/test_gpu_prefill_attention.py`` checks it against MLX's attention on one.
``MARKBASE_GPU_PREFILL_ATTENTION=mlx`` turns it off (``=kernel``, the default, on).
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype

BLOCK_Q = 64  # query rows a block (16 a warp)
BLOCK_K = 64  # keys a tile
THREADS = BLOCK_Q // 16 * 32  # a warp a 16-row MMA tile of queries
HEAD_DIMS = (64, 128)
ENV = "MARKBASE_GPU_PREFILL_ATTENTION"
# 2: the next K/V tile is copied by cp.async while this one is used (2 buffers, 70 KB
# of shared memory at D 128); 1: loaded through registers between two barriers
STAGES_ENV = "MARKBASE_GPU_PREFILL_ATTN_STAGES"
# 1: K and V fragments by ldmatrix (one instruction feeds two MMAs; V transposed on
# the way); 0: 32-bit (K) and 16-bit (V) shared loads, two and four an MMA
LDM_ENV = "MARKBASE_GPU_PREFILL_ATTN_LDM"

_HEADER = r"""
__device__ __forceinline__ uint32_t mb_pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t mb_pack2(float lo, float hi, __half) {
  const __half2 r = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
// 16 bytes global -> shared without a register; zeros when !valid (src-size 0); the
// destination as a shared-space address (mb_cp16s) or a generic pointer (mb_cp16z)
__device__ __forceinline__ void mb_cp16s(uint32_t d, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void mb_cp16z(void* dst, const void* src, bool valid) {
  mb_cp16s(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, valid);
}
__device__ __forceinline__ void mb_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// until at most N of this thread's commit groups are still in flight (as gpu_qstream's)
template <int N>
__device__ __forceinline__ void mb_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// four 8x8 b16 matrices from shared memory; lane l gives row l % 8 of matrix l / 8,
// and gets in r[i] what an MMA fragment holds of matrix i (.trans: of its transpose)
__device__ __forceinline__ void mb_ldm4(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void mb_ldm4t(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
template <typename T>
__device__ __forceinline__ uint32_t mb_join2(T lo, T hi) {
  return static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&lo)) |
         (static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
}
"""

_SOURCE = r"""
  constexpr int BQ = 64;
  constexpr int BK = 64;          // keys a tile
  constexpr int RS = HD + 8;      // shared row stride (elements): spreads the banks
  constexpr int NT = BK / 8;      // score n-tiles a warp
  constexpr int KS = HD / 16;     // k-steps of q.k
  constexpr int DT = HD / 8;      // output n-tiles
  constexpr int CH = HD / 8;      // 16-byte chunks a row
  constexpr int TILE = BK * RS;
  // STAGES tiles of K, then STAGES of V (dynamic shared memory)
  extern __shared__ __align__(16) unsigned char mb_smem[];
  T* const ks0 = reinterpret_cast<T*>(mb_smem);
  T* const vs0 = ks0 + STAGES * TILE;

  const int lq = q_shape[2];
  const int s_len = keys_shape[2];
  const int n_q = q_shape[1];
  const int hq = blockIdx.y;
  const int b = blockIdx.z;
  const int hkv = hq / (n_q / keys_shape[1]);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int tg = lane % 4;
  // the blocks with the most keys to see start first
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int diag = s_len - lq;  // query row r sees keys <= diag + r
  const int r_lo = q0 + warp * 16;
  const bool rows_here = r_lo < lq;
  const int w_last = diag + min(lq - 1, r_lo + 15);  // this warp's last key
  const int last_key = diag + min(lq - 1, q0 + BQ - 1);
  const int ntiles = last_key / BK + 1;

  const T* kb = keys + b * keys_strides[0] + hkv * keys_strides[1];
  const T* vb = values + b * values_strides[0] + hkv * values_strides[1];
  const int64_t kst = keys_strides[2];
  const int64_t vst = values_strides[2];

  // the warp's 16 rows (clamped inside the array) as A fragments for every k-step
  uint32_t qf[KS][4];
  {
    const T* qb = q + b * q_strides[0] + hq * q_strides[1];
    const T* pa = qb + min(r_lo + g, lq - 1) * q_strides[2] + tg * 2;
    const T* pb = qb + min(r_lo + g + 8, lq - 1) * q_strides[2] + tg * 2;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      qf[kk][0] = *reinterpret_cast<const uint32_t*>(pa + kk * 16);
      qf[kk][1] = *reinterpret_cast<const uint32_t*>(pb + kk * 16);
      qf[kk][2] = *reinterpret_cast<const uint32_t*>(pa + kk * 16 + 8);
      qf[kk][3] = *reinterpret_cast<const uint32_t*>(pb + kk * 16 + 8);
    }
  }
  const float sl2 = scale[0] * 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of rows g and g + 8 (log2 units)
  float l0 = 0.f, l1 = 0.f;              // this lane's share of their sums
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

  // tile kt's K and V into stage st: cp.async (STAGES 2) or through registers
  auto load = [&](int kt, int st) {
    const int k0 = kt * BK;
    for (int i = threadIdx.x; i < BK * CH; i += blockDim.x) {
      const int r = i / CH, c = (i % CH) * 8;
      const bool in = k0 + r < s_len;
      const int64_t row = in ? k0 + r : 0;
      T* kd = ks0 + st * TILE + r * RS + c;
      T* vd = vs0 + st * TILE + r * RS + c;
      if constexpr (STAGES == 2) {
        mb_cp16z(kd, kb + row * kst + c, in);
        mb_cp16z(vd, vb + row * vst + c, in);
      } else {
        const uint4 z = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(kd) = in ? *reinterpret_cast<const uint4*>(kb + row * kst + c) : z;
        *reinterpret_cast<uint4*>(vd) = in ? *reinterpret_cast<const uint4*>(vb + row * vst + c) : z;
      }
    }
  };
  if constexpr (STAGES == 2) {
    load(0, 0);
    mb_commit();
  }
  for (int kt = 0; kt < ntiles; ++kt) {
    const int k0 = kt * BK;
    const int st = STAGES == 2 ? kt & 1 : 0;
    if constexpr (STAGES == 2) {
      if (kt + 1 < ntiles) load(kt + 1, st ^ 1);  // its stage was freed by the last barrier
      mb_commit();
      mb_wait<1>();  // tile kt has landed
    } else {
      load(kt, 0);
    }
    __syncthreads();
    const T* ks = ks0 + st * TILE;
    const T* vs = vs0 + st * TILE;
    if (rows_here && k0 <= w_last) {
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        if constexpr (LDM) {
          // matrices: keys j*8.. x dims kk*16 + 0, 8, 16, 24: b0, b1 of k-steps kk, kk+1
          const T* kr = ks + (j * 8 + (lane & 7)) * RS + (lane >> 3) * 8;
#pragma unroll
          for (int kk = 0; kk < KS; kk += 2) {
            uint32_t r[4];
            mb_ldm4(r, kr + kk * 16);
            mb_mma(s[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], r[0], r[1], T{});
            mb_mma(s[j], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3], r[2],
                   r[3], T{});
          }
        } else {
          const T* kr = ks + (j * 8 + g) * RS + tg * 2;
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + kk * 16);
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + kk * 16 + 8);
            mb_mma(s[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1, T{});
          }
        }
      }
      // scale (log2 units); the causal limit only where this tile crosses it
      const bool masked = k0 + BK - 1 > diag + r_lo;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[j][e] * sl2;
          if (masked) {
            const int key = k0 + j * 8 + tg * 2 + (e & 1);
            const int row = r_lo + g + (e >> 1) * 8;
            if (key > min(diag + row, s_len - 1)) v = -INFINITY;
          }
          s[j][e] = v;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      // key 0 is in every row's first tile, so the max is finite from there on
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
      const float z0 = n0 == -INFINITY ? 0.f : n0, z1 = n1 == -INFINITY ? 0.f : n1;
      const float a0 = exp2f(m0 - z0), a1 = exp2f(m1 - z1);
      m0 = n0;
      m1 = n1;
      l0 *= a0;
      l1 *= a1;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[d][0] *= a0;
        o[d][1] *= a0;
        o[d][2] *= a1;
        o[d][3] *= a1;
      }
      uint32_t pf[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float p0 = exp2f(s[j][0] - z0), p1 = exp2f(s[j][1] - z0);
        const float p2 = exp2f(s[j][2] - z1), p3 = exp2f(s[j][3] - z1);
        l0 += p0 + p1;
        l1 += p2 + p3;
        pf[j][0] = mb_pack2(p0, p1, T{});
        pf[j][1] = mb_pack2(p2, p3, T{});
      }
      // o += p v: the score tiles 2kk, 2kk + 1 are the A fragment of k-step kk
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t pa0 = pf[2 * kk][0], pa1 = pf[2 * kk][1];
        const uint32_t pa2 = pf[2 * kk + 1][0], pa3 = pf[2 * kk + 1][1];
        if constexpr (LDM) {
          // transposed matrices: keys kk*16 + 0, 8 x dims d*8, (d+1)*8: b0, b1 of d, d+1
          const T* vr = vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8;
#pragma unroll
          for (int d = 0; d < DT; d += 2) {
            uint32_t r[4];
            mb_ldm4t(r, vr + d * 8);
            mb_mma(o[d], pa0, pa1, pa2, pa3, r[0], r[1], T{});
            mb_mma(o[d + 1], pa0, pa1, pa2, pa3, r[2], r[3], T{});
          }
        } else {
          const T* vr = vs + (kk * 16 + tg * 2) * RS + g;
#pragma unroll
          for (int d = 0; d < DT; ++d) {
            const uint32_t b0 = mb_join2<T>(vr[d * 8], vr[d * 8 + RS]);
            const uint32_t b1 = mb_join2<T>(vr[d * 8 + 8 * RS], vr[d * 8 + 9 * RS]);
            mb_mma(o[d], pa0, pa1, pa2, pa3, b0, b1, T{});
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage
  }
  if (!rows_here) return;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float i0 = 1.f / l0, i1 = 1.f / l1;
  const int ra = r_lo + g, rb = r_lo + g + 8;
  T* ob = out + (static_cast<int64_t>(b) * n_q + hq) * lq * HD + tg * 2;
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    if (ra < lq)
      *reinterpret_cast<uint32_t*>(ob + ra * HD + d * 8) = mb_pack2(o[d][0] * i0, o[d][1] * i0, T{});
    if (rb < lq)
      *reinterpret_cast<uint32_t*>(ob + rb * HD + d * 8) = mb_pack2(o[d][2] * i1, o[d][3] * i1, T{});
  }
"""


@cache
def _specs() -> dict[str, KernelSpec]:
    from engine.backends.cuda.products.mma import _HEADER as MMA_HEADER

    inputs = [("q", "T", 4), ("keys", "T", 4), ("values", "T", 4), ("scale", "float32", 1)]
    return {
        "causal": KernelSpec(
            "mb_prefill_attn", inputs, [("out", "T")], _SOURCE, MMA_HEADER + _HEADER
        )
    }


_kernel = Baked(_specs, ensure_row_contiguous=False)


# on: its GPU tests pass on an H100 and alone it is 2.8-4.6x faster than MLX's
# attention in the same process (bench/gpu/NOTES.md, session 14)
DEFAULT = "kernel"


def enabled() -> bool:
    return envs.value(ENV) == "kernel"


def shape_supported(queries, keys, values, mask) -> bool:
    """Whether the kernel can compute this call: a causal prompt chunk (2+ query rows)
    of bf16/fp16, head dim 64 or 128, whole query groups per KV head."""
    import mlx.core as mx

    if not (isinstance(mask, str) and mask == "causal") or queries.ndim != 4:
        return False
    _, hq, lq, d = queries.shape
    if lq < 2 or d not in HEAD_DIMS or keys.ndim != 4 or keys.shape[3] != d:
        return False
    if keys.shape[0] != queries.shape[0] or keys.shape[2] < lq or hq % keys.shape[1]:
        return False
    if queries.dtype not in (mx.bfloat16, mx.float16):
        return False
    return (
        keys.dtype == queries.dtype
        and values.dtype == queries.dtype
        and (values.shape == keys.shape)
    )


def supported(queries, keys, values, mask) -> bool:
    """``shape_supported`` on a CUDA GPU, unless MARKBASE_GPU_PREFILL_ATTENTION=mlx
    (the shape first: every attention call of a model asks)."""

    if not shape_supported(queries, keys, values, mask) or not enabled():
        return False
    return platform.on_cuda()


def stages() -> int:
    return int(envs.value(STAGES_ENV))


def use_ldmatrix() -> bool:
    return envs.value(LDM_ENV)


def shared_bytes(head_dim: int, itemsize: int, n_stages: int) -> int:
    """Dynamic shared memory a block: K and V tiles, rows padded by 8 elements."""
    return 2 * n_stages * BLOCK_K * (head_dim + 8) * itemsize


def prefill_attention(queries, keys, values, scale: float):
    """softmax(q k^T * scale, causal with the keys' last L rows this chunk) v: [B, Hq, L, D]."""
    from engine.backends.cuda.products.mma import device_scalar

    b, hq, lq, d = queries.shape
    s = device_scalar(float(scale))  # not a [1] array: those sit in managed memory
    blocks = (lq + BLOCK_Q - 1) // BLOCK_Q
    n = stages()
    kern = _kernel(
        "causal",
        (("T", queries.dtype), ("HD", d), ("STAGES", n), ("LDM", use_ldmatrix())),
        shared_bytes(d, queries.dtype.size, n),
    )
    return kern(
        inputs=[queries, keys, values, s],
        grid=(blocks * THREADS, hq, b),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, hq, lq, d)],
        output_dtypes=[queries.dtype],
    )[0]


def kernel_specs_for_check() -> list[KernelSpec]:
    """The source with concrete template values (bench/gpu/nvrtc_check.py)."""
    spec = _specs()["causal"]
    return [
        for_dtype(
            spec,
            dtype,
            f"{spec.name}_{dtype}_{hd}_{n}_{int(ldm)}",
            [("T", dtype), ("HD", hd), ("STAGES", n), ("LDM", ldm)],
        )
        for dtype in ("bfloat16", "float16")
        for hd in HEAD_DIMS
        for n in (1, 2)
        for ldm in (False, True)
    ]
