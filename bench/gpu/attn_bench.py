"""The decode attention kernel alone, per loop shape: GPU time a call and the KV read
rate, for the shapes of the engine table (on the GPU machine, docs/gpu-development.md).

Why: a whole-step profile takes ~2 minutes of GPU time per variant and config;
this times only engine/backends/cuda/attention/decode.py's append form (what the decode step calls),
with CUPTI (torch.profiler in the same process), so a dozen loop shapes take about a
minute. Each "step" is one call per layer over that layer's own cache buffers (so the
KV comes from HBM, not L2, as in the engine), each call's q/k/v made from the previous
call's output (one small concatenation kernel between, so that the calls run one after
another as in a step, not side by side).

    python3 bench/gpu/attn_bench.py --shapes 8b:128:512,8b:1:600 \\
        --variants l32u4,l32u8v,l16u2v --out $OUT/attn.json

Variants are ``LoopShape.parse`` strings (l = lanes a position, u = positions in
flight a lane, v = vector loads, p = fewest positions a block, w = warps a block,
m = the last block merges the splits through shared memory), or
``auto`` (gpu_attention.auto_shape's choice per launch, the default; the environment
must set no MARKBASE_GPU_ATTN_* for it), or ``tcw4k16``: the automatic shapes with the
unsplit launches on tensor cores (engine/backends/cuda/attention/decode_tc.py; w warps a block, k keys
a tile, g stages: tiles in flight a warp + 1), ``tcsw8k16``: the split launches too (w,
g: the split form's), ``tcmw8k16``: the split form over several blocks a (row, KV head)
(MARKBASE_GPU_ATTN_TC_MULTI; ``p256``: ~256 positions a block), never picked for
``--env``. ``auto`` and the loop shapes run on CUDA cores only (the tensor-core forms
are off for them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from q4_bench import cupti_us  # noqa: E402
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda.attention import decode as gpu_attention  # noqa: E402
from engine.backends.cuda.attention import decode_tc as gpu_attention_tc  # noqa: E402


def build(model: str, batch: int, length: int, dtype):
    cfg = CONFIGS[model]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // hq
    layers = cfg["num_hidden_layers"]
    cap = length + 64
    k = [mx.random.normal((batch, hkv, cap, d)).astype(dtype) for _ in range(layers)]
    v = [mx.random.normal((batch, hkv, cap, d)).astype(dtype) for _ in range(layers)]
    qkv = mx.random.normal((batch, (hq + 2 * hkv) * d)).astype(dtype)
    # ragged rows as the engine has them: starts spread over the first quarter
    start = mx.array([(i * 37) % max(1, length // 4) for i in range(batch)], dtype=mx.int32)
    pos = length - 1 - start
    mx.eval(k, v, qkv, start, pos)
    rope = gpu_attention.rope_table(nn.RoPE(d, base=500000.0), d)
    return dict(hq=hq, hkv=hkv, d=d, k=k, v=v, qkv=qkv, start=start, pos=pos, rope=rope)


def step(m: dict, length: int):
    """One call per layer, each fed by the one before."""
    qkv = m["qkv"]
    b = qkv.shape[0]
    hq, d = m["hq"], m["d"]
    for i, (k, v) in enumerate(zip(m["k"], m["v"])):
        o = gpu_attention.decode_attention_append(
            qkv, k[:, :, :length], v[:, :, :length], m["start"], m["pos"], m["rope"],
            d**-0.5, hq, slot=i,
        )  # fmt: skip
        qkv = mx.concatenate([o.reshape(b, hq * d), m["qkv"][:, hq * d :]], axis=1)
    return qkv


def timed(m: dict, length: int, steps: int) -> dict:
    mx.eval(step(m, length))  # compile, warm
    t = time.perf_counter()
    for _ in range(steps):
        mx.eval(step(m, length))
    wall = (time.perf_counter() - t) / steps
    durs = cupti_us(lambda: step(m, length), steps, "mb_decode_attn")
    layers = len(m["k"])
    per_call = statistics.median(durs) if durs else float("nan")
    return dict(
        us_per_call=per_call,
        us_per_step=sum(durs) / steps if durs else float("nan"),
        calls_per_step=len(durs) / steps,
        wall_ms_per_step=wall * 1e3,
        layers=layers,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes", default="8b:128:512,8b:32:512,8b:8:600,8b:1:600,1b:128:512,1b:1:600"
    )
    ap.add_argument(
        "--variants",
        default="auto,l32u4,l32u8,l32u4v,l32u8v,l32u8vw4,l16u2v,l16u4v,l16u2vw4,l8u2v",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-limit-s", type=float, default=240)
    ap.add_argument("--out", default="")
    ap.add_argument("--env", default="", help="write the best shape as MARKBASE_GPU_ATTN_* exports")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    t0 = time.perf_counter()
    rows = []
    for shape in args.shapes.split(","):
        model, batch, length = shape.split(":")
        batch, length = int(batch), int(length)
        m = build(model, batch, length, dtype)
        kv_bytes = batch * m["hkv"] * length * m["d"] * 2 * dtype.size
        for name in args.variants.split(","):
            if time.perf_counter() - t0 > args.time_limit_s:
                print(f"{shape} {name}: time limit reached", flush=True)
                continue
            auto = name == "auto"  # auto_shape's choice per launch
            tc = gpu_attention_tc
            if name.startswith("tc"):  # tensor cores: "tcw4k16" unsplit, "tcsw8k16" split too
                knobs = dict(re.findall(r"([wkgp])(\d+)", name[3:]))
                multi = name.startswith("tcm")  # the split form over several blocks
                split = name.startswith("tcs") or multi
                os.environ[tc.WARPS_ENV] = "4" if split else knobs.get("w", "4")
                os.environ[tc.SPLIT_WARPS_ENV] = knobs.get("w", "8")
                os.environ[tc.BK_ENV] = knobs.get("k", "16")
                os.environ[tc.STAGES_ENV] = "2" if split else knobs.get("g", "2")
                os.environ[tc.SPLIT_STAGES_ENV] = knobs.get("g", "2")
                os.environ[tc.SPLIT_ENV] = "1" if split else "0"
                gpu_attention.set_loop_shape(
                    gpu_attention.LoopShape(ppb=int(knobs["p"]), tc=True, tc_split=True)
                    if "p" in knobs
                    else None
                )
                os.environ[tc.ENV] = "1"
            else:  # CUDA cores only (the tensor-core forms are the default)
                os.environ[tc.ENV] = "0"
                os.environ[tc.SPLIT_ENV] = "0"
                gpu_attention.set_loop_shape(None if auto else gpu_attention.LoopShape.parse(name))
            try:
                r = timed(m, length, args.steps)
            except Exception as e:  # a variant that does not compile or run: go on
                print(f"{shape} {name}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            r.update(shape=shape, variant=name, tb_s=kv_bytes / (r["us_per_call"] * 1e-6) / 1e12)
            rows.append(r)
            print(
                f"{shape:>12} {name:>12}: {r['us_per_call']:8.1f} us a call "
                f"({r['tb_s']:.2f} TB/s of KV), {r['us_per_step'] / 1e3:.2f} ms a step "
                f"of {r['layers']} layers, wall {r['wall_ms_per_step']:.2f} ms",
                flush=True,
            )
        del m
        mx.clear_cache()
    gpu_attention.set_loop_shape(None)
    os.environ.pop(gpu_attention_tc.ENV, None)
    os.environ.pop(gpu_attention_tc.SPLIT_ENV, None)
    best = pick([r for r in rows if not r["variant"].startswith("tc")])
    if args.out:
        doc = dict(stage="attn_bench", rows=rows, best=best)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if best and args.env and best["variant"] != "auto":
        shape = gpu_attention.LoopShape.parse(best["variant"])
        Path(args.env).write_text(
            f"export ATTN_BEST={best['variant']}\n"
            f"export MARKBASE_GPU_ATTN_LANES={shape.lanes}\n"
            f"export MARKBASE_GPU_ATTN_U={shape.u}\n"
            f"export MARKBASE_GPU_ATTN_VEC={int(shape.vec)}\n"
            f"export MARKBASE_GPU_ATTN_PPB={shape.ppb}\n"
            f"export MARKBASE_GPU_ATTN_WARPS={shape.warps}\n"
        )


def pick(rows: list[dict]) -> dict | None:
    """The variant whose time is nearest each shape's best over all shapes (geometric
    mean of time / best time), among those measured at every shape."""
    import math

    shapes = {r["shape"] for r in rows}
    best_at = {s: min(r["us_per_call"] for r in rows if r["shape"] == s) for s in shapes}
    scores = {}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        if {r["shape"] for r in mine} != shapes:
            continue
        logs = [math.log(r["us_per_call"] / best_at[r["shape"]]) for r in mine]
        scores[name] = math.exp(sum(logs) / len(logs))
    if not scores:
        return None
    name = min(scores, key=scores.get)
    print("score (geometric mean of time / the shape's best):", flush=True)
    for n, sc in sorted(scores.items(), key=lambda kv: kv[1]):
        print(f"  {n:>14} {sc:.3f}", flush=True)
    return dict(variant=name, score=scores[name], scores=scores)


if __name__ == "__main__":
    main()
