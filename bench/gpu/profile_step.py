"""Where a decode step's time goes on the GPU: kernels a step and GPU busy time, from
CUPTI (through torch.profiler, in the same process as MLX), against the step's wall
time in a pipelined loop like the worker's.

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/profile_step.py --model 8b --quant q4 --batches 1,8,32 \\
        --variants kernel,mlx --out $OUT/profile-8b-q4.json

Variants (``VARIANTS``) switch the decode attention of the engine's GPU step
(``FusedDecodeStep.attention_kernel``: engine/backends/cuda/attention/decode.py's kernel, or MLX's SDPA
without a mask and grouped matmuls under one, engine/model/attention.py) and the plans of
its products (engine/backends/cuda/linear.py: MLX's matmuls, or engine/backends/cuda/products/gemv.py's kernels up
to some row count). Rows are ragged (different lengths, as the server's batch has)
except at B=1.

For each (variant, B): ``wall`` = median step of the pipelined loop (build step i+1,
``mx.async_eval``, read step i's tokens); ``build`` = Python building the graph;
``enqueue`` = the ``mx.async_eval`` call (MLX encoding the graph into CUDA graphs and
launching them, on this thread); then a profiled run of the same loop: kernels per
step, summed kernel time per step, GPU busy time (the union of kernel intervals) per
step, and the top kernels. busy/wall near 1: the GPU is the limit; well below 1:
the host is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_decode import build_batch, build_model, prefill_row, ragged_lengths  # noqa: E402
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda.attention import decode as gpu_attention  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.sampler import sample_batch  # noqa: E402

now = time.perf_counter

# name -> (attention kernel, float plan, quantized plan)
# suffixes: "-nojoint" = q and k through two RoPE calls (FusedDecodeStep.joint_rope
# off); "-mt1"/"-mt2" = engine/backends/cuda/products/mma.py's blocks capped at 1/2 m-tiles; "-norm" = the RMSNorms inside qkv's and gate_up's products
# (FusedDecodeStep.fold_norm, off by default: measured slower); "-noapp" = RoPE and the
# KV write as separate ops (FusedDecodeStep.rope off);
# "-2pass" = split attention merged by a second kernel (MARKBASE_GPU_ATTN_TWO_PASS);
# "-at<shape>" = the attention kernel's loop shape (gpu_attention.LoopShape.parse, e.g.
# "-atl16u2v"; bench/gpu/attn_bench.py times the kernel alone); "-pin" = the product
# kernels with PIN (gpu_mma.pin_loads: every load of an iteration before its MMAs);
# "-qn1" = the RMSNorms inside the 1-row kernels (MARKBASE_GPU_QSTREAM_NORM=1); "-qe" =
# their first weight loads before x's conversion (MARKBASE_GPU_QSTREAM_EARLY); "-pf<MB>"
# = engine/backends/cuda/prefetch.py beside each one-row attention (o_proj and MB of gate/up);
# both engine defaults, but here on only with their suffix (so the engine as served at
# one row is "default-wc-qe-pf12"); "-ds" = the rows' offsets
# and starts copied to device memory at 1-2 rows (MARKBASE_GPU_DEVICE_SCALARS=1); "-wc" =
# the whole step under one mx.compile (FusedDecodeStep.step_compile; an engine
# default, but here only variants with "-wc" compile, so that "default" stays the
# uncompiled baseline); "-ql" = a layer's products after the attention as one
# kernel at one row (engine/backends/cuda/products/qlayer.py, FusedDecodeStep.qlayer,
# MARKBASE_GPU_QSTREAM_LAYER=1); "-ql2" = with the next layer's RMSNorm + q/k/v product
# inside it too (MARKBASE_GPU_QSTREAM_LAYER=2); "-ql3" = the attention too: one kernel a
# layer (engine/backends/cuda/products/qblock.py, MARKBASE_GPU_QSTREAM_LAYER=3)
VARIANTS = {
    "default": (True, None, None),  # what the engine does (engine/backends/cuda/linear.py defaults)
    "mlx": (False, "1:xwt", "1:qmm"),
    "kernel": (True, "1:xwt", "1:qmm"),
    "gemv8": (True, "1:xwt,2:gemv,9:xwt", "1:qgemv,9:qmm"),
    "gemv32": (True, "1:xwt,2:gemv,9:xwt", "1:qgemv,33:qmm"),
    "gemvall": (True, "1:gemv,9:xwt", "1:qgemv"),
    # engine/backends/cuda/products/mma.py's tensor-core kernels: from 2 rows, up to 32; and from 1 row
    "mma": (True, "1:xwt,2:mma,33:xwt", "1:qmm,2:qmma,33:qmm"),
    "mma16": (True, "1:xwt,2:mma,17:xwt", "1:qmm,2:qmma,33:qmm"),
    "s5": (True, "1:xwt", "1:qmm,2:qgemv,9:qmm"),  # the plans before the tensor-core products
    "mmaall": (True, "1:mma,33:xwt", "1:qmma,33:qmm"),
    "s6": (True, "1:xwt,2:mma,33:xwt", "1:qmm,2:qmma,33:qmm"),  # tensor-core products at 2-32 rows
    # 4-bit products of 33-128 rows as 32-row calls of the tensor-core kernel too
    "qmma128": (True, "1:mma,33:xwt", "1:qmma"),
    # bf16 products of 33-128 rows on the kernel too (one call; the folding at B=128)
    "mma128": (True, "1:xwt,2:mma", None),
    # 4-bit products of 33+ rows on engine/backends/cuda/products/qgemm.py (x in shared memory)
    "qgemm": (True, None, "1:qstream,2:qmma,33:qgemm"),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def pipelined(runner, batch, samplers, first, steps: int):
    y = mx.array(first, dtype=mx.int32)
    nxt = sample_batch(runner.decode(batch, y), samplers)
    mx.async_eval(nxt)
    wall, build, enq = [], [], []
    t = now()
    for _ in range(steps):
        y = nxt
        t0 = now()
        nxt = sample_batch(runner.decode(batch, y), samplers)
        t1 = now()
        mx.async_eval(nxt)
        t2 = now()
        y.tolist()
        t3 = now()
        build.append(t1 - t0)
        enq.append(t2 - t1)
        wall.append(t3 - t)
        t = t3
    nxt.tolist()
    med = statistics.median
    return dict(wall_ms=med(wall) * 1e3, build_ms=med(build) * 1e3, enqueue_ms=med(enq) * 1e3)


def kernel_stats(trace_path: Path, steps: int) -> dict:
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    ks = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not ks:
        return dict(kernels_per_step=0)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    by = defaultdict(lambda: [0, 0.0])
    for e in ks:
        name = e["name"][:90]
        by[name][0] += 1
        by[name][1] += e["dur"]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:14]
    # the host side: CUDA runtime/driver calls (a synchronisation or an allocation in
    # the middle of a step shows here), and the idle stretches between kernels
    api = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            api[e["name"][:60]][0] += 1
            api[e["name"][:60]][1] += e["dur"]
    api_top = sorted(api.items(), key=lambda kv: -kv[1][1])[:8]
    gaps = [s - e for (_, e), (s, _) in zip(spans, spans[1:]) if s - e > 20]
    return dict(
        kernels_per_step=len(ks) / steps,
        kernel_us_per_step=sum(e["dur"] for e in ks) / steps,
        busy_us_per_step=busy / steps,
        span_us_per_step=(spans[-1][1] - spans[0][0]) / steps,
        top=[dict(name=n, per_step=c / steps, us_per_step=d / steps) for n, (c, d) in top],
        api_top=[dict(name=n, per_step=c / steps, us_per_step=d / steps) for n, (c, d) in api_top],
        gaps_over_20us=dict(
            per_step=len(gaps) / steps, us_per_step=sum(gaps) / steps, largest_us=sorted(gaps)[-5:]
        ),
    )


def profiled(runner, batch, samplers, first, steps: int, trace_path: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pipelined(runner, batch, samplers, first, steps)
        mx.synchronize()
    prof.export_chrome_trace(str(trace_path))
    return kernel_stats(trace_path, steps + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--variants", default="kernel,mlx", help=f"some of {list(VARIANTS)}")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--time-limit-s", type=float, default=100)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = now()
    cfg = CONFIGS[args.model]
    model = build_model(cfg, args.quant)
    runner = ModelRunner(model)
    step = runner.decode_step
    log(
        f"[{args.model} {args.quant}] built in {now() - t_start:.1f} s; step "
        f"{type(step).__name__}, attention kernel {getattr(step, 'attention_kernel', None)}"
    )
    prompt = [(i * 104729 + 7) % cfg["vocab_size"] for i in range(args.prompt)]
    layer_kv, first = prefill_row(runner, prompt)
    from bench_decode import greedy_samplers

    rows = []
    from engine.backends.cuda import linear as gpu_linear

    kernel_ok = bool(getattr(step, "attention_kernel", False))
    rope_table = getattr(step, "rope", None)  # the append form, when the step has one
    variants = [v for v in args.variants.split(",") if v]
    if not kernel_ok:  # no CUDA (a CPU dry run) or a shape the kernel does not take
        variants = [v for v in variants if not VARIANTS[v.split("-")[0]][0]] or variants[:1]
    # suite.sh: engine/backends/cuda/products/mma.py failed its tests
    if os.environ.get("MARKBASE_NO_MMA"):
        variants = [v for v in variants if not v.startswith(("mma", "s6", "qmma"))] or variants[:1]
    for rep in range(args.repeat):
        for b in [int(x) for x in args.batches.split(",") if x]:
            lengths = ragged_lengths(args.prompt, b) if b > 1 else [args.prompt]
            order = variants if rep % 2 == 0 else variants[::-1]
            for v in order:
                if now() - t_start > args.time_limit_s:
                    log(f"B={b} {v}: time limit reached")
                    continue
                attn_kernel, float_text, quant_text = VARIANTS[v.split("-")[0]]
                step.attention_kernel = attn_kernel and kernel_ok
                if hasattr(step, "joint_rope"):
                    step.joint_rope = "-nojoint" not in v
                if hasattr(step, "rope"):
                    step.rope = None if "-noapp" in v else rope_table
                if hasattr(step, "step_compile"):  # a fresh trace cache per variant
                    step.step_compile = "-wc" in v and step.rope is not None
                    step._whole = mx.compile(step._whole_step) if step.step_compile else None
                # the 1-row kernels with the RMSNorm inside (the routes are rebuilt by
                # reset_plans below, and read this when they are)
                os.environ["MARKBASE_GPU_QSTREAM_NORM"] = "1" if "-qn1" in v else "0"
                os.environ["MARKBASE_GPU_QSTREAM_EARLY"] = "1" if "-qe" in v else "0"
                # engine/backends/cuda/prefetch.py, its MB of gate/up
                pf = re.search(r"-pf(\d*)", v)
                if hasattr(step, "l2_prefetch"):
                    step.l2_prefetch = pf is not None
                if pf and pf.group(1):
                    os.environ["MARKBASE_GPU_L2_PREFETCH_MB"] = pf.group(1)
                else:
                    os.environ.pop("MARKBASE_GPU_L2_PREFETCH_MB", None)
                at = re.search(r"-at([a-z0-9]+)", v)  # none: the automatic shapes
                shape = gpu_attention.LoopShape.parse(at.group(1)) if at else None
                gpu_attention.set_loop_shape(shape)
                from engine.backends.cuda.products import mma as gpu_mma

                gpu_mma.set_max_m_tiles(1 if "-mt1" in v else 2 if "-mt2" in v else None)
                gpu_linear.reset_plans()
                gpu_linear.set_plans(float_text, quant_text)
                try:
                    batch, _ = build_batch(runner, layer_kv, lengths)
                    samplers = greedy_samplers(b)
                    t = now()
                    pipelined(runner, batch, samplers, [first] * b, 4)
                    warm_s = now() - t
                    r = pipelined(runner, batch, samplers, [first] * b, args.steps)
                except Exception:
                    log(f"B={b} {v} FAILED:\n{traceback.format_exc()}")
                    rows.append(dict(batch=b, variant=v, error=traceback.format_exc()[-1500:]))
                    continue
                if not args.no_profile and rep == 0:
                    path = Path(f"/tmp/trace-{args.model}-{args.quant}-{b}-{v}.json")
                    try:
                        r.update(profiled(runner, batch, samplers, [first] * b,
                                          args.profile_steps, path))  # fmt: skip
                    except Exception:
                        log(f"profiler failed, no more profiles:\n{traceback.format_exc()}")
                        args.no_profile = True
                del batch
                r.update(batch=b, variant=v, rep=rep, tok_s=b / r["wall_ms"] * 1e3, warm_s=warm_s)
                rows.append(r)
                line = (
                    f"B={b:3d} {v:7s} rep {rep}: {r['tok_s']:8.0f} tok/s  wall {r['wall_ms']:.3f} ms"
                    f"  build {r['build_ms']:.3f}  enqueue {r['enqueue_ms']:.3f}"
                )
                if "kernels_per_step" in r and r["kernels_per_step"]:
                    line += (
                        f"  | kernels/step {r['kernels_per_step']:.0f}, kernel sum "
                        f"{r['kernel_us_per_step'] / 1e3:.3f} ms, busy "
                        f"{r['busy_us_per_step'] / 1e3:.3f} ms"
                    )
                log(line)
                for k in r.get("top", [])[:10]:
                    log(f"      {k['us_per_step']:8.1f} us {k['per_step']:6.1f}x  {k['name']}")
                mx.clear_cache()
                if args.out:
                    Path(args.out).write_text(json.dumps(dict(
                        model=args.model, quant=args.quant, rows=rows), indent=1))  # fmt: skip
    step.attention_kernel = kernel_ok
    gpu_linear.reset_plans()
    from engine.backends.cuda.products import mma as gpu_mma

    gpu_mma.set_max_m_tiles(None)


if __name__ == "__main__":
    main()
