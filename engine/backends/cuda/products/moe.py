"""Expert products grouped per expert: a mixture-of-experts layer's 4-bit products for
a few tokens (decode steps, short prompt chunks) as two custom CUDA kernels.

Why: MLX 0.32's CUDA ``gather_qmm`` ignores ``sorted_indices`` and runs every
(token, expert) pair as its own batch element of one row; from 8 pairs on it takes
``qmm_sm80``, a tensor-core tile of 16+ rows that is almost empty at one row, so each
pair reads its expert's weights again at a low rate. A 128-expert qwen3_moe of
Qwen3-30B-A3B's shape decoded 74.6 tok/s at one row and slowed down batched (96
tok/s at 32 rows) on an H100 before these kernels.

Here a block owns one expert and a tile of output rows, finds the expert's pairs
itself (it scans the flat expert ids of all pairs: a few hundred ids from L2) and
reads each weight row once for all of them, the way engine/backends/cuda/products/gemv.py
reads a weight once for up to 8 rows of ``x``: a warp owns ``R`` weight rows, each lane
32 consecutive inputs per step with 16-byte loads, 4-bit values turned into floats with
the exponent trick, the group's bias applied once per 32 inputs
(``s * sum(x q) + b * sum(x)``), pairs taken ``MMAX`` at a time. Blocks are laid out
over the experts that are present (``min(pairs, experts)`` slots), not all of them.

``glu`` computes gate and up of the same features in one pass and writes
``act(gate) * up`` (SwiGLU or gemma4's GELU-tanh GLU); ``product`` is the plain
grouped product (the down projection). Gate and up are rounded to the activations'
dtype before the activation, as mlx-lm's separate products round them.

Limits (the caller checks ``supported``): CUDA, bf16/fp16 activations, 4-bit affine
weights with biases, groups of 32/64/128, K and N multiples of 32 and 4, at most 1024
experts and ``MAX_TOKENS`` tokens a call (a block holds at most that many pairs of
its expert). ``bench/gpu/nvrtc_check.py`` compiles the sources (csrc/products/moe/) without a GPU,
tests/backends/cuda/emulation/moe.py runs them lane by lane in numpy, and
``tests/backends/cuda/test_gpu_moe.py`` checks them against MLX on a GPU.
"""

from __future__ import annotations

import re
from functools import cache

from engine import platform
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype
from engine.backends.cuda.kernels import source as _source

WARPS = 4
MAX_TOKENS = 256  # pairs of one expert a block can hold (one per token at most)
MAX_EXPERTS = 1024
ACTIVATIONS = {"none": 0, "silu": 1, "gelu_tanh": 2}

_HEADER = _source("products/moe/header.cuh")

# the block's expert and its pairs, then the warp's rows
_FIND = _source("products/moe/find.cu")

# the pairs in chunks of MMAX, R (GLU: 2R) weight rows a warp
_LOOP = _source("products/moe/loop.cu")


@cache
def _specs() -> dict[str, KernelSpec]:
    plain = [
        ("x", "T", 2),
        ("idx", "uint32", 1),
        ("w", "uint32", 3),
        ("scales", "T", 3),
        ("biases", "T", 3),
    ]
    glu = plain + [("w2", "uint32", 3), ("scales2", "T", 3), ("biases2", "T", 3)]
    # PICK(up's, gate's): a GLU row r >= R is the up projection's; the plain product
    # has no second weight (the name must not appear in its source at all)
    loop_plain = _LOOP.replace("PICK(w2, w)", "w").replace("PICK(scales2, scales)", "scales")
    loop_plain = loop_plain.replace("PICK(biases2, biases)", "biases")
    loop_glu = re.sub(r"PICK\((\w+), (\w+)\)", r"(r >= R ? \1 : \2)", _LOOP)
    return {
        "product": KernelSpec("mb_moe_q4", plain, [("y", "T")], _FIND + loop_plain, _HEADER),
        "glu": KernelSpec("mb_moe_q4_glu", glu, [("y", "T")], _FIND + loop_glu, _HEADER),
    }


_kernel = Baked(_specs, ensure_row_contiguous=True)


