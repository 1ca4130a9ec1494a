"""Compile markbase's custom CUDA kernels with NVRTC on a machine without a GPU.

A kernel that does not compile should fail here, before any GPU run. This rebuilds the source ``mx.fast.cuda_kernel`` would hand to
NVRTC (signature from the input/output names, template constants, the body; the
same default header) and compiles it for sm_90a as MLX's JIT does.

Needs, once (about 70 MB, not part of the project's install):

    pip download --no-deps --only-binary=:all: -d /tmp/nvrtc \\
        "nvidia-cuda-nvrtc>=13,<14" "nvidia-cuda-runtime>=13,<14" "nvidia-cuda-cccl>=13,<14"
    (unzip each into /tmp/nvrtc/site; MLX's device headers, mlx/backend/cuda/device/*.cuh
     from the MLX source at the installed version, into /tmp/nvrtc/mlxdev)

    .venv/bin/python bench/gpu/nvrtc_check.py [--root /tmp/nvrtc]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.backends.cuda.kernels import nvrtc_source as build_source  # noqa: E402
from engine.backends.cuda.specs import all_specs  # noqa: E402

# sm_90a SASS (not PTX) so that ptxas runs and reports registers and spills
ARCH = b"--gpu-architecture=sm_90a"


def compile_source(
    root: Path, source: str, name: str, ptx: Path | None = None, sass: Path | None = None
) -> tuple[bool, str]:
    """Compile for sm_90a (the log has ptxas' registers and spills); with ``ptx``, for
    compute_90a instead, and the PTX goes to ``ptx/<name>.ptx`` (to read the loads);
    with ``sass``, the cubin's SASS goes to ``sass/<name>.sass`` (nvdisasm, from the
    ``nvidia-cuda-nvdisasm`` wheel unpacked into the same site folder)."""
    site = root / "site"
    lib = ctypes.CDLL(str(site / "nvidia/cu13/lib/libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(
        ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
    )
    assert rc == 0, rc
    opts = [
        b"--device-as-default-execution-space",
        b"--gpu-architecture=compute_90a" if ptx else ARCH,
        f"--include-path={root / 'mlxdev'}".encode(),
        f"--include-path={site / 'mlx/include'}".encode(),
        f"--include-path={site / 'mlx/include/cccl'}".encode(),
        f"--include-path={site / 'nvidia/cu13/include'}".encode(),
        b"-std=c++17",
        *([] if ptx else [b"--ptxas-options=-v"]),
    ]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    if ptx and rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, code)
        ptx.mkdir(parents=True, exist_ok=True)
        (ptx / f"{name}.ptx").write_bytes(code.value)
    if sass and not ptx and rc == 0:
        import subprocess

        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, code)
        sass.mkdir(parents=True, exist_ok=True)
        cubin = sass / f"{name}.cubin"
        cubin.write_bytes(code.raw)
        nvdisasm = site / "nvidia/cu13/bin/nvdisasm"
        text = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True)
        (sass / f"{name}.sass").write_text(text.stdout + text.stderr)
    return rc == 0, buf.value.decode(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/nvrtc")
    ap.add_argument("--show", action="store_true", help="print the generated sources")
    ap.add_argument("--only", default="", help="only kernels whose name contains this")
    ap.add_argument("--ptx", default="", help="write PTX (compute_90a) to this folder")
    ap.add_argument("--sass", default="", help="write SASS (sm_90a, nvdisasm) to this folder")
    args = ap.parse_args()
    failed = 0
    specs = all_specs()
    for spec in specs:
        if args.only not in spec.name:
            continue
        src = build_source(spec)
        if args.show:
            print(src)
        ok, log = compile_source(
            Path(args.root),
            src,
            spec.name,
            Path(args.ptx) if args.ptx else None,
            Path(args.sass) if args.sass else None,
        )
        print(f"{spec.name}: {'ok' if ok else 'FAILED'}")
        if log.strip():
            print(log)
        failed += not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
