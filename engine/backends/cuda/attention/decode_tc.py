"""Decode attention with RoPE and the KV append on tensor cores, one warp a (row, KV head).

Why: engine/backends/cuda/attention/decode.py's kernel works on CUDA cores: per position a warp takes
G dot products of head_dim values, reduced across its lanes by 5 shuffles each, and
G weighted sums. With many rows that is instruction-bound, not bandwidth-bound: at the
8b model's B=128 (H100) it took 163 us a layer for ~300 MB of KV (1.8 TB/s,
5.2 ms of the 19.8 ms 4-bit step), at the 1b's 142 us for ~150 MB (1.0 TB/s, a third of
the step). Here the G query heads of a KV head are the rows of an ``mma.sync.m16n8k16``
A fragment (rows G..15 zero), and a warp walks its row's keys in tiles of BK: the K and
V tiles come into shared memory by ``cp.async`` (the next tile's copy runs while this
one is used), ``ldmatrix`` gives the MMA fragments (V transposed on the way), and the
online softmax works on the score accumulators as engine/backends/cuda/attention/prefill.py's
(GPU-tested) prompt kernel does: the scores of a 16-key step become the A fragment of
the P.V product in registers. Per 16 keys a warp issues ~2 ldmatrix and ~4 MMAs a
16 dims instead of ~1,000 CUDA-core instructions.

The append form as engine/backends/cuda/attention/decode.py's: q and the new k get RoPE here (the same
formula, rounded to T as MLX's rope writes it), the new k and v go into the cache
buffers at slot t_len - 1, and the tile holding that slot takes them from shared memory
(not from the buffer being written). No splits over time: one warp a (row, KV head),
so it is for launches with enough rows to fill the GPU (engine/backends/cuda/attention/decode.py uses
it where its own launch would not split, unless ``MARKBASE_GPU_ATTN_TC=0`` or a fixed
loop shape without ``c``). The split form (``SPLIT``; off with
``MARKBASE_GPU_ATTN_TC_SPLIT=0`` or a fixed shape without ``s``) is for few rows: one
block a (row, KV head), its warps taking every WARPS-th tile, merged through shared
memory at the end; no partials through global memory, no counters, no last-block
merge (the one-row attention of the 8b model takes 20.5 us a call on CUDA cores, 22% of
the 4-bit step, for 2.4 MB). The first tiles' copies are issued before the RoPE is
computed. bf16/fp16, head_dim 64 or 128, at most
8 query heads a KV head.
Only on a CUDA GPU; ``bench/gpu/nvrtc_check.py`` compiles it without one.
"""

from __future__ import annotations

from functools import cache

from engine import envs
from engine.backends.cuda.attention.common import APPEND_INPUTS
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype
from engine.backends.cuda.kernels import source as _source

ENV = "MARKBASE_GPU_ATTN_TC"
SPLIT_ENV = "MARKBASE_GPU_ATTN_TC_SPLIT"
WARPS_ENV = "MARKBASE_GPU_ATTN_TC_WARPS"
SPLIT_WARPS_ENV = "MARKBASE_GPU_ATTN_TC_SPLIT_WARPS"
BK_ENV = "MARKBASE_GPU_ATTN_TC_BK"
STAGES_ENV = "MARKBASE_GPU_ATTN_TC_STAGES"
SPLIT_STAGES_ENV = "MARKBASE_GPU_ATTN_TC_SPLIT_STAGES"
# the split form where the CUDA-core kernel would take at most this many blocks along
# time (~128 positions each): past that one block a (row, KV head) reads too little
# of HBM's bandwidth
MAX_SPLITS = 16
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads a KV head: the A fragment's rows 0-7

_SOURCE = _source("attention/decode_tc/source.cu")


def _header(scale: float, rope_scale: float) -> str:
    LAST_BLOCK = _source("attention/decode/last_block.cuh")
    CP_HEADER = _source("attention/prefill/header.cuh")
    MMA_HEADER = _source("products/mma/header.cuh")

    head = f"#define MB_SCALE {float(scale)!r}f\n#define MB_ROPE_SCALE {float(rope_scale)!r}f\n"
    return head + MMA_HEADER + CP_HEADER + LAST_BLOCK


def _specs(scale: float, rope_scale: float) -> dict[str, KernelSpec]:
    header = _header(scale, rope_scale)
    return {
        "append_tc": KernelSpec(
            "mb_decode_attn_tc", APPEND_INPUTS, [("out", "T")], _SOURCE, header
        ),
    }


@cache
def _kernels(scale: float, rope_scale: float) -> Baked:
    return Baked(lambda: _specs(scale, rope_scale), ensure_row_contiguous=False)


def enabled() -> bool:
    """On unless ``MARKBASE_GPU_ATTN_TC=0``. Measured on an H100 (CUPTI,
    ~512 positions): 8b B=128 146.8 -> 97.1 us a call, 1b B=128 115.1 -> 50.2, 8b B=64
    78.6 -> 55.4; the engine's 1b 4-bit B=128 25,652 -> 36,959 tok/s, 8b 6,912 ->
    7,188 (docs/performance.md)."""
    return envs.value(ENV)


