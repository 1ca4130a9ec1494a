"""Make MLX's Linux CPU backend use a fast BLAS, and say loudly when it does not.

Why: the ``mlx[cpu]`` wheel links ``libmlx.so`` against a vendored *reference*
BLAS (``mlx_cpu.libs/libblas-<hash>.so.3.10.0``, found through
``RPATH=$ORIGIN/../../mlx_cpu.libs``). Every float32 matmul of the CPU backend
goes through ``cblas_sgemm``, and the reference one runs at 3-8 GFLOP/s on this
2-core Zen 5; OpenBLAS runs the same 256x576x1536 product at 100-390 GFLOP/s.
(MLX's quantized and bfloat16/float16 matmuls do not call BLAS at all.)

How (measured on Debian 12, mlx 0.32.4; see ``bench/cpu_formats.py``):

* ``libmlx.so`` imports only ``cblas_sgemm``/``cblas_dgemm``/``cblas_cgemm``
  from BLAS (plus LAPACK from the vendored liblapack). A library opened with
  ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported joins the global lookup
  scope, which the dynamic linker searches before ``libmlx.so``'s own NEEDED
  libraries. So ``ctypes.CDLL(openblas, RTLD_GLOBAL)`` before the first
  ``import mlx.core`` rebinds MLX's matmuls in-process: no re-exec, no
  LD_PRELOAD, nothing written into the venv. Checked with /proc/self/maps,
  ``dladdr`` and a timing.
* If ``mlx.core`` is already imported that is too late; ``ensure_fast_blas``
  then re-executes the process once with ``LD_PRELOAD`` (guarded by
  ``MARKBASE_BLAS_REEXEC``), or only warns when ``allow_reexec=False``.
* A tiny C shim (source below, built with the system C compiler into the
  user cache, ~0.1 s, once) exports ``cblas_sgemm`` and sends M == 1
  products (every decode-step projection at batch 1) to ``cblas_sgemv``.
  OpenBLAS 0.3.21's sgemm packs the whole weight matrix on every call; the
  gemv reads it once: all 211 projections of a SmolLM2-135M step went from
  59 ms to 23 ms in an interleaved A/B in one process. Without a compiler the
  shim is skipped and plain OpenBLAS is used.

Library choice, in order: ``$MARKBASE_BLAS_LIB`` (a path), the system OpenBLAS
(Debian/Ubuntu ``libopenblas0-pthread``, Fedora/RHEL paths), an Intel MKL
``libmkl_rt`` installed into the running Python's prefix (PyPI ``mkl``; works
too, but is a 229 MB wheel and was not faster here), then
``ctypes.util.find_library``. ``scipy-openblas32/64`` and numpy's bundled
OpenBLAS cannot be used: their symbols are prefixed (``scipy_cblas_sgemm``).
BLIS (``libblis4-pthread``) works but took 10 s for one 4-row step in a test:
not a candidate.

Threads: ``OPENBLAS_NUM_THREADS`` defaults to the CPUs this process may run on.
The shim also sets OpenBLAS's thread count per call: all threads for the M == 1
gemvs (memory-bound: 2 threads read ~1.2-2x faster than 1), 1 thread for sgemm
with 1 < M < 16 (small decode batches: with other processes on the 2 cores, OpenBLAS's
spinning worker threads stalled those calls; 1 thread was 1.5-1.6x faster per step
at batch 4-8 under load and on par at best), all threads from M = 16 (at batch 16 2 threads were 1.3x faster at best, on par under load).
Override with ``MARKBASE_BLAS_GEMV_THREADS`` / ``MARKBASE_BLAS_SMALL_GEMM_THREADS`` /
``MARKBASE_BLAS_GEMM_THREADS`` (0 = OPENBLAS_NUM_THREADS) and ``MARKBASE_BLAS_SMALL_M``.

``MARKBASE_BLAS=off`` disables all of this; ``MARKBASE_BLAS_GEMV=0`` keeps
OpenBLAS but skips the shim. ``OPENBLAS_CORETYPE`` is left as the environment
sets it (forcing SkylakeX on Zen 5 made prefill GEMMs ~1.7x faster, but this
workplace pins Haswell on purpose for older OpenBLAS builds).

Public API: ``ensure_fast_blas()``, ``blas_report()``, ``warn_if_slow()``,
``build_gemv_shim()``. ``python -m engine.backends.cpu.blas`` prints the report
(``--build-shim`` builds the shim only, for an install step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine import envs

log = logging.getLogger("markbase.cpu_blas")

ENV_MODE = "MARKBASE_BLAS"  # "auto" (default) or "off"
ENV_LIB = "MARKBASE_BLAS_LIB"  # explicit path of a BLAS shared library exporting cblas_sgemm
ENV_GEMV = "MARKBASE_BLAS_GEMV"  # "1" (default): route M == 1 sgemm to sgemv through the shim
ENV_REEXEC = "MARKBASE_BLAS_REEXEC"  # set in the child of the one-time re-exec
ENV_REAL = "MARKBASE_BLAS_REAL"  # tells an LD_PRELOADed shim which library to forward to

# Below this a matmul of 256x576x1536 float32 means the reference BLAS (2.7-8 GFLOP/s
# measured) or something equally wrong. OpenBLAS measured 100-390 GFLOP/s on 2 quiet cores
# and 27-67 GFLOP/s with 4-5 other busy processes on them, so keep the bar low.
DEFAULT_MIN_GFLOPS = 15.0

_SYSTEM_CANDIDATES = (
    # Debian / Ubuntu (libopenblas0-pthread, libopenblas0-openmp, libopenblas0-serial)
    "/usr/lib/{triplet}/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{triplet}/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{triplet}/libopenblas.so.0",
    "/usr/lib/{triplet}/openblas-serial/libopenblas.so.0",
    # Fedora / RHEL / openSUSE / Arch
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

# The shim (engine/backends/cpu/native/blas_shim.c): exports cblas_sgemm only. Loaded (RTLD_GLOBAL)
# before the real BLAS, so MLX binds to it; every other BLAS/LAPACK symbol comes from the
# real library. It also holds the quantized-weight products of engine/backends/cpu/qgemm.py.
_SHIM_PATH = Path(__file__).parent / "native" / "blas_shim.c"
# compiled after the shim into the same library: it calls the shim's static routes
# (engine/backends/cpu/native_step.py)
_STEP_PATH = Path(__file__).parent / "native" / "decode_step.c"
# Tried in order: native code (the quantized products use AVX-512 when the
# CPU has it), then plain -O2 (the shim still routes M == 1 to sgemv).
_SHIM_FLAGS = (
    ["-O3", "-march=native", "-pthread"],
    ["-O2", "-pthread"],
)


@dataclass
class BlasSetup:
    """What ``ensure_fast_blas`` did (kept for ``blas_report``)."""

    method: str  # "dlopen-global" | "ld-preload" | "none"
    library: str | None = None  # the fast BLAS that serves MLX's sgemm
    shim: str | None = None  # the M == 1 -> sgemv shim, when loaded
    reason: str = ""
    notes: list[str] = field(default_factory=list)


_setup: BlasSetup | None = None
_shim_handle: ctypes.CDLL | None = None


# ---------------------------------------------------------------- discovery


def _triplet() -> str:
    import sysconfig

    return sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"


def _site_dirs_of_mlx() -> list[Path]:
    """Where the installed ``mlx`` package lives, without importing it."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p).parent for p in spec.submodule_search_locations]


