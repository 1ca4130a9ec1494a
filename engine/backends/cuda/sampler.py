"""One CUDA kernel for a decode step's plain draws: temperature-only and greedy rows.

Why: engine/sampler.py's two-level draw as MLX ops is ~20 kernels over the whole
[B, V] logits (a float32 copy, the max, x - max, the scaling, exp, block sums, two
cumulative sums, the picks). On an H100 with the llama-3 vocabulary that took 0.23 ms
a step at B=1 and 0.85 ms at B=128, against mlx-lm's Gumbel draw at 0.19 and 0.26
(bench/sampler_bench.py): at 1b B=128 a ~3.4 ms step pays a quarter more
when its rows sample, and OpenAI's default temperature is 1.0.

Here one block of ``THREADS`` threads draws one row, reading the logits in their own
dtype: the row's max (and its first index, the greedy token), each 256-token block's
mass, the first block whose running mass reaches u0 of the total, then the first
token in it whose running mass reaches u1 of the block's: the same two-level inverse
CDF with the same two uniforms as the MLX ops (engine/sampler.py), summed in another
order, so a draw within a rounding of a boundary may land on the neighbouring token.
A row with ``inv_t`` 0 is greedy (the max's first index, as ``mx.argmax``). Rounding
never picks a token of zero weight: a pick falls back to the last block / token
with weight. Rows' settings come in one float32 [B, 4] array (inv_t, u0, u1, 0: 16
bytes a row, out of MLX's pool of tiny arrays, engine/gpu_mma.device_scalar) and the
tokens leave in an int32 [B, 4] array, column 0 (the same reason).

Measured (H100, bf16 logits of 128,256 tokens, ``bash bench/gpu/suite.sh
sampler``, ms a step, this kernel / the MLX ops / mlx-lm): B=1 0.32 / 0.20 / 0.19,
B=8 0.18 / 0.30 / 0.10, B=32 0.14 / 0.77 / 0.11, B=128 0.53 / 0.84 / 0.23. So it runs
from ``MIN_ROWS`` rows. That form reads its row twice (the max, then the blocks'
masses), one element a thread a load: latency-bound, ~0.15 ms a row. A one-pass form
(16-byte loads, each block's max and mass against its own max, rescaled afterwards)
measured no better (H100, 2026-12-06, wall ms a step, one-pass / two-pass / mlx-lm:
B=8 0.20 / 0.53 / 0.10, B=32 0.60 / 0.50 / 0.13, B=128 0.54 / 0.66 / 0.23) and was
removed.

Top-k/top-p rows still sort on the MLX route. ``MARKBASE_GPU_SAMPLER_KERNEL=0`` turns
this off; ``MARKBASE_GPU_SAMPLER_MIN_ROWS`` moves the threshold.
"""

from __future__ import annotations

from functools import cache

from engine import envs, platform
from engine.backends.cuda.kernels import Baked, KernelSpec, for_dtype, one_output_call
from engine.backends.cuda.kernels import source as _source
from engine.types import DRAW_BLOCK

THREADS = 1024
BLOCK = DRAW_BLOCK  # tokens a block of the two-level draw: engine/sampler.py's
MAX_BLOCKS = 2048  # so vocabularies up to 524,288 tokens
MIN_ROWS = envs.MARKBASE_GPU_SAMPLER_MIN_ROWS  # measured: above

_HEADER = _source("sampler/header.cuh")

_BODY = _source("sampler/body.cu")

_INPUTS = [("x", "T", 2), ("p", "float32", 2)]


def _specs() -> dict[str, KernelSpec]:
    return {"draw": KernelSpec("mb_sample_draw", _INPUTS, [("out", "int32")], _BODY, _HEADER)}


_kernel = Baked(_specs, ensure_row_contiguous=True)
_TEMPLATE = (("NT", THREADS), ("BLK", BLOCK), ("MAXB", MAX_BLOCKS))


def enabled() -> bool:
    return envs.MARKBASE_GPU_SAMPLER_KERNEL


def takes(logits) -> bool:
    """A CUDA GPU, a [B, V] float array of ``MIN_ROWS`` or more rows within
    ``MAX_BLOCKS`` blocks."""
    import mlx.core as mx

    return (
        logits.ndim == 2
        and logits.shape[0] >= MIN_ROWS
        and logits.shape[1] <= MAX_BLOCKS * BLOCK
        and logits.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and platform.cuda_available()
    )


def draw(logits, params):
    """int32 [B]: a token for each row of ``logits`` [B, V]; ``params`` float32 [B, 4]
    (1 / temperature, or 0 for greedy; u0; u1; unused)."""
    return _launch(logits.dtype, logits.shape[0])([logits, params])[:, 0]


@cache
def _launch(dtype, rows: int):
    """The kernel's call for ``rows`` rows, worked out once (a decode step calls it every
    step: as engine/backends/cuda/linear.py's routes, outside the per-call path)."""
    import mlx.core as mx

    kern = _kernel("draw", (("T", dtype), *_TEMPLATE))
    return one_output_call(kern, (rows * THREADS, 1, 1), (THREADS, 1, 1), (rows, 4), mx.int32)


def kernel_specs_for_check() -> list[KernelSpec]:
    spec = _specs()["draw"]
    return [
        for_dtype(spec, dtype, f"{spec.name}_{dtype}", [("T", dtype), *_TEMPLATE])
        for dtype in ("float32", "bfloat16", "float16")
    ]
