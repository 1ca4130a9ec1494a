"""Decode attention with RoPE and the KV append on tensor cores, one warp a (row, KV head).

Why: engine/backends/cuda/attention/decode.py's kernel works on CUDA cores: per position a warp takes
G dot products of head_dim values, reduced across its lanes by 5 shuffles each, and
G weighted sums. With many rows that is instruction-bound, not bandwidth-bound: at the
8b model's B=128 (H100, session 17) it took 163 us a layer for ~300 MB of KV (1.8 TB/s,
5.2 ms of the 19.8 ms 4-bit step), at the 1b's 142 us for ~150 MB (1.0 TB/s, a third of
the step). Here the G query heads of a KV head are the rows of an ``mma.sync.m16n8k16``
A fragment (rows G..15 zero), and a warp walks its row's keys in tiles of BK: the K and
V tiles come into shared memory by ``cp.async`` (the next tile's copy runs while this
one is used), ``ldmatrix`` gives the MMA fragments (V transposed on the way), and the
online softmax works on the score accumulators as engine/backends/cuda/attention/prefill.py's
(GPU-tested) prompt kernel does: the scores of a 16-key step become the A fragment of
the P.V product in registers. Per 16 keys a warp issues ~2 ldmatrix and ~4 MMAs a
16 dims instead of ~1,000 CUDA-core instructions.

The append form as engine/backends/cuda/attention/decode.py's: q and the new k get RoPE here (the same
formula, rounded to T as MLX's rope writes it), the new k and v go into the cache
buffers at slot t_len - 1, and the tile holding that slot takes them from shared memory
(not from the buffer being written). No splits over time: one warp a (row, KV head),
so it is for launches with enough rows to fill the GPU (engine/backends/cuda/attention/decode.py uses
it where its own launch would not split, unless ``MARKBASE_GPU_ATTN_TC=0`` or a fixed
loop shape without ``c``). The split form (``SPLIT``; off with
``MARKBASE_GPU_ATTN_TC_SPLIT=0`` or a fixed shape without ``s``) is for few rows: one
block a (row, KV head), its warps taking every WARPS-th tile, merged through shared
memory at the end; no partials through global memory, no counters, no last-block
merge (the one-row attention of the 8b model takes 20.5 us a call on CUDA cores, 22% of
the 4-bit step, for 2.4 MB). The first tiles' copies are issued before the RoPE is
computed. bf16/fp16, head_dim 64 or 128, at most
8 query heads a KV head.
Only on a CUDA GPU; ``bench/gpu/nvrtc_check.py`` compiles it without one.
"""

from __future__ import annotations

from functools import cache

from engine import envs
from engine.backends.cuda.attention.common import APPEND_INPUTS
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype

ENV = "MARKBASE_GPU_ATTN_TC"
SPLIT_ENV = "MARKBASE_GPU_ATTN_TC_SPLIT"
WARPS_ENV = "MARKBASE_GPU_ATTN_TC_WARPS"
SPLIT_WARPS_ENV = "MARKBASE_GPU_ATTN_TC_SPLIT_WARPS"
BK_ENV = "MARKBASE_GPU_ATTN_TC_BK"
STAGES_ENV = "MARKBASE_GPU_ATTN_TC_STAGES"
SPLIT_STAGES_ENV = "MARKBASE_GPU_ATTN_TC_SPLIT_STAGES"
# the split form where the CUDA-core kernel would take at most this many blocks along
# time (~128 positions each): past that one block a (row, KV head) reads too little
# of HBM's bandwidth
MAX_SPLITS = 16
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads a KV head: the A fragment's rows 0-7

