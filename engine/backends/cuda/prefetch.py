"""L2 prefetch of a layer's o_proj weights and the first rows of its gate/up weights,
run beside the one-row decode attention (on by default on CUDA;
``MARKBASE_GPU_L2_PREFETCH=0`` turns it off).

Why: at one row the attention kernel takes ~10-13 us a layer on 8 of 132 SMs and
reads ~2.4 MB, so HBM idles for it (docs/performance.md), while the
next two products (o_proj, gate/up: ~75 MB at 8b 4-bit) are the step's bandwidth.
Asking L2 for the start of them while the attention runs moves that much of their
reading into a stretch where HBM would otherwise idle.

How it runs beside the attention: MLX's CUDA graphs order nodes by the buffers they
read and write, nothing else (mlx/backend/cuda/device.cpp). This kernel reads the
q/k/v product (``dep``, not used: only so that it starts when the attention does,
not at the graph's start) and the layer's input (``r``), and writes a copy of ``r``
that o_proj then takes as its residual: so it depends on what the attention depends
on, and o_proj waits for both, which keeps it from being dropped by MLX's lazy
evaluation. Each thread issues ``prefetch.global.L2`` a 128-byte line at a time, a hint
no thread waits on.

the measured try at this (a small kernel before the attention, ``cp.async.bulk.
prefetch.L2`` over 24-40 MB from a few threads, in series with it) made the step 1.7x
slower, not looked into; this one is beside the attention, spread over every SM, and
line by line. Measured on an H100 (docs/performance.md; 8b 4-bit, one
row): it overlaps the attention (kernel sum 2.91 ms, GPU busy 2.63), o_proj 7.5 -> 6.4
us a call, gate/up 28.2 -> 26.6, the attention 13.0 -> 14.4 (it shares the GPU); the
step 2.686/2.673 -> 2.640/2.635 ms (12 MiB; 30 MiB: no gain); with the early loads of
engine/backends/cuda/products/qstream.py, the served engine's step 2.668 -> 2.564-2.583 ms. Not yet
measured on an H200.
"""

from __future__ import annotations

from engine import envs, platform
from engine.backends.cuda.kernels import SMS, Baked, KernelSpec, for_dtype, one_output_call
from engine.backends.cuda.kernels import source as _source

THREADS = 256
DEFAULT_MB = 12  # of the gate/up weight (with its scales and biases), besides all of o_proj

_HEADER = _source("prefetch/header.cuh")

_BODY = _source("prefetch/body.cu")

_INPUTS = [
    ("r", "T", 2),
    ("dep", "T", 2),
    ("wo", "uint32", 2),
    ("so", "T", 2),
    ("bo", "T", 2),
    ("wgu", "uint32", 2),
    ("sgu", "T", 2),
    ("bgu", "T", 2),
]


def _specs() -> dict[str, KernelSpec]:
    return {"pf": KernelSpec("mb_l2_prefetch", _INPUTS, [("out", "T")], _BODY, _HEADER)}


_kernel = Baked(_specs, ensure_row_contiguous=True)


def enabled() -> bool:
    return envs.MARKBASE_GPU_L2_PREFETCH


def gate_up_rows(gate_up) -> int:
    """Rows of each half of gate/up to prefetch: ``MARKBASE_GPU_L2_PREFETCH_MB``
    (default ``DEFAULT_MB``) of weights, scales and biases, split over the two halves."""
    mb = envs.MARKBASE_GPU_L2_PREFETCH_MB
    row_bytes = gate_up.weight.shape[1] * 4 + 2 * gate_up.scales.shape[1] * 2
    return max(0, int(mb * (1 << 20) / (2 * row_bytes)))


def takes(x, o_proj, gate_up) -> bool:
    """One row, and both products 4-bit with scales and biases in x's dtype."""
    import mlx.core as mx

    if x.ndim != 2 or x.shape[0] != 1 or not platform.cuda_available():
        return False
    for lin in (o_proj, gate_up):
        if not all(hasattr(lin, a) for a in ("weight", "scales", "biases")):
            return False
        if lin.biases is None or lin.weight.dtype != mx.uint32 or lin.scales.dtype != x.dtype:
            return False
    return True


def launcher(dtype, shape: tuple, o_proj, gate_up, rows: int | None = None):
    """``call(x, dep)`` -> a copy of ``x`` (``shape``, [1, D]) made by the prefetch
    kernel (see the module's docstring); ``dep``: the array whose kernel the attention
    waits for too (the q/k/v product); ``rows``: of each gate/up half (``gate_up_rows``
    when None). Worked out once, outside the per-call path."""
    if rows is None:
        rows = gate_up_rows(gate_up)
    kern = _kernel("pf", (("T", dtype), ("ROWS", rows)))
    call = one_output_call(kern, (SMS * THREADS, 1, 1), (THREADS, 1, 1), shape, dtype)
    weights = [o_proj.weight, o_proj.scales, o_proj.biases]
    weights += [gate_up.weight, gate_up.scales, gate_up.biases]
    return lambda x, dep: call([x, dep, *weights])


def residual_after(x, dep, o_proj, gate_up, rows: int):
    """``launcher``'s call made and run once (tests)."""
    return launcher(x.dtype, x.shape, o_proj, gate_up, rows)(x, dep)


def kernel_specs_for_check() -> list[KernelSpec]:
    out = []
    for spec in _specs().values():
        for dtype in ("bfloat16", "float16"):
            tmpl = [("T", dtype), ("ROWS", 1536)]
            out.append(for_dtype(spec, dtype, f"{spec.name}_{dtype}", tmpl))
    return out
