"""Decode attention over the running batch's KV as one CUDA kernel.

Why: MLX's fused CUDA attention (cuDNN or its vector kernel) refuses an array mask in
a decode step, and the running batch needs one as soon as its rows differ in length
(left padding). The fallback, grouped matmuls under the mask (engine/model/attention.py),
costs about seven kernels per layer (scale, QK^T, mask, casts, softmax, PV), and on
the GPU each kernel costs host time: the decode step is host-bound up to ~32 rows
(docs/performance.md). This kernel reads each row's valid range ``[start[b], T)``
itself, so there is no mask at all, and it reads each K/V head once for the query
heads of its group.

Layout: one block per (time split, KV head, row); each warp walks its share of the
positions four at a time (loads first, so several are in flight), keeping an online
softmax per query head; the block's warps are merged in shared memory. When rows are
few, the time axis is split over several blocks (``splits``) so that enough blocks
run, and the last block of each (row, KV head) to finish merges the splits.

The append form (``decode_attention_append``) takes the fused q/k/v product before
RoPE, applies RoPE itself and writes the new position's k and v into the cache: RoPE
and the cache's two slice updates are then not separate graph nodes (3 a layer).

Inputs are MLX arrays as the decode step has them: ``q`` [B, Hq, 1, D] (any strides
with a contiguous last dim), ``keys``/``values`` [B, Hkv, T, D] views of the cache
buffers (``BatchKV.update_and_fetch``'s return; last dim contiguous), ``start`` [B]
int32. Only on a CUDA GPU; ``bench/gpu/nvrtc_check.py`` compiles the sources without
one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from engine import envs
from engine.backends.cuda.attention import decode_tc as tc
from engine.backends.cuda.attention.common import APPEND_INPUTS, CACHE_INPUTS
from engine.backends.cuda.kernels import SMS, Baked, KernelSpec, for_dtype
from engine.backends.cuda.kernels import source as _source

_SETUP = _source("attention/decode/setup.cu")

# q as the decode step hands it (RoPE'd, [B, Hq, 1, D]); every position from the cache
_Q_LOAD = _source("attention/decode/q_load.cu")

# The append form: q, k and v of the new position (t_len - 1) come straight from the
# row's qkv product and get their RoPE here (MLX's formula: angle = scale * position *
# inv_freq, rounded to T as MLX's rope writes it). The block whose time range holds
# the new position writes its k and v into the cache buffer behind keys/values (an
# input: MLX orders it by the stream, see decode_attention_append) and takes that
# position into the softmax from registers, so no block reads the slot being written.
_Q_ROPE = _source("attention/decode/q_rope.cu")

_SOFTMAX_INIT = _source("attention/decode/softmax_init.cu")

_LOOP = _source("attention/decode/loop.cu")

# the append form's new position, by one warp of the block that owns it (the block's
# warps are merged next, so any warp may take it)
_NEW_POSITION = _source("attention/decode/new_position.cu")

# the warp's PW positions-at-once kept separate softmaxes: merged across the lanes that
# read the same dims (lane ^ LP, ^ 2LP, ...) before the block's warps are merged
_SUB_MERGE = _source("attention/decode/sub_merge.cu")

_MERGE = _source("attention/decode/merge.cu")

_WRITE_OUT = _source("attention/decode/write_out.cu")

_WRITE_PARTS = _source("attention/decode/write_parts.cu")

# The split forms in one kernel: after writing its partial softmax, each block counts
# itself done on its (row, KV head)'s counter; the last one merges the splits (the
# merge kernel's work) and sets the counter back to 0 for the next launch. The counter
# array is an input that stays zero between launches (``_counters``); the partials are
# read through L2 (``__ldcg``: another block's writes, made visible by its fence).
_MERGE_LAST = _source("attention/decode/merge_last.cu")

POSITIONS_PER_BLOCK = 128  # each of 8 warps walks ~16 positions (4 rounds of 4 loads)


# VEC: a lane's PER values of one position as one 4/8/16-byte load (or two), kept as
# loaded until used, instead of PER scalar loads converted at once. Measured
# vector loads through ld.global.nc converted at once (with splits of ~32 positions):
# attention 30-50% slower, not understood. Needs each position's row aligned to the
# load: true for views [:, :, :T] of the cache buffers (head_dim * itemsize bytes a row).
_LOAD = _source("attention/decode/load.cuh")


# Whether this block is the last of the ``n`` blocks of its (row, KV head) to get here
# (each counts itself on ``cnt``, which is zero between launches: the last sets it back
# to 0); the same answer in every thread, and the other blocks' writes made before
# their count are visible to the last one (the fences). Also the tensor-core kernel's
# multi-block form (engine/backends/cuda/attention/decode_tc.py).
LAST_BLOCK = _source("attention/decode/last_block.cuh")


# The splits' partial softmaxes of one (row, query head) merged, for dim d: by the merge
# kernel (two-pass) and by the last block of a split (one-pass). Read through L2
# (``__ldcg``): in the one-pass form the partials are other blocks' writes.
_MERGE_SPLITS = _source("attention/decode/merge_splits.cuh")


def _header(scale: float, rope_scale: float = 1.0) -> str:
    head = f"#define MB_SCALE {float(scale)!r}f\n#define MB_ROPE_SCALE {float(rope_scale)!r}f\n"
    return head + _LOAD + _MERGE_SPLITS + LAST_BLOCK


@dataclass(frozen=True)
class LoopShape:
    """How the kernel walks the cache (bench/gpu/attn_bench.py, profile_step.py's
    suffixes). The field defaults are the measured shape; what the engine runs is
    ``auto_shape``'s, per launch, unless a shape is fixed."""

    lanes: int = 32  # lanes that share one position: 32/lanes positions a warp load
    u: int = 4  # positions a lane loads before it computes
    vec: bool = False  # a lane's values of a position as one vector load
    ppb: int = POSITIONS_PER_BLOCK  # fewest positions a block when rows split over time
    warps: int = 8  # warps a block (fewer where the merge buffer needs it: warps_for)
    # the append form's unsplit launches on tensor cores (engine/backends/cuda/attention/decode_tc.py;
    # without a fixed shape on unless MARKBASE_GPU_ATTN_TC=0)
    tc: bool = False
    # and its split launches (up to gpu_attention_tc.MAX_SPLITS) as one block a (row,
    # KV head); without a fixed shape on unless MARKBASE_GPU_ATTN_TC_SPLIT=0
    tc_split: bool = False

    def __post_init__(self) -> None:
        if self.lanes not in (8, 16, 32):
            raise ValueError(f"attention lanes a position {self.lanes}: 8, 16 or 32")
        if self.u not in (1, 2, 4, 8):
            raise ValueError(f"attention positions in flight {self.u}: 1, 2, 4 or 8")
        if self.ppb < 16:
            raise ValueError(f"attention positions a block {self.ppb}: at least 16")
        if self.warps not in (2, 4, 8):
            raise ValueError(f"attention warps a block {self.warps}: 2, 4 or 8")

    @classmethod
    def parse(cls, text: str) -> LoopShape:
        """``"l16u2vp64w4"``: lanes 16, u 2, vector loads, 64 positions a block, 4 warps
        (letters l/u/p/w with a number, v, c and s (tensor cores,
        unsplit and split launches) alone; what is left out, the default)."""
        import re

        fields = {"l": "lanes", "u": "u", "p": "ppb", "w": "warps"}
        kw: dict = {}
        for key, num in re.findall(r"([a-z])(\d*)", text):
            if key in fields and num:
                kw[fields[key]] = int(num)
            elif key == "v" and not num:
                kw["vec"] = True
            elif key == "c" and not num:
                kw["tc"] = True
            elif key == "s" and not num:
                kw["tc_split"] = True
            else:
                raise ValueError(f"attention loop shape {text!r}: {key}{num}?")
        return cls(**kw)

    @classmethod
    def from_env(cls) -> LoopShape | None:
        """``MARKBASE_GPU_ATTN_LANES``/``_U``/``_VEC``/``_PPB``/``_WARPS`` (unset ones:
        the class defaults); None when none is set. The
        tensor-core forms stay as their own switches say (on unless set to 0): a
        CUDA-core loop shape from the environment (bench/gpu/attn_bench.py's ``--env``
        exports) must not turn them off."""
        names = ("LANES", "U", "VEC", "PPB", "WARPS")
        if not any(envs.is_set(f"MARKBASE_GPU_ATTN_{n}") for n in names):
            return None
        d = cls()

        def get(name, default):
            v = envs.value(name)
            return default if v is None else v

        return cls(
            tc=tc.enabled(),
            tc_split=tc.split_enabled(),
            lanes=get("MARKBASE_GPU_ATTN_LANES", d.lanes),
            u=get("MARKBASE_GPU_ATTN_U", d.u),
            vec=get("MARKBASE_GPU_ATTN_VEC", int(d.vec)) == 1,
            ppb=get("MARKBASE_GPU_ATTN_PPB", d.ppb),
            warps=get("MARKBASE_GPU_ATTN_WARPS", d.warps),
        )


