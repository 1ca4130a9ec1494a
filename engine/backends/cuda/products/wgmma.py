"""4-bit products of 33-128 rows on Hopper's warpgroup MMA (``wgmma``), both operands
in shared memory.

Why: at 128 rows (the 8b 4-bit decode step at B=128) engine/backends/cuda/products/qgemm.py's products
run at ~175 TFLOP/s on an H100 and the step is level with compiled PyTorch in bf16
(bench/gpu/NOTES.md, session 21: gate/up 163 us a layer, down_proj 89, o_proj 37).
That kernel issues ``mma.sync`` from every warp and feeds it x fragments read from
shared memory by each warp: its ablations (session 19) found no single part binding,
the x copies, weight loads and fragment reads each costing a share. ``wgmma`` reads
both operands from shared memory by descriptor, one instruction a 64 x BN x 16 product
for a warpgroup of 4 warps, and runs asynchronously: the warps dequantize the next
step's weights while the tensor cores work on this one.

Layout: the product is ``y.T = W @ x.T``. A block takes 64 weight rows a warpgroup (4
warpgroups by default, ``warpgroups``) and BN x rows (64 or 128; rows past M are zeros)
in k-steps of 64 inputs. Each step, every thread loads one 16-byte run of 4-bit words (32 inputs of a
weight row) two steps ahead, dequantizes it (``mb_deq2``, gpu_mma's) and stores the
four 8-input runs where ``wgmma``'s canonical K-major layout without swizzle wants
them: a core matrix is 8 rows x 16 bytes, contiguous; the descriptor's leading offset
steps between core matrices along K (``ALBO``/``XLBO``: padded by PAD bytes, so that
the copies' shared-memory writes spread over the banks), its stride offset (128 bytes)
along the rows. x's 16-byte runs go to the same layout by ``cp.async``. GLU (w =
[gate; up]): a block's 16-row groups are 8 gate rows and their 8 up rows, so a lane
holds an output's gate and up sums (rows g and g + 8 of ``wgmma``'s accumulator
layout) and writes silu(gate) * up.

Three stages of dequantized weights and NX (3-5) of x: step i's buffers are
written after the barrier of step i - 1 + (stages - 2), when every warpgroup's
``wgmma.wait_group 1`` has retired the step that read them last. Writes by the
threads (``st.shared``, ``cp.async``) are made visible to ``wgmma``'s async proxy by
``fence.proxy.async`` before the barrier.

Split K: where the weight tiles fill too few of the GPU's block slots (o_proj and
down_proj of the 8b model: 32 tiles), ``S`` blocks take a share of each tile's k-steps
each; the last of a tile's blocks (a counter, zero between launches) sums the partials
in split order (deterministic) and writes the epilogue. The counters and partials are
gpu_qgemm's stream-K buffers.

Measured on an H200 (bench/gpu/NOTES.md, session 22): exact on small integers in every
form; against gpu_qgemm at 128 rows of the 8b model, with 4 warpgroups a block, gate/up
0.84x and the output layer 0.87x its time, but the split products (qkv, o_proj,
down_proj) 1.07-1.19x: so by default (``MARKBASE_GPU_WGMMA=auto``) the decode step
sends it only unsplit products of 65-128 rows (``unsplit``); the engine's 8b 4-bit
B=128 went 9,213 -> 9,774 and 10,138 tok/s. ``=1``: 33-128 rows; ``=0``: off. Needs
sm_90 (MLX's JIT compiles for sm_90a on a compute capability 9 device). The split form's
counters and partials are one set a thread: two split launches must not run at once
(the decode step's products depend on each other; tests evaluate each call alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import (
    Baked,
    KernelSpec,
    SpecsByKind,
    for_dtype,
    launch_bounds,
    one_output_call,
)

KS = 64  # inputs a k-step
A_STAGES = 3
MIN_SPLIT_STEPS = 4  # k-steps a split block takes at least
PAD = 16  # bytes between the K-columns of core matrices beyond 16 rows x 128 bytes


def _wgmma_asm(bn: int, ab: str) -> str:
    """``mb_wgmma`` for m64n{bn}k16 with ``ab`` (bf16/f16) operands, f32 accumulators."""
    nv = bn // 2
    regs = ",".join(f"%{i}" for i in range(nv))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nv))
    ctype = "__nv_bfloat16" if ab == "bf16" else "__half"
    return (
        f"__device__ __forceinline__ void mb_wgmma(float* d, uint64_t da, uint64_t db, {ctype}, "
        f"mb_n<{bn}>) {{\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nv + 2}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}.{ab} {{{regs}}}, %{nv}, %{nv + 1}, '
        f'p, 1, 1, 0, 0;\\n}}\\n"\n'
        f"      : {outs}\n"
        f'      : "l"(da), "l"(db), "r"(1));\n'
        "}\n"
    )


_HEADER_TOP = r"""
template <int BN> struct mb_n {};
__device__ __forceinline__ void mb_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void mb_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mb_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// the threads' st.shared / cp.async writes, seen by wgmma's async proxy
__device__ __forceinline__ void mb_fence_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mb_keep(float& v) { asm volatile("" : "+f"(v)::"memory"); }
__device__ __forceinline__ void mb_st16(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
}
// a shared-memory matrix descriptor: start address, leading (K) and stride (rows)
// byte offsets, no swizzle
__device__ __forceinline__ uint64_t mb_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32);
}
struct MbWq {
  uint4 q;
  uint32_t s2, b2;
};
"""


def _header() -> str:
    from engine.backends.cuda.attention.decode import LAST_BLOCK
    from engine.backends.cuda.attention.prefill import _HEADER as CP_HEADER
    from engine.backends.cuda.products.mma import _HEADER as MMA_HEADER
    from engine.backends.cuda.products.qgemm import PAIR

    asm = "".join(_wgmma_asm(bn, ab) for bn in (64, 128) for ab in ("bf16", "f16"))
    return MMA_HEADER + CP_HEADER + PAIR + LAST_BLOCK + _HEADER_TOP + asm


_SOURCE = r"""
  constexpr int RB = 64 * WGS;                 // weight rows a block: a warpgroup's 64 each
  constexpr int NT = 128 * WGS;                // threads
  constexpr int NA = 3;                        // stages of dequantized weights
  constexpr int ALBO = RB / 8 * 128 + PADB;    // bytes between A's 8-input core columns
  constexpr int XLBO = BN / 8 * 128 + PADB;
  constexpr int ASZ = 8 * ALBO;                // a stage: 64 inputs
  constexpr int XSZ = 8 * XLBO;
  constexpr int NV = BN / 2;                   // accumulators a thread
  constexpr int XIT = BN * 8 / NT;             // x copies a thread a step
  constexpr int LEAD = NX - 2;                 // steps x is copied ahead
  extern __shared__ __align__(128) unsigned char mb_smem[];
  const uint32_t abase = static_cast<uint32_t>(__cvta_generic_to_shared(mb_smem));
  const uint32_t xbase = abase + NA * ASZ;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;     // warpgroup (64 rows); warp in it (16)
  const int g = lane >> 2, t = lane & 3;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NW = w_shape[0];
  const int N = GLU ? NW / 2 : NW;
  const int words = K / 8;
  const int groups = K / GS;
  const int steps = K / 64;
  const int TC = GLU ? N / (RB / 2) : NW / RB; // weight tiles
  const int RC = (M + BN - 1) / BN;            // row chunks
  const int tiles = TC * RC;
  const int S = gridDim.x / tiles;             // k-splits
  const int tl = blockIdx.x % tiles;           // a tile's row chunks are neighbours
  const int sp = blockIdx.x / tiles;
  const int tc = tl / RC;
  const int m0 = (tl % RC) * BN;
  const int k0 = steps * sp / S, k1 = steps * (sp + 1) / S;
  const int n_steps = k1 - k0;

  // this thread's weight run: tile row r, inputs 32h..32h+31 of a step
  const int r = tid >> 1, h = tid & 1;
  int wr;
  if constexpr (GLU) {
    const int o = tc * (RB / 2) + (r >> 4) * 8 + (r & 7);
    wr = (r & 8) ? N + o : o;
  } else {
    wr = tc * RB + r;
  }
  const uint32_t* wp = w + (int64_t)wr * words + h * 4;
  const T* scp = scales + (int64_t)wr * groups;
  const T* bip = biases + (int64_t)wr * groups;
  auto wload = [&](int ks) {
    MbWq v;
    v.q = mb_ldg(wp + ks * 8);
    const int gi = (ks * 64 + h * 32) / GS;
    v.s2 = mb_pair(scp[gi]);
    v.b2 = mb_pair(bip[gi]);
    return v;
  };
  // its four 8-input runs: core column 4h + j, row r
  const uint32_t adst = abase + 4 * h * ALBO + (r >> 3) * 128 + (r & 7) * 16;
  auto deq = [&](const MbWq& v, int st) {
    const uint32_t words4[4] = {v.q.x, v.q.y, v.q.z, v.q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t u = words4[j];
      uint4 o;
      o.x = mb_deq2(u, v.s2, v.b2, T{});
      o.y = mb_deq2(u >> 8, v.s2, v.b2, T{});
      o.z = mb_deq2(u >> 16, v.s2, v.b2, T{});
      o.w = mb_deq2(u >> 24, v.s2, v.b2, T{});
      mb_st16(adst + st * ASZ + j * ALBO, o);
    }
  };
  // x's copies: unit it * NT + tid = row n (unit / 8), inputs 8 kc.. (kc = unit % 8)
  const int kc = tid & 7;
  auto stage_x = [&](int ks, int st) {
#pragma unroll
    for (int it = 0; it < XIT; ++it) {
      const int n = it * (NT / 8) + (tid >> 3);
      const bool ok = m0 + n < M;
      const T* src = ok ? x + (int64_t)(m0 + n) * K + ks * 64 + kc * 8 : x;
      mb_cp16s(xbase + st * XSZ + kc * XLBO + (n >> 3) * 128 + (n & 7) * 16, src, ok);
    }
  };
  // leading offset: between core columns (K); stride: between 8-row groups (the H200
  // gave exact products with this reading and an illegal address with the other)
  const uint64_t da0 = mb_desc(abase + wg * 8 * 128, ALBO, 128);
  const uint64_t dx0 = mb_desc(xbase, XLBO, 128);

  float d[NV];
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    d[v] = 0.f;
  }
  if (n_steps > 0) {
    stage_x(k0, 0);
    mb_commit();
#pragma unroll
    for (int p = 1; p < LEAD; ++p) {  // steps 1 .. LEAD - 1, one commit group each
      if (p < n_steps) {
        stage_x(k0 + p, p);
      }
      mb_commit();
    }
    MbWq p1 = wload(k0), p2 = p1;
    deq(p1, 0);
    if (n_steps > 1) {
      p1 = wload(k0 + 1);
    }
    if constexpr (!WEARLY) {
      if (n_steps > 2) {
        p2 = wload(k0 + 2);
      }
    }
    for (int i = 0; i < n_steps; ++i) {
      mb_wait<LEAD - 1>();  // this thread's copies of step i are in
      mb_fence_async();
      __syncthreads();      // everyone's, and the dequantized weights of step i
      const int sa = i % NA, sx = i % NX;
      mb_wg_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        mb_wgmma(d, da0 + ((sa * ASZ + 2 * s * ALBO) >> 4), dx0 + ((sx * XSZ + 2 * s * XLBO) >> 4),
                 T{}, mb_n<BN>{});
      }
      mb_wg_commit();
      // WEARLY: step i + 2's weights now, so that their loads fly during the copies,
      // the dequantization and the wait below: the fence at the loop's top compiles to
      // MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (SASS), which may hold each thread until its
      // loads in flight are in, so loads issued at the end of a step are waited for
      // almost at once
      if constexpr (WEARLY) {
        if (i + 2 < n_steps) {
          p2 = wload(k0 + i + 2);
        }
      }
      // while the tensor cores run step i: step i + LEAD's x, step i + 1's weights
      if (i + LEAD < n_steps) {
        stage_x(k0 + i + LEAD, (i + LEAD) % NX);
      }
      mb_commit();
      if (i + 1 < n_steps) {
        deq(p1, (i + 1) % NA);
        p1 = p2;
        if constexpr (!WEARLY) {
          if (i + 3 < n_steps) {
            p2 = wload(k0 + i + 3);
          }
        }
      }
      mb_wg_wait<1>();  // step i - 1 is done: its buffers are free after the next barrier
    }
    mb_wg_wait<0>();
  }
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    mb_keep(d[v]);
  }

  if constexpr (SPLIT) {
    if (S > 1) {
      // this split's sums, value-major; the last of the tile's S blocks adds them all
      // in split order
      float* mine = const_cast<float*>(wsp) + (int64_t)blockIdx.x * NV * NT + tid;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        mine[v * NT] = d[v];
      }
      if (!mb_last_of(const_cast<int*>(cnt) + tl, S)) {
        return;
      }
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        d[v] = 0.f;
      }
      for (int s2 = 0; s2 < S; ++s2) {
        const float* part = wsp + (int64_t)(s2 * tiles + tl) * NV * NT + tid;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          d[v] += __ldcg(part + v * NT);
        }
      }
    }
  }

  // accumulator layout: warp wq of the warpgroup holds its rows 16 wq + g (d[4j], d[4j+1])
  // and 16 wq + g + 8 (d[4j+2], d[4j+3]), x rows 8j + 2t and 8j + 2t + 1
  const int R0 = wg * 64 + wq * 16 + g;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = m0 + j * 8 + 2 * t + e;
      if (m < M) {
        if constexpr (GLU) {
          const int o = tc * (RB / 2) + (wg * 4 + wq) * 8 + g;
          const float gs = d[4 * j + e], us = d[4 * j + 2 + e];
          y[(int64_t)m * N + o] = static_cast<T>(gs / (1.f + __expf(-gs)) * us);
        } else {
          const int row0 = tc * RB + R0, row1 = row0 + 8;
          float v0 = d[4 * j + e], v1 = d[4 * j + 2 + e];
          if constexpr (RES) {
            v0 += static_cast<float>(r_in[(int64_t)m * N + row0]);
            v1 += static_cast<float>(r_in[(int64_t)m * N + row1]);
          }
          y[(int64_t)m * N + row0] = static_cast<T>(v0);
          y[(int64_t)m * N + row1] = static_cast<T>(v1);
        }
      }
    }
  }
