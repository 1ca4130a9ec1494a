"""Decode attention over the running batch's KV as one CUDA kernel (two for long rows).

Why: MLX's fused CUDA attention (cuDNN or its vector kernel) refuses an array mask in
a decode step, and the running batch needs one as soon as its rows differ in length
(left padding). The fallback, grouped matmuls under the mask (engine/attention.py),
costs about seven kernels per layer (scale, QK^T, mask, casts, softmax, PV), and on
the GPU each kernel costs host time: the decode step is host-bound up to ~32 rows
(bench/gpu/NOTES.md). This kernel reads each row's valid range ``[start[b], T)``
itself, so there is no mask at all, and it reads each K/V head once for the query
heads of its group.

Layout: one block per (time split, KV head, row); each warp walks its share of the
positions four at a time (loads first, so several are in flight), keeping an online
softmax per query head; the block's warps are merged in shared memory. When rows are
few, the time axis is split over several blocks (``splits``) so that enough blocks
run, and a second small kernel merges the splits.

Inputs are MLX arrays as the decode step has them: ``q`` [B, Hq, 1, D] (any strides
with a contiguous last dim), ``keys``/``values`` [B, Hkv, T, D] views of the cache
buffers (``BatchKV.update_and_fetch``'s return; last dim contiguous), ``start`` [B]
int32. Only on a CUDA GPU; ``bench/gpu/nvrtc_check.py`` compiles the sources without
one.
"""

from __future__ import annotations

from functools import cache

from engine.cuda_kernels import Baked, KernelSpec

_PARTIAL_BODY = r"""
  constexpr int PER = HD / 32;
  constexpr int U = 4;
  const int split = blockIdx.x;
  const int hkv = blockIdx.y;
  const int b = blockIdx.z;
  const int nsplit = gridDim.x;
  const int n_kv = gridDim.y;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int t_len = keys_shape[2];
  const int row0 = start[b];
  const int valid = t_len - row0;
  const int chunk = (valid + nsplit - 1) / nsplit;
  const int t0 = row0 + split * chunk;
  const int t1 = min(t_len, t0 + chunk);
  const T* kb = keys + b * keys_strides[0] + hkv * keys_strides[1] + lane * PER;
  const T* vb = values + b * values_strides[0] + hkv * values_strides[1] + lane * PER;
  const int64_t ts_k = keys_strides[2];
  const int64_t ts_v = values_strides[2];

  float qr[G][PER];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = q + b * q_strides[0] + (hkv * G + g) * q_strides[1] + lane * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      qr[g][i] = static_cast<float>(qp[i]) * MB_SCALE;
    }
  }
  float m[G];
  float l[G];
  float acc[G][PER];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      acc[g][i] = 0.f;
    }
  }

  for (int base = t0 + warp; base < t1; base += WARPS * U) {
    float kr[U][PER];
    float vr[U][PER];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int t = base + j * WARPS;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        kr[j][i] = t < t1 ? static_cast<float>(kb[t * ts_k + i]) : 0.f;
        vr[j][i] = t < t1 ? static_cast<float>(vb[t * ts_v + i]) : 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s[U];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          d += qr[g][i] * kr[j][i];
        }
        s[j] = d;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int j = 0; j < U; ++j) {
          s[j] += __shfl_xor_sync(0xffffffff, s[j], off);
        }
      }
      float mx = m[g];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (base + j * WARPS < t1) {
          mx = fmaxf(mx, s[j]);
        }
      }
      const float corr = expf(m[g] - mx);
      float lsum = l[g] * corr;
      float a[PER];
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        a[i] = acc[g][i] * corr;
      }
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (base + j * WARPS < t1) {
          const float p = expf(s[j] - mx);
          lsum += p;
#pragma unroll
          for (int i = 0; i < PER; ++i) {
            a[i] += p * vr[j][i];
          }
        }
      }
      m[g] = mx;
      l[g] = lsum;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        acc[g][i] = a[i];
      }
    }
  }

  __shared__ float sm_m[WARPS][G];
  __shared__ float sm_l[WARPS][G];
  __shared__ float sm_acc[WARPS][G][HD];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      sm_acc[warp][g][lane * PER + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HD; idx += WARPS * 32) {
    const int g = idx / HD;
    const int d = idx % HD;
    float M = -INFINITY;
    for (int w = 0; w < WARPS; ++w) {
      M = fmaxf(M, sm_m[w][g]);
    }
    float L = 0.f;
    float A = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < WARPS; ++w) {
        const float e = expf(sm_m[w][g] - M);
        L += sm_l[w][g] * e;
        A += sm_acc[w][g][d] * e;
      }
    }
    const int64_t row = static_cast<int64_t>(b) * n_kv * G + hkv * G + g;
"""

_WRITE_OUT = r"""
    out[row * HD + d] = static_cast<T>(A / L);
  }
"""

_WRITE_PARTS = r"""
    const int64_t r = row * nsplit + split;
    pacc[r * HD + d] = A;
    if (d == 0) {
      pm[r] = M;
      pl[r] = L;
    }
  }
"""

_COMBINE_BODY = r"""
  const int64_t bh = blockIdx.x;
  const int d = threadIdx.x;
  const int S = pm_shape[2];
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) {
    M = fmaxf(M, pm[bh * S + s]);
  }
  float L = 0.f;
  float A = 0.f;
  for (int s = 0; s < S; ++s) {
    const float mw = pm[bh * S + s];
    if (mw != -INFINITY) {
      const float e = expf(mw - M);
      L += pl[bh * S + s] * e;
      A += pacc[(bh * S + s) * HD + d] * e;
    }
  }
  out[bh * HD + d] = static_cast<T>(A / L);
"""

