"""A whole llama decoder layer at one row as one kernel: the attention (RoPE, the KV
write, split over time), the merge of its splits, then engine/backends/cuda/products/qlayer.py's tail
(o_proj + residual, RMSNorm, gate_up + SwiGLU, down_proj + residual) and optionally
the next layer's RMSNorm + q/k/v product, with a grid-wide barrier between phases.

Why: on the H200 the one-row attention kernel takes 21-22 us a layer for ~2.4 MB of KV
(bench/gpu/NOTES.md sessions 9-10: more splits made it slower, so it is not short of
parallelism: its fixed costs, start, merge and tail, dominate), and each kernel costs
~8 us of MLX host time. Here the attention is a phase of a kernel that is already
running on every SM: 128 blocks of 16 warps split the positions (16 splits of each KV
head, ~40 positions a block at T = 600: one round of loads), every thread of the grid
then merges one output of the splits, and the products follow. The decode step is
then one kernel a layer (plus the first q/k/v product, the head and the sampler).

The attention phase is engine/backends/cuda/attention/decode.py's append form (``_APPEND`` +
``_WRITE_PARTS``) with the block indices taken from the grid (split, KV head = block
% NSPLIT, block / NSPLIT; one row) and T from each row's position (``TPOS``), so the
cache buffers may be the whole buffers; the merge is its ``mb_merge_splits``. The rest
is gpu_qlayer's phases. Off unless MARKBASE_GPU_QSTREAM_LAYER=3: measured slower (H100,
session 25, 8b 4-bit B=1: GPU busy 3.331 ms a step against 2.408 as served).
"""

from __future__ import annotations

import os
from functools import cache

from engine.backends.cuda.attention import decode as gpu_attention
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype
from engine.backends.cuda.products import qlayer as gpu_qlayer

U = 4  # positions a lane loads at a time (registers: 8 would hold 2x the K and V)
MAX_STATIC = 40 << 10  # the attention's merge buffers (static shared memory) at most


def wanted() -> bool:
    return os.environ.get("MARKBASE_GPU_QSTREAM_LAYER", "0") == "3"


def _attention_phase() -> str:
    body = gpu_attention._APPEND + gpu_attention._WRITE_PARTS
    swaps = {
        "const int split = blockIdx.x;": "const int split = static_cast<int>(blockIdx.x) % NSPLIT;",
        "const int hkv = blockIdx.y;": "const int hkv = static_cast<int>(blockIdx.x) / NSPLIT;",
        "const int b = blockIdx.z;": "const int b = 0;",
        "const int nsplit = gridDim.x;": "constexpr int nsplit = NSPLIT;",
        "const int n_kv = gridDim.y;": "constexpr int n_kv = NKV;",
    }
    for old, new in swaps.items():
        if old not in body:
            raise AssertionError(f"gpu_qblock: gpu_attention's body no longer has {old!r}")
        body = body.replace(old, new)
    return "  if (static_cast<int>(blockIdx.x) < NSPLIT * NKV) {\n" + body + "  }\n"


_MERGE_PHASE = r"""
  mb_grid_sync(barrier);
  for (int gi = blockIdx.x * blockDim.x + threadIdx.x; gi < NKV * G * HD;
       gi += gridDim.x * blockDim.x) {
    attn[gi] = static_cast<T>(mb_merge_splits<HD>(pm, pl, pacc, gi / HD, NSPLIT, gi % HD));
  }
  mb_grid_sync(barrier);
"""

_ATTN_OUTPUTS = [("attn", "T"), ("pm", "float32"), ("pl", "float32"), ("pacc", "float32")]


def _specs(scale: float, rope_scale: float) -> dict[str, KernelSpec]:
    header = (
        gpu_qlayer._HEADER
        + gpu_attention._header(scale, rope_scale)
        + gpu_qlayer._BARRIER
        + gpu_qlayer._phase_function()
    )
    tail = gpu_qlayer._LAYER_BODY.replace("      o, wo,", "      attn, wo,")
    if tail == gpu_qlayer._LAYER_BODY:
        raise AssertionError("gpu_qblock: gpu_qlayer's phase A no longer reads o")
    body = "  int* barrier = const_cast<int*>(barrier_in);\n"
    body += _attention_phase() + _MERGE_PHASE + tail
    layer_inputs = [
        (("barrier_in", t, nd) if n == "barrier" else (n, t, nd))
        for n, t, nd in gpu_qlayer._INPUTS
        if n != "o"
    ]
    inputs = gpu_attention.APPEND_INPUTS + layer_inputs
    outputs = [*gpu_qlayer._OUTPUTS, *_ATTN_OUTPUTS]
    nxt = gpu_qlayer._NEXT_BODY.replace(
        "y, wq, sq, bq, nullptr, nw1, eps1, qkv,", "y, wq, sq, bq, nullptr, nw1, eps1, qkv_next,"
    )
    if nxt == gpu_qlayer._NEXT_BODY:
        raise AssertionError("gpu_qblock: gpu_qlayer's next phase changed")
    return {
        "block": KernelSpec("mb_qblock", inputs, outputs, body, header),
        "block_next": KernelSpec(
            "mb_qblock_next",
            inputs + gpu_qlayer._NEXT_INPUTS,
            [*outputs, ("qkv_next", "T")],
            body + nxt,
            header,
        ),
    }