_SOURCE = r"""
  constexpr int RS = HD + 8;   // shared row stride (elements): ldmatrix rows on 8 banks
  constexpr int NT = BK / 8;   // score n-tiles (8 keys each) a tile
  constexpr int KS = HD / 16;  // k-steps of q.k
  constexpr int DT = HD / 8;   // output n-tiles
  constexpr int CH = HD / 8;   // 16-byte chunks a row
  constexpr int TILE = BK * RS;
  // a warp's elements: K, V x STG stages, q, k, v, then the RoPE's cos/sin (HD floats)
  constexpr int WSM = 2 * STG * TILE + (G + 4) * HD;
  extern __shared__ __align__(16) unsigned char mb_smem[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int tg = lane % 4;
  const int n_kv = keys_shape[1];
  // (row, KV head) of this warp; SPLIT: of the block, whose warps share its tiles
  constexpr int nb = 1;
  constexpr int part = 0;
  const int unit = SPLIT ? blockIdx.x : blockIdx.x * WARPS + warp;
  if (unit >= qkv_shape[0] * n_kv) {
    return;  // the whole warp (never with SPLIT: the grid is exact there)
  }
  const int b = unit / n_kv;
  const int hkv = unit % n_kv;
  T* const ks0 = reinterpret_cast<T*>(mb_smem) + warp * WSM;
  T* const vs0 = ks0 + STG * TILE;
  T* const qsm = vs0 + STG * TILE;  // [G][HD] the query heads, RoPE'd
  T* const kn = qsm + G * HD;     // [HD] the new k, RoPE'd
  T* const vn = kn + HD;          // [HD] the new v
  float* const rcos = reinterpret_cast<float*>(vn + HD);  // [HD/2] per frequency
  float* const rsin = rcos + HD / 2;
  // every qkv value this lane's RoPE needs, read first: the reads then overlap each
  // other and start/pos's. Why: written as loads inside the loop that stores into
  // qsm, each waited for the store before it (generic pointers may alias): one L2
  // round trip an element, ~4 us of one row's ~11 us call (session 19's ablation)
  const T* xb = qkv + b * qkv_strides[0];
  const int nq = n_kv * G * HD;
  constexpr int QPL = G * HD / 32;  // query elements a lane (i = lane + 32 j)
  constexpr int KPL = HD / 32;      // new k (and v) elements a lane (d = lane + 32 j)
  auto partner = [](int d) { return TRAD ? d ^ 1 : (d < HD / 2 ? d + HD / 2 : d - HD / 2); };
  T qx[QPL], qp[QPL], kx[KPL], kp[KPL], vx[KPL];
#pragma unroll
  for (int j = 0; j < QPL; ++j) {
    const int i = lane + 32 * j;
    const T* src = xb + (hkv * G + i / HD) * HD;
    qx[j] = src[i % HD];
    qp[j] = src[partner(i % HD)];
  }
#pragma unroll
  for (int j = 0; j < KPL; ++j) {
    const int d = lane + 32 * j;
    kx[j] = xb[nq + hkv * HD + d];
    kp[j] = xb[nq + hkv * HD + partner(d)];
    vx[j] = xb[nq + n_kv * HD + hkv * HD + d];
  }
  const int row0 = start[b];
  const int t_len = TPOS ? pos[b] + row0 + 1 : keys_shape[2];
  const int t_new = t_len - 1;
  T* const kb = const_cast<T*>(keys) + b * keys_strides[0] + hkv * keys_strides[1];
  T* const vb = const_cast<T*>(values) + b * values_strides[0] + hkv * values_strides[1];
  const int64_t kst = keys_strides[2];
  const int64_t vst = values_strides[2];

  // tile kt's keys [k0, k0 + BK) into stage st, keys past the end as zeros; not the new
  // slot, which the tile takes from the warp's copy once it has landed (patched below)
  const int ntiles = (t_len - row0 + BK - 1) / BK;
  const int tpp = (ntiles + nb - 1) / nb;        // tiles a part
  const int kt_hi = min(ntiles, (part + 1) * tpp);  // this block's tiles: [part * tpp, kt_hi)
  auto load = [&](int kt, int st) {
    const int k0 = row0 + kt * BK;
#pragma unroll
    for (int i = lane; i < BK * CH; i += 32) {
      const int r = i / CH;
      const int c = (i % CH) * 8;
      const int key = k0 + r;
      if (key != t_new) {
        const bool in = key < t_len;
        const int64_t row = in ? key : 0;
        mb_cp16z(ks0 + st * TILE + r * RS + c, kb + row * kst + c, in);
        mb_cp16z(vs0 + st * TILE + r * RS + c, vb + row * vst + c, in);
      }
    }
  };
  // the warp's first STG - 1 tiles are on their way while the RoPE below is computed
  const int kstep = SPLIT ? WARPS : 1;  // SPLIT: warp w takes tiles w, w + WARPS, ...
  int kt = SPLIT ? part * tpp + warp : 0;
#pragma unroll
  for (int s0 = 0; s0 < STG - 1; ++s0) {
    if (kt + s0 * kstep < kt_hi) {
      load(kt + s0 * kstep, s0);
    }
    mb_commit();
  }

  // RoPE as engine/backends/cuda/attention/decode.py's append form: angle = scale * position * inv_freq,
  // pairs (d, d + HD/2), or (2i, 2i + 1) when TRAD; the result rounded to T
  const float pos_f = MB_ROPE_SCALE * static_cast<float>(pos[b]);
  // one sincos a frequency (HD/2 of them), not one an element: G + 1 heads share them
  // (20 a lane at 8b: ~1.7 us of one row's call, session 19)
  for (int f = lane; f < HD / 2; f += 32) {
    sincosf(pos_f * inv_freq[f], &rsin[f], &rcos[f]);
  }
  __syncwarp();
  auto rope = [&](T xt, T pt, int d) -> T {
    const int f = TRAD ? d / 2 : d % (HD / 2);
    const float c = rcos[f];
    const float s = rsin[f];
    const float x = static_cast<float>(xt);
    const float p = static_cast<float>(pt);
    const bool first = TRAD ? !(d & 1) : d < HD / 2;
    return static_cast<T>(first ? x * c - p * s : p * s + x * c);
  };
#pragma unroll
  for (int j = 0; j < QPL; ++j) {
    const int i = lane + 32 * j;
    qsm[i] = rope(qx[j], qp[j], i % HD);
  }
#pragma unroll
  for (int j = 0; j < KPL; ++j) {
    const int d = lane + 32 * j;
    const T kv = rope(kx[j], kp[j], d);
    kn[d] = kv;
    vn[d] = vx[j];
    if (!SPLIT || (warp == 0 && part == 0)) {
      kb[t_new * kst + d] = kv;  // the cache's new slot (no lane of this kernel reads it)
      vb[t_new * vst + d] = vx[j];
    }
  }
  __syncwarp();

  // the query heads as A fragments of every k-step: rows g < G, rows g + 8 zero
  uint32_t qf[KS][2];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const T* qr = qsm + min(g, G - 1) * HD + kk * 16 + tg * 2;
    qf[kk][0] = g < G ? *reinterpret_cast<const uint32_t*>(qr) : 0u;
    qf[kk][1] = g < G ? *reinterpret_cast<const uint32_t*>(qr + 8) : 0u;
  }
  const float sl2 = MB_SCALE * 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)
  float m0 = -INFINITY;  // running max of head g (log2 units)
  float l0 = 0.f;        // this lane's share of its sum
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  }

  for (int it = 0; kt < kt_hi; kt += kstep, ++it) {
    const int k0 = row0 + kt * BK;
    const int st = it % STG;
    if (kt + (STG - 1) * kstep < kt_hi) {
      // STG - 1 tiles ahead, into the stage the last __syncwarp freed
      load(kt + (STG - 1) * kstep, (it + STG - 1) % STG);
    }
    mb_commit();
    mb_wait<STG - 1>();  // tile kt's copies (this lane's) have landed
    __syncwarp();  // and every lane's
    T* const ks = ks0 + st * TILE;
    T* const vs = vs0 + st * TILE;
    if (t_new - k0 < BK) {  // the tile holds the new slot (warp-uniform): from the copy
      const int r = t_new - k0;
      for (int c = lane; c < CH; c += 32) {
        reinterpret_cast<uint4*>(ks + r * RS)[c] = reinterpret_cast<const uint4*>(kn)[c];
        reinterpret_cast<uint4*>(vs + r * RS)[c] = reinterpret_cast<const uint4*>(vn)[c];
      }
      __syncwarp();
    }
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      // matrices: keys j*8.. x dims kk*16 + 0, 8, 16, 24: b0, b1 of k-steps kk, kk+1
      const T* kr = ks + (j * 8 + (lane & 7)) * RS + (lane >> 3) * 8;
#pragma unroll
      for (int kk = 0; kk < KS; kk += 2) {
        uint32_t r[4];
        mb_ldm4(r, kr + kk * 16);
        mb_mma(s[j], qf[kk][0], 0u, qf[kk][1], 0u, r[0], r[1], T{});
        mb_mma(s[j], qf[kk + 1][0], 0u, qf[kk + 1][1], 0u, r[2], r[3], T{});
      }
    }
    // head g's scores (s[j][0..1]: keys k0 + j*8 + 2tg, +1), past the end -inf
    float mx0 = -INFINITY;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = k0 + j * 8 + tg * 2 + e;
        const float v = key < t_len ? s[j][e] * sl2 : -INFINITY;
        s[j][e] = v;
        mx0 = fmaxf(mx0, v);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    const float n0 = fmaxf(m0, mx0);  // finite: key k0 < t_len is in every tile
    const float a0 = exp2f(m0 - n0);
    m0 = n0;
    l0 *= a0;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      o[d][0] *= a0;
      o[d][1] *= a0;
    }
    uint32_t pf[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float p0 = exp2f(s[j][0] - n0);
      const float p1 = exp2f(s[j][1] - n0);
      l0 += p0 + p1;
      pf[j] = mb_pack2(p0, p1, T{});
    }
    // o += p v: score n-tiles 2kk, 2kk + 1 are the A fragment of k-step kk (rows g + 8
    // zero)
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint32_t pa0 = pf[2 * kk];
      const uint32_t pa2 = pf[2 * kk + 1];
      // transposed matrices: keys kk*16 + 0, 8 x dims d*8, (d+1)*8: b0, b1 of d, d+1
      const T* vr = vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8;
#pragma unroll
      for (int d = 0; d < DT; d += 2) {
        uint32_t r[4];
        mb_ldm4t(r, vr + d * 8);
        mb_mma(o[d], pa0, 0u, pa2, 0u, r[0], r[1], T{});
        mb_mma(o[d + 1], pa0, 0u, pa2, 0u, r[2], r[3], T{});
      }
    }
    __syncwarp();  // every lane is done with this stage
  }
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  T* const ob = out + (static_cast<int64_t>(b) * n_kv + hkv) * G * HD;
  if constexpr (SPLIT) {
    // the warps' softmaxes merged through shared memory (the stages are free now); a
    // warp without tiles has m -inf and adds nothing; warp 0 always has tile 0
    __syncthreads();
    float* const sm_m = reinterpret_cast<float*>(mb_smem);  // [WARPS][8]
    float* const sm_l = sm_m + WARPS * 8;                   // [WARPS][8]
    float* const sm_o = sm_l + WARPS * 8;                   // [WARPS][G][HD]
    if (tg == 0) {
      sm_m[warp * 8 + g] = m0;
      sm_l[warp * 8 + g] = l0;
    }
    if (g < G) {
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        sm_o[(warp * G + g) * HD + d * 8 + tg * 2] = o[d][0];
        sm_o[(warp * G + g) * HD + d * 8 + tg * 2 + 1] = o[d][1];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += WARPS * 32) {
      const int gg = i / HD;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        M = fmaxf(M, sm_m[w * 8 + gg]);
      }
      float L = 0.f;
      float A = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float mw = sm_m[w * 8 + gg];
        if (mw != -INFINITY) {
          const float e = exp2f(mw - M);
          L += sm_l[w * 8 + gg] * e;
          A += sm_o[w * G * HD + i] * e;
        }
      }
      ob[i] = static_cast<T>(A / L);
    }
  } else if (g < G) {
    const float i0 = 1.f / l0;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      *reinterpret_cast<uint32_t*>(ob + g * HD + d * 8 + tg * 2) =
          mb_pack2(o[d][0] * i0, o[d][1] * i0, T{});
    }
  }
"""


