"""engine/backends/cuda/products/qgemm.py's launch geometry and pipeline depth, product by product, against
engine/backends/cuda/products/mma.py's kernel (qmma): which knob moves a 4-bit product of 64-256 rows.

Why: qgemm's 3-stage form measured 0.82-0.90x qmma's time a layer (H100, 2026-12-05), but
its gate/up product at 128 rows still ran ~5,000 cycles a k-step a block where shared
memory reads bound it at ~2,000 and the MMAs at ~1,500. Which of
block rows, warps a block (blocks an SM) and stages matters decides the next design.

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/qgemm_sweep.py --out $OUT/qgemm_sweep.json

The stream-K form (``--forms r:2:0,s:2:0``): each call is its own
``mx.eval`` (``cupti_us``), so no two calls share its tile counters at once.

Each row: one product (8b/1b llama shapes: fused qkv, o_proj + residual, gate/up with
SwiGLU, down_proj + residual) at ``rows`` rows, us a call (median of ``--reps`` runs of
``--calls`` calls over 3 weight copies, so L2 holds none of them), TFLOP/s, and the
time over qmma's. On a CPU (``--models tiny``) it only lists the geometries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from q4_bench import cupti_us, products  # noqa: E402  (the layer's products, as the step has them)
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda.products import qgemm as gpu_qgemm  # noqa: E402

GS = 64
# (x rows a block, warps a block, m-tiles a warp); 128 rows with 2 m-tiles a warp spills
GEOMETRIES = [(64, 4, 1), (64, 8, 1), (128, 4, 1), (128, 8, 1), (64, 4, 2), (64, 8, 2)]


def timed(fn, inputs_list, calls: int, reps: int) -> float:
    """Median seconds of one kernel of ``fn`` over rotating inputs, from CUPTI's kernel
    durations. Why not wall time over a batch of calls: the calls are independent, and
    MLX's CUDA graph may run them side by side, which made the small grids (64 blocks:
    o_proj/down_proj) look ~2x faster than in the engine's step."""
    mx.eval(fn(inputs_list[0]))
    state = {"i": 0}

    def one():
        state["i"] += 1
        return fn(inputs_list[state["i"] % len(inputs_list)])

    durs = []
    for _ in range(reps):
        durs += cupti_us(one, calls, "custom_kernel_mb_")
    return statistics.median(durs) * 1e-6 if durs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument(
        "--forms",
        default="",
        help="instead of --stages x GEOMETRIES: the default geometry in these forms, "
        "comma-separated pipeline:stages:blocks-an-SM, pipeline r (weights in registers), "
        "w (in shared memory, MARKBASE_GPU_QGEMM_WS) or s (registers, the stream-K grid: "
        "MARKBASE_GPU_QGEMM_SK), e.g. r:2:0,s:2:0,w:3:0,w:3:3; a 4th field: "
        "MARKBASE_GPU_QGEMM_ABL's parts left out (timing only), e.g. r:2:0:2; a 5th: "
        "w8 for 8 warps a block of the 2-m-tile geometry (MARKBASE_GPU_QGEMM_PAIR_WARPS), "
        "e.g. s:2:0:0:w8",
    )
    ap.add_argument("--products", default="", help="only these (qkv,o,gate_up,down,lm_head)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-limit-s", type=float, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    on_gpu = mx.cuda.is_available()
    t0 = time.perf_counter()
    rows_out = []
    print("| model | product | rows | form | us | TFLOP/s | / qmma |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name in [m for m in args.models.split(",") if m]:
        cfg = CONFIGS[name]
        for pname, n, k, residual, glu in products(cfg, head=True):  # lm_head when asked
            if pname not in (args.products or "qkv,o,gate_up,down").split(","):
                continue
            weights = []
            if on_gpu:
                for _ in range(3):
                    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
                    weights.append(mx.quantize(w, group_size=GS, bits=4))
                mx.eval(weights)
            for rows in [int(r) for r in args.rows.split(",") if r]:
                if time.perf_counter() - t0 > args.time_limit_s:
                    print(f"time limit reached at {name} {pname} {rows}")
                    break
                shapes = [(bm, wm, mt) for bm, wm, mt in GEOMETRIES if (n // 16) % (wm * mt) == 0]
                if not on_gpu:
                    print(
                        f"| {name} | {pname} | {rows} | geometries {shapes} "
                        f"(default {gpu_qgemm.geometry(rows, n // 16)}) | | | |"
                    )
                    continue
                from engine.backends.cuda.products import mma as gpu_mma

                x = mx.random.normal((rows, k)).astype(mx.bfloat16) * 0.1
                extra = [mx.zeros((rows, n), dtype=mx.bfloat16)] if residual else []
                inputs = [[x, *wsb, *extra] for wsb in weights]
                flop = 2.0 * rows * n * k
                qmma = gpu_mma.launcher("q4", mx.bfloat16, rows, n, k, GS, residual, glu)
                base = timed(qmma, inputs, args.calls, args.reps)
                forms = [("qmma", base)]
                for st in [s for s in args.stages.split(",") if s and not args.forms]:
                    os.environ[gpu_qgemm.STAGES_ENV] = st
                    for bm, wm, mt in shapes:
                        fn = gpu_qgemm._launch(mx.bfloat16, rows, n, GS, residual, glu, bm, wm, mt)
                        us = timed(fn, inputs, args.calls, args.reps)
                        forms.append((f"qgemm bm{bm} w{wm} mt{mt} st{st}", us))
                for form in [f for f in args.forms.split(",") if f]:
                    pipe, st, blocks, *more = form.split(":")
                    os.environ[gpu_qgemm.STAGES_ENV] = st
                    os.environ[gpu_qgemm.LB_ENV] = blocks
                    pw = more[1][1:] if len(more) > 1 else str(gpu_qgemm.PAIR_WARPS)
                    os.environ[gpu_qgemm.PAIR_WARPS_ENV] = pw
                    bm, wm, mt = gpu_qgemm.geometry(rows, n // 16)
                    try:
                        fn = gpu_qgemm._launch(
                            mx.bfloat16, rows, n, GS, residual, glu, bm, wm, mt, pipe == "s", k
                        )
                        us = timed(fn, inputs, args.calls, args.reps)
                    except Exception as e:  # a form that does not launch (resources)
                        print(f"{form}: {e}")
                        us = float("nan")
                    forms.append((f"qgemm bm{bm} w{wm} mt{mt} {form}", us))
                envs = (gpu_qgemm.STAGES_ENV, gpu_qgemm.LB_ENV, gpu_qgemm.PAIR_WARPS_ENV)
                for env in envs:
                    os.environ.pop(env, None)
                for form, s in forms:
                    print(
                        f"| {name} | {pname} | {rows} | {form} | {s * 1e6:.1f} | "
                        f"{flop / s / 1e12:.0f} | {s / base:.2f} |"
                    )
                    rows_out.append(
                        dict(
                            model=name,
                            product=pname,
                            rows=rows,
                            form=form,
                            us=s * 1e6,
                            tflops=flop / s / 1e12,
                            vs_qmma=s / base,
                        )
                    )
            del weights
    if args.out:
        Path(args.out).write_text(json.dumps(dict(engine="qgemm-sweep", rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
