"""A llama layer's products after its attention, at one row, as one kernel: o_proj +
residual, the RMSNorm, gate_up + SwiGLU, down_proj + residual (engine/backends/cuda/products/qstream.py's
integer form, ``q4i``, as three phases with a grid-wide barrier between them).

Why: the 8b 4-bit single-stream step is host-bound on the H200: MLX needs ~8 us of
host time for each kernel it builds and encodes, and a step had 233 of them, seven a
layer (bench/gpu/NOTES.md, sessions 11-13). Four of a layer's seven are these products
and the norm between them; here they are one, 233 -> 137 kernels a step. It may also
save GPU time: each kernel boundary costs the previous kernel's tail (its last warps
finishing while the rest of the GPU idles) plus the next one's start, ~3-5 us, against
~1-2 us for a barrier.

How: one block of 16 warps per SM (every block must be resident at once for the
barrier, so the grid is the GPU's SM count, known per device name, ``SM_COUNTS``; an
unknown GPU does not get this kernel). Each phase is gpu_qstream's ``_IBODY`` with its
inputs read through L2 (``__ldcg``: another SM wrote them in this kernel), so a
phase's arithmetic, and its result, is that of the separate kernel. The barrier is a
counter and a generation in a small int32 input per layer (``barrier``); a block that
waits more than a second sets an error flag there and every later barrier of it is
skipped, so a GPU that cannot hold the grid gives wrong numbers and a flag the tests
read, not a hang. For the same reason two launches must never run side by side (each
needs every SM): MLX's CUDA graphs run nodes without a data dependency concurrently,
so only chain them (the decode step does: each layer's input is the last one's output).

Each phase after the first issues its first weight loads, then meets the barrier
(session 24): the weights do not depend on the last phase, so their HBM latency runs
under the wait, which separate launches cannot do (MLX's graphs have no programmatic
dependent launch).

Off unless MARKBASE_GPU_QSTREAM_LAYER=1 (``wanted``): measured slower. Session 14: 8b
4-bit B=1 GPU time 2.91 -> 3.59 ms, while its epsilon was a [1] array in MLX's pool of
tiny arrays. Session 25 (H100, ``suite.sh b1-ql``), with the epsilon in device memory
and the barrier after the first loads: GPU busy 2.408 ms a step as served against 2.583
(this kernel), 2.625 (with the next q/k/v) and 3.331 (gpu_qblock's whole layer); the
layer kernel takes 54.2 us a layer against ~48 us for the separate launches.
"""

from __future__ import annotations

import os

from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype
from engine.backends.cuda.products.qstream import _HEADER, _IBODY, smem_bytes, smem_per_sm

WARPS = 16
MAX_STAGES = 8
# SMs by device name (MLX's device_info has no SM count): the grid must not exceed it
SM_COUNTS = {"H200": 132, "H100 80GB HBM3": 132, "H100 SXM": 132, "GH200": 132, "H100 PCIe": 114}

_BARRIER = r"""
// every block of the grid meets here (all are resident: one a SM); bar[0] counts the
// arrivals, bar[1] is the generation, bar[2] an error flag: a block that waited more
// than a second sets it, and then no block waits at any later barrier
__device__ __forceinline__ void mb_grid_sync(int* bar) {
  __syncthreads();
  if (threadIdx.x == 0 && *reinterpret_cast<volatile int*>(bar + 2) == 0) {
    volatile int* gen = bar + 1;
    const int g = *gen;
    __threadfence();
    if (atomicAdd(bar, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(bar, 0);
      __threadfence();
      atomicAdd(bar + 1, 1);
    } else {
      unsigned long long t0;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      while (*gen == g) {
        __nanosleep(32);
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 1000000000ull || *reinterpret_cast<volatile int*>(bar + 2) != 0) {
          atomicExch(bar + 2, 1);
          break;
        }
      }
    }
    __threadfence();
  }
  __syncthreads();
}
"""