SMS = 132  # H100/H200; only sets how finely short batches split the time axis
POSITIONS_PER_BLOCK = 128  # each of 8 warps walks ~16 positions (4 rounds of 4 loads)


def _header(scale: float) -> str:
    return f"#define MB_SCALE {float(scale)!r}f\n"


def _specs(scale: float) -> dict[str, KernelSpec]:
    header = _header(scale)
    inputs = [("q", "T", 4), ("keys", "T", 4), ("values", "T", 4), ("start", "int32", 1)]
    return {
        "single": KernelSpec(
            "mb_decode_attn", inputs, [("out", "T")], _PARTIAL_BODY + _WRITE_OUT, header
        ),
        "parts": KernelSpec(
            "mb_decode_attn_parts",
            inputs,
            [("pm", "float32"), ("pl", "float32"), ("pacc", "float32")],
            _PARTIAL_BODY + _WRITE_PARTS,
            header,
        ),
        "combine": KernelSpec(
            "mb_decode_attn_combine",
            [("pm", "float32", 3), ("pl", "float32", 3), ("pacc", "float32", 4)],
            [("out", "T")],
            _COMBINE_BODY,
        ),
    }


@cache
def _kernels(scale: float) -> Baked:
    """One kernel object per template values (engine/cuda_kernels.py: less host time a
    call), per softmax scale."""
    return Baked(lambda: _specs(scale), ensure_row_contiguous=False)


def warps_for(group: int, head_dim: int) -> int:
    """8 warps a block unless the block's shared merge buffer would pass 32 KB."""
    return 8 if group * head_dim <= 1024 else 4


def supported(n_heads: int, n_kv_heads: int, head_dim: int, dtype) -> str | None:
    """None when the kernel handles this attention shape, else why not."""
    import mlx.core as mx

    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"dtype {dtype}"
    if head_dim % 32 or head_dim > 256:
        return f"head_dim {head_dim} (needs a multiple of 32, at most 256)"
    if n_heads % n_kv_heads:
        return f"{n_heads} query heads over {n_kv_heads} KV heads"
    group = n_heads // n_kv_heads
    if group * head_dim * warps_for(group, head_dim) * 4 > 32 * 1024:
        return f"group {group} x head_dim {head_dim} too large for the shared merge buffer"
    return None


def splits(batch: int, n_kv_heads: int, length: int) -> int:
    """Blocks per (row, KV head) along time: enough blocks for the GPU (~2 per SM) but
    no fewer than ~128 positions per block."""
    want = -(-2 * SMS // (batch * n_kv_heads))
    return max(1, min(want, -(-length // POSITIONS_PER_BLOCK), 64))


def decode_attention(q, keys, values, start, scale: float):
    """softmax(q k^T * scale) v over each row's positions ``[start[b], T)``; [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    g = hq // hkv
    warps = warps_for(g, d)
    n = splits(b, hkv, t)
    kern = _kernels(float(scale))
    template = (("T", q.dtype), ("HD", d), ("G", g), ("WARPS", warps))
    inputs = [q, keys, values, start]
    grid = (n * warps * 32, hkv, b)
    block = (warps * 32, 1, 1)
    if n == 1:
        return kern("single", template)(
            inputs=inputs,
            grid=grid,
            threadgroup=block,
            output_shapes=[(b, hq, 1, d)],
            output_dtypes=[q.dtype],
        )[0]
    import mlx.core as mx

    pm, pl, pacc = kern("parts", template)(
        inputs=inputs,
        grid=grid,
        threadgroup=block,
        output_shapes=[(b, hq, n), (b, hq, n), (b, hq, n, d)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return kern("combine", template[:2])(
        inputs=[pm, pl, pacc],
        grid=(b * hq * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[(b, hq, 1, d)],
        output_dtypes=[q.dtype],
    )[0]


def warm(n_heads: int, n_kv_heads: int, head_dim: int, dtype, scale: float) -> None:
    """Compile both forms (unsplit; split + merge) for this shape now, so that no request
    waits on NVRTC: which form a step takes depends on its rows and length."""
    import mlx.core as mx

    for t in (1, 4 * POSITIONS_PER_BLOCK):
        q = mx.zeros((1, n_heads, 1, head_dim), dtype=dtype)
        kv = mx.zeros((1, n_kv_heads, t, head_dim), dtype=dtype)
        mx.eval(decode_attention(q, kv, kv, mx.zeros((1,), dtype=mx.int32), scale))


def kernel_specs_for_check() -> list[KernelSpec]:
    """The sources with concrete template values (bench/gpu/nvrtc_check.py)."""
    out = []
    for dtype in ("bfloat16", "float32"):
        for hd, g in ((64, 4), (128, 4), (128, 8), (64, 1), (32, 2)):
            w = warps_for(g, hd)
            for kind, spec in _specs(0.125).items():
                tmpl = [("T", dtype), ("HD", hd)]
                if kind != "combine":
                    tmpl += [("G", g), ("WARPS", w)]
                ins = [(n, dtype if t == "T" else t, nd) for n, t, nd in spec.inputs]
                outs = [(n, dtype if t == "T" else t) for n, t in spec.outputs]
                name = f"{spec.name}_{dtype}_{hd}_{g}_{w}"
                out.append(KernelSpec(name, ins, outs, spec.source, spec.header, tmpl))
    return out
