"""4-bit decode products of many rows (33-128+) on tensor cores, x staged in shared memory.

Why: engine/backends/cuda/products/mma.py's kernel holds x in registers, 32 rows a block, and splits the
input dim over its warps. At 128 rows every weight tile is then dequantized by 4
blocks, and each block's warps wait on their own loads with nothing staged: the 8b
4-bit step at B=128 takes 20.9 ms on an H100 against 16.1 ms in bf16 (docs/performance.md), its products running at ~130 TFLOP/s. Widening that kernel's blocks
does not help (4x the L2 traffic of x, docs/performance.md).

Here a block takes 64 or 128 rows of x and ``WM`` m-tiles of 16 weight rows, one a
warp. x goes through shared memory in steps of 128 inputs, copied by ``cp.async``
into two buffers (the next step's copy runs while this one is used) and read by every
warp, so each weight fragment is dequantized once for all of the block's rows. A
warp's weight words for the next step are loaded into registers while it computes
this one. No warp splits the input dim, so there is no reduction at the end: each
lane writes its outputs (plus the residual, or silu(gate) * up) from its accumulators.

Layout: the MMA is ``y.T = W @ x.T`` as in gpu_mma.py (``mma.sync.m16n8k16``, weight
rows on the 16-row side, x rows on the 8-column side) with the same input permutation:
lane ``t`` of a quad holds physical inputs ``32t..32t+31`` of a step and feeds them as
the logical inputs ``2t, 2t+1, 2t+8, 2t+9`` of 8 MMA steps, for the weight and for x
alike. x's shared buffer is ``[n-tile][pair of MMA steps][g][t]`` of 16-byte units
(one global 16-byte load each), so the warp reads a fragment as 512 contiguous bytes.
``bench/gpu/qgemm_emulation.py`` checks this mapping lane by lane in numpy.

x has ``ST`` buffers (step ks + ST - 1's copy and weight registers are loaded while
step ks is computed). ``MT`` m-tiles a warp make each x fragment read from shared
memory feed that many weight tiles: ``geometry`` picks 64-row blocks of 8 warps (4
where the m-tiles do not split into 16s) with 2 m-tiles each, 2 stages, wherever the
weight's m-tiles split so.

The grid is stream-K (``stream_k``): every block of an SMs'-worth grid
takes an even share of all tiles' k-steps, and a tile cut between blocks is summed by
the last of them (one tile a block ran the 8b gate/up at 128 rows as 1.7 waves).

In the default quantized plan from 33 rows (``33:qgemm``) for the products where it
measured faster than gpu_mma (``takes``: every SwiGLU gate/up; qkv, the output layer
and the 8b down_proj at 128 rows by their work a block slot); the others stay on
gpu_mma. Measured on an H100 (docs/performance.md, CUPTI, 8b at 128 rows,
against gpu_mma): gate/up 0.72x, output layer 0.67x, qkv 0.88x, down_proj 0.90x;
o_proj 1.03x (left on gpu_mma). (bench/gpu/qgemm_sweep.py's first form timed
independent calls, which MLX's CUDA graph may overlap: it flattered the small grids.)
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import (
    SMS,
    Baked,
    KernelSpec,
    SpecsByKind,
    for_dtype,
    launch_bounds,
    one_output_call,
)
from engine.backends.cuda.kernels import source as _source

KSTEP = 128  # inputs a step: 4 lanes of a quad x 32
MIN_BLOCKS = 128  # about one a SM of an H100/H200 (132)
PAIR_WARPS = 8  # warps a block in the 2-m-tiles-a-warp geometry (pair_warps)
PAIR_WARPS_FEWER = 4  # ... where the m-tiles do not split into 8 x 2

_SOURCE = _source("products/qgemm/source.cu")


# a 16-bit scale or bias as the pair (h, h) that gpu_mma's mb_deq2 takes (also
# engine/backends/cuda/products/wgmma.py's)
PAIR = _source("products/qgemm/pair.cuh")

# one m-tile's weight registers for one k-step: words of its two rows, scale/bias pairs
_QW = PAIR + _source("products/qgemm/qw.cuh")


def product_kind(kind: str, suffix: str, flag: str, residual: str) -> tuple:
    """A 4-bit product kernel's kind read: ``q4``, ``q4_res`` or ``q4_glu``, then
    ``suffix`` (its partial-sum form: tile counters ``cnt`` and partials ``wsp`` as
    inputs), then ``_lbTxB``. Returns (base, partial form, "TxB" or "", the inputs, the
    body's flag lines: GLU, RES, ``flag``, and null pointers for the absent inputs);
    the residual input is named ``residual``. Also engine/backends/cuda/products/wgmma.py's."""
    base, _, bounds = kind.partition("_lb")
    part = base.endswith(suffix)
    base = base.removesuffix(suffix)
    glu, res = {"q4": (False, False), "q4_res": (False, True), "q4_glu": (True, False)}[base]
    inputs = [("x", "T", 2), ("w", "uint32", 2), ("scales", "T", 2), ("biases", "T", 2)]
    if res:
        inputs.append((residual, "T", 2))
    if part:
        inputs += [("cnt", "int32", 1), ("wsp", "float32", 1)]
    flags = f"  constexpr bool GLU = {'true' if glu else 'false'};\n"
    flags += f"  constexpr bool RES = {'true' if res else 'false'};\n"
    flags += f"  constexpr bool {flag} = {'true' if part else 'false'};\n"
    if not res:
        flags += f"  const T* {residual} = nullptr;\n"
    if not part:
        flags += "  const int* cnt = nullptr;\n  const float* wsp = nullptr;\n"
    return base, part, bounds, inputs, flags


@cache
def _spec(kind: str) -> KernelSpec:
    """Kinds ``q4``, ``q4_res`` (a residual ``r`` [M, N] added) and ``q4_glu`` (w =
    [gate; up], the output silu(gate) * up): the decode step's products at many rows.
    A suffix ``_sk``: the stream-K form (``stream_k``), with its tile counters ``cnt``
    and partial sums ``wsp`` as inputs (``stream_k_buffers``). A suffix ``_lbTxB``
    declares the kernel ``__launch_bounds__(T, B)`` (at most T threads a block, B
    blocks an SM): MLX writes the kernel's signature, so the header redefines
    ``__global__`` to carry it. Why: with 2 m-tiles a warp ptxas takes 206 registers,
    which leaves 2 blocks of 4 warps an SM (docs/performance.md)."""
    LAST_BLOCK = _source("attention/decode/last_block.cuh")
    CP_HEADER = _source("attention/prefill/header.cuh")
    MMA_HEADER = _source("products/mma/header.cuh")

    base, sk, bounds, inputs, flags = product_kind(kind, "_sk", "SK", "r")
    header = MMA_HEADER + CP_HEADER + _QW + LAST_BLOCK  # (named in the SK branch either way)
    header += launch_bounds(bounds)
    return KernelSpec(
        "mb_qgemm" + base[2:] + ("_sk" if sk else "") + (f"_lb{bounds}" if bounds else ""),
        inputs,
        [("y", "T")],
        flags + _SOURCE,
        header,
    )


_kernel = Baked(lambda: SpecsByKind(_spec), ensure_row_contiguous=True)


def supported(x_dtype, n: int, k: int, bits: int, group_size: int, mode: str, biases) -> bool:
    """engine/backends/cuda/products/gemv.py's 4-bit conditions (CUDA, bf16/fp16 x, 4-bit affine with
    biases), and a group size of 32/64/128, K a multiple of 128, N of 16."""
    from engine.backends.cuda.products import gemv as gpu_gemv

    return (
        gpu_gemv.quant_supported(x_dtype, n, k, bits, group_size, mode, biases)
        and group_size in (32, 64, 128)
        and k % KSTEP == 0
        and n % 16 == 0
    )


def geometry(rows: int, m_tiles: int) -> tuple[int, int, int]:
    """(x rows a block, warps a block, m-tiles a warp) for ``rows`` rows and ``m_tiles``
    m-tiles of the weight. Where the m-tiles split into 4 warps x 2: 64-row blocks of 4
    warps with 2 m-tiles each, the fastest form for the gate/up product at 128 rows
    (H100, CUPTI: 0.85x gpu_mma's time at 8b, 0.76x at 1b, where 8 warps
    gave 0.84x and 0.68x; 128-row blocks with 2 m-tiles a warp spill). Otherwise one m-tile a
    warp: 128 rows a block from 65 rows (64 below), 8 warps, fewer warps (then fewer
    rows) while that leaves under MIN_BLOCKS blocks."""
    for pw in (pair_warps(), PAIR_WARPS_FEWER):  # 8 warps where they divide, else 4
        if m_tiles % (pw * 2) == 0:
            return 64, pw, 2
    options = [(128 if rows > 64 else 64, wm) for wm in (8, 4, 2)] + [(64, 2), (64, 1)]
    for bm, wm in options:
        if m_tiles % wm == 0 and m_tiles // wm * -(-rows // bm) >= MIN_BLOCKS:
            return bm, wm, 1
    for bm, wm in reversed(options):
        if m_tiles % wm == 0:
            return bm, wm, 1
    return 64, 1, 1


PAIR_WARPS_ENV = "MARKBASE_GPU_QGEMM_PAIR_WARPS"


def pair_warps() -> int:
    """Warps a block of the 2-m-tile geometry: PAIR_WARPS (8: one block of 256 weight
    rows an SM, x copied from L2 half as often a weight row), or 4 with
    ``MARKBASE_GPU_QGEMM_PAIR_WARPS=4`` (2 blocks an SM; the default).
    Measured (H100, CUPTI, 128 rows, stream-K): 8b output layer 647 against
    704 us, down_proj 93 against 101, gate/up 172 against 171; 1b output layer 94
    against 106; the engine's 8b 4-bit B=128 with stream-K 7,571-7,906 tok/s against
    6,636 with 4 warps (stream-K on the gate/up and output layer only)."""
    return int(envs.value(PAIR_WARPS_ENV))


def shared_bytes(bm: int, stages: int) -> int:
    """``stages`` buffers of a step: x (bm rows x 128 inputs x 2 bytes)."""
    return stages * bm * KSTEP * 2


STAGES_ENV = "MARKBASE_GPU_QGEMM_STAGES"
LB_ENV = "MARKBASE_GPU_QGEMM_LB"


def stages(mt: int = 1) -> int:
    """Buffers of x (and steps the weight registers are loaded ahead, less one):
    ``MARKBASE_GPU_QGEMM_STAGES`` (2 or 3) if set, else 2 with 2 m-tiles a warp (the
    sweep's best; its registers are the tighter) and 3 with one (3 stages beat 2 there:
    docs/performance.md). A form with the weights in shared memory too
    (cp.async, 2-4 stages) measured no better  and was removed."""
    want = envs.value(STAGES_ENV)
    return int(want) if want is not None else 2 if mt == 2 else 3


def min_blocks() -> int:
    """``MARKBASE_GPU_QGEMM_LB``: blocks an SM the kernel is compiled for (0: no bound)."""
    return envs.value(LB_ENV)


def wide_enough(rows: int, m_tiles: int) -> bool:
    """Whether ``geometry`` gives this product blocks of 4+ m-tiles and at least
    MIN_BLOCKS of them. With fewer m-tiles a block, each block reads all of x from L2 for
    32 weight rows or less (o_proj and down_proj of the 8b model at 128 rows took 3.2x
    gpu_mma's time); with fewer blocks, half the SMs idle: in the engine's
    step (8b 4-bit B=128) the 64-block o_proj/down_proj took 151 us a call
    against gpu_mma's 69, while gate/up (448 blocks) took 203 against 233. The plan's
    ``qgemm`` falls back to ``qmma`` for them (engine/backends/cuda/linear.py)."""
    bm, wm, mt = geometry(rows, m_tiles)
    return wm * mt >= 4 and m_tiles // (wm * mt) * -(-rows // bm) >= MIN_BLOCKS


PLAIN_ENV = "MARKBASE_GPU_QGEMM_PLAIN"
PLAIN_MIN_K = 4096  # inputs: 32+ k-steps a block


def takes(rows: int, m_tiles: int, glu: bool, k: int = 0, residual: bool = False) -> bool:
    """Whether the plan's ``qgemm`` runs this product here. By default (``stream_k``
    3) where the stream-K form measured faster (``_worth_stream_k``); with 2, every
    product whose m-tiles split into the 2-m-tile geometry; with 0 or 1 (one tile a
    block, or stream-K on the same products): the SwiGLU gate/up where
    ``wide_enough``, and a wide product without a residual of PLAIN_MIN_K+ inputs (the
    output layer of the 8b model, not the 1b's: K 2048) unless
    ``MARKBASE_GPU_QGEMM_PLAIN=0``. Measured by CUPTI (H100, 128 rows,
    against gpu_mma): gate/up 0.84x at 8b and 0.68-0.76x at 1b; qkv 1.32-1.74x, o_proj
    and down_proj 1.95-4.3x (64 blocks: half the SMs idle, which stream-K is for); with
    the output layer on qgemm too, the engine's 1b B=128 step was 8.5% slower than
    all-qmma while the 8b's was 5-7% faster. Measured on an H100: the 8b output layer
    alone 727 us against qmma's 973 (1b: 99 against 146, not measured in the engine
    since); the engine's 8b 4-bit B=128 7,629 -> 8,111 and 8,168 tok/s, against
    compiled PyTorch's 8,030 in the same run."""
    sk = stream_k()
    if sk == 2:
        return geometry(rows, m_tiles)[2] == 2
    if sk == 3:
        return _worth_stream_k(rows, m_tiles, glu, k, residual)
    if not wide_enough(rows, m_tiles):
        return False
    if glu:
        return True
    plain = envs.value(PLAIN_ENV)
    return plain and not residual and k >= PLAIN_MIN_K


SK_ENV = "MARKBASE_GPU_QGEMM_SK"
SK_MAX_TILES = 1 << 16  # tile counters a thread keeps (8b output layer, 1,024 rows: 16,032)
SK_MAX_THREADS = 256  # threads an SM of the stream-K grid, at most (2 blocks of 4 warps)
SK_MAX_VALUES = 64  # accumulators a thread (MT x NTW x 4), at most


SK_PLAIN_ITEMS = 4  # k-steps of work a block slot from which a plain product gains
SK_RESIDUAL_ITEMS = 20  # ... and a product with a residual


def _worth_stream_k(rows: int, m_tiles: int, glu: bool, k: int, residual: bool) -> bool:
    """``stream_k`` 3: the kernel where the measured sweep (H100, 64 and 128 rows,
    CUPTI, against gpu_mma) saw the stream-K form win: every SwiGLU gate/up, and other
    products with enough k-steps of work a block slot (plain ones from SK_PLAIN_ITEMS:
    the 8b qkv at 64 rows, 5.8 a slot, 0.89x; the 1b qkv at 128, 2.9, 1.22x; the output
    layers 0.64-0.74x; with a residual from SK_RESIDUAL_ITEMS: the 8b down_proj at 128
    rows, 27 a slot, 0.90x, at 64, 13.6, 1.21x; o_proj 7.8, 1.03x)."""
    bm, wm, mt = geometry(rows, m_tiles)
    if mt != 2 or k < KSTEP:
        return False
    if glu:
        return True
    tiles = m_tiles // (wm * mt) * -(-rows // bm)
    per_slot = tiles * (k // KSTEP) / stream_k_slots(wm, mt)
    return per_slot >= (SK_RESIDUAL_ITEMS if residual else SK_PLAIN_ITEMS)


def stream_k() -> int:
    """``MARKBASE_GPU_QGEMM_SK``: 3 (default) stream-K where it measured faster than
    gpu_mma (``_worth_stream_k``); 0 one tile a block (the default);
    1 the products the one-tile form takes (``takes``' rules), in the stream-K form; 2
    stream-K for every product of 33+ rows whose weight splits into the 2-m-tile
    geometry.

    Why: a launch of one tile a block runs in whole waves. The 8b gate/up at 128 rows is
    448 tiles on 264 block slots (2 an SM): 1.7 waves, so its second wave leaves 30% of
    the GPU idle; o_proj and down_proj are 64 tiles, a quarter of the slots. Stream-K
    (Osama et al., 2023) gives each of the grid's blocks (the SMs' worth) an equal share
    of the tiles' k-steps, cut across tiles; a tile cut between blocks is summed by the
    last of them from the others' partial sums (fp32, in block order: deterministic).
    Measured (H100, same run): 8b 4-bit B=128 7,417 tok/s (0) -> 7,926
    and 8,323 (3), B=64 6,368 -> 7,038 and 6,879; 1b B=128 37,390 -> 38,595, B=64
    29,340 -> 30,135. Mode 2 lost at 1b (B=128 35,624 -> 31,148)."""
    return int(envs.value(SK_ENV))


def blocks_per_sm(wm: int, mt: int) -> int:
    """Blocks of the form an SM holds at once: 2 of the 2-m-tile form's 4 warps (206
    registers), otherwise about 8 warps' worth. Sizes the stream-K grid; a
    wrong guess costs balance, not correctness."""
    return 2 if (wm, mt) == (4, 2) else max(1, 8 // wm)


def stream_k_slots(wm: int, mt: int) -> int:
    """Blocks of the form the GPU holds at once: its SMs x ``blocks_per_sm``."""
    return sms() * blocks_per_sm(wm, mt)


def stream_k_grid(tiles: int, steps: int, wm: int, mt: int) -> int:
    """Blocks of a stream-K launch: every slot (``stream_k_slots``), or fewer where
    there are fewer k-steps than that in all: the kernel's owner arithmetic needs a
    k-step a block at least."""
    return max(1, min(tiles * steps, stream_k_slots(wm, mt)))


def sms() -> int:
    """This GPU's SM count (SMS, an H100/H200's, where it cannot be read); also
    engine/backends/cuda/products/wgmma.py's."""
    return platform.sm_count() or SMS


def partials_size() -> int:
    """Floats of the stream-K partials buffer (also engine/backends/cuda/products/wgmma.py's split form's)."""
    return sms() * SK_MAX_THREADS * 2 * SK_MAX_VALUES


def stream_k_buffers():
    """(tile counters, partial sums) of the calling thread's stream-K launches: int32
    zeros that every launch leaves zero again, and float32 room for two partials a
    block. Per thread: each model's worker thread has its own MLX stream, and launches
    on two streams may run at the same time. Made (and evaluated) at the first call:
    under ``mx.compile`` they must exist before the trace (``ensure_stream_k``)."""
    import threading

    key = threading.get_ident()
    bufs = _SK_BUFFERS.get(key)
    if bufs is None:
        import mlx.core as mx

        bufs = (
            mx.zeros((SK_MAX_TILES,), dtype=mx.int32),
            mx.zeros((partials_size(),), dtype=mx.float32),
        )
        mx.eval(bufs)
        _SK_BUFFERS[key] = bufs
    return bufs


_SK_BUFFERS: dict = {}


def ensure_stream_k() -> None:
    """Make this thread's stream-K buffers now if the form is on (before a trace)."""
    if stream_k():
        stream_k_buffers()


@cache
def _template(dtype, gs: int, ntw: int, wm: int, st: int, mt: int) -> tuple:
    return (("T", dtype), ("GS", gs), ("NTW", ntw), ("WM", wm), ("ST", st), ("MT", mt))


def launcher(dtype, rows: int, n: int, k: int, gs: int, residual: bool = False, glu: bool = False):
    """``call(inputs) -> y`` for ``rows`` rows of x [rows, K] and a 4-bit weight of ``n``
    rows; ``inputs``: x, weight, scales, biases, then the residual (``residual``).
    Worked out once (engine/backends/cuda/linear.py keeps one per layer and row count)."""
    if glu and residual:
        raise ValueError("gpu_qgemm: glu and residual together are not a kernel")
    bm, wm, mt = geometry(rows, n // 16)
    return _launch(dtype, rows, n, gs, residual, glu, bm, wm, mt, sk=stream_k() > 0, k=k)


def _launch(
    dtype, rows: int, n: int, gs: int, residual: bool, glu: bool, bm: int, wm: int,
    mt: int = 1, sk: bool = False, k: int = 0,
):  # fmt: skip
    """The launch of ``launcher`` with its geometry given (``warm`` gives each one);
    ``mt`` m-tiles a warp (2: each x fragment read from shared memory feeds two weight
    tiles; bench/gpu/qgemm_sweep.py measures it; N must be a multiple of 16 wm mt);
    ``sk``: the stream-K form (``stream_k``) for inputs of ``k``, unless the tiles pass
    SK_MAX_TILES (its grid is sized by the k-steps)."""
    if sk and k < KSTEP:
        raise ValueError("gpu_qgemm: the stream-K form needs the input size k")
    if (n // 16) % (wm * mt):
        raise ValueError(f"gpu_qgemm: {n} weight rows do not split into {wm} x {mt} m-tiles")
    kind = "q4_glu" if glu else "q4_res" if residual else "q4"
    st = stages(mt)
    tiles = n // 16 // (wm * mt) * -(-rows // bm)
    blocks = stream_k_grid(tiles, max(1, k // KSTEP), wm, mt)
    partials = blocks * 2 * wm * 32 * mt * (bm // 8) * 4  # floats: two a thread's sums
    sk = sk and tiles <= SK_MAX_TILES and partials <= partials_size()
    if sk:
        kind += "_sk"
    if min_blocks():
        kind += f"_lb{wm * 32}x{min_blocks()}"
    smem = shared_bytes(bm, st)
    fn = _kernel(kind, _template(dtype, gs, bm // 8, wm, st, mt), smem)
    shape = (rows, n // 2 if glu else n)
    if not sk:
        return one_output_call(fn, (tiles * wm * 32, 1, 1), (wm * 32, 1, 1), shape, dtype)
    run = one_output_call(fn, (blocks * wm * 32, 1, 1), (wm * 32, 1, 1), shape, dtype)
    extra = list(stream_k_buffers())
    return lambda inputs: run([*inputs, *extra])


def quantized_matmul(x, w, scales, biases, group_size: int, residual=None, glu: bool = False):
    """``x @ dequantize(w).T`` for x [M, K] and a 4-bit affine ``w`` [N, K/8];
    ``residual`` [M, N] added, or with ``glu`` (w = [gate; up]) silu(gate) * up."""
    n, k = w.shape[0], w.shape[1] * 8
    run = launcher(x.dtype, x.shape[0], n, k, group_size, residual is not None, glu)
    inputs = [x, w, scales, biases] + ([residual] if residual is not None else [])
    return run(inputs)


WARM_ROWS = 1024  # warm() covers every geometry of up to this many rows


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call: ``products`` = (group size,
    K, N, residual, glu) per product; each geometry any row count up to WARM_ROWS
    picks (a new one mid-serving would be an NVRTC compile, ~1 s, in a step)."""
    import mlx.core as mx

    sk = stream_k() > 0
    outs = []
    for gs, k, n_rows, residual, glu in sorted(set(products)):
        shapes = {
            geometry(r, n_rows // 16)
            for r in range(1, WARM_ROWS + 1)
            if takes(r, n_rows // 16, glu, k, residual)  # the others run on gpu_mma
        }
        for bm, wm, mt in sorted(shapes):
            rows, n = bm, 16 * wm * mt  # a small weight with the same template
            s = mx.ones((n, k // gs), dtype=dtype)
            ins = [mx.zeros((rows, k), dtype=dtype), mx.zeros((n, k // 8), dtype=mx.uint32), s, s]
            if residual:
                ins.append(mx.zeros((rows, n), dtype=dtype))
            outs.append(_launch(dtype, rows, n, gs, residual, glu, bm, wm, mt, sk, k)(ins))
    mx.eval(outs)


def kernel_specs_for_check() -> list[KernelSpec]:
    """The sources with concrete template values (bench/gpu/nvrtc_check.py): with and
    without launch bounds, one tile a block and stream-K."""
    out = []
    forms = [  # (ntw, wm, st, mt, gs, blocks an SM, stream-K)
        *((ntw, wm, st, mt, 64, 0, False) for ntw, wm, st, mt in (
            (16, 8, 3, 1), (16, 8, 2, 1), (8, 8, 3, 1), (8, 2, 3, 1), (8, 8, 3, 2),
            (8, 4, 2, 2), (8, 8, 2, 2), (16, 4, 2, 2))),
        (8, 4, 3, 2, 64, 3, False), (8, 4, 2, 2, 64, 4, False), (8, 4, 3, 2, 32, 3, False),
        (8, 4, 2, 2, 64, 0, True), (8, 8, 2, 2, 64, 0, True), (16, 8, 3, 1, 64, 0, True),
        (8, 2, 3, 1, 128, 0, True),
    ]  # fmt: skip
    for base in ("q4", "q4_res", "q4_glu"):
        for dtype in ("bfloat16", "float16"):
            for ntw, wm, st, mt, gs, blocks, sk in forms:
                kind = base + ("_sk" if sk else "") + (f"_lb{wm * 32}x{blocks}" if blocks else "")
                spec = _spec(kind)
                tmpl = [("T", dtype), ("GS", gs), ("NTW", ntw), ("WM", wm), ("ST", st), ("MT", mt)]
                name = f"{spec.name}_{dtype}_{ntw}_{wm}_{st}_{mt}_{gs}"
                out.append(for_dtype(spec, dtype, name, tmpl))
    return out
