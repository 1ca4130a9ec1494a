"""The CPU backend's public face: the only names generic code (engine/*.py,
engine/model/, engine/loading/, server/) imports from engine/backends/cpu.

Inside: ``blas`` (MLX's float32 matmuls bound to a fast system BLAS, and the C shim in
``native/``), ``qgemm`` (4-bit decode products from quantized copies of float32
weights), ``step`` (the lean decode step), ``native_step`` (the llama and Gemma 3 decode step as one C call), ``attention`` (``sdpa``: attention with the softmax
inside the score product), ``fast_math`` (exp and SwiGLU without MLX's
slow exp), ``tuning`` (the weight format per machine).

Importing this package imports no MLX: each name loads its module at first use (PEP
562), so server/cli.py can bind the BLAS before MLX is first imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module under engine.backends.cpu, its attribute)
_EXPORTS = {
    "ensure_fast_blas": ("blas", "ensure_fast_blas"),
    "warn_if_slow": ("blas", "warn_if_slow"),
    "install_fast_math": ("fast_math", "install"),
    "sdpa": ("attention", "sdpa"),
    "sdpa_supported": ("attention", "sdpa_supported"),
    "qgemm_available": ("qgemm", "available"),
    "register_qgemm_model": ("qgemm", "register_model"),
    "exact_qgemm": ("qgemm", "exact_products"),
    "shadow_of": ("qgemm", "shadow_of"),
    "shadow_of_codes": ("qgemm", "shadow_of_codes"),
    "CpuDecodeStep": ("step", "CpuDecodeStep"),
    "NativeDecodeStep": ("native_step", "NativeDecodeStep"),
    "best_cpu_weight_format": ("tuning", "best_cpu_weight_format"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from engine.backends.cpu.attention import sdpa, sdpa_supported
    from engine.backends.cpu.blas import ensure_fast_blas, warn_if_slow
    from engine.backends.cpu.fast_math import install as install_fast_math
    from engine.backends.cpu.native_step import NativeDecodeStep
    from engine.backends.cpu.qgemm import available as qgemm_available
    from engine.backends.cpu.qgemm import exact_products as exact_qgemm
    from engine.backends.cpu.qgemm import register_model as register_qgemm_model
    from engine.backends.cpu.qgemm import shadow_of, shadow_of_codes
    from engine.backends.cpu.step import CpuDecodeStep
    from engine.backends.cpu.tuning import best_cpu_weight_format
