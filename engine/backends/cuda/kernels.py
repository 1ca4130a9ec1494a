"""Custom CUDA kernels as MLX builds them: a spec per kernel, kept so that
bench/gpu/nvrtc_check.py can compile the same source without a GPU.

``Baked`` makes one ``mx.fast.cuda_kernel`` object per set of template values, with
the values written into the source, instead of passing ``template=`` on every call:
on the H200 each call's host time is what limits small decode steps, and MLX turns
a call's template list into strings, hashes them and formats them into the source
every time (bench/gpu/call_cost.py: a 2-line kernel costs ~5 us a call, the
templated product kernels 10-16 us).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from engine import envs

SMS = 132  # an H100/H200's SMs: how the kernels size grids and split work (not correctness)
CSRC = Path(__file__).resolve().parent / "csrc"

CTYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "int32": "int32_t",
    "uint32": "uint32_t",
}


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.cuda_kernel`` gets (plus template values, for the NVRTC check)."""

    name: str
    inputs: list = field(default_factory=list)  # (name, dtype name, ndim)
    outputs: list = field(default_factory=list)  # (name, dtype name)
    source: str = ""
    header: str = ""
    template: list = field(default_factory=list)  # (name, int | bool | dtype name)


@cache
def source(name: str) -> str:
    """The CUDA text of ``csrc/<name>``: a kernel body fragment (``.cu``) or device
    functions and macros for a kernel's header (``.cuh``), as the kernel modules join
    them into what ``mx.fast.cuda_kernel`` compiles. Read once, at the module's import."""
    return (CSRC / name).read_text()


def dtype_name(dtype) -> str:
    """``mx.bfloat16`` (or ``"bfloat16"``) -> ``"bfloat16"``."""
    return dtype if isinstance(dtype, str) else str(dtype).rsplit(".", 1)[-1]


def bake(spec: KernelSpec, template) -> KernelSpec:
    """``spec`` with its template values as ``constexpr``/``using`` lines at the top of
    the body (where MLX would write them) and a name that says them."""
    lines, parts = [], []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
            parts.append("t" if value else "f")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
            parts.append(str(value))
        else:
            lines.append(f"  using {name} = {CTYPES[dtype_name(value)]};")
            parts.append(dtype_name(value))
    source = "\n".join(lines) + "\n\n" + spec.source
    return replace(spec, name="_".join([spec.name, *parts]), source=source, template=[])


def for_dtype(spec: KernelSpec, dtype: str, name: str, template: list) -> KernelSpec:
    """``spec`` with its ``T`` inputs and outputs as ``dtype`` and these template values,
    named ``name`` (the kernels' ``kernel_specs_for_check`` for bench/gpu/nvrtc_check.py)."""
    ins = [(n, dtype if t == "T" else t, nd) for n, t, nd in spec.inputs]
    outs = [(n, dtype if t == "T" else t) for n, t in spec.outputs]
    return KernelSpec(name, ins, outs, spec.source, spec.header, template)


def minify(code: str) -> str:
    """``code`` without comment lines, trailing ``//`` comments (on lines without a
    string literal), indentation and blank lines: the same program in fewer bytes.

    Why: MLX 0.32.4 rebuilds a custom kernel's whole source string on every call and
    hashes all of it when it is encoded (mlx/backend/cuda/custom_kernel.cpp:
    ``build_kernel``, then ``std::hash`` for the module name), so each call's host time
    grows with the source's length, and the decode step is host-bound at one row
    (docs/performance.md)."""
    out = []
    for line in code.splitlines():
        text = line.strip()
        if not text or text.startswith("//"):
            continue
        cut = text.find(" //")
        if cut > 0 and '"' not in text:
            text = text[:cut].rstrip()
        out.append(text)
    return "\n".join(out) + "\n"


def minified(spec: KernelSpec) -> KernelSpec:
    """``spec`` with its source and header through ``minify``, unless
    MARKBASE_GPU_KERNEL_MINIFY=0 (the sources as written, for A/B runs)."""
    if not envs.MARKBASE_GPU_KERNEL_MINIFY:
        return spec
    return replace(spec, source=minify(spec.source), header=minify(spec.header))


