"""Weight formats: what ``weight_format`` means, and conversions between them.

    native    keep the file's quantization where MLX can hold it (see gguf_quants: Q4_0, Q4_1,
              Q5_0, Q5_1, Q8_0, Q4_K, Q5_K transcode losslessly to MLX affine group-32; Q6_K
              becomes MLX 8-bit; other GGML types become MLX 4-bit); float tensors stay float
    q4        every quantizable matrix (Linear, Embedding, SwitchLinear) MLX 4-bit affine
    float32 | bfloat16 | float16   dequantize everything to that dtype

``compute_dtype`` is the dtype of everything that is not a packed integer (norms, scales,
biases, float weights): it decides the activation dtype. On the CPU backend float16 and
bfloat16 matmuls are 8-40x slower than float32, so the CPU default is float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import platform
from engine.backends import cpu
from engine.loading.loaded_model import ModelLoadError

WEIGHT_FORMATS = ("native", "q4", "float32", "bfloat16", "float16")
FLOAT_FORMATS = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
Q4_GROUP_SIZE = 32
DTYPES = FLOAT_FORMATS  # names accepted for compute_dtype


def resolve_weight_format(requested: str) -> str:
    """The one place that decides what ``"auto"`` means, by backend (measured):

    - Linux CPU: float32 with a fast BLAS (every other format runs through MLX's scalar
      single-threaded kernels, 3-20x slower); "native" without one (engine.backends.cpu.tuning).
    - CUDA: bfloat16. MLX's CUDA 4-bit matmul streams only 0.09-0.15 TB/s from 8 rows
      up: 1B model at batch 128 decoded 22k tok/s in bf16 vs 2.1k in 4-bit (bench/gpu).
    - Metal: native (4-bit kernels are MLX's strength there).
    """
    if requested == "auto":
        backend = platform.backend()
        if backend == "cpu":
            return cpu.best_cpu_weight_format()
        return "bfloat16" if backend == "cuda" else "native"
    if requested not in WEIGHT_FORMATS:
        raise ModelLoadError(
            f"unknown weight_format {requested!r}; expected 'auto' or one of {WEIGHT_FORMATS}"
        )
    return requested


def resolve_compute_dtype(weight_format: str, requested: str | None = None) -> mx.Dtype:
    """dtype of activations, norms and quantization scales."""
    if weight_format in FLOAT_FORMATS:
        return FLOAT_FORMATS[weight_format]
    if requested is not None:
        if requested not in DTYPES:
            raise ModelLoadError(f"unknown compute_dtype {requested!r}")
        return DTYPES[requested]
    return mx.float32 if platform.on_cpu() else mx.bfloat16


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


@dataclass
class WeightSet:
    """Weights under mlx-lm parameter names, with the quantization of each quantized module.

    ``quant[module_path] = {"group_size": g, "bits": b, "mode": m}``; that module then has
    ``weight`` (packed uint32), ``scales`` and (affine) ``biases`` in ``arrays``.
    ``origin[param_name]`` says where a tensor came from, for error messages.
    """

    arrays: dict[str, mx.array]
    quant: dict[str, dict] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    hint: Callable[[str], str | None] | None = None  # source name of a parameter not loaded

    def describe(self, name: str) -> str:
        if name in self.origin:
            return self.origin[name]
        if self.hint is not None and (h := self.hint(name)):
            return repr(h)
        return repr(name)

    def set_float(self, module: str, w: mx.array) -> None:
        self.arrays[f"{module}.weight"] = w
        self.arrays.pop(f"{module}.scales", None)
        self.arrays.pop(f"{module}.biases", None)
        self.quant.pop(module, None)

    def set_quantized(self, module: str, w: mx.array, group_size: int, bits: int) -> None:
        q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
        self.arrays[f"{module}.weight"] = q
        self.arrays[f"{module}.scales"] = s
        self.arrays[f"{module}.biases"] = b
        self.quant[module] = {"group_size": group_size, "bits": bits, "mode": "affine"}

    def dequantized(self, module: str, dtype: mx.Dtype) -> mx.array:
        q = self.quant[module]
        w = mx.dequantize(
            self.arrays[f"{module}.weight"],
            self.arrays[f"{module}.scales"],
            self.arrays.get(f"{module}.biases"),
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
        )
        return w.astype(dtype)


def quantizable_modules(model: nn.Module, group_size: int) -> set[str]:
    """Paths of modules that can be MLX-quantized with this group size."""
    out = set()
    for path, m in model.named_modules():
        if not hasattr(m, "to_quantized") or isinstance(
            m, (nn.QuantizedLinear, nn.QuantizedEmbedding)
        ):
            continue
        w = getattr(m, "weight", None)
        if w is not None and w.ndim >= 2 and w.shape[-1] % group_size == 0:
            out.add(path)
    return out


def apply_format(
    ws: WeightSet,
    weight_format: str,
    compute_dtype: mx.Dtype,
    quantizable: set[str],
    shadows: dict | None = None,
) -> WeightSet:
    """Convert ``ws`` in place to ``weight_format``; float tensors end up in ``compute_dtype``.

    With ``shadows`` (a dict) and a float32 format, each dequantized module's quantized
    form is kept there as an ``engine.backends.cpu.qgemm.QuantShadow`` (CPU decode reads it)."""
    if weight_format in FLOAT_FORMATS:
        keep = shadows is not None and compute_dtype == mx.float32
        for module in list(ws.quant):
            if keep:
                shadow = _shadow(ws, module)
                if shadow is not None:
                    shadows[module] = shadow
            ws.set_float(module, ws.dequantized(module, compute_dtype))
    elif weight_format == "q4":
        for module in list(ws.quant):
            q = ws.quant[module]
            if q["bits"] != 4 or q.get("mode", "affine") != "affine":
                ws.set_quantized(module, ws.dequantized(module, mx.float32), Q4_GROUP_SIZE, 4)
        for module in sorted(quantizable):
            w = ws.arrays.get(f"{module}.weight")
            if module not in ws.quant and w is not None and mx.issubdtype(w.dtype, mx.floating):
                ws.set_quantized(module, w.astype(mx.float32), Q4_GROUP_SIZE, 4)
    elif weight_format != "native":
        raise ModelLoadError(f"unknown weight_format {weight_format!r}")
    for name, a in ws.arrays.items():
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != compute_dtype:
            ws.arrays[name] = a.astype(compute_dtype)
    return ws


def _shadow(ws: WeightSet, module: str):
    q = ws.quant[module]
    if q.get("mode", "affine") != "affine":
        return None
    return cpu.shadow_of(
        ws.arrays[f"{module}.weight"],
        ws.arrays[f"{module}.scales"],
        ws.arrays.get(f"{module}.biases"),
        q["bits"],
        q["group_size"],
    )


def quantize_model_like(model: nn.Module, ws: WeightSet) -> None:
    """Swap the modules ``ws`` holds quantized for their quantized versions."""
    if not ws.quant:
        return

    def predicate(path: str, m: nn.Module):
        q = ws.quant.get(path)
        return dict(q) if q else False

    nn.quantize(model, class_predicate=predicate)


def model_param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
