"""4-bit products of one row (the single-stream decode step), streamed through shared
memory by ``cp.async``: engine/gpu_mma.py's kernel with another way to keep loads in
flight.

Why: at 8b 4-bit B=1 the products are ~2.4 ms of a ~3.5 ms step and read their weights
at 1.5-1.8 TB/s on the H200, where a copy reaches 2.5 (MLX) to 4.3 TB/s (PyTorch)
(bench/gpu/NOTES.md, sessions 8-9). The tensor-core kernel holds a lane's in-flight
loads in registers, so more loads in flight cost occupancy, and its blocks are short
(16 rows, then a reduction through shared memory): session 9 measured more loads a
lane (``PIN``) slower. Here a lane's loads go to its own ring of ``S`` 16-byte slots
in shared memory (``cp.async``: no register holds a load in flight), a warp owns whole
output rows and walks them to the end, and there is no block-wide step after the
prologue: with 8 warps a block and 2-3 blocks an SM, 50-100 KB of weight are in
flight on each SM.

Layout: the block first copies x into shared memory as float32 (its 16-byte quarters
swizzled by the chunk, so that the 8 lanes of a load phase hit 8 bank groups) and
the sum of each 32-input chunk (for the groups' biases). Warp ``gw`` of ``TW`` takes
outputs ``gw, gw + TW, ...``; an output is one weight row (two with the SwiGLU: gate
row ``o`` and up row ``o + N``); lane ``l`` takes the row's 32-input chunks ``l, l + 32,
...`` (16 bytes of weight each, inside one quantization group). 4-bit values become
floats with the exponent trick on their place in the word (``(w & 0xF << 4k) |
0x4B000000`` is 2^23 + q * 16^k, exact), one accumulator per k, so a value costs a
LOP3, an FADD and an FFMA; a chunk adds ``s * dot + b * sum(x)``. The row's sum is a
warp shuffle; lane 0 writes it (plus the residual, or the SwiGLU of gate and up).

All math is float32 on the exact 4-bit values (the dequantized weight is never
rounded to bf16). Limits (``supported``): bf16/fp16 x of one row, 4-bit affine with
biases, group size 32/64/128, K a multiple of 1024 (whole chunks for every lane) and
at most 16384 (x in shared memory). ``bench/gpu/nvrtc_check.py`` compiles the source
without a GPU; ``tests/test_gpu_qstream.py`` checks it against MLX on one.
"""

from __future__ import annotations

from functools import cache

from engine.cuda_kernels import KernelSpec, bake

