"""CPU (Linux, MLX CPU backend) policy and a faster decode step.

Measured on the 2-core AMD EPYC (Zen 5) dev box, MLX 0.32.4 + mlx-lm 0.32.2, a
random llama with SmolLM2-135M's exact shape (hidden 576, 30 layers, 9/3 heads,
MLP 1536, vocab 49152, tied embeddings), KV length 256; ``bench/cpu_formats.py``
prints the table. Other sessions loaded the 2 cores during every run (load
average 2-7), so absolute numbers moved by up to 3x between runs; compare within
one row of the table (configurations interleaved in one process).

Decode tok/s (aggregate), batch 1 / 4 / 8 / 16, median (loaded machine):

    float32, OpenBLAS + shim + CpuDecodeStep   22-30 / 50 / 78 / 106  (best 28-37 / 52 / 84 / 113-144)
    float32, plain OpenBLAS, model(x, cache)   12-14 / 28 / 54 / 78-96
    float32, vendored reference BLAS             3.4 / 4.4 / 4.5 / 4.9
    q4 g32 / g64 (MLX quantized)                 8-9 / 9.5 / 9 / 4.6  (any BLAS: 3.3 / 4.7 / 6.3 / 8.5 with the reference one)
    q8                                           2.5-3 / 3.3 / 3.5 / 3.5
    bfloat16                                       3 / 6.7 / 8 / 8-9
    float16                                      2.4 / 8.5 / 11 / 6
    llama.cpp Q4_1 (same GGUF), 2 threads: 152 at batch 1 on a quiet machine, but
    0.8-58 under this load; 1 thread, loaded: 82 / 75 / 95 / 85.

Why float32 with a fast BLAS, at every batch size:

* MLX's CPU backend runs everything except float32 matmuls as single-threaded
  scalar C++ (``simd::max_size == 1`` on x86; ``mx.fast.*`` are all fallbacks
  built from ordinary ops). Float32 matmuls go to ``cblas_sgemm``: the only
  multi-threaded, vectorised kernel there is (``engine.backends.cpu.blas`` makes it
  OpenBLAS instead of the vendored reference BLAS).
* MLX quantized matmul (4-bit g32/g64, 8-bit) is a scalar loop, ~1 ns per
  weight and row: 4-bit and 8-bit take ~100-400 ms per step at batch 1 and grow
  linearly with the batch (no reuse of the dequantized weights).
* bfloat16/float16 matmuls use MLX's own scalar ``simd_gemm`` (no BLAS); float16
  also pays a software half conversion.
* A float32 step at batch 1 is bound by memory: 540 MB of weights per token at
  the ~15-25 GB/s that 2 cores read (~70% of the step; MLX's per-op overhead is
  the rest). The shim in ``engine.backends.cpu.blas`` sends those M == 1 products to
  sgemv: 2-2.6x faster than OpenBLAS 0.3.21's sgemm, which repacks the weight on
  every call.
* Without a fast BLAS, "native" (GGUF quantization kept as MLX affine): on par
  with reference-BLAS float32 at batch 1, 1.1-1.7x faster from batch 4, and 4x
  less memory.

The ceiling: float32 cannot go past ~40 tok/s single-stream here (540 MB per
token); llama.cpp reads ~100 MB per token (Q4_1 + Q8_0 embeddings). Half of
llama.cpp's speed needs 8- or 4-bit weights with a multi-threaded SIMD kernel,
i.e. a custom MLX CPU primitive (C++ extension); MLX's own quantized kernel is
~10x too slow for that.

``CpuDecodeStep`` (``engine.model.decode_step.FusedDecodeStep`` with its defaults, chosen
by ``engine.model.decode_step.make_decode_step`` on the CPU) speeds up one decode step of a
llama-family mlx-lm model by 1.1-1.3x over ``model(x, cache)`` (real SmolLM2
float32 at batch 1: 21-30 -> 30-40 tok/s, same greedy tokens): per-layer
``mx.compile`` of the parts before and after the KV update (fuses the
RMSNorm/RoPE/SwiGLU fallbacks into a few JIT kernels), fused QKV and gate/up
projections (one BLAS call instead of 3 and 2, no extra memory: the module
weights become views of the fused ones), and attention with the GQA repeats
folded into the matrix rows (48 small sgemms per layer at batch 16 instead of
the 144 that ``mx.fast.scaled_dot_product_attention``'s CPU fallback issues).
Outputs match the plain model to float32 rounding.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("markbase.cpu_tuning")

WEIGHT_FORMATS = ("native", "q4", "q8", "float32", "bfloat16", "float16")


def best_cpu_weight_format(batch_hint: int = 1, *, fast_blas: bool | None = None) -> str:
    """Weight format to load for MLX's CPU backend (one of ``WEIGHT_FORMATS``).

    ``batch_hint``: the decode batch the server expects (its max concurrency).
    ``fast_blas``: whether MLX's sgemm is a fast BLAS; None asks ``engine.backends.cpu.blas``
    (no measurement; imports nothing from MLX).

    With a fast BLAS: "float32" at every batch size (module docstring: 4-bit, 8-bit,
    bfloat16 and float16 all run through MLX's scalar single-threaded kernels, 3-20x
    slower than float32 through OpenBLAS). Without one: "native" (on par with
    reference-BLAS float32 at batch 1, faster from batch 4, 4x less memory).
    ``batch_hint`` does not change the answer today; it is kept because a fast
    quantized kernel would make it matter (quantized wins at batch 1, float32 GEMM
    at large batches).
    """
    if fast_blas is None:
        fast_blas = _fast_blas_active()
    return "float32" if fast_blas else "native"


def _fast_blas_active() -> bool:
    if not sys.platform.startswith("linux"):
        return True  # macOS: Accelerate; this policy is for the Linux CPU backend
    try:
        from engine.backends.cpu import blas as cpu_blas
    except ImportError:
        return False
    setup = cpu_blas.ensure_fast_blas(allow_reexec=False)
    return setup.method != "none" or cpu_blas.vendored_reference_blas() is None


# ------------------------------------------------------------ the decode step
# The fused decode step (engine/model/decode_step.py, which runs on the GPU too) under its
# old CPU name, for bench/cpu_formats.py and tests/backends/cpu/test_cpu_blas.py. Since 2026-12-03
# the CPU's default is engine/backends/cpu/step.py's lean step (engine.runner picks it), which
# also has a class named CpuDecodeStep: ~1,000 graph nodes a step instead of ~2,170.
from engine.model.decode_step import FusedDecodeStep as CpuDecodeStep  # noqa: E402

__all__ = ["WEIGHT_FORMATS", "CpuDecodeStep", "best_cpu_weight_format"]