_shape: list[LoopShape | None] = []


def fixed_shape() -> LoopShape | None:
    """The loop shape every launch uses (``set_loop_shape`` or the environment, read
    once), or None: each launch takes ``auto_shape``'s."""
    if not _shape:
        _shape.append(LoopShape.from_env())
    return _shape[0]


def set_loop_shape(shape: LoopShape | None) -> None:
    """Every launch uses ``shape`` from now on; None: the environment's again (or the
    automatic choice when it sets none)."""
    _shape.clear()
    if shape is not None:
        _shape.append(shape)


def auto_shape(blocks: int, head_dim: int) -> LoopShape:
    """The loop shape for a launch of ``blocks`` blocks (splits x KV heads x rows), as
    measured (bench/gpu/attn_bench.py, docs/performance.md; us a call on the H200, 8b
    shapes, bf16, ~600 positions): fewer blocks than SMs (one row, split over time):
    8 positions in flight a warp, scalar loads, 8 warps (8b B=1 20.8 us against 21.9
    for the measured 4 positions; vector loads and 4 warps 23-31). Many blocks: vector
    loads, and at head_dim 128 8 positions in flight with 4 warps a block (8b B=128
    139 us against 163, B=32 48.5 against 53.4, B=8 26.5 against 30.1); at head_dim
    64, 4 positions (1b B=128 107 us against 125; 8 with 4 warps 119)."""
    if blocks < SMS:
        return _FEW_BLOCKS
    return _MANY_BLOCKS_HD128 if head_dim >= 128 else _MANY_BLOCKS