def _header(scale: float, rope_scale: float) -> str:
    from engine.backends.cuda.attention.decode import LAST_BLOCK
    from engine.backends.cuda.attention.prefill import _HEADER as CP_HEADER
    from engine.backends.cuda.products.mma import _HEADER as MMA_HEADER

    head = f"#define MB_SCALE {float(scale)!r}f\n#define MB_ROPE_SCALE {float(rope_scale)!r}f\n"
    return head + MMA_HEADER + CP_HEADER + LAST_BLOCK


def _specs(scale: float, rope_scale: float) -> dict[str, KernelSpec]:
    header = _header(scale, rope_scale)
    return {
        "append_tc": KernelSpec(
            "mb_decode_attn_tc", APPEND_INPUTS, [("out", "T")], _SOURCE, header
        ),
    }


@cache
def _kernels(scale: float, rope_scale: float) -> Baked:
    return Baked(lambda: _specs(scale, rope_scale), ensure_row_contiguous=False)


def enabled() -> bool:
    """On unless ``MARKBASE_GPU_ATTN_TC=0``. Measured on an H100 (session 18, CUPTI,
    ~512 positions): 8b B=128 146.8 -> 97.1 us a call, 1b B=128 115.1 -> 50.2, 8b B=64
    78.6 -> 55.4; the engine's 1b 4-bit B=128 25,652 -> 36,959 tok/s, 8b 6,912 ->
    7,188 (bench/gpu/NOTES.md)."""
    return envs.value(ENV)


