"""The CUDA backend's public face: the only names generic code (engine/*.py,
engine/model/, server/) imports from engine/backends/cuda.

Inside: ``setup`` (process set-up before MLX starts), ``kernels`` (kernel specs, the
CUDA sources in ``csrc/``, MLX's ``cuda_kernel`` objects), ``linear`` (how each decode
product runs by rows), ``products/`` (the product kernels), ``attention/`` (decode and
prompt attention), ``sampler``, ``prefill`` and ``prefill_stages`` (prompt chunks),
``prefetch``, ``rope_offsets``.

Importing this package imports no MLX and no kernel module: each name below loads its
module at first use (PEP 562). server/cli.py takes ``default_ptx_cache_dir`` from here
before MLX is first imported, and a CPU process never loads the kernel modules unless
it asks for a CUDA name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module under engine.backends.cuda, its attribute)
_EXPORTS = {
    # process set-up (no MLX)
    "default_ptx_cache_dir": ("setup", "default_ptx_cache_dir"),
    "default_cuda_attention": ("setup", "default_cuda_attention"),
    # decode products by rows
    "GpuLinear": ("linear", "GpuLinear"),
    "GpuQuantizedLinear": ("linear", "GpuQuantizedLinear"),
    "linear_for_module": ("linear", "for_module"),
    "plan_uses": ("linear", "uses"),
    "warm_products": ("products.warmup", "warm_products"),
    "ensure_stream_k": ("products.qgemm", "ensure_stream_k"),
    "is_plain_quantized": ("prefill", "is_plain_quantized"),
    # decode attention
    "attention_supported": ("attention.decode", "supported"),
    "decode_attention": ("attention.decode", "decode_attention"),
    "decode_attention_append": ("attention.decode", "decode_attention_append"),
    "attention_splits": ("attention.decode", "append_splits"),
    "ensure_attention_counters": ("attention.decode", "ensure_counters"),
    "rope_table": ("attention.decode", "rope_table"),
    "warm_attention": ("attention.decode", "warm"),
    # prompt attention
    "prefill_attention_supported": ("attention.prefill", "supported"),
    "prefill_attention": ("attention.prefill", "prefill_attention"),
    # the L2 prefetch beside a one-row step's attention
    "l2_prefetch_enabled": ("prefetch", "enabled"),
    "l2_prefetch_takes": ("prefetch", "takes"),
    "l2_prefetch_launcher": ("prefetch", "launcher"),
    # prompt chunks
    "install_prefill": ("prefill", "install"),
    "install_rope_offsets": ("rope_offsets", "install"),
    "prefill_stage_every": ("prefill_stages", "every_from_env"),
    "prefill_staged": ("prefill_stages", "staged"),
    # mixture-of-experts layers: grouped expert products (engine/model/moe.py)
    "moe_supported": ("products.moe", "supported"),
    "moe_glu": ("products.moe", "glu"),
    "moe_product": ("products.moe", "product"),
    "MOE_MAX_TOKENS": ("products.moe", "MAX_TOKENS"),
    "dequantize": ("products.dequant", "dequantize"),
    # sampling
    "sampler_enabled": ("sampler", "enabled"),
    "sampler_takes": ("sampler", "takes"),
    "sampler_draw": ("sampler", "draw"),
    "SAMPLER_MIN_ROWS": ("sampler", "MIN_ROWS"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for readers and type checkers: what each name is
    from engine.backends.cuda.attention.decode import append_splits as attention_splits
    from engine.backends.cuda.attention.decode import (
        decode_attention,
        decode_attention_append,
        rope_table,
    )
    from engine.backends.cuda.attention.decode import ensure_counters as ensure_attention_counters
    from engine.backends.cuda.attention.decode import supported as attention_supported
    from engine.backends.cuda.attention.decode import warm as warm_attention
    from engine.backends.cuda.attention.prefill import prefill_attention
    from engine.backends.cuda.attention.prefill import supported as prefill_attention_supported
    from engine.backends.cuda.linear import GpuLinear, GpuQuantizedLinear
    from engine.backends.cuda.linear import for_module as linear_for_module
    from engine.backends.cuda.linear import uses as plan_uses
    from engine.backends.cuda.prefetch import enabled as l2_prefetch_enabled
    from engine.backends.cuda.prefetch import launcher as l2_prefetch_launcher
    from engine.backends.cuda.prefetch import takes as l2_prefetch_takes
    from engine.backends.cuda.prefill import install as install_prefill
    from engine.backends.cuda.prefill import is_plain_quantized
    from engine.backends.cuda.prefill_stages import every_from_env as prefill_stage_every
    from engine.backends.cuda.prefill_stages import staged as prefill_staged
    from engine.backends.cuda.products.dequant import dequantize
    from engine.backends.cuda.products.moe import MAX_TOKENS as MOE_MAX_TOKENS
    from engine.backends.cuda.products.moe import glu as moe_glu
    from engine.backends.cuda.products.moe import product as moe_product
    from engine.backends.cuda.products.moe import supported as moe_supported
    from engine.backends.cuda.products.qgemm import ensure_stream_k
    from engine.backends.cuda.products.warmup import warm_products
    from engine.backends.cuda.rope_offsets import install as install_rope_offsets
    from engine.backends.cuda.sampler import MIN_ROWS as SAMPLER_MIN_ROWS
    from engine.backends.cuda.sampler import draw as sampler_draw
    from engine.backends.cuda.sampler import enabled as sampler_enabled
    from engine.backends.cuda.sampler import takes as sampler_takes
    from engine.backends.cuda.setup import default_cuda_attention, default_ptx_cache_dir
