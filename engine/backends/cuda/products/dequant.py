"""4-bit weights expanded to bf16/fp16 at the memory's rate, for prefill's products.

Why: a prompt chunk of 256+ rows dequantizes each weight and runs cuBLAS's float
product (engine/backends/cuda/prefill.py). MLX 0.32's ``affine_dequantize`` kernel gives each
thread one byte (two outputs), and ran at ~1.0 TB/s on an H100: in a 2048-token 1b
4-bit chunk, 108 calls took 2.46 of its 12.96 ms for ~2.5 GB moved (docs/performance.md,
the measured prefill profile). The 4-bit 8b prefill was level with compiled PyTorch's
bf16 (30,354 against 30,199 tok/s), 12 ms a chunk behind markbase's bf16.

Here a warp takes 128 words (1,024 weights): each lane loads 4 words, one per 32-lane
stride so every load and every 16-byte store of the warp is contiguous, with each
word's scale and bias (a word's 8 weights share a group, group sizes 32-128). The
arithmetic is written as MLX's (``scale * q + bias`` in the weight's dtype, its
``__hmul``/``__hadd`` as ``__hmul2``/``__hadd2``), and the compiler treats it the same
way: NVRTC contracts the two into one ``HFMA2`` (sm_90a SASS), as nvcc's
default does with MLX's. So the weights should be ``mx.dequantize``'s bit for bit; the
GPU test compares them.

Measured on an H100 (CUPTI): 0.42-0.55x MLX's kernel time on every product
of the 8b and 1b models (2.4-2.9 TB/s against 1.1-1.2), equal to ``mx.dequantize`` bit
for bit (26 GPU tests); a 2048-token 4-bit prefill 31,007 -> 34,477 tok/s at 8b
(chunks of 512: 17,548 -> 23,756), 155,759 -> 160,114 at 1b. On by default;
``MARKBASE_GPU_DEQUANT=0`` turns it off. Elsewhere, and for other bit widths, modes
and dtypes, ``mx.dequantize``.
"""

from __future__ import annotations

from functools import cache

from engine import envs
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype, one_output_call
from engine.backends.cuda.kernels import source as _source

ENV = "MARKBASE_GPU_DEQUANT"
WORDS_A_WARP = 128
THREADS = 256

_HEADER = _source("products/dequant/header.cuh")

_SOURCE = _source("products/dequant/source.cu")


@cache
def _spec() -> KernelSpec:
    return KernelSpec(
        "mb_dequant4",
        [("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)],
        [("y", "T")],
        _SOURCE,
        _HEADER,
    )


_kernel = Baked(lambda: {"q4": _spec()}, ensure_row_contiguous=True)


def enabled() -> bool:
    """``MARKBASE_GPU_DEQUANT``: 1 (default) this kernel, 0 MLX's ``mx.dequantize``."""
    return envs.value(ENV)


def supported(w, scales, biases, group_size: int, bits: int, mode: str) -> bool:
    """CUDA, 4-bit affine with biases, bf16/fp16 scales, groups of 32/64/128, a 2-D
    uint32 weight (MLX's packing: weight 8i + j in bits 4j..4j+3 of word i)."""
    import mlx.core as mx

    from engine.backends.cuda.products import gemv as gpu_gemv

    n, k = w.shape[0], w.shape[-1] * 8
    return (
        gpu_gemv.quant_supported(scales.dtype, n, k, bits, group_size, mode, biases)
        and group_size in (32, 64, 128)
        and w.ndim == 2
        and w.dtype == mx.uint32
        and biases.dtype == scales.dtype
        and scales.shape == (n, k // group_size)
    )


@cache
def _launcher(dtype, group_size: int, n: int, words: int):
    fn = _kernel("q4", (("T", dtype), ("GS", group_size)))
    warps = -(-n * words // WORDS_A_WARP)
    threads = -(-warps * 32 // THREADS) * THREADS
    return one_output_call(fn, (threads, 1, 1), (THREADS, 1, 1), (n, words * 8), dtype)


def dequantize(w, scales, biases, group_size: int = 64, bits: int = 4, mode: str = "affine"):
    """``mx.dequantize``'s result: through the kernel where ``enabled`` and ``supported``."""
    import mlx.core as mx

    if enabled() and supported(w, scales, biases, group_size, bits, mode):
        run = _launcher(scales.dtype, group_size, w.shape[0], w.shape[1])
        return run([w, scales, biases])
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)


def kernel_specs_for_check() -> list[KernelSpec]:
    """The kernel per dtype and group size (bench/gpu/nvrtc_check.py)."""
    out = []
    for dtype in ("bfloat16", "float16"):
        for gs in (32, 64, 128):
            name = f"mb_dequant4_{dtype}_{gs}"
            out.append(for_dtype(_spec(), dtype, name, [("T", dtype), ("GS", gs)]))
    return out