def split_enabled() -> bool:
    """The launches the CUDA-core kernel splits over time (few rows) as one block a
    (row, KV head) whose warps share the tiles; on unless ``MARKBASE_GPU_ATTN_TC_SPLIT=0``.
    Measured (session 18, H100, 600 positions): 8b one row 20.5 -> 17.7 us a call, 8b
    B=8 28.1 -> 17.4, 1b one row 18.5 -> 12.2; the 8b 4-bit B=1 step 2.97 -> 2.81 ms."""
    return envs.value(SPLIT_ENV)


MAX_SHARED = 227 << 10  # dynamic shared memory a block may have (H100/H200)


def stages(split: bool, warps: int, bk: int, group: int, head_dim: int) -> int:
    """K/V tiles in flight a warp, plus the one in use: ``MARKBASE_GPU_ATTN_TC_STAGES``
    (``_SPLIT_STAGES`` for the split form; 2-4, default 2), fewer where the block's
    shared memory would pass MAX_SHARED. Why: the split form at one row waits ~1 us a
    tile a warp with one tile in flight (8b, 600 and 2,000 positions: 17.7 and 31.7 us a
    call, session 18); more in flight is the knob to measure."""
    name = SPLIT_STAGES_ENV if split else STAGES_ENV
    want = int(envs.value(name))
    while want > 2 and shared_bytes(warps, bk, group, head_dim, want) > MAX_SHARED:
        want -= 1
    return want


