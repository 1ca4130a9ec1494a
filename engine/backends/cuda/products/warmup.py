"""Compile every product kernel variant a decode step can call, before it serves.

Which variant a step runs depends on its rows, so the warm-up (engine/worker.py, through
``FusedDecodeStep.warm_up``) compiles them all now: NVRTC takes about a second each, and
MLX keeps the PTX on disk, so only a machine's first start pays.

``products``: the step's (linear, residual, glu, normed) per product, ``normed`` when an
RMSNorm comes before it; the output layer is added by ``lm_head``.
"""

from __future__ import annotations

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.linear import GpuLinear, GpuQuantizedLinear
from engine.backends.cuda.products import gemv as gpu_gemv
from engine.backends.cuda.products import mma as gpu_mma
from engine.backends.cuda.products import qgemm as gpu_qgemm
from engine.backends.cuda.products import qstream as gpu_qstream
from engine.backends.cuda.products import wgmma as gpu_wgmma


def warm_products(dtype, groups: tuple, products: list, lm_head, fold: bool) -> None:
    """The variants of the kernels the current plans name: ``groups`` the 4-bit group
    sizes the model has; ``fold``: the step hands RMSNorms to the 1-row products."""
    with_head = products + [(lm_head, False, False, True)]
    quantized, float_ = gpu_linear.uses("qgemv") and bool(groups), gpu_linear.uses("gemv")
    if quantized or float_:
        gpu_gemv.warm(dtype, groups, quantized=quantized, float_=float_)
    if gpu_linear.uses("mma") or gpu_linear.uses("qmma") or gpu_linear.uses("qstream"):
        gpu_mma.warm(dtype, _mma_products(dtype, products))
    if gpu_linear.uses("qstream"):
        gpu_qstream.warm(dtype, _qstream_products(dtype, with_head, fold))
    if gpu_linear.uses("qgemm"):
        gpu_qgemm.warm(dtype, _qgemm_products(dtype, with_head))
        if gpu_wgmma.enabled():
            gpu_wgmma.warm(dtype, _qgemm_products(dtype, with_head, gpu_wgmma.supported))


def _mma_products(dtype, products) -> set:
    """(group size or 0, K, N, residual, glu) of every product the step can send to
    engine/backends/cuda/products/mma.py (gpu_mma.warm compiles their variants)."""
    quant = gpu_linear.uses("qmma") or gpu_linear.uses("qstream")
    float_ = gpu_linear.uses("mma")
    out = set()
    for linear, residual, glu, _ in products:
        if quant and isinstance(linear, GpuQuantizedLinear):
            n, k = linear.weight.shape[0], linear.scales.shape[-1] * linear.group_size
            if gpu_mma.quant_supported(
                dtype, n, k, linear.bits, linear.group_size, linear.mode, linear.biases
            ):
                out.add((linear.group_size, k, n, residual, glu))
        elif float_ and isinstance(linear, GpuLinear):
            n, k = linear.weight.shape
            if gpu_mma.float_supported(dtype, linear.weight.dtype, n, k):
                out.add((0, k, n, residual, glu))
    return out


def _qgemm_products(dtype, products, supported=None) -> set:
    """(group size, K, N, residual, glu) of every product the step can send to
    engine/backends/cuda/products/qgemm.py (the output layer too: gpu_qgemm.takes may give
    it to the kernel), or to the kernel whose ``supported`` is given (wgmma's)."""
    out = set()
    for linear, residual, glu, _ in products:
        if not isinstance(linear, GpuQuantizedLinear):
            continue
        n, k = linear.weight.shape[0], linear.scales.shape[-1] * linear.group_size
        if (supported or gpu_qgemm.supported)(
            dtype, n, k, linear.bits, linear.group_size, linear.mode, linear.biases
        ):
            out.add((linear.group_size, k, n, residual, glu))
    return out


def _qstream_products(dtype, products, fold: bool) -> set:
    """(group size, K, residual, glu, norm) of every 1-row product the step can send to
    engine/backends/cuda/products/qstream.py (the lm_head too: it has the qkv's K, so
    shares its kernel on llama shapes, but a model need not)."""
    out = set()
    for linear, residual, glu, normed in products:
        if not isinstance(linear, GpuQuantizedLinear):
            continue
        n, k = linear.weight.shape[0], linear.scales.shape[-1] * linear.group_size
        if gpu_qstream.supported(
            dtype, 1, n, k, linear.bits, linear.group_size, linear.mode, linear.biases
        ):
            norm = normed and fold and gpu_qstream.takes_norm(n, glu)
            out.add((linear.group_size, k, residual, glu, norm))
    return out
