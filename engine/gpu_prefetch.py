"""Pull the next products' weights into L2 while the single-stream attention runs.

Why: at one row the decode attention is latency-bound (8b: ~21 us a layer reading
~2.4 MB; HBM nearly idle), and the products after it (o_proj, gate_up) are
bandwidth-bound and short enough that each kernel's ramp costs a good part of its
time (bench/gpu/read_bw.py, NOTES.md session 10: an MLX kernel reads 4.5 TB/s over
1 GB but ~2.4 TB/s over 58 MB buffers). This kernel copies the fused q/k/v row (so
that the attention, which reads the copy, runs after it) and issues
``cp.async.bulk.prefetch.L2`` for the first bytes of the given weights: fire and
forget, so it ends in a few microseconds and the HBM fills L2 during the attention.

Off unless ``MARKBASE_GPU_L2_PREFETCH`` sets the megabytes to prefetch a layer
(engine/decode_step.py; 4-bit models, one row, the attention kernel's append form).
``bench/gpu/nvrtc_check.py`` compiles the source without a GPU.
"""

from __future__ import annotations

import os

from engine.cuda_kernels import Baked, KernelSpec

CHUNK = 1 << 16  # bytes a prefetch instruction asks for
THREADS = 256

_BODY = r"""
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int stride = gridDim.x * blockDim.x;
  const int n = x_shape[1];
  for (int i = tid; i < n; i += stride) {
    y[i] = x[i];
  }
  constexpr int NCA = (NA + CH - 1) / CH;
  constexpr int NCB = (NB + CH - 1) / CH;
  for (int c = tid; c < NCA + NCB; c += stride) {
    const bool first = c < NCA;
    const int cc = first ? c : c - NCA;
    const long long left = (long long)(first ? NA : NB) - (long long)cc * CH;
    const unsigned size = static_cast<unsigned>(left < CH ? left : CH);
    const char* p = reinterpret_cast<const char*>(first ? a : b) + (long long)cc * CH;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(size) : "memory");
  }
"""


def _specs() -> dict[str, KernelSpec]:
    inputs = [("x", "T", 2), ("a", "uint32", 1), ("b", "uint32", 1)]
    return {"prefetch": KernelSpec("mb_l2_prefetch", inputs, [("y", "T")], _BODY, "")}


_kernel = Baked(_specs, ensure_row_contiguous=True)


def budget_bytes() -> int:
    """Bytes to prefetch a layer (``MARKBASE_GPU_L2_PREFETCH``, megabytes; 0: off)."""
    return int(float(os.environ.get("MARKBASE_GPU_L2_PREFETCH", "0")) * (1 << 20))


def split(budget: int, a_bytes: int, b_bytes: int) -> tuple[int, int]:
    """How much of each weight: all of the first while it fits, then the second; whole
    16-byte units (what the instruction takes)."""
    na = min(a_bytes, budget) // 16 * 16
    nb = min(b_bytes, budget - na) // 16 * 16
    return na, max(nb, 0)


def launcher(dtype, n: int, a_bytes: int, b_bytes: int, budget: int):
    """``call(x, a, b) -> copy of x`` [1, n], prefetching the first bytes of a then b."""
    na, nb = split(budget, a_bytes, b_bytes)
    fn = _kernel("prefetch", (("T", dtype), ("NA", na), ("NB", nb), ("CH", CHUNK)))
    chunks = -(-na // CHUNK) + -(-nb // CHUNK)
    threads = max(n, chunks, 1)
    grid = (-(-threads // THREADS) * THREADS, 1, 1)
    threadgroup = (THREADS, 1, 1)
    shapes = [(1, n)]
    dtypes = [dtype]

    def call(x, a, b):
        return fn(
            inputs=[x, a.reshape(-1), b.reshape(-1)],
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )[0]

    return call


def kernel_specs_for_check() -> list[KernelSpec]:
    spec = _specs()["prefetch"]
    out = []
    for dtype in ("bfloat16", "float16"):
        tmpl = [("T", dtype), ("NA", 8 << 20), ("NB", 31 << 20), ("CH", CHUNK)]
        ins = [(n, dtype if t == "T" else t, nd) for n, t, nd in spec.inputs]
        outs = [(n, dtype) for n, _ in spec.outputs]
        out.append(KernelSpec(f"{spec.name}_{dtype}", ins, outs, spec.source, "", tmpl))
    return out
