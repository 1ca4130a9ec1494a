"""Decode products for a few rows (1-8) as custom CUDA kernels: 4-bit affine and bf16/fp16.

Why: on the H200 the decode step's products are the largest cost, and MLX 0.32.4's
kernels for them are weak exactly where decoding lives (docs/performance.md;
profile): its 4-bit ``qmv`` moves the 8b model's weights at ~0.93 TB/s for one row
(4.5 of a 5.8 ms step, against a ~1 ms floor), its 4-bit ``qmm_sm80`` at ~0.34 TB/s for
8 rows, and a bf16 product of 2-32 rows goes through cuBLAS, whose per-call host cost
(~35 us each, captured into the CUDA graph) makes small batches host-bound.

Both kernels read every weight row once for all rows of ``x``: a warp owns ``R``
weight rows, each lane 32 (4-bit) or 8 (bf16) consecutive inputs per step, with 16-byte
loads; the rows of ``x`` come through L1 and are reused for the ``R`` weight rows.
4-bit values become floats with the exponent trick (``0x4B000000 | q`` is 2^23 + q),
and the group's bias is applied once per 32 inputs: ``s * sum(x q) + b * sum(x)``.
Up to ``MMAX`` = 8 rows a call (more rows: several calls, each reading the weight
again). Only bf16/fp16 activations, row counts 1-8 a call, K a multiple of 32 (4-bit,
group size a multiple of 32) or 8 (float). ``bench/gpu/nvrtc_check.py`` compiles the
sources without a GPU; ``tests/backends/cuda/test_gpu_gemv.py`` checks them against MLX on one.
"""

from __future__ import annotations

from engine import platform
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype
from engine.backends.cuda.kernels import source as _source

WARPS = 4
MAX_ROWS = 8

_HEADER = _source("products/gemv/header.cuh")

# shared by both kernels: the warp's R weight rows, acc[m][r] over the rows of x, and
# at the end a warp sum per (m, r) written by lane 0
_HEAD = _source("products/gemv/head.cu")

_TAIL = _source("products/gemv/tail.cu")

_Q4_LOOP = _source("products/gemv/q4_loop.cu")

_F_LOOP = _source("products/gemv/f_loop.cu")


def _specs() -> dict[str, KernelSpec]:
    return {
        "q4": KernelSpec(
            "mb_q4_gemv",
            [("x", "T", 2), ("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)],
            [("y", "T")],
            _HEAD + _Q4_LOOP + _TAIL,
            _HEADER,
        ),
        "float": KernelSpec(
            "mb_gemv",
            [("x", "T", 2), ("w", "T", 2)],
            [("y", "T")],
            _HEAD + _F_LOOP + _TAIL,
            _HEADER,
        ),
    }


# one kernel object per template values (engine/backends/cuda/kernels.py: less host time a call)
_kernel = Baked(_specs, ensure_row_contiguous=True)


def _mmax(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def _rows_per_warp(n: int, mmax: int) -> int:
    want = 4 if mmax <= 4 else 2
    while n % want:
        want //= 2
    return want


def quant_supported(x_dtype, n: int, k: int, bits: int, group_size: int, mode: str, biases) -> bool:
    import mlx.core as mx

    return (
        platform.cuda_available()
        and x_dtype in (mx.bfloat16, mx.float16)
        and bits == 4
        and mode == "affine"
        and biases is not None
        and group_size % 32 == 0
        and k % group_size == 0
        and n > 0
    )


def float_supported(x_dtype, w_dtype, k: int) -> bool:
    import mlx.core as mx

    return (
        platform.cuda_available()
        and x_dtype in (mx.bfloat16, mx.float16)
        and w_dtype == x_dtype
        and k % 8 == 0
    )


def _call(kind: str, x, inputs: list, n: int, template: tuple):
    """One kernel call per MAX_ROWS rows of ``x`` [M, K]."""
    import mlx.core as mx

    m = x.shape[0]
    outs = []
    for r0 in range(0, m, MAX_ROWS):
        xs = x if m <= MAX_ROWS else x[r0 : r0 + MAX_ROWS]
        rows = xs.shape[0]
        mmax = _mmax(rows)
        r = _rows_per_warp(n, mmax)
        blocks = -(-n // (r * WARPS))
        outs.append(
            _kernel(kind, (("T", x.dtype), ("MMAX", mmax), ("R", r), ("WARPS", WARPS)) + template)(
                inputs=[xs] + inputs,
                grid=(blocks * WARPS * 32, 1, 1),
                threadgroup=(WARPS * 32, 1, 1),
                output_shapes=[(rows, n)],
                output_dtypes=[x.dtype],
            )[0]
        )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def quantized_gemv(x, w, scales, biases, group_size: int):
    """``x @ dequantize(w).T`` for 4-bit affine ``w`` [N, K/8] uint32; x [M, K]."""
    return _call("q4", x, [w, scales, biases], w.shape[0], (("GS", group_size),))


def gemv(x, w):
    """``x @ w.T`` for a float ``w`` [N, K]; x [M, K]."""
    return _call("float", x, [w], w.shape[0], ())


def warm(dtype, group_sizes=(64,), quantized: bool = True, float_: bool = True) -> None:
    """Compile every row-count variant now (1, 2, 4 and 8 rows) of the kernels asked
    for (4-bit per group size, float), so that no request waits on NVRTC."""
    import mlx.core as mx

    k, n = 256, 64
    wf = mx.zeros((n, k), dtype=dtype)
    for m in (1, 2, 4, 8):
        x = mx.zeros((m, k), dtype=dtype)
        outs = [gemv(x, wf)] if float_ else []
        for gs in group_sizes if quantized else ():
            w = mx.zeros((n, k // 8), dtype=mx.uint32)
            s = mx.ones((n, k // gs), dtype=dtype)
            outs.append(quantized_gemv(x, w, s, s, gs))
        mx.eval(outs)


def kernel_specs_for_check() -> list[KernelSpec]:
    out = []
    for kind, spec in _specs().items():
        for dtype in ("bfloat16", "float16"):
            for mmax in (1, 2, 4, 8):
                r = _rows_per_warp(4096, mmax)
                tmpl = [("T", dtype), ("MMAX", mmax), ("R", r), ("WARPS", WARPS)]
                if kind == "q4":
                    tmpl.append(("GS", 64))
                out.append(for_dtype(spec, dtype, f"{spec.name}_{dtype}_{mmax}_{r}", tmpl))
    return out


# the names engine/backends/cuda/linear.py calls (the same as engine/backends/cuda/products/mma.py's)
matmul = gemv
quantized_matmul = quantized_gemv
