"""The prefill attention kernel alone (engine/backends/cuda/attention/prefill.py), per form,
against MLX's own attention in the same process.

    python3 bench/gpu/prefill_attn_bench.py [--out FILE]

Causal attention of one 2048-token chunk, fresh (S = L) and after a 2048-token cached
prefix (S = 2L), at the 1b and 8b shapes (bench/gpu/shapes.py: 32 query heads, 8 KV
heads, head dim 64 / 128), bf16. Prints ms a layer and TFLOP/s (causal FLOPs: 4 L D
Hq (S - L/2)). MLX's attention is whatever this process has: with
MLX_CUDA_USE_CUDNN_SDPA=0 (what markbase sets) its unfused fallback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from engine.backends.cuda.attention import prefill as pa  # noqa: E402

FORMS = {"2-ldm": ("2", "1"), "1-ldm": ("1", "1"), "2-lds": ("2", "0"), "1-lds": ("1", "0")}


def timed(fn, reps: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lq = a.length
    rows = []
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, cuDNN SDPA env: "
        f"{os.environ.get('MLX_CUDA_USE_CUDNN_SDPA')}"
    )
    print("| shape | S | form | ms | TFLOP/s | vs mlx |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, d in (("1b", 64), ("8b", 128)):
        for s in (lq, 2 * lq):
            mx.random.seed(0)
            q = mx.random.normal((1, 32, lq, d)).astype(mx.bfloat16)
            k = mx.random.normal((1, 8, s, d)).astype(mx.bfloat16)
            v = mx.random.normal((1, 8, s, d)).astype(mx.bfloat16)
            mx.eval(q, k, v)
            flops = 4 * lq * d * 32 * (s - lq / 2)
            base = None
            for form in ("mlx", *(FORMS if mx.cuda.is_available() else ())):
                if form == "mlx":  # its causal mask is aligned to the keys' end, as ours
                    fn = partial(
                        mx.fast.scaled_dot_product_attention, q, k, v, scale=d**-0.5, mask="causal"
                    )
                else:
                    os.environ[pa.STAGES_ENV], os.environ[pa.LDM_ENV] = FORMS[form]
                    fn = partial(pa.prefill_attention, q, k, v, d**-0.5)
                t = timed(fn, a.reps)
                base = base or t
                rows.append(dict(shape=name, s=s, form=form, ms=t * 1e3, tflops=flops / t / 1e12))
                print(
                    f"| {name} | {s} | {form} | {t * 1e3:.3f} | {flops / t / 1e12:.1f} | "
                    f"{base / t:.2f}x |",
                    flush=True,
                )
    if a.out:
        Path(a.out).write_text(json.dumps(dict(engine="prefill-attn", rows=rows), indent=1))


if __name__ == "__main__":
    main()
