"""Mixture-of-experts layers with their expert products grouped per expert.

mlx-lm's families run their experts through ``SwitchGLU`` (qwen3_moe, mixtral,
gemma4_text's MoE block, gpt_oss, olmoe, granitemoe, ...): ``gather_qmm`` over every
(token, expert) pair, sorted by expert only from 64 pairs on. On MLX 0.32's CUDA
backend ``gather_qmm`` ignores the sort and runs each pair as a one-row product on a
16-row tensor-core tile, so every pair reads its expert's weights again, slowly: a
Qwen3-30B-A3B-shaped model decoded 74.6 tok/s at one row and 96 tok/s at 32 rows on
an H100 before the grouping. ``install`` swaps each ``SwitchGLU`` of a model for
``GroupedSwitchGLU``, which computes the same thing with the pairs grouped per expert,
in prefill and decode alike, by the route the backend does best:

- ``kernel`` (CUDA, 4-bit experts, up to ``MARKBASE_MOE_KERNEL_TOKENS`` tokens: decode
  steps and short prompt chunks): engine/backends/cuda/products/moe.py, one kernel
  for gate and up with the activation, one for down; each expert's weights read once
  for all of its pairs.
- ``dequant`` (CUDA, more tokens: prompt chunks): the experts' 4-bit weights expanded
  to the activations' dtype (engine/backends/cuda/products/dequant.py's kernel), then
  MLX's ``gather_mm`` over the pairs sorted by expert, which MLX runs as one grouped
  GEMM (CUTLASS) when the indices are sorted.
- ``sorted`` (whatever the kernels do not take; the CPU from 64 pairs on): the pairs
  sorted by expert through the model's own ``SwitchLinear`` modules with
  ``sorted_indices=True``, the same products mlx-lm computes (the CPU's results equal
  mlx-lm's forward bit for bit: tests/engine/test_moe.py). Below 64 pairs the CPU
  takes mlx-lm's own call (``mlx``), as mlx-lm does.

``MARKBASE_MOE=mlx`` leaves mlx-lm's ``SwitchGLU`` as it is (the baseline for A/B runs).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU

from engine import envs, platform
from engine.backends import cuda

log = logging.getLogger("markbase.moe")

SORT_MIN_PAIRS = 64  # mlx-lm's SwitchGLU sorts from this many pairs on (switch_layers.py)


def activation_kind(activation) -> str | None:
    """The kernels' name for a ``SwitchGLU`` activation, or None if they lack it:
    mlx-lm's ``SwiGLU`` (``silu(gate) * up``) and gemma4_text's ``GeGLU``
    (``gelu_approx(gate) * up``)."""
    if type(activation) is SwiGLU:
        return "silu"
    cls = type(activation)
    if cls.__name__ == "GeGLU" and cls.__module__.endswith("gemma4_text"):
        return "gelu_tanh"
    return None


class GroupedSwitchGLU(SwitchGLU):
    """``SwitchGLU`` whose expert products are grouped per expert (module docstring).
    Same parameters, same call: ``(x [..., D], indices [..., k]) -> [..., k, D]``."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        lead, k = indices.shape[:-1], indices.shape[-1]
        d = x.shape[-1]
        xf = x.reshape(-1, d)
        idx = mx.stop_gradient(indices).reshape(-1)
        route = self.route(xf, idx.size)
        if route == "mlx":
            return super().__call__(x, indices)
        if route == "kernel":
            y = self._kernel(xf, idx, k)
        else:
            y = self._sorted(xf, idx, k, dense=route == "dequant")
        return y.reshape(*lead, k, y.shape[-1])

    def route(self, xf: mx.array, pairs: int) -> str:
        """``kernel``, ``dequant``, ``sorted`` or ``mlx`` for ``xf`` [T, D] and ``pairs``
        (token, expert) pairs (module docstring). What does not depend on the call's
        size is worked out at the first call and kept: the decode step calls this
        once a layer, and its host time counts."""
        if not platform.on_cuda():
            # mlx-lm's own call below its sorting threshold: a few pairs gain nothing
            # from sorting on the CPU, and BLAS rounds a float product of other shapes
            # differently (float32 experts: last-bit differences)
            return "sorted" if pairs >= SORT_MIN_PAIRS else "mlx"
        fits = getattr(self, "_moe_fits", None)
        if fits is None:
            fits = self._moe_fits = self._static_route(xf.dtype)
        tokens = xf.shape[0]
        if fits == "kernel" and tokens <= min(
            envs.value("MARKBASE_MOE_KERNEL_TOKENS"), cuda.MOE_MAX_TOKENS
        ):
            return "kernel"
        return "sorted" if fits == "sorted" else "dequant"

    def _static_route(self, dtype) -> str:
        """``kernel`` (the kernels take these experts up to their token limit),
        ``dequant`` (4-bit affine without biases: the dequantized grouped GEMM) or
        ``sorted`` (the rest: float experts, which ``gather_mm`` over sorted pairs
        already runs as MLX's grouped GEMM, biases, other modes)."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(isinstance(p, QuantizedSwitchLinear) for p in projs):
            return "sorted"
        if any("bias" in p or p.mode != "affine" for p in projs):
            return "sorted"
        if activation_kind(self.activation) is not None and all(
            cuda.moe_supported(dtype, p, 1) for p in projs
        ):
            return "kernel"
        return "dequant"

    def _kernel(self, xf: mx.array, idx: mx.array, k: int) -> mx.array:
        if idx.dtype != mx.uint32:
            idx = idx.astype(mx.uint32)
        act = activation_kind(self.activation)
        h = cuda.moe_glu(xf, idx, k, self.gate_proj, self.up_proj, act)
        return cuda.moe_product(h, idx, self.down_proj, xf.shape[0])

    def _sorted(self, xf: mx.array, idx: mx.array, k: int, dense: bool) -> mx.array:
        """The pairs sorted by expert (stable, as mlx-lm sorts them), the three products
        over the sorted rows, then back in pair order: [T * k, D]."""
        order = mx.argsort(idx)
        inv_order = mx.argsort(order)
        xs = mx.expand_dims(xf, -2)[order // k]  # [P, 1, D], laid out as mlx-lm's
        es = idx[order]
        up = _expert_product(self.up_proj, xs, es, dense)
        gate = _expert_product(self.gate_proj, xs, es, dense)
        y = _expert_product(self.down_proj, self.activation(up, gate), es, dense)
        return y[inv_order][:, 0, :]


def _expert_product(lin, xs: mx.array, es: mx.array, dense: bool) -> mx.array:
    """``lin``'s product over rows ``xs`` [P, 1, K] sorted by expert ``es`` [P]: its own
    call, or (``dense``) its weights dequantized and MLX's grouped ``gather_mm``."""
    if not dense:
        return lin(xs, es, sorted_indices=True)
    w = lin["weight"]
    e, n, words = w.shape
    scales, biases = lin["scales"], lin.get("biases")
    wd = cuda.dequantize(
        w.reshape(e * n, words),
        scales.reshape(e * n, -1),
        None if biases is None else biases.reshape(e * n, -1),
        group_size=lin.group_size,
        bits=lin.bits,
        mode=lin.mode,
    ).reshape(e, n, -1)
    y = mx.gather_mm(xs, wd.astype(xs.dtype).swapaxes(-1, -2), rhs_indices=es, sorted_indices=True)
    if "bias" in lin:
        y = y + mx.expand_dims(lin["bias"][es], -2)
    return y


def install(model: nn.Module) -> int:
    """Swap every ``SwitchGLU`` in ``model`` for ``GroupedSwitchGLU`` in place (its
    class only: parameters and activation stay). Returns how many; 0 with
    ``MARKBASE_MOE=mlx``."""
    if envs.value("MARKBASE_MOE") == "mlx":
        return 0
    n = 0
    for _, module in model.named_modules():
        if type(module) is SwitchGLU:
            module.__class__ = GroupedSwitchGLU
            n += 1
    if n:
        log.info("grouped expert products in %d MoE layers", n)
    return n


def uninstall(model: nn.Module) -> int:
    """Undo ``install`` (mlx-lm's ``SwitchGLU`` again); returns how many."""
    n = 0
    for _, module in model.named_modules():
        if type(module) is GroupedSwitchGLU:
            module.__class__ = SwitchGLU
            n += 1
    return n