def vendored_reference_blas() -> str | None:
    """Path of the reference BLAS that ``mlx[cpu]`` ships, or None when MLX does not use one."""
    for site in _site_dirs_of_mlx():
        hits = sorted(glob.glob(str(site / "mlx_cpu.libs" / "libblas*.so*")))
        if hits:
            return hits[0]
    return None


def _mlx_is_cuda_build() -> bool:
    from importlib import metadata

    for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            metadata.version(dist)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def _exports_cblas_sgemm(path: str) -> bool:
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
        return hasattr(lib, "cblas_sgemm") and hasattr(lib, "cblas_sgemv")
    except OSError:
        return False


def find_fast_blas() -> str | None:
    """The first fast BLAS library on this machine that exports plain ``cblas_sgemm``."""
    explicit = envs.value(ENV_LIB)
    if explicit:
        return explicit if _exports_cblas_sgemm(explicit) else None
    triplet = _triplet()
    candidates = [c.format(triplet=triplet) for c in _SYSTEM_CANDIDATES]
    for prefix in {sys.prefix, sys.base_prefix}:  # PyPI `mkl` puts libmkl_rt in <prefix>/lib
        candidates += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    for name in ("openblas", "openblasp"):
        found = ctypes.util.find_library(name)
        if found:
            candidates.append(found)
    for cand in candidates:
        if (os.path.exists(cand) or "/" not in cand) and _exports_cblas_sgemm(cand):
            return cand
    return None


