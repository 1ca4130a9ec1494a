"""4-bit products of 33-128 rows on Hopper's warpgroup MMA (``wgmma``), both operands
in shared memory.

Why: at 128 rows (the 8b 4-bit decode step at B=128) engine/backends/cuda/products/qgemm.py's products
run at ~175 TFLOP/s on an H100 and the step is level with compiled PyTorch in bf16
(docs/performance.md: gate/up 163 us a layer, down_proj 89, o_proj 37).
That kernel issues ``mma.sync`` from every warp and feeds it x fragments read from
shared memory by each warp: its ablations  found no single part binding,
the x copies, weight loads and fragment reads each costing a share. ``wgmma`` reads
both operands from shared memory by descriptor, one instruction a 64 x BN x 16 product
for a warpgroup of 4 warps, and runs asynchronously: the warps dequantize the next
step's weights while the tensor cores work on this one.

Layout: the product is ``y.T = W @ x.T``. A block takes 64 weight rows a warpgroup (4
warpgroups by default, ``warpgroups``) and BN x rows (64 or 128; rows past M are zeros)
in k-steps of 64 inputs. Each step, every thread loads one 16-byte run of 4-bit words (32 inputs of a
weight row) two steps ahead, dequantizes it (``mb_deq2``, gpu_mma's) and stores the
four 8-input runs where ``wgmma``'s canonical K-major layout without swizzle wants
them: a core matrix is 8 rows x 16 bytes, contiguous; the descriptor's leading offset
steps between core matrices along K (``ALBO``/``XLBO``: padded by PAD bytes, so that
the copies' shared-memory writes spread over the banks), its stride offset (128 bytes)
along the rows. x's 16-byte runs go to the same layout by ``cp.async``. GLU (w =
[gate; up]): a block's 16-row groups are 8 gate rows and their 8 up rows, so a lane
holds an output's gate and up sums (rows g and g + 8 of ``wgmma``'s accumulator
layout) and writes silu(gate) * up.

Three stages of dequantized weights and NX (3-5) of x: step i's buffers are
written after the barrier of step i - 1 + (stages - 2), when every warpgroup's
``wgmma.wait_group 1`` has retired the step that read them last. Writes by the
threads (``st.shared``, ``cp.async``) are made visible to ``wgmma``'s async proxy by
``fence.proxy.async`` before the barrier.

Split K: where the weight tiles fill too few of the GPU's block slots (o_proj and
down_proj of the 8b model: 32 tiles), ``S`` blocks take a share of each tile's k-steps
each; the last of a tile's blocks (a counter, zero between launches) sums the partials
in split order (deterministic) and writes the epilogue. The counters and partials are
gpu_qgemm's stream-K buffers.

Measured on an H200 (docs/performance.md): exact on small integers in every
form; against gpu_qgemm at 128 rows of the 8b model, with 4 warpgroups a block, gate/up
0.84x and the output layer 0.87x its time, but the split products (qkv, o_proj,
down_proj) 1.07-1.19x: so by default (``MARKBASE_GPU_WGMMA=auto``) the decode step
sends it only unsplit products of 65-128 rows (``unsplit``); the engine's 8b 4-bit
B=128 went 9,213 -> 9,774 and 10,138 tok/s. ``=1``: 33-128 rows; ``=0``: off. Needs
sm_90 (MLX's JIT compiles for sm_90a on a compute capability 9 device). The split form's
counters and partials are one set a thread: two split launches must not run at once
(the decode step's products depend on each other; tests evaluate each call alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import (
    Baked,
    KernelSpec,
    SpecsByKind,
    for_dtype,
    launch_bounds,
    one_output_call,
)
from engine.backends.cuda.kernels import source as _source

KS = 64  # inputs a k-step
A_STAGES = 3
MIN_SPLIT_STEPS = 4  # k-steps a split block takes at least
PAD = 16  # bytes between the K-columns of core matrices beyond 16 rows x 128 bytes


def _wgmma_asm(bn: int, ab: str) -> str:
    """``mb_wgmma`` for m64n{bn}k16 with ``ab`` (bf16/f16) operands, f32 accumulators."""
    nv = bn // 2
    regs = ",".join(f"%{i}" for i in range(nv))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nv))
    ctype = "__nv_bfloat16" if ab == "bf16" else "__half"
    return (
        f"__device__ __forceinline__ void mb_wgmma(float* d, uint64_t da, uint64_t db, {ctype}, "
        f"mb_n<{bn}>) {{\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nv + 2}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}.{ab} {{{regs}}}, %{nv}, %{nv + 1}, '
        f'p, 1, 1, 0, 0;\\n}}\\n"\n'
        f"      : {outs}\n"
        f'      : "l"(da), "l"(db), "r"(1));\n'
        "}\n"
    )


_HEADER_TOP = _source("products/wgmma/header_top.cuh")


def _header() -> str:
    LAST_BLOCK = _source("attention/decode/last_block.cuh")
    CP_HEADER = _source("attention/prefill/header.cuh")
    MMA_HEADER = _source("products/mma/header.cuh")
    PAIR = _source("products/qgemm/pair.cuh")

    asm = "".join(_wgmma_asm(bn, ab) for bn in (64, 128) for ab in ("bf16", "f16"))
    return MMA_HEADER + CP_HEADER + PAIR + LAST_BLOCK + _HEADER_TOP + asm


_SOURCE = _source("products/wgmma/source.cu")


@cache
def _spec(kind: str) -> KernelSpec:
    """Kinds ``q4``, ``q4_res`` (a residual ``r_in`` [M, N] added), ``q4_glu`` (w =
    [gate; up], the output silu(gate) * up); a suffix ``_sp``: the split-K form (tile
    counters ``cnt`` and partials ``wsp`` as inputs); ``_lbTxB``: compiled for B blocks
    of T threads an SM (gpu_qgemm's header trick: MLX writes the signature)."""
    from engine.backends.cuda.products.qgemm import product_kind

    base, split, bounds, inputs, flags = product_kind(kind, "_sp", "SPLIT", "r_in")
    header = _header() + launch_bounds(bounds)
    return KernelSpec(
        "mb_wgmma" + base[2:] + ("_sp" if split else "") + (f"_lb{bounds}" if bounds else ""),
        inputs,
        [("y", "T")],
        flags + _SOURCE,
        header,
    )


_kernel = Baked(lambda: SpecsByKind(_spec), ensure_row_contiguous=True)

ENV = "MARKBASE_GPU_WGMMA"
NX_ENV = "MARKBASE_GPU_WGMMA_NX"
WG_ENV = "MARKBASE_GPU_WGMMA_WG"
WEARLY_ENV = "MARKBASE_GPU_WGMMA_WEARLY"


def mode() -> str:
    """``MARKBASE_GPU_WGMMA``: ``auto`` (default) the unsplit products of AUTO_MIN_ROWS-128
    rows, where it was measured faster; ``1`` those of 33-128 rows; ``0`` off."""
    return envs.value(ENV)


def enabled() -> bool:
    """On (``mode``) and an sm_90 GPU (``hopper``)."""
    return mode() != "0" and hopper()


def hopper() -> bool:
    """Whether MLX's GPU is compute capability 9.x (wgmma; MLX compiles for sm_90a)."""
    if not _hopper:
        arch = platform.compute_capability()
        if arch is not None:
            ok = arch[0] == 9
        else:  # an MLX without the keys: by name
            name = platform.device_name()
            ok = any(n in name for n in ("H100", "H200", "H800", "H20", "GH200"))
        _hopper.append(ok)
    return _hopper[0]


_hopper: list = []


def x_stages() -> int:
    """Buffers of x (``MARKBASE_GPU_WGMMA_NX``): 4 (default, copied two steps ahead), 3
    (one step ahead) or 5. H100, 8b at 128 rows with the early weight loads
    (``weights_early``), us: gate/up 136.4 with 3, 123.9 with 4; output layer 535.6 /
    489.2 ; without them 4 was no better than 3  and 5 is slower
    (181 KB of shared memory)."""
    return int(envs.value(NX_ENV))


def warpgroups() -> int:
    """Warpgroups a block (``MARKBASE_GPU_WGMMA_WG``): 4 (default: 256 weight rows, one
    block an SM, x read from L2 half as often a weight row) or 2 (128 weight rows, two
    blocks an SM). H200, 8b at 128 rows, against gpu_qgemm's time : gate/up
    0.84x with 4, 1.11x with 2; output layer 0.87x / 1.24x."""
    return int(envs.value(WG_ENV))


def supported(x_dtype, n: int, k: int, bits: int, group_size: int, mode: str, biases) -> bool:
    """gpu_gemv's 4-bit conditions, groups of 32/64/128, K a multiple of 64, and whole
    tiles of two warpgroups: N a multiple of 128 (GLU: 64 outputs a tile)."""
    from engine.backends.cuda.products import gemv as gpu_gemv

    return (
        gpu_gemv.quant_supported(x_dtype, n, k, bits, group_size, mode, biases)
        and group_size in (32, 64, 128)
        and k % KS == 0
        and n % 128 == 0
    )


MIN_ROWS = 33
AUTO_MIN_ROWS = 65  # 128-row blocks: the form measured (8b at 128 rows)
MAX_ROWS = 128


def takes(rows: int, n: int, k: int) -> bool:
    """Whether the decode step sends this product (``rows`` x [n, k], a shape
    ``supported`` takes) here rather than to gpu_qgemm: on, AUTO_MIN_ROWS-128 rows
    (33-128 with ``=1``), and a launch without k-splits (``unsplit``). The split form
    is for benchmarks and tests: it measured slower, and the step never runs it."""
    low = MIN_ROWS if mode() == "1" else AUTO_MIN_ROWS
    return low <= rows <= MAX_ROWS and enabled() and unsplit(rows, n, k)


@dataclass(frozen=True)
class Geometry:
    """A launch's shape: x rows a block (``bn``: the wgmma's N), x buffers, warpgroups."""

    bn: int
    nx: int
    wgs: int

    @property
    def rows(self) -> int:  # weight rows a block
        return 64 * self.wgs

    @property
    def threads(self) -> int:
        return 128 * self.wgs

    @property
    def shared_bytes(self) -> int:
        return A_STAGES * 8 * (self.rows // 8 * 128 + PAD) + self.nx * 8 * (
            self.bn // 8 * 128 + PAD
        )

    @property
    def per_sm(self) -> int:
        """Blocks an SM holds: two of two warpgroups where their shared memory fits
        (228 KB an SM, ~1 KB reserved a block; 128 registers a thread, as compiled)."""
        fits = 2 * (self.shared_bytes + 1024) <= 228 * 1024
        return 2 if self.wgs == 2 and fits else 1

    @property
    def values(self) -> int:  # accumulators a block
        return self.bn // 2 * self.threads


def geometry(rows: int, n: int) -> Geometry:
    """64 x rows a block up to 64 rows (m64n64k16), else 128; ``warpgroups`` where the
    weight rows split into them, else 2."""
    wgs = warpgroups()
    if n % (64 * wgs):
        wgs = 2
    return Geometry(64 if rows <= 64 else 128, x_stages(), wgs)


def splits(tiles: int, steps: int, slots: int, values: int, room: int) -> int:
    """k-splits of a launch: as many as fill the block slots (``slots // tiles``), each
    MIN_SPLIT_STEPS k-steps at least, and partials (``values`` floats a block) that fit
    ``room`` floats."""
    s = max(1, min(slots // max(tiles, 1), steps // MIN_SPLIT_STEPS))
    while s > 1 and tiles * s * values > room:
        s -= 1
    return s


def _plan(rows: int, n: int, k: int) -> tuple[Geometry, int, int]:
    """(geometry, tiles, k-splits) of a launch."""
    from engine.backends.cuda.products import qgemm as gpu_qgemm

    geo = geometry(rows, n)
    tiles = n // geo.rows * -(-rows // geo.bn)
    slots = gpu_qgemm.sms() * geo.per_sm
    return geo, tiles, splits(tiles, k // KS, slots, geo.values, gpu_qgemm.partials_size())


def unsplit(rows: int, n: int, k: int) -> bool:
    """Whether the launch needs no k-splits: the products where it measured faster (the
    H200: 8b gate/up and output layer at 128 rows, 4 warpgroups, 0.84x /
    0.87x gpu_qgemm's time; the split o_proj, down_proj and qkv 1.07-1.19x slower)."""
    return _plan(rows, n, k)[2] == 1


@cache
def _template(dtype, gs: int, bn: int, nx: int, wgs: int, wearly: bool = False) -> tuple:
    return (
        ("T", dtype), ("GS", gs), ("BN", bn), ("NX", nx), ("WGS", wgs), ("PADB", PAD),
        ("WEARLY", wearly),
    )  # fmt: skip


def weights_early() -> bool:
    """``MARKBASE_GPU_WGMMA_WEARLY`` (default 1; 0 turns it off): each k-step's weight
    loads issued right after its wgmma, two steps ahead, instead of at its end, three
    ahead. Why (from the SASS): the fence before each step's barrier
    compiles to ``MEMBAR.ALL.CTA``, which waits for the thread's global loads in flight,
    so loads issued just before it made every k-step wait out an HBM round trip.
    Measured (H100, 8b at 128 rows): gate/up 142.5 -> 136.4 us (123.9 with
    4 x buffers), output layer 547.8 -> 535.6 (489.2); the whole B=128 step's GPU time
    14.07 -> 13.53 ms with both."""
    return envs.value(WEARLY_ENV)


def launcher(dtype, rows: int, n: int, k: int, gs: int, residual: bool = False, glu: bool = False):
    """``call(inputs) -> y`` for x [rows, k] and a 4-bit weight of ``n`` rows; inputs:
    x, weight, scales, biases, then the residual (``residual``)."""
    from engine.backends.cuda.products import qgemm as gpu_qgemm

    if glu and residual:
        raise ValueError("gpu_wgmma: glu and residual together are not a kernel")
    geo, tiles, s = _plan(rows, n, k)
    kind = "q4_glu" if glu else "q4_res" if residual else "q4"
    if s > 1:
        kind += "_sp"
    kind += f"_lb{geo.threads}x{geo.per_sm}"
    template = _template(dtype, gs, geo.bn, geo.nx, geo.wgs, weights_early())
    fn = _kernel(kind, template, geo.shared_bytes)
    shape = (rows, n // 2 if glu else n)
    grid = (tiles * s * geo.threads, 1, 1)
    run = one_output_call(fn, grid, (geo.threads, 1, 1), shape, dtype)
    if s == 1:
        return run
    extra = list(gpu_qgemm.stream_k_buffers())
    return lambda inputs: run([*inputs, *extra])


def quantized_matmul(x, w, scales, biases, group_size: int, residual=None, glu: bool = False):
    """``x @ dequantize(w).T`` for x [M, K] and a 4-bit affine ``w`` [N, K/8];
    ``residual`` [M, N] added, or with ``glu`` (w = [gate; up]) silu(gate) * up."""
    n, k = w.shape[0], w.shape[1] * 8
    run = launcher(x.dtype, x.shape[0], n, k, group_size, residual is not None, glu)
    inputs = [x, w, scales, biases] + ([residual] if residual is not None else [])
    return run(inputs)


def warm(dtype, products) -> None:
    """Compile now every variant the decode step can call: ``products`` = (group size,
    K, N, residual, glu); one launch of each geometry of the rows ``takes``, on zeros."""
    import mlx.core as mx

    for gs, k, n, residual, glu in sorted(set(products)):
        if not supported(dtype, n, k, 4, gs, "affine", True):
            continue
        sc = mx.ones((n, k // gs), dtype=dtype)
        wq = mx.zeros((n, k // 8), dtype=mx.uint32)
        seen = set()
        for rows in range(MIN_ROWS, MAX_ROWS + 1):
            if not takes(rows, n, k) or geometry(rows, n) in seen:
                continue
            seen.add(geometry(rows, n))
            ins = [mx.zeros((rows, k), dtype=dtype), wq, sc, sc]
            if residual:
                ins.append(mx.zeros((rows, n), dtype=dtype))
            # one at a time: a split launch's counters and partials are shared
            mx.eval(launcher(dtype, rows, n, k, gs, residual, glu)(ins))


def kernel_specs_for_check() -> list[KernelSpec]:
    """Every form with concrete template values (bench/gpu/nvrtc_check.py)."""
    out = []
    geos = [Geometry(128, 3, 2), Geometry(64, 3, 2), Geometry(128, 4, 2), Geometry(128, 3, 4),
            Geometry(64, 3, 4), Geometry(128, 4, 4), Geometry(128, 5, 4)]  # fmt: skip
    for base in ("q4", "q4_res", "q4_glu"):
        for split in (False, True):
            for dtype in ("bfloat16", "float16"):
                for geo in geos:
                    kind = base + ("_sp" if split else "") + f"_lb{geo.threads}x{geo.per_sm}"
                    spec = _spec(kind)
                    for wearly in (False, True):  # WEARLY is the default at every geometry
                        tmpl = list(_template(dtype, 64, geo.bn, geo.nx, geo.wgs, wearly))
                        name = f"{spec.name}_{dtype}_{geo.bn}_{geo.nx}_{geo.wgs}"
                        name += "_we" if wearly else ""
                        out.append(for_dtype(spec, dtype, name, tmpl))
    return out
