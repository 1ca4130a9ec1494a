"""Every custom CUDA kernel's specs with concrete template values, for the checks that
need no GPU: bench/gpu/nvrtc_check.py compiles each ``kernels.nvrtc_source`` with NVRTC,
tests/backends/cuda/test_kernel_sources.py checks them on the CPU. (Apart from
kernels.py, which every kernel module imports.)"""

from __future__ import annotations

from engine.backends.cuda import prefetch, sampler
from engine.backends.cuda.attention import decode, decode_tc
from engine.backends.cuda.attention import prefill as prefill_attention
from engine.backends.cuda.kernels import KernelSpec
from engine.backends.cuda.products import dequant, gemv, mma, moe, qgemm, qstream, wgmma

MODULES = (decode, decode_tc, gemv, mma, qstream, prefill_attention, qgemm, dequant, wgmma,
           prefetch, sampler, moe)  # fmt: skip


def all_specs() -> list[KernelSpec]:
    """Each module's ``kernel_specs_for_check``, in one list."""
    return [spec for m in MODULES for spec in m.kernel_specs_for_check()]