def split_enabled() -> bool:
    """The launches the CUDA-core kernel splits over time (few rows) as one block a
    (row, KV head) whose warps share the tiles; on unless ``MARKBASE_GPU_ATTN_TC_SPLIT=0``.
    Measured (H100, 600 positions): 8b one row 20.5 -> 17.7 us a call, 8b
    B=8 28.1 -> 17.4, 1b one row 18.5 -> 12.2; the 8b 4-bit B=1 step 2.97 -> 2.81 ms."""
    return envs.value(SPLIT_ENV)


MAX_SHARED = 227 << 10  # dynamic shared memory a block may have (H100/H200)


def stages(split: bool, warps: int, bk: int, group: int, head_dim: int) -> int:
    """K/V tiles in flight a warp, plus the one in use: ``MARKBASE_GPU_ATTN_TC_STAGES``
    (``_SPLIT_STAGES`` for the split form; 2-4, default 2), fewer where the block's
    shared memory would pass MAX_SHARED. Why: the split form at one row waits ~1 us a
    tile a warp with one tile in flight (8b, 600 and 2,000 positions: 17.7 and 31.7 us a
    call); more in flight is the knob to measure."""
    name = SPLIT_STAGES_ENV if split else STAGES_ENV
    want = int(envs.value(name))
    while want > 2 and shared_bytes(warps, bk, group, head_dim, want) > MAX_SHARED:
        want -= 1
    return want


def geometry(split: bool = False) -> tuple[int, int]:
    """(warps a block, keys a tile): ``MARKBASE_GPU_ATTN_TC_WARPS`` (1/2/4/8, default
    4; with ``split`` ``MARKBASE_GPU_ATTN_TC_SPLIT_WARPS``, default 8) and
    ``MARKBASE_GPU_ATTN_TC_BK`` (16/32, default 16), checked."""
    name = SPLIT_WARPS_ENV if split else WARPS_ENV
    return int(envs.value(name)), int(envs.value(BK_ENV))


def supported(group: int, head_dim: int, dtype) -> bool:
    import mlx.core as mx

    return dtype in (mx.bfloat16, mx.float16) and head_dim in HEAD_DIMS and group <= MAX_GROUP


def shared_bytes(warps: int, bk: int, group: int, head_dim: int, n_stages: int = 2) -> int:
    """Per warp: K and V tiles in ``n_stages`` stages, the RoPE'd query heads, the new k
    and v, the RoPE's cos and sin (float, head_dim/2 each)."""
    return warps * (2 * n_stages * bk * (head_dim + 8) + (group + 4) * head_dim) * 2


def launch(inputs, rows: int, n_kv: int, group: int, head_dim: int, dtype, scale, rope_scale,
           traditional: bool, whole_buffers: bool, split: bool = False,
           warps: int | None = None, bk: int | None = None):  # fmt: skip
    """``decode_attention_append``'s inputs (qkv, keys, values, start, pos, inv_freq) ->
    the attention [rows, Hq, 1, D]; the new k and v written into the buffers. ``split``:
    one block a (row, KV head), its warps taking every WARPS-th tile, merged in the
    block; else one warp a (row, KV head)."""
    dw, dbk = geometry(split)
    warps, bk = warps or dw, bk or dbk
    stg = stages(split, warps, bk, group, head_dim)
    template = (("T", dtype), ("HD", head_dim), ("G", group), ("WARPS", warps), ("BK", bk))
    template += (("TRAD", traditional), ("TPOS", whole_buffers), ("SPLIT", split), ("STG", stg))
    kern = _kernels(float(scale), float(rope_scale))
    smem = shared_bytes(warps, bk, group, head_dim, stg)
    fn = kern("append_tc", template, smem)
    blocks = rows * n_kv if split else -(-rows * n_kv // warps)
    return fn(
        inputs=inputs,
        grid=(blocks * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, n_kv * group, 1, head_dim)],
        output_dtypes=[dtype],
    )[0]


def kernel_specs_for_check() -> list[KernelSpec]:
    """The source with concrete template values (bench/gpu/nvrtc_check.py)."""
    specs = _specs(0.125, 1.0)
    spec = specs["append_tc"]
    out = []
    for dtype in ("bfloat16", "float16"):
        for hd, g, warps, bk, trad, split, stg in ((128, 4, 4, 16, False, False, 2),
                                                   (64, 4, 4, 32, True, False, 2),
                                                   (128, 8, 2, 32, False, False, 2),
                                                   (64, 1, 4, 16, False, False, 3),
                                                   (128, 4, 8, 16, False, True, 2),
                                                   (128, 4, 8, 16, False, True, 3),
                                                   (128, 8, 8, 16, True, True, 2),
                                                   (128, 4, 4, 16, False, True, 4),
                                                   (64, 4, 4, 32, False, True, 2)):  # fmt: skip
            tmpl = [("T", dtype), ("HD", hd), ("G", g), ("WARPS", warps), ("BK", bk)]
            tmpl += [("TRAD", trad), ("TPOS", bk == 16), ("SPLIT", split), ("STG", stg)]
            name = f"{spec.name}_{dtype}_{hd}_{g}_{warps}_{bk}_{int(split)}_{stg}"
            out.append(for_dtype(spec, dtype, name, tmpl))
    return out