@cache
def _kernels(scale: float, rope_scale: float) -> Baked:
    return Baked(lambda: _specs(scale, rope_scale), ensure_row_contiguous=False)


def static_bytes(group: int, head_dim: int) -> int:
    """The attention phase's static shared memory (its merge buffers, 16 warps)."""
    warps = gpu_qlayer.WARPS
    return warps * group * head_dim * 4 + 2 * warps * group * 4 + 256


def attention_supported(n_heads: int, n_kv_heads: int, head_dim: int, d: int, rope) -> bool:
    """Whether the attention phase takes this shape: the append kernel's limits, the
    attention output as o_proj's input (Hq * head_dim = D), a KV head's splits over the
    SMs (at least 2 each), the merge buffers within ``MAX_STATIC``, a RoPE table."""
    sms = gpu_qlayer.sm_count()
    if rope is None or sms is None or n_heads % n_kv_heads or n_heads * head_dim != d:
        return False
    if head_dim % 32 or head_dim > 256 or sms // n_kv_heads < 2:
        return False
    return static_bytes(n_heads // n_kv_heads, head_dim) <= MAX_STATIC


def _template(dtype, d, f, gs, hq, hkv, hd, traditional: bool, sm_bytes=None):
    g = hq // hkv
    s = gpu_qlayer.shape(d, f, gs, sm_bytes=sm_bytes, reserve=static_bytes(g, hd))
    nsplit = (gpu_qlayer.sm_count() or 132) // hkv
    lanes = max(32, hd // 16)
    template = (("T", dtype), *((k, s[k]) for k in gpu_qlayer.TEMPLATE_KEYS))
    template += (("HD", hd), ("G", g), ("NSPLIT", nsplit), ("NKV", hkv), ("LP", lanes))
    template += (("U", U), ("VEC", False), ("TRAD", traditional), ("TPOS", True))
    return template, s["smem"], nsplit


def block(
    qkv,
    keys,
    values,
    start,
    pos,
    rope,
    scale: float,
    n_heads: int,
    x,
    o_proj,
    gate_up,
    down_proj,
    norm_weight,
    eps: float,
    slot: int = 0,
    next_qkv=None,
    all_outputs: bool = False,
):
    """A decoder layer at one row from its q/k/v product ``qkv`` [1, (Hq + 2 Hkv) hd]
    (before RoPE) on: ``keys``/``values`` the layer's cache buffers [1, Hkv, >= T, hd]
    (the new position at pos + start, written here), ``start``/``pos`` [1], ``rope`` a
    gpu_attention.RopeTable; then gpu_qlayer.post's arguments. Returns the layer's
    output y [1, D], or with ``next_qkv`` (y, the next layer's q/k/v product)."""
    from engine.backends.cuda.products.mma import device_scalar

    d, f = x.shape[-1], down_proj.weight.shape[1] * 8
    hkv, hd = keys.shape[1], keys.shape[3]
    template, smem, nsplit = _template(
        x.dtype, d, f, o_proj.group_size, n_heads, hkv, hd, rope.traditional
    )
    fn = _kernels(float(scale), float(rope.scale))(
        "block" if next_qkv is None else "block_next", template, smem
    )
    inputs = [qkv, keys, values, start, pos, rope.inv_freq]
    inputs += [x, o_proj.weight, o_proj.scales, o_proj.biases, norm_weight, device_scalar(eps)]
    inputs += [gate_up.weight, gate_up.scales, gate_up.biases]
    inputs += [down_proj.weight, down_proj.scales, down_proj.biases, gpu_qlayer.barrier(slot)]
    shapes = [(1, d), (1, d), (1, f), (1, n_heads * hd)]
    shapes += [(1, n_heads, nsplit), (1, n_heads, nsplit), (1, n_heads, nsplit, hd)]
    dtypes = [x.dtype] * 4 + ["float32"] * 3
    if next_qkv is not None:
        wq, nw1, eps1 = next_qkv
        inputs += [nw1, device_scalar(eps1), wq.weight, wq.scales, wq.biases]
        shapes.append((1, wq.weight.shape[0]))
        dtypes.append(x.dtype)
    import mlx.core as mx

    outs = fn(
        inputs=inputs,
        grid=(gpu_qlayer.sm_count() * gpu_qlayer.WARPS * 32, 1, 1),
        threadgroup=(gpu_qlayer.WARPS * 32, 1, 1),
        output_shapes=shapes,
        output_dtypes=[mx.float32 if t == "float32" else t for t in dtypes],
    )
    if all_outputs:
        return outs
    return outs[0] if next_qkv is None else (outs[0], outs[7])


def kernel_specs_for_check() -> list[KernelSpec]:
    """Both kinds at llama 8b's and 1b's shapes (bench/gpu/nvrtc_check.py)."""
    out = []
    for spec in _specs(0.088, 1.0).values():
        for dtype in ("bfloat16", "float16"):
            for d, f, hq, hkv, hd in ((4096, 14336, 32, 8, 128), (2048, 8192, 32, 8, 64)):
                template, _, _ = _template(dtype, d, f, 64, hq, hkv, hd, False, 228 << 10)
                tmpl = [(k, v) for k, v in template]
                name = f"{spec.name}_{dtype}_{d}_{hd}"
                out.append(for_dtype(spec, dtype, name, tmpl))
    return out
