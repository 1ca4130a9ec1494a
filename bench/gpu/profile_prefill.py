"""Where a prefill's GPU time goes: kernels and GPU busy time of one prompt chunk (CUPTI,
through torch.profiler in the same process as MLX), per model, weights and route.

Why: a 2048-token prefill of the 1b model measured 14.2 ms in bf16 and 24.7 ms in 4-bit
with the dequantize route (H100, 2026-12-05), but the products alone
(``matmul_rows.py``) explain ~1.4 ms of that 10.5 ms; this names the rest.

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/profile_prefill.py --models 1b,8b --quants bf16,q4 --out $OUT/pp.json

Variants: ``default`` (as served: engine/backends/cuda/attention/prefill.py's kernel and, for
4-bit, engine/backends/cuda/prefill.py's route from 256 rows), ``qmm`` (4-bit: MLX's
``quantized_matmul`` at every row count), ``mlxattn`` (MLX's attention for prompts),
``unstaged`` / ``staged<N>`` (engine/backends/cuda/prefill_stages.py off / every N layers; the
default stages every 4). A variant may be named more than once, to interleave an A/B.
Each prints wall ms a chunk (median of ``--reps``, synchronised), then, profiled, the
kernels a chunk, the summed kernel time, the GPU busy time and the top kernels.
On a CPU (``--models tiny --no-profile``) it only checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_decode import build_model  # noqa: E402
from profile_step import kernel_stats  # noqa: E402
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda import prefill as gpu_prefill
from engine.backends.cuda import prefill_stages  # noqa: E402
from engine.backends.cuda.attention import prefill as gpu_prefill_attention
from engine.runner import ModelRunner  # noqa: E402

now = time.perf_counter
# default as served; staged<N> stages every N layers, unstaged none
# (engine/backends/cuda/prefill_stages.py); a variant may repeat to interleave A/B runs
VARIANTS = ("default", "qmm", "mlxattn", "unstaged", "staged<N>")
OFF = 1 << 30  # a row threshold no chunk reaches: the dequantize route off


def log(msg: str) -> None:
    print(msg, flush=True)


def known(variant: str) -> bool:
    return variant in VARIANTS or (variant.startswith("staged") and variant[6:].isdigit())


def set_variant(runner: ModelRunner, model, variant: str, env: dict) -> None:
    """Switch the routes in this process (each reads its switch per call or per
    install): the dequantize route's threshold, the prompt attention's route, and
    the layers between prefill stages."""
    runner.stage_every = prefill_stages.every_from_env()
    if variant == "unstaged":
        runner.stage_every = 0
    elif variant.startswith("staged"):
        runner.stage_every = int(variant[6:])
    gpu_prefill.install(
        model, min_rows=OFF if variant == "qmm" else gpu_prefill.min_rows_from_env()
    )
    if variant == "mlxattn":
        env["MARKBASE_GPU_PREFILL_ATTENTION"] = "mlx"
    else:
        env.pop("MARKBASE_GPU_PREFILL_ATTENTION", None)


def one_chunk(runner: ModelRunner, tokens: list[int]) -> None:
    kv = runner.new_sequence_kv()
    runner.prefill(kv, tokens, want_logits=True)
    mx.eval([c.keys for c in kv] + [c.values for c in kv])
    mx.synchronize()


def profiled(runner: ModelRunner, tokens: list[int], reps: int, trace: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            one_chunk(runner, tokens)
    prof.export_chrome_trace(str(trace))
    return kernel_stats(trace, reps)


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--quants", default="bf16,q4")
    ap.add_argument("--variants", default="default,qmm,mlxattn")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-limit-s", type=float, default=150)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = now()
    rows = []
    trace = Path(os.environ.get("TMPDIR", "/tmp")) / "profile_prefill_trace.json"
    for name in [m for m in args.models.split(",") if m]:
        cfg = CONFIGS[name]
        tokens = [(i * 7919 + 13) % cfg["vocab_size"] for i in range(args.tokens)]
        for quant in [q for q in args.quants.split(",") if q]:
            if now() - t_start > args.time_limit_s:
                log(f"[{name} {quant}] time limit reached")
                continue
            model = build_model(cfg, quant)
            runner = ModelRunner(model, fused_decode=False)
            for variant in [v for v in args.variants.split(",") if v]:
                if not known(variant):
                    raise SystemExit(f"unknown variant {variant!r}: want some of {VARIANTS}")
                if variant == "qmm" and quant == "bf16":
                    continue
                if now() - t_start > args.time_limit_s:
                    log(f"[{name} {quant}] {variant}: time limit reached")
                    continue
                set_variant(runner, model, variant, os.environ)
                t = now()
                one_chunk(runner, tokens)  # first call: JIT compiles
                first = now() - t
                one_chunk(runner, tokens)
                walls = []
                for _ in range(args.reps):
                    t = now()
                    one_chunk(runner, tokens)
                    walls.append(now() - t)
                row = dict(
                    model=name,
                    quant=quant,
                    variant=variant,
                    tokens=args.tokens,
                    first_s=first,
                    wall_ms=statistics.median(walls) * 1e3,
                    prompt_attention="kernel" if gpu_prefill_attention.enabled() else "mlx",
                )
                row["tok_s"] = args.tokens / row["wall_ms"] * 1e3
                msg = (
                    f"[{name} {quant}] {variant:8s} {row['tok_s']:9.0f} tok/s  "
                    f"{row['wall_ms']:7.2f} ms a chunk (first {first:.2f} s)"
                )
                if not args.no_profile:
                    row.update(profiled(runner, tokens, args.reps, trace))
                    msg += (
                        f" | kernels {row['kernels_per_step']:.0f}, kernel sum "
                        f"{row['kernel_us_per_step'] / 1e3:.2f} ms, busy "
                        f"{row['busy_us_per_step'] / 1e3:.2f} ms"
                    )
                log(msg)
                for k in row.get("top", [])[:10]:
                    log(f"    {k['us_per_step']:9.1f} us {k['per_step']:6.1f}x  {k['name']}")
                for k in row.get("api_top", [])[:6]:
                    log(f"    host {k['us_per_step']:9.1f} us {k['per_step']:6.1f}x  {k['name']}")
                if "gaps_over_20us" in row:
                    gp = row["gaps_over_20us"]
                    log(
                        f"    idle gaps >20 us: {gp['per_step']:.0f} a chunk, {gp['us_per_step']:.0f} us;"
                        f" largest {[round(x) for x in gp['largest_us']]}"
                    )
                rows.append(row)
            os.environ.pop("MARKBASE_GPU_PREFILL_ATTENTION", None)
            del runner, model
            mx.clear_cache()
    if args.out:
        Path(args.out).write_text(
            json.dumps([dict(engine="mlx", stage="prefill-profile", rows=rows)], indent=1)
        )


if __name__ == "__main__":
    main()