# made once: auto_shape runs on every launch (a layer's attention, every step)
_FEW_BLOCKS = LoopShape(u=8)
_MANY_BLOCKS_HD128 = LoopShape(u=8, vec=True, warps=4)
_MANY_BLOCKS = LoopShape(u=4, vec=True)


def auto_shapes(head_dim: int) -> list[LoopShape]:
    """Every shape ``auto_shape`` gives for this head_dim (what warm-up compiles)."""
    return list(dict.fromkeys(auto_shape(b, head_dim) for b in (1, SMS)))


# the time length: the views' (the cache buffers sliced to it), or in the append form
# with TPOS (``decode_attention_append(..., nsplit=)``) each row's position + start + 1,
# so that the kernel can take the whole buffers and a step's inputs keep their shapes
# from one step to the next (FusedDecodeStep's compiled step)
_SETUP_READ = _SETUP.replace("MB_T_LEN", "keys_shape[2]")
_SETUP_APPEND = _SETUP.replace("MB_T_LEN", "TPOS ? pos[b] + row0 + 1 : keys_shape[2]")
_READ = _SETUP_READ + _Q_LOAD + _SOFTMAX_INIT + _LOOP + _SUB_MERGE + _MERGE
_APPEND = _SETUP_APPEND + _Q_ROPE + _SOFTMAX_INIT + _LOOP + _NEW_POSITION + _SUB_MERGE + _MERGE
_PARTS_OUT = [("pm", "float32"), ("pl", "float32"), ("pacc", "float32")]
_SPLIT_OUT = [("out", "T"), *_PARTS_OUT]
_SPLIT_BODY = _WRITE_PARTS + _MERGE_LAST
_COUNTER = ("counter", "int32", 1)


def _specs(scale: float, rope_scale: float = 1.0) -> dict[str, KernelSpec]:
    header = _header(scale, rope_scale)
    inputs = [("q", "T", 4), *CACHE_INPUTS]
    append = APPEND_INPUTS
    return {
        "single": KernelSpec("mb_decode_attn", inputs, [("out", "T")], _READ + _WRITE_OUT, header),
        "append": KernelSpec(
            "mb_decode_attn_app", append, [("out", "T")], _APPEND + _WRITE_OUT, header
        ),
        "split": KernelSpec(
            "mb_decode_attn_split", [*inputs, _COUNTER], _SPLIT_OUT, _READ + _SPLIT_BODY, header
        ),
        "append_split": KernelSpec(
            "mb_decode_attn_app_split",
            [*append, _COUNTER],
            _SPLIT_OUT,
            _APPEND + _SPLIT_BODY,
            header,
        ),
    }


