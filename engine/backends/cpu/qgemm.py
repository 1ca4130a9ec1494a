"""Quantized decode matmuls on the CPU, behind MLX's float32 ones.

Why: decode on a CPU is bound by the bytes of weights read per token. MLX's CPU
backend has two choices, both poor: its quantized matmul does not use BLAS or SIMD
well (8 tok/s for SmolLM2-135M here), and float32 weights through OpenBLAS read
4 bytes per weight (540 MB per token for the same model). So on the CPU markbase
loads float32 weights (fast prefill through BLAS GEMM) *and* keeps the MLX
affine-quantized form they were dequantized from (4 or 8 bits, the GGUF's own
values). The sgemm shim (engine/backends/cpu/native/blas_shim.c) that MLX's matmuls already
call looks each weight pointer up in a table; for products with few rows (decode
steps, up to ``MARKBASE_QGEMM_MAX_M`` rows) it reads the quantized copy with an
AVX-512 kernel on all cores instead. The weight values are exactly the float32
ones (``w = scale * q + bias``); only the order of the float sums differs.

The MLX graph does not change: the same model, the same compiled step. A product
whose weight is not registered (attention, or any model without shadows) takes
the float path as before.

Safety of the pointer table: a ``Registration`` holds references to the float32
arrays it registered (so their memory cannot be reused while a key points at it)
and to the quantized copies; it removes its keys when closed or collected.

``MARKBASE_QGEMM_INT8=1`` quantizes the inputs to int8 blocks as llama.cpp does
(AVX2: ``maddubs``; AVX512-VNNI: ``dpbusd``; Q8_1: the weights' biases meet the sums
of the rounded values): single-stream decode 1.2-1.3x faster served on 2 Zen 3 cores,
with llama.cpp's numerics instead of the model's own, so it is opt-in
(docs/performance.md). ``MARKBASE_QGEMM=0`` turns it all off; ``MARKBASE_QGEMM_MAX_M`` (default 16) and
``MARKBASE_QGEMM_THREADS`` (default: all CPUs of the process) tune it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from engine import envs, platform

log = logging.getLogger("markbase.cpu_qgemm")

ENV_ON = "MARKBASE_QGEMM"
ENV_MAX_M = "MARKBASE_QGEMM_MAX_M"
ENV_THREADS = "MARKBASE_QGEMM_THREADS"
ENV_SPIN = "MARKBASE_QGEMM_SPIN_US"
# "1": inputs as int8 blocks (llama.cpp's Q8_1 activations): faster products with
# llama.cpp's numerics rather than the model's own: opt-in.
ENV_INT8 = "MARKBASE_QGEMM_INT8"


@dataclass
class QuantShadow:
    """The MLX affine-quantized form of one float32 weight [N, K]."""

    bits: int
    group_size: int
    q: np.ndarray  # uint8 [N, K * bits / 8], MLX's packing
    scales: np.ndarray  # float32 [N, K / group_size]
    biases: np.ndarray  # float32 [N, K / group_size]

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def cols(self) -> int:
        return int(self.q.shape[1] * 8 // self.bits)


def shadow_of(wq, scales, biases, bits: int, group_size: int) -> QuantShadow | None:
    """A ``QuantShadow`` from MLX quantized arrays, or None when the kernel cannot
    use that format (it takes affine 4/8-bit, groups of 32, 64 or 128, 2-D).

    2, 3, 5 and 6-bit weights (Gemma 3's Q5_0 projections, Q5_1, Q5_K) are widened
    to 8 bits: the same integers, scales and biases, so the same values
    (``w = scale * q + bias``) at 1.25 bytes a weight instead of float32's 4."""
    if not _kernel_takes(bits, group_size) or biases is None or wq.ndim != 2:
        return None
    q = np.ascontiguousarray(_numpy(wq))
    q = q.view(np.uint8).reshape(q.shape[0], -1)
    if bits in WIDENED:
        q, bits = _widen_to_8(q, bits), 8
    return _shadow(q, scales, biases, bits, group_size)


def _shadow(q: np.ndarray, scales, biases, bits: int, group_size: int) -> QuantShadow:
    s = np.ascontiguousarray(_numpy(scales), dtype=np.float32)
    b = np.ascontiguousarray(_numpy(biases), dtype=np.float32)
    if group_size > 32:  # the kernel reads one scale and bias per 32 weights
        s = np.ascontiguousarray(np.repeat(s, group_size // 32, axis=1))
        b = np.ascontiguousarray(np.repeat(b, group_size // 32, axis=1))
        group_size = 32
    return QuantShadow(bits, group_size, q, s, b)


def shadow_of_codes(
    q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> QuantShadow | None:
    """``shadow_of`` from unpacked codes (uint8 [N, K], one weight each: a GGUF block
    format decoded), without packing them into MLX's bit stream first."""
    if not _kernel_takes(bits, group_size) or q.ndim != 2:
        return None
    q = q.astype(np.uint8, copy=False)
    if bits == 4:
        q, bits = q[:, 0::2] | (q[:, 1::2] << 4), 4
    else:
        bits = 8
    return _shadow(np.ascontiguousarray(q), scales, biases, bits, group_size)


# bit widths whose packed integers are stored as 8-bit ones in the shadow
WIDENED = (2, 3, 5, 6)


def _kernel_takes(bits: int, group_size: int) -> bool:
    """Whether the products can read weights of this affine format (as 4 or 8 bits,
    one scale and bias per 32 weights; rows stored as 8 bits also per 16: llama.cpp's
    Q6_K sub-blocks)."""
    if bits not in WIDENED + (4, 8):
        return False
    return group_size % 32 == 0 or (group_size == 16 and bits != 4)


def _widen_to_8(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's little-endian ``bits``-bit stream (uint8 [N, K * bits / 8]) as one
    uint8 per weight [N, K]. Every ``bits`` bytes hold 8 weights: they are read as one
    little-endian word and shifted out (unpacking to single bits first took ~2 s of
    Gemma 3 270M's load)."""
    rows = packed.shape[0]
    groups = packed.reshape(rows, -1, bits)
    word = np.zeros(groups.shape[:2], dtype=np.uint64)
    for k in range(bits):
        word |= groups[:, :, k].astype(np.uint64) << np.uint64(8 * k)
    out = np.empty((*groups.shape[:2], 8), dtype=np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for i in range(8):
        out[:, :, i] = (word >> np.uint64(bits * i)) & mask
    return out.reshape(rows, -1)


def _numpy(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    mx.eval(a)
    return np.array(memoryview(a), copy=True)


def _data_pointer(a) -> int:
    """Address of an evaluated, row-contiguous MLX array's first element: the pointer
    MLX hands to cblas_sgemm for it (memoryview is zero-copy for such arrays)."""
    view = np.asarray(memoryview(a))
    if not view.flags["C_CONTIGUOUS"]:
        raise ValueError("not row-contiguous")
    return int(view.ctypes.data)


def _lib():
    from engine.backends.cpu.blas import shim_library

    lib = shim_library()
    if lib is None or not hasattr(lib, "markbase_qw_add"):
        return None
    if not getattr(lib, "_markbase_qw_typed", False):
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.markbase_qw_add.argtypes = [vp, i, i, i, i, i, i, vp, vp, vp]
        lib.markbase_qw_remove.argtypes = [vp, i]
        lib.markbase_qw_config.argtypes = [i, i, i, i]
        lib.markbase_qw_hits.restype = ctypes.c_long
        lib.markbase_qw_matmul.argtypes = [vp, i, i, i, vp, vp]
        lib.markbase_qw_set_int8.argtypes = [i]
        lib.markbase_qw_timing.argtypes = [i]
        lib.markbase_qw_time_us.restype = ctypes.c_double
        lib._markbase_qw_typed = True
    return lib


def available() -> str | None:
    """None when quantized decode matmuls can run here, else why not."""
    if envs.value(ENV_ON) in ("0", "off", "no"):
        return f"{ENV_ON}=0"
    try:
        if not platform.on_cpu():
            return "MLX runs on a GPU"
    except ImportError:
        return "MLX is not installed"
    lib = _lib()
    if lib is None:
        return "the sgemm shim is not loaded (no fast BLAS or no C compiler)"
    if lib.markbase_qw_simd() not in (256, 512) and envs.value(ENV_ON) != "force":
        return "the CPU has neither AVX2+FMA nor AVX-512 (the portable kernel is slower than float32 BLAS)"
    lib.markbase_qw_set_int8(1 if envs.value(ENV_INT8) else 0)
    lib.markbase_qw_config(1, envs.value(ENV_MAX_M), envs.value(ENV_THREADS), envs.value(ENV_SPIN))
    return None


_exact_lock = threading.Lock()
_exact_depth = 0


@contextlib.contextmanager
def exact_products():
    """Float inputs for every quantized product while inside, whatever
    ``MARKBASE_QGEMM_INT8`` says. The load check (engine/load_check.py) compares the
    engine's cache forms with the model's own on the same weights: int8 inputs would
    round the two paths' slightly different floats to different integers, and a model
    would be refused for a difference that is not its caches'. Nests across threads
    (models load on threads of their own)."""
    global _exact_depth
    lib = _lib()
    with _exact_lock:
        _exact_depth += 1
        if lib is not None:
            lib.markbase_qw_set_int8(0)
    try:
        yield
    finally:
        with _exact_lock:
            _exact_depth -= 1
            if _exact_depth == 0 and lib is not None:
                lib.markbase_qw_set_int8(1 if envs.value(ENV_INT8) else 0)


def hits() -> int:
    """Products served from quantized weights so far (all models)."""
    lib = _lib()
    return int(lib.markbase_qw_hits()) if lib is not None else 0


class Registration:
    """Float32 weights of one model whose decode products read quantized copies."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._keep: list = []  # float32 arrays and shadows: alive while keys point at them
        self._finalizer = weakref.finalize(self, _remove_keys, self._keys)

    @property
    def count(self) -> int:
        return len(self._keys)

    def add(self, weight, parts: list[QuantShadow]) -> bool:
        """Register float32 ``weight`` [N, K] as the rows of ``parts`` stacked in order.
        False (nothing registered) when a part does not match or the table is full."""
        import mlx.core as mx

        lib = _lib()
        if lib is None or weight.dtype != mx.float32 or weight.ndim != 2:
            return False
        n_total, k = (int(d) for d in weight.shape)
        if sum(p.rows for p in parts) != n_total or any(p.cols != k for p in parts):
            return False
        mx.eval(weight)
        try:
            ptr = _data_pointer(weight)
        except (ValueError, TypeError, BufferError):
            return False
        return self.add_address(ptr, n_total, k, parts, [weight])

    def add_address(self, ptr: int, n_total: int, k: int, parts: list[QuantShadow], keep) -> bool:
        """Register the float32 matrix [n_total, k] at ``ptr``; ``keep`` must hold the
        arrays that own that memory."""
        lib = _lib()
        if lib is None or sum(p.rows for p in parts) != n_total or any(p.cols != k for p in parts):
            return False
        n0 = 0
        for p in parts:
            rc = lib.markbase_qw_add(
                ptr,
                n_total,
                k,
                n0,
                p.rows,
                p.bits,
                p.group_size,
                p.q.ctypes.data,
                p.scales.ctypes.data,
                p.biases.ctypes.data,
            )
            if rc == -4:  # already registered (another runner of the same model)
                return False
            if rc != 0:
                lib.markbase_qw_remove(ptr, n_total)
                log.debug("quantized weight not registered (code %d)", rc)
                return False
            n0 += p.rows
        self._keys.append((ptr, n_total))
        self._keep.append((keep, parts))
        return True

    def close(self) -> None:
        self._finalizer()
        self._keep.clear()


def _remove_keys(keys: list[tuple[int, int]]) -> None:
    lib = _lib()
    if lib is not None:
        for ptr, n in keys:
            lib.markbase_qw_remove(ptr, n)
    keys.clear()


def register_model(model, shadows: dict[str, QuantShadow]) -> Registration | None:
    """Register every float32 weight of ``model`` that has a shadow (by module path),
    as the model holds it now, and every run of such weights that lie back to back in
    one buffer (fused projections: Q/K/V or gate/up concatenated, the modules' weights
    being views into it). None when the quantized route is unavailable.

    A run is found by addresses alone, so it is right whatever made it contiguous: a
    product whose B is N rows from that address reads exactly those weights' bytes."""
    why = available()
    if why or not shadows:
        if why:
            log.info("quantized CPU decode matmuls not used: %s", why)
        return None
    reg = Registration()
    placed = []  # (address, rows, cols, weight, shadow)
    for path, module in model.named_modules():
        shadow = shadows.get(path)
        weight = getattr(module, "weight", None) if shadow is not None else None
        if weight is None or not reg.add(weight, [shadow]):
            continue
        placed.append((_data_pointer(weight), shadow.rows, shadow.cols, weight, shadow))
    placed.sort(key=lambda p: p[0])
    by_start = {p[0]: i for i, p in enumerate(placed)}
    for i, (_, _, cols, _, _) in enumerate(placed):
        run = [placed[i]]
        while len(run) < MAX_RUN:
            last = run[-1]
            j = by_start.get(last[0] + last[1] * last[2] * 4)
            if j is None or placed[j][2] != cols:
                break
            run.append(placed[j])
            _add_run(reg, run)
    log.info("quantized CPU decode matmuls: %d weight matrices registered", reg.count)
    return reg


MAX_RUN = 4  # segments per key in the shim (QSEG_MAX)


def _add_run(reg: Registration, run: list) -> None:
    """Register the concatenation of ``run``'s weights as one matrix. Holding the
    weights (views into one buffer) keeps that buffer alive."""
    total = sum(p[1] for p in run)
    reg.add_address(run[0][0], total, run[0][2], [p[4] for p in run], [p[3] for p in run])