def geometry(split: bool = False) -> tuple[int, int]:
    """(warps a block, keys a tile): ``MARKBASE_GPU_ATTN_TC_WARPS`` (1/2/4/8, default
    4; with ``split`` ``MARKBASE_GPU_ATTN_TC_SPLIT_WARPS``, default 8) and
    ``MARKBASE_GPU_ATTN_TC_BK`` (16/32, default 16), checked."""
    name = SPLIT_WARPS_ENV if split else WARPS_ENV
    return int(envs.value(name)), int(envs.value(BK_ENV))


def supported(group: int, head_dim: int, dtype) -> bool:
    import mlx.core as mx

    return dtype in (mx.bfloat16, mx.float16) and head_dim in HEAD_DIMS and group <= MAX_GROUP


def shared_bytes(warps: int, bk: int, group: int, head_dim: int, n_stages: int = 2) -> int:
    """Per warp: K and V tiles in ``n_stages`` stages, the RoPE'd query heads, the new k
    and v, the RoPE's cos and sin (float, head_dim/2 each)."""
    return warps * (2 * n_stages * bk * (head_dim + 8) + (group + 4) * head_dim) * 2


def launch(inputs, rows: int, n_kv: int, group: int, head_dim: int, dtype, scale, rope_scale,
           traditional: bool, whole_buffers: bool, split: bool = False,
           warps: int | None = None, bk: int | None = None):  # fmt: skip
    """``decode_attention_append``'s inputs (qkv, keys, values, start, pos, inv_freq) ->
    the attention [rows, Hq, 1, D]; the new k and v written into the buffers. ``split``:
    one block a (row, KV head), its warps taking every WARPS-th tile, merged in the
    block; else one warp a (row, KV head)."""
    dw, dbk = geometry(split)
    warps, bk = warps or dw, bk or dbk
    stg = stages(split, warps, bk, group, head_dim)
    template = (("T", dtype), ("HD", head_dim), ("G", group), ("WARPS", warps), ("BK", bk))
    template += (("TRAD", traditional), ("TPOS", whole_buffers), ("SPLIT", split), ("STG", stg))
    kern = _kernels(float(scale), float(rope_scale))
    smem = shared_bytes(warps, bk, group, head_dim, stg)
    fn = kern("append_tc", template, smem)
    blocks = rows * n_kv if split else -(-rows * n_kv // warps)
    return fn(
        inputs=inputs,
        grid=(blocks * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, n_kv * group, 1, head_dim)],
        output_dtypes=[dtype],
    )[0]


def kernel_specs_for_check() -> list[KernelSpec]:
    """The source with concrete template values (bench/gpu/nvrtc_check.py)."""
    specs = _specs(0.125, 1.0)
    spec = specs["append_tc"]
    out = []
    for dtype in ("bfloat16", "float16"):
        for hd, g, warps, bk, trad, split, stg in ((128, 4, 4, 16, False, False, 2),
                                                   (64, 4, 4, 32, True, False, 2),
                                                   (128, 8, 2, 32, False, False, 2),
                                                   (64, 1, 4, 16, False, False, 3),
                                                   (128, 4, 8, 16, False, True, 2),
                                                   (128, 4, 8, 16, False, True, 3),
                                                   (128, 8, 8, 16, True, True, 2),
                                                   (128, 4, 4, 16, False, True, 4),
                                                   (64, 4, 4, 32, False, True, 2)):  # fmt: skip
            tmpl = [("T", dtype), ("HD", hd), ("G", g), ("WARPS", warps), ("BK", bk)]
            tmpl += [("TRAD", trad), ("TPOS", bk == 16), ("SPLIT", split), ("STG", stg)]
            name = f"{spec.name}_{dtype}_{hd}_{g}_{warps}_{bk}_{int(split)}_{stg}"
            out.append(for_dtype(spec, dtype, name, tmpl))
    return out
