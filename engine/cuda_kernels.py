"""Custom CUDA kernels as MLX builds them: a spec per kernel, kept so that
bench/gpu/nvrtc_check.py can compile the same source without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.cuda_kernel`` gets (plus template values, for the NVRTC check)."""

    name: str
    inputs: list = field(default_factory=list)  # (name, dtype name, ndim)
    outputs: list = field(default_factory=list)  # (name, dtype name)
    source: str = ""
    header: str = ""
    template: list = field(default_factory=list)  # (name, int | bool | dtype name)


def build(specs: dict[str, KernelSpec], ensure_row_contiguous: bool) -> dict:
    """``{kind: mx.fast.cuda_kernel(...)}`` for ``specs`` (CUDA builds of MLX only)."""
    import mlx.core as mx

    return {
        kind: mx.fast.cuda_kernel(
            name=spec.name,
            input_names=[n for n, _, _ in spec.inputs],
            output_names=[n for n, _ in spec.outputs],
            source=spec.source,
            header=spec.header,
            ensure_row_contiguous=ensure_row_contiguous,
        )
        for kind, spec in specs.items()
    }
