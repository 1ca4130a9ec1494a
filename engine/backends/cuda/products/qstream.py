"""4-bit products of one row (the single-stream decode step), their weights streamed
through shared memory by ``cp.async``, on CUDA cores (form ``q4``, the default: measured
fastest) or tensor cores (form ``mma``).

Why: at 8b 4-bit B=1 the products are ~2.4 ms of a ~3.5 ms step on engine/backends/cuda/products/mma.py's
kernel, reading the weights at 1.5-1.8 TB/s on the H200, where a copy reaches 2.5
(MLX) to 4.3 TB/s (PyTorch) (docs/performance.md). That kernel holds a
lane's in-flight loads in registers, so more loads in flight cost occupancy (more
loads a lane measured slower), and its blocks are short (16 rows, then a
reduction through shared memory). Here a lane's loads go to its own ring of
``STAGES`` slots in shared memory (``cp.async``: no register holds a load in flight),
a warp owns whole output rows and walks them to the end, and nothing is block-wide
after the prologue.

The CUDA-core form (``_BODY``, the measured first try): a warp owns one output row at
a time, lane ``l`` its 32-input chunks ``l, l + 32, ...``; a 4-bit value becomes a
float with the exponent trick on its place in the word (``(w & 0xF << 4k) |
0x4B000000`` is 2^23 + q * 16^k, exact), one accumulator per k: a LOP3, an FADD and an
FFMA a value, ~5 instructions a weight with the rest (SASS); that puts its issue time
at ~20 us of the 8b gate_up's 31.5 (36.9 on engine/backends/cuda/products/mma.py), so it is likely
issue-bound. It also takes shapes the tensor-core form does not (N not a multiple of
16).

The tensor-core form (``_MMA_BODY``): see the comment above it; about 1.8 instructions
a weight, yet measured slower (8b gate_up 40 us, down_proj 35 us): something else
limits it (suspects: 32 dependent MMAs a block; few m-tiles for the smaller
products, so few warps: down_proj's 256 m-tiles fill 64 SMs). For scale: a plain MLX
read kernel gets 4.5 TB/s over 1 GB (bench/gpu/read_bw.py). Both forms do their math
in float32 on the exact 4-bit values.

Limits (``supported``): bf16/fp16 x of one row, 4-bit affine with biases, group size
32/64/128, K a multiple of 1024 and at most 16384 (x lives in shared memory).
``bench/gpu/nvrtc_check.py`` compiles the sources without a GPU,
``bench/gpu/qstream_emulation.py`` checks the tensor-core form's index logic in numpy,
``tests/backends/cuda/test_gpu_qstream.py`` checks both forms against MLX on a GPU.
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import SMS, Baked, KernelSpec, for_dtype, one_output_call
from engine.backends.cuda.kernels import source as _source

WARPS = 8
STAGES = 8  # a lane's slots: STAGES - 1 chunks in flight while it computes one
# shared memory an SM gives its blocks, by compute capability (the CUDA programming
# guide's table; a block may use all but 1 KB): H100/H200/B200 228 KB, A100 164 KB,
# the rest (sm_86/89/120) 100 KB
SMEM_BY_ARCH = {(9, 0): 228 << 10, (10, 0): 228 << 10, (8, 0): 164 << 10, (8, 7): 164 << 10}
SMEM_OTHER = 100 << 10
MAX_K = 16384

_HEADER = _source("products/qstream/header.cuh")

_BODY = _source("products/qstream/body.cu")


# The integer form (``q4i``, the default): the same ring and walk as
# ``_BODY``, but x is held as int16 with a power-of-two scale per 32-input chunk
# (2^(14 - e), e the exponent of the chunk's largest |x|: every bf16 value within 2^7
# of that largest, every fp16 one within 2^4, becomes an integer exactly; smaller ones
# are rounded at 2^-15 of it), and a chunk's dot product is integer arithmetic. A
# weight word's 8 values become two words of bytes by one LOP3 each (w & 0x0F0F0F0F:
# values 0, 2, 4, 6; w & 0xF0F0F0F0: 16 x values 1, 3, 5, 7, read as unsigned bytes,
# so no shift), and each of those meets two int16 pairs of x in a DP2A (two 16 x 8-bit
# products added to an int32). Both sums stay below 2^23 (after the 16 comes off),
# so they convert to float exactly; scale, bias and x's chunk sum (float32) go on as
# before. A slot holds CPS chunks of a lane, so the ring's bookkeeping is paid once for
# them. SASS (bench/gpu/nvrtc_check.py --sass): ~74 instructions a 32-weight chunk
# (2.3 a weight) against ~170 for ``_BODY``.
_IBODY = _source("products/qstream/ibody.cu")


# The tensor-core form (``mma``): a warp owns 16 weight rows (an m-tile; with the SwiGLU
# 8 gate rows and their 8 up rows) and walks K in blocks of 8 quantization groups. In
# one mma.sync.m16n8k16 the 16 k of a lane's A pairs are 2 values from each of the
# block's 8 groups (k pair 2j, 2j+1 <- group j), and B's column n holds x only for the
# k of group n, so C[row, n] sums group n alone: the scale and bias of each group go on
# once a block (C's 8 columns are the 8 groups), and the weight enters the MMA as the
# raw 4-bit value plus a constant (one LOP3 for two values: (w >> 4s) & 0x000F000F |
# 0x43004300 is the bf16 pair 128 + q_s, 128 + q_{s+4}); the constant comes off with
# the group's sum of x. About one instruction a weight, against ~5 on CUDA cores.
_MMA_BODY = _source("products/qstream/mma_body.cu")


def _specs() -> dict[str, KernelSpec]:
    """Forms ``q4i``/``q4`` (CUDA cores) and ``mma`` (tensor cores), each plain,
    ``_res`` (a residual ``r`` [1, N] added: o_proj/down_proj) and ``_glu`` (w = [gate;
    up], output silu(gate) * up, [1, N/2]: gate_up); the integer form also ``_norm`` and
    ``_glu_norm`` (x through an RMSNorm first: its weight ``nw`` [K] and ``eps`` [1]:
    qkv, gate_up and the lm_head, one kernel a norm fewer)."""

    inputs = [("x", "T", 2), ("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)]
    out = {}
    for form, body, header in (
        ("q4", _BODY, _HEADER),
        ("q4i", _IBODY, _HEADER),
        ("mma", _MMA_BODY, _source("products/mma/header.cuh") + _HEADER),
    ):
        kinds = [("", False, False, False), ("_res", False, True, False)]
        kinds += [("_glu", True, False, False)]
        if form in NORM_FORMS:
            kinds += [("_norm", False, False, True), ("_glu_norm", True, False, True)]
        if form == "q4i":  # bench/gpu/q4_bench.py's ablation: the stream without the math
            kinds += [(k + "_abl", g, r, nm) for k, g, r, nm in kinds]
        for suffix, glu, res, norm in kinds:
            flags = "".join(
                f"  constexpr bool {name} = {'true' if on else 'false'};\n"
                for name, on in (("GLU", glu), ("RES", res), ("NORM", norm))
            )
            if form == "q4i":
                flags += (
                    f"  constexpr bool ABL = {'true' if suffix.endswith('_abl') else 'false'};\n"
                )
            if not res:
                flags += "  const T* r = nullptr;\n"
            if not norm:
                flags += "  const T* nw = nullptr;\n  const float* eps = nullptr;\n"
            extra = [("r", "T", 2)] if res else []
            extra += [("nw", "T", 1), ("eps", "float32", 1)] if norm else []
            name = {"q4": "mb_qstream", "q4i": "mb_qstream_i", "mma": "mb_qstream_mma"}[form]
            out[form + suffix] = KernelSpec(
                name + suffix, inputs + extra, [("y", "T")], flags + body, header
            )
    return out


def smem_bytes(form: str, k: int, gs: int, stages: int, warps: int, cps: int = 1) -> int:
    """Dynamic shared memory a block needs: x, its chunk or group sums, the lanes' slots
    (``cps``: chunks a slot, the integer form's)."""
    if form == "q4":  # x as float32, 144 bytes a 32-input chunk; 16 + 4 + 4 bytes a slot
        return (k // 32) * (9 * 16 + 4) + stages * warps * 32 * (16 + 4 + 4)
    if form == "q4i":  # x as int16 + (scale, sum), 80 bytes a chunk; cps x 24 bytes a slot
        return (k // 32) * 80 + stages * cps * warps * 32 * (16 + 4 + 4)
    ng = k // gs  # x as bf16/fp16 pairs, 8 bytes of padding a group; 4 segments + 16 a slot
    return ng * (gs // 2 + 4) * 4 + ng * 4 + 16 + stages * warps * 32 * (4 * gs // 2 + 16)


# one kernel object per kind and template (its dynamic shared memory follows from them)
_kernel = Baked(_specs, ensure_row_contiguous=True)


def supported(x_dtype, rows: int, n: int, k: int, bits: int, group_size: int, mode, biases):
    import mlx.core as mx

    return (
        platform.cuda_available()
        and rows == 1
        and x_dtype in (mx.bfloat16, mx.float16)
        and bits == 4
        and mode == "affine"
        and biases is not None
        and group_size in (32, 64, 128)
        and k % 1024 == 0
        and 0 < k <= MAX_K
        and n > 0
        and _fits("q4", k, group_size, 2, 4)  # the smallest block fits this GPU's SM
    )


# per form: slots a lane, warps a block (the CUDA-core forms: 16 warps from K > 8192,
# where x's shared memory leaves one block an SM); the integer form's slots hold
# CPS chunks each (2 where a lane's chunks a row are even; else 1, and twice the slots)
DEFAULTS = {"q4": (STAGES, WARPS), "q4i": (4, WARPS), "mma": (4, 4)}
CPS = 2
FORMS = tuple(DEFAULTS)
# measured (bench/gpu/q4_bench.py, docs/performance.md; 8b, us a layer's 4 products):
# engine/backends/cuda/products/mma.py 75.6, the float CUDA-core form 65.2, the tensor-core form 97-131;
# MARKBASE_GPU_QSTREAM_FORM picks another for A/B runs
DEFAULT_FORM = "q4i"
# the forms whose kernels can take the RMSNorm before them (its cost: one more K-vector
# read from L2 and a block-wide sum in the prologue, where each block holds all of x anyway)
NORM_FORMS = ("q4i",)
_knobs: dict = {}


def set_knobs(
    form: str | None = None,
    stages: int | None = None,
    warps: int | None = None,
    cps: int | None = None,
    early: bool | None = None,
    abl: bool | None = None,
):
    """Launchers made from now on use ``form`` ("q4i": CUDA cores, integer dot products;
    "q4": CUDA cores, float; "mma": tensor cores), ``stages``/``warps``/``cps`` (chunks
    a slot, the integer form's; None: the defaults), ``early`` (``early_issue``; None:
    the environment's), ``abl`` (the integer form without its math: wrong outputs, for
    timing only); bench/gpu/q4_bench.py's variants."""
    if form is not None and form not in FORMS:
        raise ValueError(f"gpu_qstream: unknown form {form!r} (one of {', '.join(FORMS)})")
    _knobs.clear()
    pairs = (("form", form), ("stages", stages), ("warps", warps), ("cps", cps))
    pairs += (("early", early), ("abl", abl))
    _knobs.update({k: v for k, v in pairs if v is not None})


def early_issue() -> bool:
    """Whether the integer form issues its ring's first weight loads before converting x
    (default; MARKBASE_GPU_QSTREAM_EARLY=0 turns it off). Why: each block converts all
    of x (K/32 chunks, a block-wide barrier) before its first load, so every 1-row
    product started with its HBM idle for that prologue plus a load's latency, ~129
    times a step at 8b. H100 (docs/performance.md): a layer's four products
    alone 60.4 -> 57.3 us; with engine/backends/cuda/prefetch.py, the served 8b 4-bit single
    stream 2.668 -> 2.564-2.583 ms a step."""
    if _knobs.get("early") is not None:
        return bool(_knobs["early"])
    return envs.MARKBASE_GPU_QSTREAM_EARLY


def default_form() -> str:
    form = envs.MARKBASE_GPU_QSTREAM_FORM or DEFAULT_FORM
    if form not in FORMS:
        raise ValueError(
            f"MARKBASE_GPU_QSTREAM_FORM={form!r}: not a form (one of {', '.join(FORMS)})"
        )
    return form


def form_for(n: int, glu: bool) -> str:
    """The tensor-core form needs whole m-tiles (16 rows; with the SwiGLU 8 outputs):
    other shapes take the integer CUDA-core form."""
    want = _knobs.get("form") or default_form()
    if want == "mma" and n % 16:  # (with the SwiGLU: N/2 outputs in 8s, the same test)
        return "q4i"
    return want


_smem: list[int] = []


def smem_per_sm() -> int:
    """This GPU's shared memory an SM (``SMEM_BY_ARCH``; the smallest when unknown)."""
    if not _smem:
        arch = platform.compute_capability()  # None: no GPU, or unknown (the smallest)
        _smem.append(SMEM_BY_ARCH.get(arch, SMEM_OTHER))
    return _smem[0]


def _fits(form: str, k: int, gs: int, stages: int, warps: int, cps: int = 1) -> bool:
    return smem_bytes(form, k, gs, stages, warps, cps) + 1024 <= smem_per_sm()


def cps_for(form: str, k: int) -> int:
    """Chunks a slot: the knob (or ``CPS``) where it divides a lane's chunks a row
    (K / 1024), else 1; 1 for the forms without it."""
    if form != "q4i":
        return 1
    want = _knobs.get("cps", CPS)
    return want if (k // 1024) % want == 0 else 1


def shape_for(form: str, k: int, gs: int = 64) -> tuple[int, int]:
    """(slots a lane, warps a block): the knobs, else the defaults (16 warps for the
    CUDA-core forms from K > 8192, where x's shared memory leaves one block an SM; the
    integer form twice the slots where they hold one chunk), halving the warps, then
    the slots, until a block fits this GPU's SM."""
    stages, warps = DEFAULTS[form]
    if "stages" in _knobs or "warps" in _knobs:
        return _knobs.get("stages", stages), _knobs.get("warps", warps)
    cps = cps_for(form, k)
    if form == "q4i" and cps == 1:
        stages *= CPS
    if form in ("q4", "q4i") and k > 8192:
        warps *= 2
    while not _fits(form, k, gs, stages, warps, cps) and warps > 4:
        warps //= 2
    while not _fits(form, k, gs, stages, warps, cps) and stages > 2:
        stages //= 2
    return stages, warps


@cache
def _grid_blocks(
    form: str, units: int, k: int, gs: int, stages: int, warps: int, cps: int = 1
) -> int:
    """Blocks: as many warps as the SMs hold at once (shared memory bounds the blocks
    an SM), then no more than the work units (rows, or m-tiles) need with every warp
    taking the same count."""
    smem = smem_bytes(form, k, gs, stages, warps, cps)
    per_sm = max(1, min(2048 // (warps * 32), smem_per_sm() // (smem + 1024)))
    max_warps = SMS * per_sm * warps
    per_warp = -(-units // max_warps)
    want_warps = -(-units // per_warp)
    return -(-want_warps // warps)


def takes_norm(n: int, glu: bool) -> bool:
    """Whether the kernel for these outputs folds the RMSNorm before it in: the form has
    it and MARKBASE_GPU_QSTREAM_NORM is not 0 (on by default). Until
    then it was off: inside the step the norm forms ran 2-3x slower than alone (H200: GPU time 2.74 -> 4.01 ms). The cause was their epsilon, a [1] array in
    MLX's pool of tiny arrays (managed memory), which every block read: one such read
    costs a 9 MiB read kernel ~11 us (H100, bench/gpu/pool_cost.py). With the epsilon in
    device memory (``gpu_mma.device_scalar``) the fold takes 65 launches out of a step: 8b
    4-bit B=1 2.584 -> 2.455 ms, 1b 4-bit 956 -> 1,072 tok/s (H100, docs/performance.md)."""
    return form_for(n, glu) in NORM_FORMS and envs.MARKBASE_GPU_QSTREAM_NORM


def launcher(
    dtype, n: int, k: int, gs: int, residual: bool = False, glu: bool = False, norm: bool = False
):
    """``call(inputs) -> y`` [1, N] (``glu``: [1, N/2]) for x [1, K] and a 4-bit weight of
    ``n`` rows; ``inputs``: x, w, scales, biases, then the residual (``residual``) or the
    RMSNorm's weight [K] and epsilon [1] float32 (``norm``: ``takes_norm`` must say so)."""
    if glu and residual:
        raise ValueError("gpu_qstream: glu and residual together are not a kernel")
    if norm and residual:
        raise ValueError("gpu_qstream: norm and residual together are not a kernel")
    form = form_for(n, glu)
    if norm and form not in NORM_FORMS:
        raise ValueError(f"gpu_qstream: form {form} does not take the RMSNorm")
    stages, warps = shape_for(form, k, gs)
    cps = cps_for(form, k)
    kind = form + ("_glu" if glu else "_res" if residual else "") + ("_norm" if norm else "")
    if form == "q4i" and _knobs.get("abl"):
        kind += "_abl"
    template = (("T", dtype), ("K", k), ("GS", gs), ("STAGES", stages), ("WARPS", warps))
    if form == "q4i":
        template += (("CPS", cps), ("EARLY", early_issue()))
    smem = smem_bytes(form, k, gs, stages, warps, cps)
    if smem + 1024 > smem_per_sm():
        raise ValueError(
            f"gpu_qstream: {stages} slots x {warps} warps at K={k} need {smem} bytes of "
            f"shared memory a block, more than an SM has ({smem_per_sm()})"
        )
    fn = _kernel(kind, template, smem)
    n_out = n // 2 if glu else n
    units = n_out if form != "mma" else (n_out // 8 if glu else n_out // 16)
    blocks = _grid_blocks(form, units, k, gs, stages, warps, cps)
    return one_output_call(fn, (blocks * warps * 32, 1, 1), (warps * 32, 1, 1), (1, n_out), dtype)


def quantized_matmul(
    x, w, scales, biases, group_size: int, residual=None, glu: bool = False, norm=None
):
    """``x @ dequantize(w).T`` for one row x [1, K] and a 4-bit affine ``w`` [N, K/8];
    ``residual`` [1, N] added; ``glu``: w = [gate; up], the result silu(gate) * up;
    ``norm`` = (weight [K], eps): x through that RMSNorm first."""
    from engine.backends.cuda.products.mma import device_scalar

    n, k = w.shape[0], w.shape[1] * 8
    inputs = [x, w, scales, biases] + ([residual] if residual is not None else [])
    if norm is not None:
        inputs += [norm[0], device_scalar(float(norm[1]))]
    run = launcher(x.dtype, n, k, group_size, residual is not None, glu, norm is not None)
    return run(inputs)


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call: ``products`` = (group size,
    K, residual, glu[, norm]) per kind of 1-row product (NVRTC ~1 s each; MLX keeps the
    PTX on disk)."""
    import mlx.core as mx

    from engine.backends.cuda.products.mma import device_scalar

    outs = []
    for gs, k, residual, glu, *rest in sorted(set(products)):
        norm = bool(rest and rest[0])
        n = 16  # one m-tile (the tensor-core form's; the CUDA-core form takes any)
        s = mx.ones((n, k // gs), dtype=dtype)
        ins = [mx.zeros((1, k), dtype=dtype), mx.zeros((n, k // 8), dtype=mx.uint32), s, s]
        if residual:
            ins.append(mx.zeros((1, n), dtype=dtype))
        if norm:
            ins += [mx.ones((k,), dtype=dtype), device_scalar(1e-5)]
        outs.append(launcher(dtype, n, k, gs, residual, glu, norm)(ins))
    mx.eval(outs)


def kernel_specs_for_check() -> list[KernelSpec]:
    out = []
    for spec in _specs().values():
        for dtype in ("bfloat16", "float16"):
            for k, gs, stages, warps in ((4096, 64, 8, 8), (14336, 32, 4, 16), (1024, 128, 12, 4)):
                tmpl = [("T", dtype), ("K", k), ("GS", gs), ("STAGES", stages), ("WARPS", warps)]
                name = f"{spec.name}_{dtype}_{k}_{gs}_{stages}"
                if spec.name.startswith("mb_qstream_i"):  # chunks a slot: 2 where K allows
                    cps = 2 if (k // 1024) % 2 == 0 else 1
                    tmpl += [("CPS", cps), ("EARLY", stages != 4)]
                    name += f"_c{cps}" + ("_e" if stages != 4 else "")
                out.append(for_dtype(spec, dtype, name, tmpl))
    return out