"""


@cache
def _spec(kind: str) -> KernelSpec:
    """Kinds ``q4``, ``q4_res`` (a residual ``r_in`` [M, N] added), ``q4_glu`` (w =
    [gate; up], the output silu(gate) * up); a suffix ``_sp``: the split-K form (tile
    counters ``cnt`` and partials ``wsp`` as inputs); ``_lbTxB``: compiled for B blocks
    of T threads an SM (gpu_qgemm's header trick: MLX writes the signature)."""
    from engine.backends.cuda.products.qgemm import product_kind

    base, split, bounds, inputs, flags = product_kind(kind, "_sp", "SPLIT", "r_in")
    header = _header() + launch_bounds(bounds)
    return KernelSpec(
        "mb_wgmma" + base[2:] + ("_sp" if split else "") + (f"_lb{bounds}" if bounds else ""),
        inputs,
        [("y", "T")],
        flags + _SOURCE,
        header,
    )


_kernel = Baked(lambda: SpecsByKind(_spec), ensure_row_contiguous=True)

ENV = "MARKBASE_GPU_WGMMA"
NX_ENV = "MARKBASE_GPU_WGMMA_NX"
WG_ENV = "MARKBASE_GPU_WGMMA_WG"
WEARLY_ENV = "MARKBASE_GPU_WGMMA_WEARLY"


def mode() -> str:
    """``MARKBASE_GPU_WGMMA``: ``auto`` (default) the unsplit products of AUTO_MIN_ROWS-128
    rows, where it was measured faster; ``1`` those of 33-128 rows; ``0`` off."""
    return envs.value(ENV)


def enabled() -> bool:
    """On (``mode``) and an sm_90 GPU (``hopper``)."""
    return mode() != "0" and hopper()


def hopper() -> bool:
    """Whether MLX's GPU is compute capability 9.x (wgmma; MLX compiles for sm_90a)."""
    if not _hopper:
        arch = platform.compute_capability()
        if arch is not None:
            ok = arch[0] == 9
        else:  # an MLX without the keys: by name
            name = platform.device_name()
            ok = any(n in name for n in ("H100", "H200", "H800", "H20", "GH200"))
        _hopper.append(ok)
    return _hopper[0]


_hopper: list = []


def x_stages() -> int:
    """Buffers of x (``MARKBASE_GPU_WGMMA_NX``): 4 (default, copied two steps ahead), 3
    (one step ahead) or 5. H100, 8b at 128 rows with the early weight loads
    (``weights_early``), us: gate/up 136.4 with 3, 123.9 with 4; output layer 535.6 /
    489.2 (session 24); without them 4 was no better than 3 (session 23) and 5 is slower
    (181 KB of shared memory)."""
    return int(envs.value(NX_ENV))


def warpgroups() -> int:
    """Warpgroups a block (``MARKBASE_GPU_WGMMA_WG``): 4 (default: 256 weight rows, one
    block an SM, x read from L2 half as often a weight row) or 2 (128 weight rows, two
    blocks an SM). H200, 8b at 128 rows, against gpu_qgemm's time (session 22): gate/up
    0.84x with 4, 1.11x with 2; output layer 0.87x / 1.24x."""
    return int(envs.value(WG_ENV))


def supported(x_dtype, n: int, k: int, bits: int, group_size: int, mode: str, biases) -> bool:
    """gpu_gemv's 4-bit conditions, groups of 32/64/128, K a multiple of 64, and whole
    tiles of two warpgroups: N a multiple of 128 (GLU: 64 outputs a tile)."""
    from engine.backends.cuda.products import gemv as gpu_gemv

    return (
        gpu_gemv.quant_supported(x_dtype, n, k, bits, group_size, mode, biases)
        and group_size in (32, 64, 128)
        and k % KS == 0
        and n % 128 == 0
    )


MIN_ROWS = 33
AUTO_MIN_ROWS = 65  # 128-row blocks: the form measured (8b at 128 rows, session 22)
MAX_ROWS = 128


def takes(rows: int, n: int, k: int) -> bool:
    """Whether the decode step sends this product (``rows`` x [n, k], a shape
    ``supported`` takes) here rather than to gpu_qgemm: on, AUTO_MIN_ROWS-128 rows
    (33-128 with ``=1``), and a launch without k-splits (``unsplit``). The split form
    is for benchmarks and tests: it measured slower, and the step never runs it."""
    low = MIN_ROWS if mode() == "1" else AUTO_MIN_ROWS
    return low <= rows <= MAX_ROWS and enabled() and unsplit(rows, n, k)


@dataclass(frozen=True)
class Geometry:
    """A launch's shape: x rows a block (``bn``: the wgmma's N), x buffers, warpgroups."""

    bn: int
    nx: int
    wgs: int

    @property
    def rows(self) -> int:  # weight rows a block
        return 64 * self.wgs

    @property
    def threads(self) -> int:
        return 128 * self.wgs

    @property
    def shared_bytes(self) -> int:
        return A_STAGES * 8 * (self.rows // 8 * 128 + PAD) + self.nx * 8 * (
            self.bn // 8 * 128 + PAD
        )

    @property
    def per_sm(self) -> int:
        """Blocks an SM holds: two of two warpgroups where their shared memory fits
        (228 KB an SM, ~1 KB reserved a block; 128 registers a thread, as compiled)."""
        fits = 2 * (self.shared_bytes + 1024) <= 228 * 1024
        return 2 if self.wgs == 2 and fits else 1

    @property
    def values(self) -> int:  # accumulators a block
        return self.bn // 2 * self.threads


def geometry(rows: int, n: int) -> Geometry:
    """64 x rows a block up to 64 rows (m64n64k16), else 128; ``warpgroups`` where the
    weight rows split into them, else 2."""
    wgs = warpgroups()
    if n % (64 * wgs):
        wgs = 2
    return Geometry(64 if rows <= 64 else 128, x_stages(), wgs)


def splits(tiles: int, steps: int, slots: int, values: int, room: int) -> int:
    """k-splits of a launch: as many as fill the block slots (``slots // tiles``), each
    MIN_SPLIT_STEPS k-steps at least, and partials (``values`` floats a block) that fit
    ``room`` floats."""
    s = max(1, min(slots // max(tiles, 1), steps // MIN_SPLIT_STEPS))
    while s > 1 and tiles * s * values > room:
        s -= 1
    return s


def _plan(rows: int, n: int, k: int) -> tuple[Geometry, int, int]:
    """(geometry, tiles, k-splits) of a launch."""
    from engine.backends.cuda.products import qgemm as gpu_qgemm

    geo = geometry(rows, n)
    tiles = n // geo.rows * -(-rows // geo.bn)
    slots = gpu_qgemm.sms() * geo.per_sm
    return geo, tiles, splits(tiles, k // KS, slots, geo.values, gpu_qgemm.partials_size())


def unsplit(rows: int, n: int, k: int) -> bool:
    """Whether the launch needs no k-splits: the products where it measured faster (the
    H200, session 22: 8b gate/up and output layer at 128 rows, 4 warpgroups, 0.84x /
    0.87x gpu_qgemm's time; the split o_proj, down_proj and qkv 1.07-1.19x slower)."""
    return _plan(rows, n, k)[2] == 1


@cache
def _template(dtype, gs: int, bn: int, nx: int, wgs: int, wearly: bool = False) -> tuple:
    return (
        ("T", dtype), ("GS", gs), ("BN", bn), ("NX", nx), ("WGS", wgs), ("PADB", PAD),
        ("WEARLY", wearly),
    )  # fmt: skip


def weights_early() -> bool:
    """``MARKBASE_GPU_WGMMA_WEARLY`` (default 1; 0 turns it off): each k-step's weight
    loads issued right after its wgmma, two steps ahead, instead of at its end, three
    ahead. Why (session 23, from the SASS): the fence before each step's barrier
    compiles to ``MEMBAR.ALL.CTA``, which waits for the thread's global loads in flight,
    so loads issued just before it made every k-step wait out an HBM round trip.
    Measured (H100, session 24, 8b at 128 rows): gate/up 142.5 -> 136.4 us (123.9 with
    4 x buffers), output layer 547.8 -> 535.6 (489.2); the whole B=128 step's GPU time
    14.07 -> 13.53 ms with both."""
    return envs.value(WEARLY_ENV)


def launcher(dtype, rows: int, n: int, k: int, gs: int, residual: bool = False, glu: bool = False):
    """``call(inputs) -> y`` for x [rows, k] and a 4-bit weight of ``n`` rows; inputs:
    x, weight, scales, biases, then the residual (``residual``)."""
    from engine.backends.cuda.products import qgemm as gpu_qgemm

    if glu and residual:
        raise ValueError("gpu_wgmma: glu and residual together are not a kernel")
    geo, tiles, s = _plan(rows, n, k)
    kind = "q4_glu" if glu else "q4_res" if residual else "q4"
    if s > 1:
        kind += "_sp"
    kind += f"_lb{geo.threads}x{geo.per_sm}"
    template = _template(dtype, gs, geo.bn, geo.nx, geo.wgs, weights_early())
    fn = _kernel(kind, template, geo.shared_bytes)
    shape = (rows, n // 2 if glu else n)
    grid = (tiles * s * geo.threads, 1, 1)
    run = one_output_call(fn, grid, (geo.threads, 1, 1), shape, dtype)
    if s == 1:
        return run
    extra = list(gpu_qgemm.stream_k_buffers())
    return lambda inputs: run([*inputs, *extra])


def quantized_matmul(x, w, scales, biases, group_size: int, residual=None, glu: bool = False):
    """``x @ dequantize(w).T`` for x [M, K] and a 4-bit affine ``w`` [N, K/8];
    ``residual`` [M, N] added, or with ``glu`` (w = [gate; up]) silu(gate) * up."""
    n, k = w.shape[0], w.shape[1] * 8
    run = launcher(x.dtype, x.shape[0], n, k, group_size, residual is not None, glu)
    inputs = [x, w, scales, biases] + ([residual] if residual is not None else [])
    return run(inputs)


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call: ``products`` = (group size,
    K, N, residual, glu); one launch of each geometry of the rows ``takes``, on zeros."""
    import mlx.core as mx

    for gs, k, n, residual, glu in sorted(set(products)):
        if not supported(dtype, n, k, 4, gs, "affine", True):
            continue
        sc = mx.ones((n, k // gs), dtype=dtype)
        wq = mx.zeros((n, k // 8), dtype=mx.uint32)
        seen = set()
        for rows in range(MIN_ROWS, MAX_ROWS + 1):
            if not takes(rows, n, k) or geometry(rows, n) in seen:
                continue
            seen.add(geometry(rows, n))
            ins = [mx.zeros((rows, k), dtype=dtype), wq, sc, sc]
            if residual:
                ins.append(mx.zeros((rows, n), dtype=dtype))
            # one at a time: a split launch's counters and partials are shared
            mx.eval(launcher(dtype, rows, n, k, gs, residual, glu)(ins))


def kernel_specs_for_check() -> list[KernelSpec]:
    """Every form with concrete template values (bench/gpu/nvrtc_check.py)."""
    out = []
    geos = [Geometry(128, 3, 2), Geometry(64, 3, 2), Geometry(128, 4, 2), Geometry(128, 3, 4),
            Geometry(64, 3, 4), Geometry(128, 4, 4), Geometry(128, 5, 4)]  # fmt: skip
    for base in ("q4", "q4_res", "q4_glu"):
        for split in (False, True):
            for dtype in ("bfloat16", "float16"):
                for geo in geos:
                    kind = base + ("_sp" if split else "") + f"_lb{geo.threads}x{geo.per_sm}"
                    spec = _spec(kind)
                    for wearly in (False, True):  # WEARLY is the default at every geometry
                        tmpl = list(_template(dtype, 64, geo.bn, geo.nx, geo.wgs, wearly))
                        name = f"{spec.name}_{dtype}_{geo.bn}_{geo.nx}_{geo.wgs}"
                        name += "_we" if wearly else ""
                        out.append(for_dtype(spec, dtype, name, tmpl))
    return out