def _phase_function() -> str:
    """gpu_qstream's integer-form body as a device function of its inputs, which it
    reads through L2 (they may be this kernel's own earlier writes, from another SM).
    ``bar`` (not null): the grid barrier that waits for the last phase's writes (this
    phase's input) is met after this phase's first weight loads are issued, so they fly
    while the blocks wait for each other; weights do not depend on the last phase.
    The block first syncs: its new loads may land where its last phase's x was."""
    body = _IBODY.replace("w_shape[0]", "w_rows")
    swaps = {
        "*reinterpret_cast<const uint4*>(x + c * 32 + p * 8)": (
            "__ldcg(reinterpret_cast<const uint4*>(x + c * 32 + p * 8))"
        ),
        "static_cast<float>(r[c_o])": "static_cast<float>(__ldcg(r + c_o))",
        _EARLY_START: _BARRIER_START,
    }
    for old, new in swaps.items():
        if old not in body:
            raise AssertionError(f"gpu_qlayer: gpu_qstream's body no longer has {old!r}")
        body = body.replace(old, new)
    head = (
        "template <typename T, int K, int GS, int WARPS, int STAGES, int CPS, bool GLU,\n"
        "          bool RES, bool NORM>\n"
        "__device__ __forceinline__ void mb_q4i_phase(const T* x, const uint32_t* w,\n"
        "    const T* scales, const T* biases, const T* r, const T* nw, const float* eps,\n"
        "    T* y, const int w_rows, int* bar) {\n"
        "  constexpr bool EARLY = true;\n"
        "  constexpr bool ABL = false;\n"
    )
    return head + body + "}\n"


_EARLY_START = """  if constexpr (EARLY) {
    mb_ring_start<STAGES>(total, issue);
  }
"""
_BARRIER_START = """  __syncthreads();
  mb_ring_start<STAGES>(total, issue);
  if (bar != nullptr) {
    mb_grid_sync(bar);
  }
"""


_LAYER_BODY = r"""
  // A: h = o @ Wo^T + x; B: z = silu(gate) * up of rmsnorm(h) @ Wgu^T; C: y = z @ Wd^T + h
  // (each phase after the first meets the grid barrier after its first weight loads)
  mb_q4i_phase<T, D, GS, WARPS, SA, CA, false, true, false>(
      o, wo, so, bo, x, nullptr, nullptr, h, wo_shape[0], nullptr);
  mb_q4i_phase<T, D, GS, WARPS, SA, CA, true, false, true>(
      h, wgu, sgu, bgu, nullptr, nw, eps, z, wgu_shape[0], barrier);
  mb_q4i_phase<T, F, GS, WARPS, SC, CC, false, true, false>(
      z, wd, sd, bd, h, nullptr, nullptr, y, wd_shape[0], barrier);
"""

# D (the ``layer_next`` kind): the next layer's q/k/v product of rmsnorm(y), so that the
# step's next kernel is that layer's attention
_NEXT_BODY = r"""
  mb_q4i_phase<T, D, GS, WARPS, SA, CA, false, false, true>(
      y, wq, sq, bq, nullptr, nw1, eps1, qkv, wq_shape[0], barrier);
"""
_NEXT_INPUTS = [
    ("nw1", "T", 1),
    ("eps1", "float32", 1),
    ("wq", "uint32", 2),
    ("sq", "T", 2),
    ("bq", "T", 2),
]

_INPUTS = [
    ("o", "T", 2),
    ("x", "T", 2),
    ("wo", "uint32", 2),
    ("so", "T", 2),
    ("bo", "T", 2),
    ("nw", "T", 1),
    ("eps", "float32", 1),
    ("wgu", "uint32", 2),
    ("sgu", "T", 2),
    ("bgu", "T", 2),
    ("wd", "uint32", 2),
    ("sd", "T", 2),
    ("bd", "T", 2),
    ("barrier", "int32", 1),
]
_OUTPUTS = [("y", "T"), ("h", "T"), ("z", "T")]


def _specs() -> dict[str, KernelSpec]:
    header = _HEADER + _BARRIER + _phase_function()
    # the barrier writes through an input (MLX passes inputs as const pointers)
    body = "  int* barrier = const_cast<int*>(barrier_in);\n" + _LAYER_BODY
    inputs = [(("barrier_in", t, nd) if n == "barrier" else (n, t, nd)) for n, t, nd in _INPUTS]
    return {
        "layer": KernelSpec("mb_qlayer", inputs, _OUTPUTS, body, header),
        "layer_next": KernelSpec(
            "mb_qlayer_next",
            inputs + _NEXT_INPUTS,
            [*_OUTPUTS, ("qkv", "T")],
            body + _NEXT_BODY,
            header,
        ),
    }


_kernel = Baked(_specs, ensure_row_contiguous=True)


def wanted() -> bool:
    """MARKBASE_GPU_QSTREAM_LAYER=1: the layer's tail as one kernel; 2: with the next
    layer's RMSNorm + q/k/v product as a fourth phase (``wanted_next``)."""
    return os.environ.get("MARKBASE_GPU_QSTREAM_LAYER", "0") in ("1", "2", "3")


