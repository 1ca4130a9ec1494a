"""Prompt (prefill) attention as one CUDA kernel: causal, any cached prefix, GQA.

Why: MLX 0.32.4's CUDA attention for many query rows is either cuDNN's, which builds
an execution graph per (query length, key length) and so cost every prompt length
not seen before 0.1-0.6 s of time to first token on the H200, or, with cuDNN off
(what ``markbase serve`` sets, engine/backends/cuda/setup.py), separate matmul / softmax /
matmul kernels that write the whole score matrix to memory: a 2048-token prefill of
the 1b model took 37 ms against PyTorch's 13 (docs/performance.md). This
kernel is FlashAttention-2's forward pass: scores stay in registers, an online
softmax per row, and the lengths are runtime values, so one compiled kernel serves
every prompt length and every prefix length (a chunk after a prefix-cache hit).

Layout: a block takes 64 query rows of one query head (4 warps, 16 rows each, as
``mma.sync.m16n8k16`` A fragments held in registers for the whole pass) and walks
the keys in tiles of 64 staged through shared memory (by default two buffers: the
next tile's ``cp.async`` copies run while this one is used; ``STAGES_ENV``). Per tile a warp computes its
16 x 64 scores on tensor cores, masks past its rows' causal limit (only on the tiles
that need it), rescales its running output, and multiplies the probabilities (kept
as bf16/fp16 in the registers the score accumulators left, as the next MMA's A
operand) by the V tile. Blocks that see the most keys are launched first.

Queries ``q`` [B, Hq, L, D] and the cache's ``keys``/``values`` [B, Hkv, S, D] with
S >= L (the last L keys are this chunk's: query row i sees keys ``<= S - L + i``),
any strides with a contiguous last dim. bf16 or fp16, D of 64 or 128. Only on a CUDA
GPU; ``bench/gpu/nvrtc_check.py`` compiles the source without one and
``tests/backends/cuda/test_gpu_prefill_attention.py`` checks it against MLX's attention on one.
``MARKBASE_GPU_PREFILL_ATTENTION=mlx`` turns it off (``=kernel``, the default, on).
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype
from engine.backends.cuda.kernels import source as _source

BLOCK_Q = 64  # query rows a block (16 a warp)
BLOCK_K = 64  # keys a tile
THREADS = BLOCK_Q // 16 * 32  # a warp a 16-row MMA tile of queries
HEAD_DIMS = (64, 128)
ENV = "MARKBASE_GPU_PREFILL_ATTENTION"
# 2: the next K/V tile is copied by cp.async while this one is used (2 buffers, 70 KB
# of shared memory at D 128); 1: loaded through registers between two barriers
STAGES_ENV = "MARKBASE_GPU_PREFILL_ATTN_STAGES"
# 1: K and V fragments by ldmatrix (one instruction feeds two MMAs; V transposed on
# the way); 0: 32-bit (K) and 16-bit (V) shared loads, two and four an MMA
LDM_ENV = "MARKBASE_GPU_PREFILL_ATTN_LDM"

_HEADER = _source("attention/prefill/header.cuh")

_SOURCE = _source("attention/prefill/source.cu")


@cache
def _specs() -> dict[str, KernelSpec]:
    MMA_HEADER = _source("products/mma/header.cuh")

    inputs = [("q", "T", 4), ("keys", "T", 4), ("values", "T", 4), ("scale", "float32", 1)]
    return {
        "causal": KernelSpec(
            "mb_prefill_attn", inputs, [("out", "T")], _SOURCE, MMA_HEADER + _HEADER
        )
    }


_kernel = Baked(_specs, ensure_row_contiguous=False)


# on: its GPU tests pass on an H100 and alone it is 2.8-4.6x faster than MLX's
# attention in the same process (docs/performance.md)
DEFAULT = "kernel"


def enabled() -> bool:
    return envs.value(ENV) == "kernel"


def shape_supported(queries, keys, values, mask) -> bool:
    """Whether the kernel can compute this call: a causal prompt chunk (2+ query rows)
    of bf16/fp16, head dim 64 or 128, whole query groups per KV head."""
    import mlx.core as mx

    if not (isinstance(mask, str) and mask == "causal") or queries.ndim != 4:
        return False
    _, hq, lq, d = queries.shape
    if lq < 2 or d not in HEAD_DIMS or keys.ndim != 4 or keys.shape[3] != d:
        return False
    if keys.shape[0] != queries.shape[0] or keys.shape[2] < lq or hq % keys.shape[1]:
        return False
    if queries.dtype not in (mx.bfloat16, mx.float16):
        return False
    return (
        keys.dtype == queries.dtype
        and values.dtype == queries.dtype
        and (values.shape == keys.shape)
    )


def supported(queries, keys, values, mask) -> bool:
    """``shape_supported`` on a CUDA GPU, unless MARKBASE_GPU_PREFILL_ATTENTION=mlx
    (the shape first: every attention call of a model asks)."""

    if not shape_supported(queries, keys, values, mask) or not enabled():
        return False
    return platform.on_cuda()


def stages() -> int:
    return int(envs.value(STAGES_ENV))


def use_ldmatrix() -> bool:
    return envs.value(LDM_ENV)


def shared_bytes(head_dim: int, itemsize: int, n_stages: int) -> int:
    """Dynamic shared memory a block: K and V tiles, rows padded by 8 elements."""
    return 2 * n_stages * BLOCK_K * (head_dim + 8) * itemsize


def prefill_attention(queries, keys, values, scale: float):
    """softmax(q k^T * scale, causal with the keys' last L rows this chunk) v: [B, Hq, L, D]."""
    from engine.backends.cuda.products.mma import device_scalar

    b, hq, lq, d = queries.shape
    s = device_scalar(float(scale))  # not a [1] array: those sit in managed memory
    blocks = (lq + BLOCK_Q - 1) // BLOCK_Q
    n = stages()
    kern = _kernel(
        "causal",
        (("T", queries.dtype), ("HD", d), ("STAGES", n), ("LDM", use_ldmatrix())),
        shared_bytes(d, queries.dtype.size, n),
    )
    return kern(
        inputs=[queries, keys, values, s],
        grid=(blocks * THREADS, hq, b),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, hq, lq, d)],
        output_dtypes=[queries.dtype],
    )[0]


def kernel_specs_for_check() -> list[KernelSpec]:
    """The source with concrete template values (bench/gpu/nvrtc_check.py)."""
    spec = _specs()["causal"]
    return [
        for_dtype(
            spec,
            dtype,
            f"{spec.name}_{dtype}_{hd}_{n}_{int(ldm)}",
            [("T", dtype), ("HD", hd), ("STAGES", n), ("LDM", ldm)],
        )
        for dtype in ("bfloat16", "float16")
        for hd in HEAD_DIMS
        for n in (1, 2)
        for ldm in (False, True)
    ]