@cache
def _kernels(scale: float, rope_scale: float = 1.0) -> Baked:
    """One kernel object per template values (engine/backends/cuda/kernels.py: less host time a
    call), per softmax scale and RoPE position scale."""
    return Baked(lambda: _specs(scale, rope_scale), ensure_row_contiguous=False)


def warps_for(group: int, head_dim: int) -> int:
    """8 warps a block unless the block's shared merge buffer would pass 32 KB."""
    return 8 if group * head_dim <= 1024 else 4


def supported(n_heads: int, n_kv_heads: int, head_dim: int, dtype) -> str | None:
    """None when the kernel handles this attention shape, else why not."""
    import mlx.core as mx

    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"dtype {dtype}"
    if head_dim % 32 or head_dim > 256:
        return f"head_dim {head_dim} (needs a multiple of 32, at most 256)"
    if n_heads % n_kv_heads:
        return f"{n_heads} query heads over {n_kv_heads} KV heads"
    group = n_heads // n_kv_heads
    if group * head_dim * warps_for(group, head_dim) * 4 > 32 * 1024:
        return f"group {group} x head_dim {head_dim} too large for the shared merge buffer"
    return None


def splits(batch: int, n_kv_heads: int, length: int, ppb: int = POSITIONS_PER_BLOCK) -> int:
    """Blocks per (row, KV head) along time: enough blocks for the GPU (~2 per SM) but
    no fewer than ~``ppb`` positions per block."""
    want = -(-2 * SMS // (batch * n_kv_heads))
    return max(1, min(want, -(-length // ppb), 64))


def decode_attention(q, keys, values, start, scale: float, slot: int = 0, shape=None):
    """softmax(q k^T * scale) v over each row's positions ``[start[b], T)``; [B, Hq, 1, D].
    ``slot``: which counters the one-kernel split form uses (``_counters``); ``shape``:
    a ``LoopShape`` for this call (else the fixed or automatic one)."""
    b, hq, _, d = q.shape
    kern = _kernels(float(scale))
    forms = ("single", "split")
    ins = [q, keys, values, start]
    return _launch(kern, forms, ins, b, hq, d, keys, q.dtype, slot=slot, shape=shape)


@dataclass(frozen=True)
class RopeTable:
    """A RoPE module as the append kernel applies it: angle = scale * position *
    inv_freq[i], the pairs (i, i + D/2), or (2i, 2i + 1) when ``traditional``."""

    inv_freq: object  # mx.array [D/2] float32
    scale: float
    traditional: bool


def rope_table(rope, head_dim: int) -> RopeTable | None:
    """The table for mlx-lm's plain ``nn.RoPE`` or ``Llama3RoPE`` over the whole head,
    computed as MLX's rope kernel computes it (``exp2(-i/(D/2) * log2(base))``, or
    ``1/freqs``); None for any other module (YaRN's and SuScaled's input scales,
    partial rotary dims), which keeps the separate RoPE op."""
    import math

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    dims = getattr(rope, "dims", None)
    traditional = getattr(rope, "traditional", None)
    if dims != head_dim or not isinstance(traditional, bool):
        return None
    if traditional and head_dim < 64:  # a lane's values must hold whole pairs
        return None
    half = head_dim // 2
    if type(rope) is nn.RoPE:
        d = np.arange(half, dtype=np.float32) / np.float32(half)
        inv = np.exp2(-d * np.float32(math.log2(rope.base))).astype(np.float32)
        return RopeTable(mx.array(inv), float(rope.scale), traditional)
    if type(rope).__name__ == "Llama3RoPE" and getattr(rope, "_freqs", None) is not None:
        freqs = np.array(rope._freqs.astype(mx.float32))
        if freqs.shape != (half,):
            return None
        return RopeTable(
            mx.array((1.0 / freqs.astype(np.float64)).astype(np.float32)), 1.0, traditional
        )
    return None


def decode_attention_append(
    qkv,
    keys,
    values,
    start,
    pos,
    rope: RopeTable,
    scale: float,
    n_heads: int,
    slot: int = 0,
    shape=None,
    nsplit: int | None = None,
):
    """One decode step's attention from the fused QKV product, with RoPE and the KV
    append inside: ``qkv`` [B, Hq*D + 2*Hkv*D] (the rows' q, k, v before RoPE),
    ``keys``/``values`` [B, Hkv, T, D] views of the cache buffers whose last slot
    (T - 1) is the new position, not yet written (``BatchKV.reserve``), ``start`` [B]
    each row's first valid slot, ``pos`` [B] each row's RoPE position. Returns the
    attention output [B, Hq, 1, D]; the new k (RoPE'd) and v are in the buffers after.

    The write goes through an input array, which MLX does not know about. It is safe
    for how the decode step uses it: MLX runs a stream's work in order and ends each
    evaluation's CUDA graph at the end of the evaluation, no other node of a step reads
    that layer's cache, and everything that reads the cache later (the next step,
    ``BatchKV.keep``/``row_kv``) is evaluated after. 3 nodes a layer fewer than RoPE +
    two slice updates + attention (the step is host-bound up to ~32 rows).

    ``nsplit``: ``keys``/``values`` are instead the whole cache buffers (any capacity
    past T), each row's T is ``pos + start + 1`` (as ``BatchKV`` keeps them), and the
    launch splits time into ``nsplit`` blocks (``append_splits(B, Hkv, T)``). Then a
    step's arrays keep their shapes from step to step, and the launch depends on T
    only through ``nsplit``: what lets the whole step run under ``mx.compile``."""
    b = qkv.shape[0]
    d = keys.shape[3]
    kern = _kernels(float(scale), float(rope.scale))
    inputs = [qkv, keys, values, start, pos, rope.inv_freq]
    forms = ("append", "append_split")
    args = (b, n_heads, d, keys, qkv.dtype, rope.traditional, slot, shape, nsplit)
    return _launch(kern, forms, inputs, *args, scales=(float(scale), float(rope.scale)))


def append_splits(batch: int, n_kv_heads: int, length: int) -> int:
    """The blocks along time a launch over ``length`` positions takes (``splits`` with
    the fixed loop shape's positions a block, as ``_launch`` picks them)."""
    shape = fixed_shape()
    return splits(batch, n_kv_heads, length, shape.ppb if shape else POSITIONS_PER_BLOCK)


def ensure_counters(n: int, slots: int) -> None:
    """Make the split form's counters for ``slots`` layers now (``_counters``): under
    ``mx.compile`` a launch must find them made (they are evaluated when made)."""
    for slot in range(slots):
        _counters(n, slot)


def _counters(n: int, slot: int):
    """A zeroed int32 array of at least ``n`` counters for the one-kernel split forms
    (each launch leaves it zero again), one per ``slot``, size class and thread:
    launches that may run at the same time must use different arrays. MLX's CUDA graphs
    run nodes without a data dependency side by side (the decode step uses one slot per
    layer), and each model's worker thread has its own MLX stream, so two models'
    steps may run at once."""
    import threading

    import mlx.core as mx

    size = max(1024, 1 << (n - 1).bit_length())
    key = (threading.get_ident(), slot, size)
    arr = _COUNTERS.get(key)
    if arr is None:
        arr = mx.zeros((size,), dtype=mx.int32)
        mx.eval(arr)
        _COUNTERS[key] = arr
    return arr


_COUNTERS: dict = {}


def _launch(
    kern, forms, inputs, b, hq, d, keys, dtype, traditional=None, slot=0, shape=None, nsplit=None,
    scales=None,
):  # fmt: skip
    """Run a form unsplit, or split over time (merged in the kernel's last block per
    row and KV head). ``nsplit``: the append form over whole
    buffers (``decode_attention_append``). ``scales``: the append form's (softmax,
    RoPE position) scales, for its tensor-core kernels (engine/backends/cuda/attention/decode_tc.py)."""
    import mlx.core as mx

    hkv, t = keys.shape[1], keys.shape[2]
    g = hq // hkv
    shape = shape or fixed_shape()
    n = nsplit or splits(b, hkv, t, shape.ppb if shape else POSITIONS_PER_BLOCK)
    if traditional is not None:
        if n == 1:
            on = shape.tc if shape else tc.enabled()
        else:
            on = (shape.tc_split if shape else tc.split_enabled()) and n <= tc.MAX_SPLITS
        if on and tc.supported(g, d, dtype):
            return tc.launch(inputs, b, hkv, g, d, dtype, *scales, traditional,
                             nsplit is not None, split=n > 1)  # fmt: skip
    shape = shape or auto_shape(n * hkv * b, d)
    warps = min(shape.warps, warps_for(g, d))
    lanes = max(shape.lanes, d // 16)  # at most 16 values a lane
    vec = shape.vec and d // lanes * dtype.size >= 4
    template = (("T", dtype), ("HD", d), ("G", g), ("WARPS", warps), ("LP", lanes))
    template += (("U", shape.u), ("VEC", vec))
    if traditional is not None:
        template += (("TRAD", traditional), ("TPOS", nsplit is not None))
    grid = (n * warps * 32, hkv, b)
    block = (warps * 32, 1, 1)
    single, split = forms
    if n == 1:
        return kern(single, template)(
            inputs=inputs,
            grid=grid,
            threadgroup=block,
            output_shapes=[(b, hq, 1, d)],
            output_dtypes=[dtype],
        )[0]
    part_shapes = [(b, hq, n), (b, hq, n), (b, hq, n, d)]
    return kern(split, template)(
        inputs=[*inputs, _counters(b * hkv, slot)],
        grid=grid,
        threadgroup=block,
        output_shapes=[(b, hq, 1, d), *part_shapes],
        output_dtypes=[dtype, mx.float32, mx.float32, mx.float32],
    )[0]


def warm(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype,
    scale: float,
    rope=None,
    whole_buffers: bool = False,
) -> None:
    """Compile every form (unsplit; split + merge; with ``rope``, a ``RopeTable``, the
    append forms too, over views or with ``whole_buffers`` as the compiled step calls
    them, on CUDA cores and on tensor cores) for this shape now, so that no request
    waits on NVRTC: which form a step takes depends on its rows and length."""
    import mlx.core as mx

    start = mx.zeros((1,), dtype=mx.int32)
    width = (n_heads + 2 * n_kv_heads) * head_dim
    fixed = fixed_shape()
    # the CUDA-core forms of every automatic shape (an explicit shape never takes the
    # tensor-core kernels unless it says c/s), then with ``None`` the launch's own
    # choice: the tensor-core forms where they are on (unsplit at one block of time,
    # split at 4; longer rows take the CUDA-core split compiled before)
    if fixed:  # and its CUDA-core forms, which rows past the split form's cap take
        plain = replace(fixed, tc=False, tc_split=False)
        shapes = list(dict.fromkeys([fixed, plain]))
    else:
        shapes = [*auto_shapes(head_dim), None]
    for shape in shapes:
        for t in (1, 4 * POSITIONS_PER_BLOCK):
            q = mx.zeros((1, n_heads, 1, head_dim), dtype=dtype)
            kv = mx.zeros((1, n_kv_heads, t, head_dim), dtype=dtype)
            if shape is not None:
                mx.eval(decode_attention(q, kv, kv, start, scale, shape=shape))
            if rope is not None:
                k, v = mx.zeros_like(kv), mx.zeros_like(kv)
                qkv = mx.zeros((1, width), dtype=dtype)
                nsplit = append_splits(1, n_kv_heads, t) if whole_buffers else None
                out = decode_attention_append(
                    qkv, k, v, start, start, rope, scale, n_heads, shape=shape, nsplit=nsplit
                )
                mx.eval(out)


def kernel_specs_for_check() -> list[KernelSpec]:
    """The sources with concrete template values (bench/gpu/nvrtc_check.py)."""
    out = []
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        for hd, g in ((64, 4), (128, 4), (128, 8), (64, 1), (32, 2), (256, 2)):
            w = warps_for(g, hd)
            for lanes, u, vec in ((32, 4, False), (16, 4, True), (8, 2, True), (32, 8, True)):
                lanes = max(lanes, hd // 16)
                vec = vec and hd // lanes * size >= 4
                for kind, spec in _specs(0.125).items():
                    tmpl = [("T", dtype), ("HD", hd)]
                    tmpl += [("G", g), ("WARPS", w), ("LP", lanes), ("U", u), ("VEC", vec)]
                    if kind.startswith("append"):
                        tmpl += [("TRAD", hd >= 64 and g == 4), ("TPOS", u == 8)]
                    name = f"{spec.name}_{dtype}_{hd}_{g}_{w}_{lanes}_{u}_{int(vec)}"
                    out.append(for_dtype(spec, dtype, name, tmpl))
    return out