def wanted_next() -> bool:
    """(3: the attention in the kernel too, engine/backends/cuda/products/qblock.py.)"""
    return os.environ.get("MARKBASE_GPU_QSTREAM_LAYER", "0") in ("2", "3")


def sm_count() -> int | None:
    """This GPU's SMs from its name (``SM_COUNTS``), None when unknown or no GPU; read
    once (each launch needs it)."""
    if not _sm_count:
        try:
            import mlx.core as mx

            name = str(mx.device_info().get("device_name", "")) if mx.cuda.is_available() else ""
        except Exception:
            name = ""
        _sm_count.append(next((n for key, n in SM_COUNTS.items() if key in name), None))
    return _sm_count[0]


_sm_count: list = []


def _cps(k: int) -> int:
    return 2 if (k // 1024) % 2 == 0 else 1


def _stages(k: int, gs: int, cps: int, sm_bytes: int) -> int:
    """The most slots a lane (up to ``MAX_STAGES`` chunk pairs) that fit one block an SM."""
    stages = MAX_STAGES * (2 // cps)
    while stages > 2 and smem_bytes("q4i", k, gs, stages, WARPS, cps) + 2048 > sm_bytes:
        stages -= 1
    return stages


def shape(d: int, f: int, gs: int, sm_bytes: int | None = None, reserve: int = 0) -> dict:
    """Template values and dynamic shared memory of the kernel for hidden size ``d``,
    intermediate size ``f`` and group size ``gs`` (``sm_bytes``: shared memory an SM,
    this GPU's unless given; ``reserve``: bytes of it other phases' static arrays take)."""
    sm_bytes = (sm_bytes or smem_per_sm()) - reserve
    ca, cc = _cps(d), _cps(f)
    sa, sc = _stages(d, gs, ca, sm_bytes), _stages(f, gs, cc, sm_bytes)
    smem = max(smem_bytes("q4i", d, gs, sa, WARPS, ca), smem_bytes("q4i", f, gs, sc, WARPS, cc))
    return dict(D=d, F=f, GS=gs, WARPS=WARPS, SA=sa, CA=ca, SC=sc, CC=cc, smem=smem)


def supported(dtype, rows: int, d: int, f: int, o_proj, gate_up, down_proj) -> bool:
    """Whether the kernel takes this layer: one row, bf16/fp16, the three products 4-bit
    affine with biases and one group size, D and F multiples of 1024 (F at most
    16384: z lives in shared memory in phase C), a GPU with a known SM count, and a
    block with at least 2 slots a lane that fits its SM."""
    import mlx.core as mx

    if rows != 1 or dtype not in (mx.bfloat16, mx.float16) or not mx.cuda.is_available():
        return False
    linears = (o_proj, gate_up, down_proj)
    if any(getattr(m, "bits", None) != 4 for m in linears):
        return False
    if any(getattr(m, "mode", "affine") != "affine" for m in linears):
        return False
    if any(getattr(m, "biases", None) is None for m in linears):
        return False
    groups = {m.group_size for m in linears}
    if len(groups) != 1 or groups & {32, 64, 128} != groups:
        return False
    gs = groups.pop()
    if d % 1024 or f % 1024 or f > 16384 or d > 16384:
        return False
    shapes = (o_proj.weight.shape[0], gate_up.weight.shape[0], down_proj.weight.shape[0])
    ks = (o_proj.weight.shape[1] * 8, gate_up.weight.shape[1] * 8, down_proj.weight.shape[1] * 8)
    if shapes != (d, 2 * f, d) or ks != (d, d, f):  # o_proj's K too (Hq * head_dim = D)
        return False
    if sm_count() is None:
        return False
    s = shape(d, f, gs)
    return s["SA"] >= 2 and s["SC"] >= 2 and s["smem"] + 2048 <= smem_per_sm()


TEMPLATE_KEYS = ("D", "F", "GS", "WARPS", "SA", "CA", "SC", "CC")


_BARRIERS: dict = {}


def barrier(slot: int):
    """The zeroed int32 [4] barrier of ``slot`` (one per layer), made and evaluated once:
    under mx.compile a launch must find it made (``ensure_barriers``)."""
    arr = _BARRIERS.get(slot)
    if arr is None:
        import mlx.core as mx

        arr = mx.zeros((4,), dtype=mx.int32)
        mx.eval(arr)
        _BARRIERS[slot] = arr
    return arr


def ensure_barriers(slots: int) -> None:
    for slot in range(slots):
        barrier(slot)


def timed_out() -> bool:
    """Whether any layer's barrier has its error flag set (a block waited > 1 s)."""
    return any(int(b[2].item()) != 0 for b in _BARRIERS.values())


def post(
    o,
    x,
    o_proj,
    gate_up,
    down_proj,
    norm_weight,
    eps: float,
    slot: int = 0,
    all_outputs=False,
    next_qkv=None,
):
    """y = h + down(silu(gate) * up), h = x + o_proj(o), (gate, up) = gate_up(rmsnorm(h)),
    for one row: o, x [1, D]; the three ``GpuQuantizedLinear``-like products (weight,
    scales, biases, group_size); the RMSNorm's weight [D] and epsilon. One kernel.
    ``next_qkv`` = (the next layer's q/k/v product, its input RMSNorm's weight, eps):
    returns (y, that product of rmsnorm(y)) (``next_supported`` must say so).
    ``all_outputs``: every output (y, h, z[, qkv]; z = silu(gate) * up [1, F]), for
    the tests."""
    from engine.backends.cuda.products.mma import device_scalar

    d = x.shape[-1]
    f = down_proj.weight.shape[1] * 8
    gs = o_proj.group_size
    s = shape(d, f, gs)
    template = tuple((k, s[k]) for k in ("D", "F", "GS", "WARPS", "SA", "CA", "SC", "CC"))
    template = (("T", x.dtype), *template)
    fn = _kernel("layer" if next_qkv is None else "layer_next", template, s["smem"])
    blocks = sm_count()
    inputs = [o, x, o_proj.weight, o_proj.scales, o_proj.biases, norm_weight, device_scalar(eps)]
    inputs += [gate_up.weight, gate_up.scales, gate_up.biases]
    inputs += [down_proj.weight, down_proj.scales, down_proj.biases, barrier(slot)]
    shapes = [(1, d), (1, d), (1, f)]
    if next_qkv is not None:
        wq, nw1, eps1 = next_qkv
        inputs += [nw1, device_scalar(eps1), wq.weight, wq.scales, wq.biases]
        shapes.append((1, wq.weight.shape[0]))
    outs = fn(
        inputs=inputs,
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=shapes,
        output_dtypes=[x.dtype] * len(shapes),
    )
    if all_outputs:
        return outs
    return outs[0] if next_qkv is None else (outs[0], outs[3])


def next_supported(d: int, gs: int, wq) -> bool:
    """Whether the next layer's q/k/v product can be the kernel's fourth phase: 4-bit
    affine with biases, this layer's group size, input size D."""
    return (
        getattr(wq, "bits", None) == 4
        and getattr(wq, "mode", "affine") == "affine"
        and getattr(wq, "biases", None) is not None
        and getattr(wq, "group_size", None) == gs
        and wq.weight.shape[1] * 8 == d
    )


def warm(dtype, d: int, f: int, gs: int, next_rows: int = 0) -> None:
    """Compile the kernel for this layer shape now (NVRTC), on zero weights; with
    ``next_rows`` (the q/k/v product's outputs), its ``layer_next`` kind too."""
    import mlx.core as mx

    class _Q:
        def __init__(self, n, k):
            self.weight = mx.zeros((n, k // 8), dtype=mx.uint32)
            self.scales = mx.zeros((n, k // gs), dtype=dtype)
            self.biases = mx.zeros((n, k // gs), dtype=dtype)
            self.group_size = gs

    x = mx.zeros((1, d), dtype=dtype)
    nw = mx.ones((d,), dtype=dtype)
    mx.eval(post(x, x, _Q(d, d), _Q(2 * f, d), _Q(d, f), nw, 1e-5, slot=-1))
    if next_rows:
        nxt = (_Q(next_rows, d), nw, 1e-5)
        mx.eval(post(x, x, _Q(d, d), _Q(2 * f, d), _Q(d, f), nw, 1e-5, slot=-1, next_qkv=nxt))


def kernel_specs_for_check() -> list[KernelSpec]:
    """The layer kernel at llama 8b's and 1b's shapes (bench/gpu/nvrtc_check.py)."""
    out = []
    for spec in _specs().values():
        for dtype in ("bfloat16", "float16"):
            for d, f, gs in ((4096, 14336, 64), (2048, 8192, 64), (1024, 3072, 32)):
                s = shape(d, f, gs, sm_bytes=228 << 10)  # an H200's
                tmpl = [("T", dtype)] + [
                    (k, s[k]) for k in ("D", "F", "GS", "WARPS", "SA", "CA", "SC", "CC")
                ]
                out.append(for_dtype(spec, dtype, f"{spec.name}_{dtype}_{d}_{f}_{gs}", tmpl))
    return out
