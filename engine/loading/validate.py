"""Checks run on every load (GGUF files and folders, every family), before weights go
into the model.

Missing, unexpected, mis-shaped and mistyped tensors (a float where the model holds packed
4-bit codes, or the reverse) are found by comparing names, shapes and dtype kinds with the
(already quantized) model's parameters. NaN/Inf is found with one reduction (a sum, which is
NaN/Inf iff an element is) per floating tensor (for packed weights: their scales and biases), all evaluated together in a
single ``mx.eval`` so the check stays on the device and costs one sync.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.loading.formats import WeightSet, model_param_shapes
from engine.loading.loaded_model import ModelLoadError


def check_weights(model: nn.Module, ws: WeightSet, source: str) -> None:
    expected = model_param_shapes(model)
    got = ws.arrays
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{source}: missing tensor {ws.describe(missing[0])} -> {missing[0]}{more}"
        )
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelLoadError(
            f"{source}: unexpected tensor {ws.describe(unexpected[0])} (as {unexpected[0]}){more}"
        )
    for name, shape in expected.items():
        if tuple(got[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {ws.describe(name)} has shape {list(got[name].shape)}, "
                f"the model expects {list(shape)} for {name}"
            )
    kinds = model_param_kinds(model)
    for name, floating in kinds.items():
        if mx.issubdtype(got[name].dtype, mx.floating) != floating:
            want = "floating-point" if floating else "integer (packed quantized)"
            raise ModelLoadError(
                f"{source}: tensor {ws.describe(name)} is {got[name].dtype}, the model expects "
                f"{want} values for {name}"
            )
    check_finite(ws, source)


def model_param_kinds(model: nn.Module) -> dict[str, bool]:
    """Whether each parameter of ``model`` is floating-point (False: packed integers)."""
    from mlx.utils import tree_flatten

    return {k: mx.issubdtype(v.dtype, mx.floating) for k, v in tree_flatten(model.parameters())}


def check_finite(ws: WeightSet, source: str) -> None:
    names = [n for n, a in ws.arrays.items() if mx.issubdtype(a.dtype, mx.floating)]
    if not names:
        return

    # A sum is NaN/Inf iff some element is (barring an overflow no sane weight reaches), and
    # on the CPU backend it is ~25x cheaper than all(isfinite(x)).
    def total(a: mx.array) -> mx.array:
        return mx.sum(a.astype(mx.float32) if a.dtype == mx.float16 else a)  # f16 sums overflow

    flags = mx.isfinite(mx.stack([total(ws.arrays[n]) for n in names]))
    mx.eval(flags)
    bad = [n for n, ok in zip(names, flags.tolist()) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ModelLoadError(
            f"{source}: tensor {ws.describe(bad[0])} has NaN/Inf values ({bad[0]}){more}"
        )