# ---------------------------------------------------------------- the gemv shim


def _cache_dir() -> Path:
    base = envs.MARKBASE_CACHE_DIR
    if base:
        return Path(base) / "cpu_blas"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "markbase" / "cpu_blas"


def _cpu_signature() -> str:
    """What ``-march=native`` compiled for: a cache key, so a home directory shared by
    machines of different CPUs never loads code built for another one."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "unknown"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def build_gemv_shim(cache_dir: str | os.PathLike | None = None) -> str | None:
    """Compile the shim once (cached by source, flags and CPU); None without a compiler."""
    source = _SHIM_PATH.read_text() + "\n" + _STEP_PATH.read_text()
    out_dir = Path(cache_dir) if cache_dir else _cache_dir()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    for flags in _SHIM_FLAGS:
        key = "\0".join([source, " ".join(flags), _cpu_signature()])
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        target = out_dir / f"libmarkbase_sgemm-{digest}.so"
        if target.exists():
            return str(target)
        if not cc:
            log.info("no C compiler: the sgemm shim is not built (plain BLAS is used)")
            return None
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "shim.c"
                src.write_text(source)
                tmp_so = Path(tmp) / "shim.so"
                cmd = [cc, *flags, "-shared", "-fPIC", "-o", str(tmp_so), str(src), "-ldl", "-lm"]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    log.info(
                        "building the sgemm shim with %s failed: %s", flags, proc.stderr[-300:]
                    )
                    continue
                os.replace(tmp_so, target)  # atomic: concurrent builders are fine
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("building the sgemm shim failed: %s", exc)
            return None
        return str(target)
    log.warning("the sgemm shim did not build with any flags: plain BLAS is used")
    return None


def shim_library() -> ctypes.CDLL | None:
    """The loaded shim (None when ``ensure_fast_blas`` did not load one)."""
    return _shim_handle


# ---------------------------------------------------------------- setup


def _mlx_core_loaded() -> bool:
    if "mlx.core" in sys.modules:
        return True
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith("/libmlx.so") for line in f)
    except OSError:
        return False


def _thread_env() -> None:
    if not any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, n))
    if "libmkl_rt" in (envs.value(ENV_LIB) or ""):
        os.environ.setdefault("MKL_THREADING_LAYER", "GNU")


def ensure_fast_blas(*, allow_reexec: bool = True, gemv_shim: bool | None = None) -> BlasSetup:
    """Make MLX's CPU matmuls use a fast BLAS. Call before the first ``import mlx.core``.

    Idempotent and cheap after the first call. A no-op (``method="none"``) on
    non-Linux, on CUDA builds of MLX, when MLX does not link the vendored
    reference BLAS, with ``MARKBASE_BLAS=off``, or when no fast BLAS is found
    (``warn_if_slow`` then says so loudly). If ``mlx.core`` is already loaded the
    process re-executes itself once with ``LD_PRELOAD`` (unless
    ``allow_reexec=False``, then it only records why it is slow).
    """
    global _setup, _shim_handle
    if _setup is not None:
        return _setup
    if envs.value(ENV_REEXEC) and os.environ.get("LD_PRELOAD"):
        # We are the child of the re-exec: the loader already bound MLX to LD_PRELOAD.
        pre = os.environ["LD_PRELOAD"].replace(":", " ").split()
        shim = next((p for p in pre if "markbase_sgemm" in p), None)
        lib = envs.value(ENV_REAL) or next((p for p in pre if p != shim), None)
        _setup = BlasSetup("ld-preload", library=lib, shim=shim, reason="re-executed once")
        # The loader has bound MLX; keep our libraries out of child processes (the g++
        # that mx.compile runs, test servers...). ENV_REEXEC stays set: no second re-exec.
        rest = [p for p in pre if p not in (shim, lib)]
        if rest:
            os.environ["LD_PRELOAD"] = " ".join(rest)
        else:
            os.environ.pop("LD_PRELOAD", None)
        if shim:
            try:
                _shim_handle = ctypes.CDLL(shim)  # already mapped: the same handle
                _shim_handle.markbase_blas_calls.restype = ctypes.c_long
                _threads_from_env()
            except OSError:
                _shim_handle = None
        return _setup
    if not sys.platform.startswith("linux"):
        _setup = BlasSetup("none", reason=f"{sys.platform}: MLX brings its own BLAS")
        return _setup
    if envs.value(ENV_MODE) in ("off", "0", "none", "vendored"):
        _setup = BlasSetup("none", reason=f"{ENV_MODE}=off")
        return _setup
    if _mlx_is_cuda_build():
        _setup = BlasSetup("none", reason="CUDA build of MLX: matmuls run on the GPU")
        return _setup
    if vendored_reference_blas() is None:
        _setup = BlasSetup("none", reason="MLX does not link the vendored reference BLAS")
        return _setup

    lib = find_fast_blas()
    if lib is None:
        _setup = BlasSetup(
            "none",
            reason="no fast BLAS found (apt-get install libopenblas0-pthread, or set "
            f"{ENV_LIB}=/path/to/libopenblas.so.0)",
        )
        return _setup
    want_shim = gemv_shim if gemv_shim is not None else envs.value(ENV_GEMV) == "1"
    shim = build_gemv_shim() if want_shim else None
    _thread_env()

    if _mlx_core_loaded():
        if not allow_reexec or envs.value(ENV_REEXEC):
            _setup = BlasSetup(
                "none",
                library=lib,
                reason="mlx.core was imported before ensure_fast_blas()"
                + (" (and a re-exec was already done)" if allow_reexec else ""),
            )
            return _setup
        env = dict(os.environ)
        preload = [p for p in (shim, lib) if p]
        env["LD_PRELOAD"] = " ".join(preload + env.get("LD_PRELOAD", "").split())
        env[ENV_REAL] = lib
        env[ENV_REEXEC] = "1"
        argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
        log.warning("mlx.core already imported: re-executing once with LD_PRELOAD=%s", preload)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)

    notes = []
    if shim:
        try:
            _shim_handle = ctypes.CDLL(shim, mode=os.RTLD_GLOBAL)  # first: it owns cblas_sgemm
            _shim_handle.markbase_blas_calls.restype = ctypes.c_long
            _shim_handle.markbase_blas_set_gemv_min.argtypes = [ctypes.c_long]
        except OSError as exc:
            notes.append(f"shim not used: {exc}")
            _shim_handle, shim = None, None
    # Everything else (sgemv, Fortran BLAS for the vendored LAPACK, ...) from the real one.
    ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    if _shim_handle is not None:
        if _shim_handle.markbase_blas_init(lib.encode()) != 0:
            raise OSError(f"sgemv shim could not bind {lib}")
        _threads_from_env()
    _setup = BlasSetup("dlopen-global", library=lib, shim=shim, reason="loaded before mlx.core")
    _setup.notes = notes
    return _setup


# ---------------------------------------------------------------- bench knobs


def select_sgemm(backend: str) -> None:
    """Switch the shim in-process, for interleaved A/B benchmarks.

    ``backend``: "fast" (the fast BLAS's sgemm for every product) or "fast+gemv"
    (the default: M == 1 products through sgemv). The vendored reference BLAS cannot
    be selected in-process: its cblas_sgemm calls ``sgemm_``, which the global scope
    binds to the fast BLAS; measure it in a process started with MARKBASE_BLAS=off.
    """
    if _shim_handle is None:
        raise RuntimeError("select_sgemm needs ensure_fast_blas() with the shim loaded")
    if backend not in ("fast", "fast+gemv"):
        raise ValueError(backend)
    _shim_handle.markbase_blas_set_gemv(1 if backend == "fast+gemv" else 0)


def set_blas_threads(
    gemv: int = 0, small_gemm: int = 1, gemm: int = 0, small_m: int | None = None
) -> bool:
    """OpenBLAS threads per kind of product, switched per call by the shim (0: the
    library's default, i.e. OPENBLAS_NUM_THREADS): ``gemv`` for M == 1, ``small_gemm``
    for 1 < M < ``small_m`` (decode batches), ``gemm`` for the rest (prefill).
    Without the shim: one global setting, ``max(gemv, gemm)``."""
    if _shim_handle is not None:
        m = -1 if small_m is None else int(small_m)
        return bool(
            _shim_handle.markbase_blas_set_threads(int(gemv), int(small_gemm), int(gemm), m)
        )
    lib = _setup.library if _setup else None
    if not lib:
        return False
    try:
        n = max(gemv, gemm)
        if n > 0:
            ctypes.CDLL(lib).openblas_set_num_threads(int(n))
        return True
    except (OSError, AttributeError):
        return False


def _threads_from_env() -> None:
    set_blas_threads(
        gemv=envs.MARKBASE_BLAS_GEMV_THREADS,
        small_gemm=envs.MARKBASE_BLAS_SMALL_GEMM_THREADS,
        gemm=envs.MARKBASE_BLAS_GEMM_THREADS,
        small_m=envs.MARKBASE_BLAS_SMALL_M,
    )


# ---------------------------------------------------------------- report


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_provider(symbol: str) -> str | None:
    """File that the global lookup scope resolves ``symbol`` to (what libmlx.so binds to)."""
    try:
        me = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(me, symbol), ctypes.c_void_p).value
        libdl = ctypes.CDLL(ctypes.util.find_library("dl") or "libc.so.6")
        info = _DlInfo()
        if addr and libdl.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        pass
    return None


def _mapped_blas_files() -> list[str]:
    pat = re.compile(r"(blas|lapack|mkl|blis|markbase_sgemm)", re.I)
    seen: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and pat.search(os.path.basename(parts[-1])):
                    if parts[-1] not in seen:
                        seen.append(parts[-1])
    except OSError:
        pass
    return seen


def _measure_gflops(m: int = 256, k: int = 576, n: int = 1536, reps: int = 7) -> float:
    """The best of ``reps`` products: whether the BLAS is fast, not how busy the machine
    is (OpenBLAS's two threads wait for each other, so one preempted thread made the
    median of a busy 2-core machine 5x slow)."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.full((m, k), 0.5, dtype=mx.float32)
        b = mx.full((k, n), 0.25, dtype=mx.float32)
        mx.eval(a, b)
        mx.eval(a @ b)  # warm up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - t0)
    return 2.0 * m * k * n / min(times) / 1e9


def blas_report(measure: bool = True) -> dict:
    """Which BLAS MLX's CPU matmul actually uses, and how fast (imports mlx.core)."""
    setup = _setup or BlasSetup("none", reason="ensure_fast_blas() was not called")
    rep: dict = {"platform": sys.platform, "setup": asdict(setup)}
    if not sys.platform.startswith("linux"):
        rep.update(provider=None, fast=True, gflops=None)
        return rep
    vendored = vendored_reference_blas()
    provider = None
    if measure or _mlx_core_loaded():
        import mlx.core  # noqa: F401  (maps libmlx.so and its BLAS)
    provider = _global_provider("cblas_sgemm")
    if provider is None:
        provider = vendored  # nothing global: libmlx.so binds to its own NEEDED libblas
    rep["vendored_reference_blas"] = vendored
    rep["sgemm_provider"] = provider
    rep["mapped"] = _mapped_blas_files()
    rep["openblas_num_threads"] = os.environ.get("OPENBLAS_NUM_THREADS")
    rep["openblas_coretype"] = os.environ.get("OPENBLAS_CORETYPE")
    uses_vendored = bool(
        vendored and provider and os.path.realpath(provider) == os.path.realpath(vendored)
    )
    rep["uses_reference_blas"] = uses_vendored if vendored else False
    if measure:
        rep["gflops"] = round(_measure_gflops(), 1)
        rep["matmul"] = "256x576x1536 float32 on mx.cpu, median of 5"
    if _shim_handle is not None:
        rep["shim_calls"] = {
            "gemv": int(_shim_handle.markbase_blas_calls(1)),
            "gemm": int(_shim_handle.markbase_blas_calls(0)),
        }
    rep["fast"] = (not rep["uses_reference_blas"]) and (
        rep.get("gflops") is None or rep["gflops"] >= DEFAULT_MIN_GFLOPS
    )
    return rep


def warn_if_slow(
    threshold_gflops: float = DEFAULT_MIN_GFLOPS, logger: logging.Logger | None = None
) -> dict:
    """Measure (``blas_report``) and log a loud warning when MLX's CPU matmul is slow."""
    lg = logger or log
    rep = blas_report(measure=True)
    if not sys.platform.startswith("linux"):
        return rep
    gf = rep.get("gflops") or 0.0
    if rep["uses_reference_blas"] or gf < threshold_gflops:
        bar = "!" * 78
        lg.warning(
            "\n%s\n!! SLOW CPU MATMUL: MLX uses %s at %.1f GFLOP/s (want >= %.0f).\n"
            "!! Decode will be several times slower than it should be. Why: %s\n"
            "!! Fix: apt-get install -y libopenblas0-pthread (or set %s to a BLAS .so\n"
            "!! exporting cblas_sgemm), and call engine.backends.cpu.blas.ensure_fast_blas()\n"
            "!! before the first `import mlx.core`.\n%s",
            bar,
            rep.get("sgemm_provider"),
            gf,
            threshold_gflops,
            rep["setup"].get("reason") or "-",
            ENV_LIB,
            bar,
        )
    else:
        lg.info(
            "CPU BLAS: %s%s, %.0f GFLOP/s (256x576x1536 f32)",
            rep.get("sgemm_provider"),
            " + sgemv shim" if rep["setup"].get("shim") else "",
            gf,
        )
    return rep


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-shim", action="store_true", help="only build the sgemv shim")
    ap.add_argument("--no-measure", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.build_shim:
        path = build_gemv_shim() if sys.platform.startswith("linux") else None
        print(path or "shim not built (not Linux or no C compiler)")
        return 0
    ensure_fast_blas()
    rep = blas_report(measure=not args.no_measure)
    print(json.dumps(rep, indent=2))
    return 0 if rep.get("fast", True) else 1


if __name__ == "__main__":
    sys.exit(main())
