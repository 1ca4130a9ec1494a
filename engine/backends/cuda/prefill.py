"""Prefill's quantized products on a GPU: dequantize the weight, then a float matmul.

Why: prefill multiplies hundreds or thousands of rows by every weight, which is
compute-bound, and MLX 0.32.4's CUDA ``quantized_matmul`` is far from the tensor
cores' rate there: on the H200 a 2048-token prefill of the 8b model took 238 ms at
4 bits against 56 ms in bf16 (docs/performance.md, "Prefill"). Expanding the 4-bit
weight to the activations' dtype first reads 0.56 bytes a weight and writes and
reads 2 more, a few ms a 2k-token chunk at 8b, after which cuBLAS runs the bf16
product at full rate. Below ``min_rows`` rows (decode, short prompt chunks) the
product is memory-bound and reading the 4-bit weight once is what wins, so
``quantized_matmul`` stays.

The expansion is engine/backends/cuda/products/dequant.py's kernel (MLX's ``affine_dequantize`` ran at
~1.2 TB/s, this one at 2.4-2.9: 8b 4-bit 2k prefill 31.0k -> 34.5k tok/s;
``MARKBASE_GPU_DEQUANT=0`` for ``mx.dequantize``).

``install`` turns the model's ``nn.QuantizedLinear`` modules into
``DequantPrefillLinear`` in place (same parameters, same results up to the float
product's rounding); the GPU decode step does not call these modules (it has its own
routes, engine/backends/cuda/linear.py), so only prefill and models without a fused step see
it. ``MARKBASE_GPU_PREFILL_DEQ_ROWS`` sets the row threshold (default 256); 0 turns
it off.

Measured on an H100 (docs/performance.md): one layer's products at 256
rows 0.82x (8b) and 0.95x (1b) of ``quantized_matmul``'s time, at 2048 rows 0.25x;
below 256 rows slower (1.4x at 128). A 2048-token prefill of the 8b 4-bit model, with
engine/backends/cuda/attention/prefill.py: 8,741 -> 24,694 tok/s.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine import envs
from engine.backends.cuda.products import dequant as gpu_dequant

ROWS_ENV = "MARKBASE_GPU_PREFILL_DEQ_ROWS"
# where dequantizing first starts to win (bench/gpu/matmul_rows.py --forms qmm,deq)
DEFAULT_MIN_ROWS = 256


class DequantPrefillLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` that dequantizes its weight for products of many rows."""

    min_rows: int = DEFAULT_MIN_ROWS

    def __call__(self, x: mx.array) -> mx.array:
        if x.size < self.min_rows * x.shape[-1]:
            return self._few_rows(x)
        w = gpu_dequant.dequantize(
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

    def _few_rows(self, x: mx.array) -> mx.array:
        """A chunk below ``min_rows``: engine/backends/cuda/products/mma.py's kernel (4-bit affine on CUDA,
        more than one row: one row stays MLX's), or with ``MARKBASE_GPU_PREFILL_SMALL=mlx``
        MLX's ``quantized_matmul``."""
        k = x.shape[-1]
        rows = x.size // k
        if rows > 1 and small_route() == "qmma" and self["scales"].dtype == x.dtype:
            from engine.backends.cuda.products import mma as gpu_mma

            n, biases = self["weight"].shape[0], self.get("biases")
            gs, bits, mode = self.group_size, self.bits, self.mode
            if gpu_mma.quant_supported(x.dtype, n, k, bits, gs, mode, biases):
                y = gpu_mma.quantized_matmul(
                    x.reshape(rows, k), self["weight"], self["scales"], biases, gs
                ).reshape(*x.shape[:-1], n)
                return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


SMALL_ENV = "MARKBASE_GPU_PREFILL_SMALL"


def small_route() -> str:
    """``MARKBASE_GPU_PREFILL_SMALL``: ``qmma`` (default) or ``mlx``, how prompt chunks
    of 2 to ``min_rows`` - 1 rows run their 4-bit products.

    Why a second route: MLX's ``quantized_matmul`` runs them on ``qmm_sm80``, which it
    JIT-compiles per tile size on first use (m16 / m32 / m64: 23-28 s each on an H100) and which was 3-5x slower than gpu_mma's kernel at 8-32 rows in the
    decode step  and 1.4x at 128 . Chunks that small are every
    short prompt and the uncached tail of a prompt whose prefix is cached, so they set
    time to first token in a chat. Measured (H100, 8b 4-bit, one chunk):
    24 tokens 23.2 -> 10.7 ms, 100 tokens 28.5 -> 19.9, 200 tokens 39.9 -> 29.9; and
    from an empty PTX cache the engine's warm-up took 60 s instead of 130 s."""
    return envs.value(SMALL_ENV)


def is_plain_quantized(module) -> bool:
    """Whether ``module`` is an ``nn.QuantizedLinear`` with nothing changed but this
    route: the GPU decode step fuses and replans exactly these. A second
    ``ModelRunner`` on one model (the benchmarks build one per variant) finds the first
    one's ``DequantPrefillLinear`` modules; taking them for something else sent every
    decode product to MLX's ``quantized_matmul`` (8b 4-bit at 8 rows: 546 tok/s against
    1,725, docs/performance.md)."""
    return type(module) is nn.QuantizedLinear or type(module) is DequantPrefillLinear


def min_rows_from_env(env=None) -> int:
    """The row threshold in effect: ``MARKBASE_GPU_PREFILL_DEQ_ROWS``, else the default."""
    rows = envs.value(ROWS_ENV, env)
    return DEFAULT_MIN_ROWS if rows is None else rows


def install(model: nn.Module, min_rows: int | None = None) -> int:
    """Route ``model``'s quantized linear layers through ``DequantPrefillLinear`` from
    ``min_rows`` rows on; returns how many layers now do (0 when ``min_rows`` is 0)."""
    min_rows = min_rows_from_env() if min_rows is None else min_rows
    if min_rows <= 0:
        return 0
    count = 0
    for _, module in model.named_modules():
        if is_plain_quantized(module):
            module.__class__ = DequantPrefillLinear
            module.min_rows = min_rows
            count += 1
    return count
