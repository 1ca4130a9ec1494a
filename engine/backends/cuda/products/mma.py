"""Decode products of few rows on tensor cores: bf16/fp16 and 4-bit affine weights.

Why: engine/backends/cuda/products/gemv.py's few-row kernels multiply on CUDA cores, one FMA per weight
and row: for 8 rows that is ALU-bound (8b 4-bit, 8 rows: 10.6 ms a step against a
~1.2 ms read of the weights; bf16, 8 rows: 3x cuBLAS's GPU time). MLX's own kernels
for these shapes are weak too (4-bit ``qmm_sm80`` moves 0.34 TB/s at 8 rows, 23 ms a
step at 32), and a bf16 product of 2-32 rows goes through cuBLAS, whose host cost per
call makes the small-batch step host-bound (docs/performance.md).

Here the product is computed transposed, ``y.T = W @ x.T``, with
``mma.sync.m16n8k16``: 16 output features are the MMA's M side and the batch rows its
N side (8 per n-tile, up to 4 n-tiles), so the tensor core does the multiplies and
the kernel only has to stream the weight. A block owns 16 output features; its
``WARPS`` warps split the input dim and add their results through shared memory at
the end. Each lane loads 16 bytes of a weight row at a time (the 4 lanes of a quad
read 64 consecutive bytes), and the same 16-byte slice of each ``x`` row: the order
of the products inside a 16-wide MMA step does not matter for the sum, so the lanes'
registers are fed to the MMA as they were loaded (lane ``t`` of a quad holds
physical inputs ``8t..8t+7`` of its slice, which the MMA reads as logical inputs
``2t, 2t+1, 2t+8, 2t+9`` of two steps; x is permuted the same way), no shuffles.

4-bit: each lane loads 32 nibbles of a row (one 16-byte word group, always inside one
quantization group) and turns each pair into bf16/fp16 with the exponent trick
(``0x4300 | q`` is 128 + q in bf16, ``0x6400 | q`` is 1024 + q in fp16; subtracting the
constant is exact), then ``q * scale + bias`` in one paired FMA: the weight rounded
once to the activations' type, as a dequantize-then-multiply does.

Limits (``float_supported``/``quant_supported``): bf16/fp16 activations, N a multiple
of 16, K a multiple of 32 (float) or 128 (4-bit, group size a multiple of 32),
any rows a call (a block takes up to 32; more rows are more blocks, and each 32-row
chunk reads the weight again, from L2 when the chunks of a tile run side by side:
worth it for 4-bit weights, whose reads are small). ``bench/gpu/nvrtc_check.py`` compiles the
sources without a GPU; ``tests/backends/cuda/test_gpu_mma.py`` checks them against MLX on one.
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype, one_output_call
from engine.backends.cuda.kernels import source as _source

WARPS = 8
BLOCK_ROWS = 32  # rows of x a block takes (4 n-tiles of 8); more rows, more blocks

_HEADER = _source("products/mma/header.cuh")

# both kernels: lane roles, the accumulators c[n-tile][4], and at the end the warps'
# partial sums added through shared memory and written as y[m, n]
_HEAD = _source("products/mma/head.cu")

_TAIL = _source("products/mma/tail.cu")

# float weights [N, K]: a lane's 16-byte slice is 8 inputs, two MMA steps
_F_LOOP = _source("products/mma/f_loop.cu")

# 4-bit weights [N, K/8] uint32: a lane's 16-byte slice is 32 inputs (one quantization
# group's part), eight MMA steps; x's matching 32 inputs are four 16-byte loads
_Q4_LOOP = _source("products/mma/q4_loop.cu")


def _specs() -> dict[str, KernelSpec]:
    """Kinds: ``float``/``q4``, each also with ``_res`` (a residual input ``r`` [M, N]
    added to the output) and ``_glu`` (w = [gate; up]; the output is silu(gate) * up,
    [M, N/2]): the decode step's o_proj and down_proj with the residual adds folded in,
    and gate_up with the SwiGLU (engine/model/decode_step.py)."""
    inputs = {
        "float": [("x", "T", 2), ("w", "T", 2)],
        "q4": [("x", "T", 2), ("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)],
    }
    loops = {"float": _F_LOOP, "q4": _Q4_LOOP}
    names = {"float": "mb_mma_f", "q4": "mb_mma_q4"}
    forms = (("", False, False), ("_res", False, True), ("_glu", True, False))
    out = {}
    for base in ("float", "q4"):
        for suffix, glu, res in forms:
            flags = "".join(
                f"  constexpr bool {name} = {'true' if on else 'false'};\n"
                for name, on in (("GLU", glu), ("RES", res))
            )
            # the discarded branches still name the inputs a form does not have
            if not res:
                flags += "  const T* r = nullptr;\n"
            extra = [("r", "T", 2)] if res else []
            out[base + suffix] = KernelSpec(
                names[base] + suffix,
                inputs[base] + extra,
                [("y", "T")],
                flags + _HEAD + loops[base] + _TAIL,
                _HEADER,
            )
    return out


# one kernel object per template values (engine/backends/cuda/kernels.py: less host time a call)
_kernel = Baked(_specs, ensure_row_contiguous=True)


def _float_u(k: int, mt: int) -> int:
    # about 128 bytes of weight in flight per lane whatever MT (registers)
    return min(4 if k % 128 == 0 else 2 if k % 64 == 0 else 1, max(1, 4 // mt))


def _quant_u(k: int, nt: int, mt: int) -> int:
    return 2 if nt <= 2 and mt == 1 and k % 256 == 0 else 1


# A block's m-tiles: every block reads its rows of x (up to 32 x K) from L2 for its
# 16 * MT weight rows, so with one m-tile x's traffic is 2x the weight's at 32 rows
# (bf16) and 8x (4-bit). More m-tiles a block divide that, but leave fewer blocks and
# need more registers (1 block of 8 warps an SM at MT 4). Measured (docs/performance.md, session
# 7): 8b 4-bit 32 rows GPU 9.4 -> 7.5 ms a step; at 8 rows slower (bf16 6.3 -> 8.2 ms,
# 4-bit 4.3 -> 4.6): so more than one m-tile only from 17 rows, and only while at
# least MIN_BLOCKS blocks remain (about one per SM of an H200's 132).
# MARKBASE_GPU_MMA_MT caps it (A/B; set_max_m_tiles switches it in one process).
MIN_BLOCKS = 128
_cap: list[int] = []


def _max_m_tiles() -> int:
    if not _cap:
        _cap.append(envs.MARKBASE_GPU_MMA_MT)
    return _cap[0]


def set_max_m_tiles(cap: int | None) -> None:
    """Cap the m-tiles a block takes from the next call on (None: the environment's)."""
    _cap.clear()
    if cap is not None:
        _cap.append(max(1, cap))


def m_tiles(n_weight_rows: int, rows: int = 32) -> int:
    """How many 16-row m-tiles a block takes for a weight of ``n_weight_rows`` rows
    and ``rows`` rows of x."""
    if rows <= 16:
        return 1
    chunks = -(-rows // BLOCK_ROWS)
    for mt in (4, 2):
        if (
            mt <= _max_m_tiles()
            and n_weight_rows % (16 * mt) == 0
            and n_weight_rows // (16 * mt) * chunks >= MIN_BLOCKS
        ):
            return mt
    return 1


def float_supported(x_dtype, w_dtype, n: int, k: int) -> bool:
    import mlx.core as mx

    return (
        platform.cuda_available()
        and x_dtype in (mx.bfloat16, mx.float16)
        and w_dtype == x_dtype
        and n % 16 == 0
        and k % 32 == 0
        and n > 0
    )


def quant_supported(x_dtype, n: int, k: int, bits: int, group_size: int, mode: str, biases) -> bool:
    from engine.backends.cuda.products import gemv as gpu_gemv

    return (
        gpu_gemv.quant_supported(x_dtype, n, k, bits, group_size, mode, biases)
        and k % 128 == 0
        and n % 16 == 0
    )


# A/B knobs for 4-bit products of 1-8 rows (one n-tile): chunks a lane loads before it
# computes and warps a block (bench/gpu/q4_bench.py); empty = the rules above
_q4_few: dict = {}


def set_q4_few_rows(u: int | None = None, warps: int | None = None, xl: bool = False) -> None:
    """Launchers made from now on for 4-bit products of 1-8 rows use ``u`` / ``warps``
    (None: the default rule; a ``u`` that K does not allow falls back to the rule) and,
    with ``xl``, read x where it is used instead of with the weight (``XL``; not with
    the RMSNorm folded in, which scales x as it is loaded)."""
    _q4_few.clear()
    _q4_few.update({k: v for k, v in (("u", u), ("warps", warps)) if v is not None})
    if xl:
        _q4_few["xl"] = True


@cache
def _template(dtype, nt: int, u: int, gs: int, mt: int, warps: int = WARPS, xl=False) -> tuple:
    out = (("T", dtype), ("NT", nt), ("U", u), ("WARPS", warps), ("MT", mt), ("XL", xl))
    return out + (("GS", gs),) if gs else out


def launcher(
    base: str,
    dtype,
    rows: int,
    n: int,
    k: int,
    gs: int = 0,
    residual: bool = False,
    glu: bool = False,
    mt: int | None = None,
):
    """``call(inputs) -> y`` for products of ``rows`` rows of x [rows, K] and a weight
    of ``n`` rows (``base`` "float", or "q4" with group size ``gs``), in ``dtype``.
    ``inputs``: x, the weight's arrays, then the residual (``residual``). Everything but the inputs is worked out
    here once: engine/backends/cuda/linear.py keeps one per layer and row count, because doing
    it on every call cost more host time than MLX's own op (bench/gpu/wrapper_cost.py)."""
    if glu and residual:
        raise ValueError("gpu_mma: glu and residual together are not a kernel")
    kind = base + ("_glu" if glu else "_res" if residual else "")
    nt = _n_tiles(rows)
    mt = m_tiles(n, rows) if mt is None else mt
    u = _float_u(k, mt) if base == "float" else _quant_u(k, nt, mt)
    warps, xl = WARPS, False
    if base == "q4" and nt == 1 and _q4_few:
        warps = _q4_few.get("warps", WARPS)
        want = _q4_few.get("u", u)
        u = want if k % (128 * want) == 0 else u
        xl = _q4_few.get("xl", False)
    fn = _kernel(kind, _template(dtype, nt, u, gs, mt, warps, xl))
    grid = (n // (16 * mt) * -(-rows // BLOCK_ROWS) * warps * 32, 1, 1)
    shape = (rows, n // 2 if glu else n)
    return one_output_call(fn, grid, (warps * 32, 1, 1), shape, dtype)


def _call(base: str, x, inputs: list, n: int, k: int, gs: int, residual, glu: bool):
    inputs = [x, *inputs]
    if residual is not None:
        inputs.append(residual)
    run = launcher(base, x.dtype, x.shape[0], n, k, gs, residual is not None, glu)
    return run(inputs)


_device_scalars_made: dict = {}
SCALAR_WORDS = 4  # 16 bytes: past MLX's CUDA scalar pool (arrays of 8 bytes or less)


def device_scalar(value: float):
    """A float32 scalar input (kernels read element 0: RMSNorm's epsilon, the prefill
    attention's softmax scale) in device memory, made once per value by a GPU op.
    Why not ``mx.array([value])``: MLX's CUDA allocator puts every array of 8 bytes or
    less in one small pool of managed memory (mlx/backend/cuda/allocator.cpp,
    ``SmallSizePool``), which the GPU reads across PCIe: a 9 MiB read kernel whose
    blocks each read one such scalar took 15.9 us a launch against 4.7 us from a 16-byte
    device array (H100, bench/gpu/pool_cost.py). So this array is 16 bytes,
    made by ``mx.full`` on the GPU stream."""
    arr = _device_scalars_made.get(value)
    if arr is None:
        import mlx.core as mx

        arr = mx.full((SCALAR_WORDS,), value, dtype=mx.float32)
        mx.eval(arr)  # (allowed inside mx.compile's trace: it depends on no traced input)
        _device_scalars_made[value] = arr
    return arr


def _n_tiles(rows: int) -> int:
    return 1 if rows <= 8 else 2 if rows <= 16 else 4


def matmul(x, w, residual=None, glu: bool = False):
    """``x @ w.T`` for a bf16/fp16 ``w`` [N, K]; x [M, K] of the same dtype.
    ``residual`` [M, N]: added to the result. ``glu``: w is [gate; up] and the result
    is ``silu(x @ gate.T) * (x @ up.T)``, [M, N/2]."""
    n, k = w.shape
    return _call("float", x, [w], n, k, 0, residual, glu)


def quantized_matmul(x, w, scales, biases, group_size: int, residual=None, glu: bool = False):
    """``x @ dequantize(w).T`` for 4-bit affine ``w`` [N, K/8] uint32; x [M, K].
    ``residual`` and ``glu`` as in ``matmul``."""
    n, k = w.shape[0], w.shape[1] * 8
    return _call("q4", x, [w, scales, biases], n, k, group_size, residual, glu)


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call (1, 2 and 4 n-tiles for each
    product kind), so that no request waits on NVRTC (about a second each; MLX keeps
    the PTX on disk, so only a machine's first start pays). ``products``: (group size
    or 0 for a float weight, K, N, residual, glu) per kind of product the model has;
    N (the weight's rows) picks the m-tiles, and a small weight with the same m-tiles
    stands in for it."""
    import mlx.core as mx

    outs = []
    for gs, k, n_rows, residual, glu in sorted(set(products)):
        base = "q4" if gs else "float"
        tiles = {(_n_tiles(m), m_tiles(n_rows, m)) for m in (2, 9, 17, 33, 65, 97)}
        for nt, mt in sorted(tiles):
            m, n = {1: 2, 2: 9, 4: 17}[nt], 16 * mt
            ins = [mx.zeros((m, k), dtype=dtype)]
            if gs:
                s = mx.ones((n, k // gs), dtype=dtype)
                ins += [mx.zeros((n, k // 8), dtype=mx.uint32), s, s]
            else:
                ins += [mx.zeros((n, k), dtype=dtype)]
            if residual:
                ins += [mx.zeros((m, n), dtype=dtype)]
            run = launcher(base, dtype, m, n, k, gs, bool(residual), glu, mt=mt)
            outs.append(run(ins))
    mx.eval(outs)


def kernel_specs_for_check() -> list[KernelSpec]:
    out = []
    for kind, spec in _specs().items():
        for dtype in ("bfloat16", "float16"):
            for nt, mt in ((1, 1), (2, 1), (4, 1), (1, 4), (4, 2), (4, 4)):
                for u in sorted(
                    {_float_u(k, mt) for k in (32, 64, 128)}
                    if kind.startswith("float")
                    else {_quant_u(k, nt, mt) for k in (128, 256)}
                ):
                    tmpl = [("T", dtype), ("NT", nt), ("U", u), ("WARPS", WARPS), ("MT", mt)]
                    tmpl += [("XL", kind == "q4_glu" and nt == 1)]
                    if kind.startswith("q4"):
                        tmpl.append(("GS", 64))
                    out.append(for_dtype(spec, dtype, f"{spec.name}_{dtype}_{nt}_{u}_{mt}", tmpl))
    return out
