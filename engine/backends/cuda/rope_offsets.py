"""RoPE's position offset in device memory for prompt chunks on a CUDA GPU.

Why: a prompt chunk's attention layers call their RoPE module with the cache's offset
as a Python int (engine/kv.py's ``SequenceKV``), and ``mx.fast.rope`` turns an int
into a 4-byte array made on the host. MLX's CUDA allocator keeps every array of 8
bytes or less in one pool of managed memory, and its rope kernel reads the offset
through that pointer in every thread: a read across PCIe that costs a wide kernel
~11 us (a 9 MiB read kernel, H100: 15.9 against 4.7 us a launch, bench/gpu/pool_cost.py). At 8b that is two such reads a layer, 64 a prompt chunk. Here an int
offset becomes a view of a 16-byte array a GPU op made (device memory), made once
per offset and shared by the chunk's layers: one tiny kernel a chunk. Measured (H100, CUPTI): a 1b 4-bit 2k chunk's rope kernels 345-380 us with it, 528 us
without: -5.7 us a call (-0.18 ms a chunk; predicted -0.35); through the engine the
effect was smaller than the noise between processes.

Only RoPE classes whose ``__call__`` hands ``offset`` straight to ``mx.fast.rope``
are patched (``PASS_THROUGH``: MLX's ``nn.RoPE``, mlx-lm's ``Llama3RoPE``); others
(do arithmetic on an int offset) are left alone. The patch is on the class, so the
module's type stays what engine/gpu_attention.rope_table checks; it converts only
while MLX's default device is a GPU. ``MARKBASE_GPU_ROPE_DEVICE_OFFSET=0`` turns it off.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn

from engine import envs, platform
from engine.backends.cuda.products.mma import (
    SCALAR_WORDS,  # 16 bytes: past MLX's CUDA pool of tiny arrays
)

ENV = "MARKBASE_GPU_ROPE_DEVICE_OFFSET"
KEEP = 16  # offsets remembered a thread (a chunk's layers share one)


def pass_through_classes() -> tuple[type, ...]:
    classes: list[type] = [nn.RoPE]
    try:
        from mlx_lm.models.rope_utils import Llama3RoPE

        classes.append(Llama3RoPE)
    except ImportError:  # an mlx-lm without it
        pass
    return tuple(classes)


_patched: set = set()
_local = threading.local()
force_on_cpu = False  # tests: convert on the CPU too


def enabled() -> bool:
    return envs.value(ENV)


def device_offset(offset: int) -> mx.array:
    """``offset`` as an int32 [1] view of a 16-byte array made by a GPU op, one per
    value and thread (each model's worker thread has its own MLX stream)."""
    made = getattr(_local, "made", None)
    if made is None:
        made = _local.made = {}
    arr = made.get(offset)
    if arr is None:
        if len(made) >= KEEP:
            made.clear()
        arr = made[offset] = mx.full((SCALAR_WORDS,), offset, dtype=mx.int32)[:1]
    return arr


def _converting() -> bool:
    return force_on_cpu or platform.on_gpu()


def install(model) -> int:
    """Patch the pass-through RoPE classes ``model`` uses (once per class); returns
    how many classes this call patched."""
    if not enabled():
        return 0
    classes = pass_through_classes()
    count = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls not in classes or cls in _patched:
            continue
        original = cls.__call__

        def call(self, x, offset=0, _original=original):
            if type(offset) is int and _converting():
                offset = device_offset(offset)
            return _original(self, x, offset)

        cls.__call__ = call
        _patched.add(cls)
        count += 1
    return count