def make_kernel(spec: KernelSpec, ensure_row_contiguous: bool, shared_memory: int = 0):
    """The ``mx.fast.cuda_kernel`` object of a baked spec (``shared_memory``: dynamic
    shared memory a block, fixed when the object is made), its source ``minified``."""
    import mlx.core as mx

    spec = minified(spec)
    return mx.fast.cuda_kernel(
        name=spec.name,
        input_names=[n for n, _, _ in spec.inputs],
        output_names=[n for n, _ in spec.outputs],
        source=spec.source,
        header=spec.header,
        ensure_row_contiguous=ensure_row_contiguous,
        shared_memory=shared_memory,
    )


def launch_bounds(bounds: str) -> str:
    """Header text that declares the kernel ``__launch_bounds__(T, B)`` for ``bounds``
    "TxB" (at most T threads a block, B blocks an SM; "" for none): MLX writes the
    kernel's signature, so the header redefines ``__global__`` to carry it."""
    if not bounds:
        return ""
    threads, blocks = (int(v) for v in bounds.split("x"))
    return (
        "#undef __global__\n#define __global__ __attribute__((global)) "
        f"__launch_bounds__({threads}, {blocks})\n"
    )


class SpecsByKind(dict):
    """kind -> ``make(kind)``, made at the first lookup: for kernels whose kinds are
    parsed from the name (the 4-bit products' ``q4_res_sk_lb256x2``) rather than listed."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, kind: str) -> KernelSpec:
        spec = self[kind] = self._make(kind)
        return spec


class Baked:
    """``baked(kind, template[, shared_memory])`` -> the kernel object for
    ``specs()[kind]`` with these template values baked in, made once. ``template`` is a
    tuple of (name, value); ``shared_memory`` (dynamic, bytes a block) must follow from
    the template, as MLX fixes it when the object is made."""

    def __init__(self, specs, ensure_row_contiguous: bool) -> None:
        self._specs = specs  # a callable: {kind: KernelSpec}, read at the first use
        self._ensure = ensure_row_contiguous
        self._made: dict = {}

    def __call__(self, kind: str, template: tuple, shared_memory: int = 0):
        key = (kind, template)
        kernel = self._made.get(key)
        if kernel is None:
            spec = bake(self._specs()[kind], template)
            kernel = make_kernel(spec, self._ensure, shared_memory)
            self._made[key] = kernel
        return kernel


def one_output_call(fn, grid: tuple, threadgroup: tuple, shape: tuple, dtype):
    """``call(inputs) -> the output`` of a kernel with one output and a fixed launch:
    the geometry worked out once, outside the per-call path (host time a call)."""
    shapes, dtypes = [shape], [dtype]

    def call(inputs):
        return fn(
            inputs=inputs,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )[0]

    return call


# ---------------------------------------------------------------- checks without a GPU

# what MLX's build_kernel (mlx/backend/cuda/custom_kernel.cpp) puts before a kernel
DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
)


def nvrtc_source(spec: KernelSpec) -> str:
    """The whole translation unit MLX hands NVRTC for ``spec`` (minified as
    ``make_kernel`` hands it over): header, signature from the input/output names,
    template constants, the body."""
    spec = minified(spec)
    out = DEFAULT_HEADER + spec.header
    out += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    out += f"__global__ void custom_kernel_{spec.name}(\n"
    for name, dtype, ndim in spec.inputs:
        out += f"    const {CTYPES[dtype]}* {name},\n"
        if ndim > 0:
            if f"{name}_shape" in spec.source:
                out += f"    const __grid_constant__ Shape {name}_shape,\n"
            if f"{name}_strides" in spec.source:
                out += f"    const __grid_constant__ Strides {name}_strides,\n"
            if f"{name}_ndim" in spec.source:
                out += f"    const __grid_constant__ int {name}_ndim,\n"
    outs = [f"    {CTYPES[dtype]}* {name}" for name, dtype in spec.outputs]
    out += ",\n".join(outs) + ") {\n"
    for name, value in spec.template:
        if isinstance(value, bool):
            out += f"  constexpr bool {name} = {'true' if value else 'false'};\n"
        elif isinstance(value, int):
            out += f"  constexpr int {name} = {value};\n"
        else:
            out += f"  using {name} = {CTYPES[value]};\n"
    out += "\n" + spec.source + "\n}\n\n} // namespace mlx::core::cu\n"
    return out