WARPS = 8
STAGES = 8  # a lane's slots: STAGES - 1 chunks in flight while it computes one
SMS = 132  # H100/H200: sets the grid (warps enough for every SM, not more)
SMEM_PER_SM = 227 * 1024  # what an H100/H200 SM gives blocks (KB), for the grid size
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
// one of the two 16-bit values of a word (hi: the upper) as float
__device__ __forceinline__ float mb_half_of(uint32_t v, bool hi, __nv_bfloat16) {
  return __uint_as_float(hi ? (v & 0xffff0000u) : (v << 16));
}
__device__ __forceinline__ float mb_half_of(uint32_t v, bool hi, __half) {
  const uint16_t h = static_cast<uint16_t>(hi ? (v >> 16) : (v & 0xffffu));
  return __half2float(*reinterpret_cast<const __half*>(&h));
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
#pragma unroll
  for (int p = 0; p < STAGES - 1; ++p) {
    if (p < total) {
      issue(p);
    }
    mb_commit();
  }
  int c_o = gw, c_rr = 0, c_j = 0;  // the chunk to compute
  float acc = 0.f, gate = 0.f;
  for (int q = 0; q < total; ++q) {
    // chunk q + STAGES - 1 into the slot chunk q - 1 left (read last iteration)
    if (q + STAGES - 1 < total) {
      issue(q + STAGES - 1);
    }
    mb_commit();
    mb_wait<STAGES - 1>();  // chunk q's group is complete
    const int s = q % STAGES;
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
  }
"""


def _specs() -> dict[str, KernelSpec]:
    """``q4``, ``q4_res`` (a residual ``r`` [1, N] added: o_proj/down_proj) and
    ``q4_glu`` (w = [gate; up], output silu(gate) * up, [1, N/2]: gate_up)."""
    inputs = [("x", "T", 2), ("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)]
    out = {}
    for suffix, glu, res in (("", False, False), ("_res", False, True), ("_glu", True, False)):
        flags = f"  constexpr bool GLU = {'true' if glu else 'false'};\n"
        flags += f"  constexpr bool RES = {'true' if res else 'false'};\n"
        if not res:
            flags += "  const T* r = nullptr;\n"
        extra = [("r", "T", 2)] if res else []
        out["q4" + suffix] = KernelSpec(
            "mb_qstream" + suffix, inputs + extra, [("y", "T")], flags + _BODY, _HEADER
        )
    return out


def smem_bytes(k: int, stages: int = STAGES, warps: int = WARPS) -> int:
    """Dynamic shared memory a block needs: x (float32), chunk sums, the lanes' slots."""
    return (k // 32) * (9 * 16 + 4) + stages * warps * 32 * (16 + 4 + 4)


_kernels: dict = {}


def _kernel(kind: str, template: tuple, smem: int):
    """One kernel object per (kind, template) with its dynamic shared memory (MLX takes
    that when the object is made, so it cannot go through engine/cuda_kernels.Baked)."""
    key = (kind, template)
    fn = _kernels.get(key)
    if fn is None:
        import mlx.core as mx

        spec = bake(_specs()[kind], template)
        fn = _kernels[key] = mx.fast.cuda_kernel(
            name=spec.name,
            input_names=[n for n, _, _ in spec.inputs],
            output_names=[n for n, _ in spec.outputs],
            source=spec.source,
            header=spec.header,
            ensure_row_contiguous=True,
            shared_memory=smem,
        )
    return fn


def supported(x_dtype, rows: int, n: int, k: int, bits: int, group_size: int, mode, biases):
    import mlx.core as mx

    return (
        mx.cuda.is_available()
        and rows == 1
        and x_dtype in (mx.bfloat16, mx.float16)
        and bits == 4
        and mode == "affine"
        and biases is not None
        and group_size in (32, 64, 128)
        and k % 1024 == 0
        and 0 < k <= MAX_K
        and n > 0
    )


_knobs: dict = {}


def set_knobs(stages: int | None = None, warps: int | None = None) -> None:
    """Launchers made from now on use ``stages``/``warps`` (None: the defaults);
    bench/gpu/q4_bench.py's variants."""
    _knobs.clear()
    _knobs.update({k: v for k, v in (("stages", stages), ("warps", warps)) if v is not None})


@cache
def _grid_blocks(n_out: int, k: int, stages: int, warps: int) -> int:
    """Blocks: as many warps as the SMs hold at once (shared memory bounds the blocks
    an SM), then no more than the outputs need with every warp taking the same count."""
    per_sm = max(1, min(2048 // (warps * 32), SMEM_PER_SM // (smem_bytes(k, stages, warps) + 1024)))
    max_warps = SMS * per_sm * warps
    per_warp = -(-n_out // max_warps)
    want_warps = -(-n_out // per_warp)
    return -(-want_warps // warps)


def warps_for(k: int) -> int:
    """Warps a block: x takes ~4.6 bytes of shared memory an input, so from K > 8192 a
    block of 8 warps would leave one block (8 warps) an SM: 16 warps a block then."""
    return _knobs.get("warps", WARPS if k <= 8192 else 2 * WARPS)


def launcher(dtype, n: int, k: int, gs: int, residual: bool = False, glu: bool = False):
    """``call(inputs) -> y`` [1, N] (``glu``: [1, N/2]) for x [1, K] and a 4-bit weight of
    ``n`` rows; ``inputs``: x, w, scales, biases, then the residual (``residual``)."""
    if glu and residual:
        raise ValueError("gpu_qstream: glu and residual together are not a kernel")
    stages = _knobs.get("stages", STAGES)
    warps = warps_for(k)
    kind = "q4" + ("_glu" if glu else "_res" if residual else "")
    template = (("T", dtype), ("K", k), ("GS", gs), ("STAGES", stages), ("WARPS", warps))
    fn = _kernel(kind, template, smem_bytes(k, stages, warps))
    n_out = n // 2 if glu else n
    blocks = _grid_blocks(n_out, k, stages, warps)
    grid = (blocks * warps * 32, 1, 1)
    threadgroup = (warps * 32, 1, 1)
    shapes = [(1, n_out)]
    dtypes = [dtype]

    def call(inputs):
        return fn(
            inputs=inputs,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )[0]

    return call


def quantized_matmul(x, w, scales, biases, group_size: int, residual=None, glu: bool = False):
    """``x @ dequantize(w).T`` for one row x [1, K] and a 4-bit affine ``w`` [N, K/8];
    ``residual`` [1, N] added; ``glu``: w = [gate; up], the result silu(gate) * up."""
    n, k = w.shape[0], w.shape[1] * 8
    inputs = [x, w, scales, biases] + ([residual] if residual is not None else [])
    return launcher(x.dtype, n, k, group_size, residual is not None, glu)(inputs)


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call: ``products`` = (group size,
    K, residual, glu) per kind of 1-row product (NVRTC ~1 s each; MLX keeps the PTX on
    disk)."""
    import mlx.core as mx

    outs = []
    for gs, k, residual, glu in sorted(set(products)):
        n = 2 if glu else 1
        s = mx.ones((n, k // gs), dtype=dtype)
        ins = [mx.zeros((1, k), dtype=dtype), mx.zeros((n, k // 8), dtype=mx.uint32), s, s]
        if residual:
            ins.append(mx.zeros((1, n), dtype=dtype))
        outs.append(launcher(dtype, n, k, gs, residual, glu)(ins))
    mx.eval(outs)


def kernel_specs_for_check() -> list[KernelSpec]:
    out = []
    for spec in _specs().values():
        for dtype in ("bfloat16", "float16"):
            for k, gs, stages, warps in ((4096, 64, 8, 8), (14336, 32, 8, 16), (1024, 128, 12, 4)):
                tmpl = [("T", dtype), ("K", k), ("GS", gs), ("STAGES", stages), ("WARPS", warps)]
                ins = [(n, dtype if t == "T" else t, nd) for n, t, nd in spec.inputs]
                outs = [(n, dtype if t == "T" else t) for n, t in spec.outputs]
                out.append(
                    KernelSpec(
                        f"{spec.name}_{dtype}_{k}_{gs}_{stages}",
                        ins,
                        outs,
                        spec.source,
                        spec.header,
                        tmpl,
                    )
                )
    return out
