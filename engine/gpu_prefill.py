"""Prefill's quantized products on a GPU: dequantize the weight, then a float matmul.

Why: prefill multiplies hundreds or thousands of rows by every weight, which is
compute-bound, and MLX 0.32.4's CUDA ``quantized_matmul`` is far from the tensor
cores' rate there: on the H200 a 2048-token prefill of the 8b model took 238 ms at
4 bits against 56 ms in bf16 (bench/gpu/NOTES.md, "Prefill"). Expanding the 4-bit
weight to the activations' dtype first reads 0.56 bytes a weight and writes and
reads 2 more, a few ms a 2k-token chunk at 8b, after which cuBLAS runs the bf16
product at full rate. Below ``min_rows`` rows (decode, short prompt chunks) the
product is memory-bound and reading the 4-bit weight once is what wins, so
``quantized_matmul`` stays.

``install`` turns the model's ``nn.QuantizedLinear`` modules into
``DequantPrefillLinear`` in place (same parameters, same results up to the float
product's rounding); the GPU decode step does not call these modules (it has its own
routes, engine/gpu_linear.py), so only prefill and models without a fused step see
it. ``MARKBASE_GPU_PREFILL_DEQ_ROWS`` sets the row threshold (e.g. 256); 0, the
default until a GPU run measures it, turns it off.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

ROWS_ENV = "MARKBASE_GPU_PREFILL_DEQ_ROWS"
# 0 (off) until its speed is measured on a GPU (session 14's one call did not reach
# it; bench/gpu/suite.sh prefill-ab); 256 is the planned value
DEFAULT_MIN_ROWS = 0


class DequantPrefillLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` that dequantizes its weight for products of many rows."""

    min_rows: int = DEFAULT_MIN_ROWS

    def __call__(self, x: mx.array) -> mx.array:
        if x.size < self.min_rows * x.shape[-1]:
            return super().__call__(x)
        w = mx.dequantize(
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        y = x @ w.astype(x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


def min_rows_from_env(env=None) -> int:
    """The row threshold in effect: ``MARKBASE_GPU_PREFILL_DEQ_ROWS``, else the default."""
    text = (os.environ if env is None else env).get(ROWS_ENV, "")
    if not text:
        return DEFAULT_MIN_ROWS
    if not text.isdigit():
        raise ValueError(f"{ROWS_ENV}={text!r}: want a row count (0 turns the route off)")
    return int(text)


def install(model: nn.Module, min_rows: int | None = None) -> int:
    """Route ``model``'s quantized linear layers through ``DequantPrefillLinear`` from
    ``min_rows`` rows on; returns how many layers now do (0 when ``min_rows`` is 0)."""
    min_rows = min_rows_from_env() if min_rows is None else min_rows
    if min_rows <= 0:
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear or isinstance(module, DequantPrefillLinear):
            module.__class__ = DequantPrefillLinear
            module.min_rows = min_rows
            count += 1
    return count