def supported(x_dtype, lin, tokens: int) -> bool:
    """Whether the kernels take a ``QuantizedSwitchLinear`` ``lin`` for ``tokens`` rows
    of ``x_dtype`` activations."""
    import mlx.core as mx

    w = lin.get("weight") if hasattr(lin, "get") else None
    scales = lin.get("scales") if w is not None else None
    biases = lin.get("biases") if w is not None else None
    if w is None or scales is None or biases is None or "bias" in lin:
        return False
    e, n, words = w.shape if w.ndim == 3 else (0, 0, 0)
    k = words * 8
    return (
        platform.cuda_available()
        and x_dtype in (mx.bfloat16, mx.float16)
        and scales.dtype == x_dtype
        and biases.dtype == x_dtype
        and w.dtype == mx.uint32
        and getattr(lin, "bits", None) == 4
        and getattr(lin, "mode", "affine") == "affine"
        and lin.group_size in (32, 64, 128)
        and k % 32 == 0
        and k % lin.group_size == 0
        and n % 4 == 0
        and 0 < e <= MAX_EXPERTS
        and 0 < tokens <= MAX_TOKENS
    )


def _mmax(tokens: int) -> int:
    """Pairs a warp takes at once: an expert has at most one pair a token."""
    return 1 if tokens == 1 else 4 if tokens <= 16 else 8


def _rows(n: int, mmax: int, glu: bool) -> int:
    want = (2 if mmax <= 4 else 1) if glu else (4 if mmax <= 4 else 2)
    while n % want:
        want //= 2
    return want


@cache
def _launch(
    kind: str,
    dtype,
    group_size: int,
    n: int,
    tokens: int,
    pairs: int,
    experts: int,
    div: int,
    act: int,
):
    """(kernel, grid, threadgroup) for one call shape, worked out once."""
    mmax = _mmax(tokens)
    glu = kind == "glu"
    r = _rows(n, mmax, glu)
    template = (
        ("T", dtype),
        ("GS", group_size),
        ("R", r),
        ("RR", 2 * r if glu else r),
        ("WARPS", WARPS),
        ("MMAX", mmax),
        ("DIV", div),
        ("ACT", act),
        ("LCAP", MAX_TOKENS),
    )
    tiles = -(-n // (WARPS * r))
    slots = min(pairs, experts)
    return _kernel(kind, template), (slots * tiles * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)


def glu(x, idx, top_k: int, gate, up, activation: str):
    """``act(x_t @ gate[e].T) * (x_t @ up[e].T)`` for every pair (token t, expert e):
    ``x`` [T, K], ``idx`` [T * top_k] uint32 (pair p is token p // top_k), ``gate`` and
    ``up`` ``QuantizedSwitchLinear``; returns [T * top_k, N]."""
    w = gate["weight"]
    experts, n = w.shape[0], w.shape[1]
    fn, grid, tg = _launch(
        "glu", x.dtype, gate.group_size, n, x.shape[0], idx.shape[0], experts, top_k,
        ACTIVATIONS[activation],
    )  # fmt: skip
    return fn(
        inputs=[
            x,
            idx,
            w,
            gate["scales"],
            gate["biases"],
            up["weight"],
            up["scales"],
            up["biases"],
        ],
        grid=grid,
        threadgroup=tg,
        output_shapes=[(idx.shape[0], n)],
        output_dtypes=[x.dtype],
    )[0]


def product(h, idx, lin, tokens: int):
    """``h_p @ lin[e_p].T`` for every pair p: ``h`` [P, K] (one row a pair), ``idx`` [P]
    uint32; ``tokens`` bounds the pairs of one expert. Returns [P, N]."""
    w = lin["weight"]
    experts, n = w.shape[0], w.shape[1]
    fn, grid, tg = _launch(
        "product", h.dtype, lin.group_size, n, tokens, idx.shape[0], experts, 1, 0
    )
    return fn(
        inputs=[h, idx, w, lin["scales"], lin["biases"]],
        grid=grid,
        threadgroup=tg,
        output_shapes=[(idx.shape[0], n)],
        output_dtypes=[h.dtype],
    )[0]


def kernel_specs_for_check() -> list[KernelSpec]:
    """Both kernels per dtype and pair count (bench/gpu/nvrtc_check.py)."""
    out = []
    for kind, spec in _specs().items():
        glu_ = kind == "glu"
        for dtype in ("bfloat16", "float16"):
            for tokens in (1, 8, 128):
                mmax = _mmax(tokens)
                r = _rows(768, mmax, glu_)
                tmpl = [
                    ("T", dtype), ("GS", 64), ("R", r), ("RR", 2 * r if glu_ else r),
                    ("WARPS", WARPS), ("MMAX", mmax), ("DIV", 8 if glu_ else 1),
                    ("ACT", 1 if glu_ else 0), ("LCAP", MAX_TOKENS),
                ]  # fmt: skip
                out.append(for_dtype(spec, dtype, f"{spec.name}_{dtype}_{mmax}_{r}", tmpl))
    return out
