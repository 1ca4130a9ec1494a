"""4-bit products of one row (the single-stream decode step) on engine/backends/cuda/products/mma.py's
kernel, per launch shape: GPU time a call and the weight read rate (on the GPU
machine, docs/gpu-development.md).

Why: at 8b 4-bit B=1 the products are 2.56 ms of a 3.5 ms step and read their
weights at ~1.65 TB/s (H200, 2026-12-03). This times each of a layer's
products as the decode step calls them (qkv; o_proj and down_proj with the residual;
gate_up with the SwiGLU) with CUPTI, over distinct weight copies (from HBM, not L2),
one call after another, for variants of the loads in flight a lane (u), warps a
block (w), with PIN (p1: every load of an iteration before its first MMA; without
it ptxas sinks later loads below earlier MMAs) and XL (x1: x read where used, not
held in registers from the weight's loads on).

    python3 bench/gpu/q4_bench.py --model 8b --variants u2w8,u4w8,u2w16 --out $OUT/q4.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda.products import mma as gpu_mma  # noqa: E402
from engine.backends.cuda.products import qstream as gpu_qstream  # noqa: E402

GS = 64


def products(cfg: dict, head: bool = False) -> list[tuple[str, int, int, bool, bool]]:
    """(name, N weight rows, K, residual, glu) of one layer, as the decode step has them;
    with ``head``, the output layer (``lm_head``) too."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    out = [
        ("qkv", h + 2 * kv, h, False, False),
        ("o", h, h, True, False),
        ("gate_up", 2 * f, h, False, True),
        ("down", h, f, True, False),
    ]
    return out + ([("lm_head", cfg["vocab_size"], h, False, False)] if head else [])


def weights(n: int, k: int, copies: int):
    out = []
    for _ in range(copies):
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=GS, bits=4)
        mx.eval(wq, s, b)
        out.append((wq, s, b))
    return out


def run(x, ws, n: int, k: int, residual: bool, glu: bool, stream: bool = False, norm=None):
    """One call per weight copy, each fed by the one before (``stream``: on
    engine/backends/cuda/products/qstream.py's kernel, else engine/backends/cuda/products/mma.py's; ``norm``: the RMSNorm's
    weight and epsilon inside the call)."""
    outs = []
    for wq, s, b in ws:
        if stream:
            call = gpu_qstream.launcher(mx.bfloat16, n, k, GS, residual, glu, norm is not None)
        else:
            call = gpu_mma.launcher("q4", mx.bfloat16, 1, n, k, GS, residual, glu)
        ins = [x, wq, s, b] + ([x[:, :n]] if residual else [])
        ins += list(norm) if norm is not None else []
        y = call(ins)
        outs.append(y)
        x = x + (y[:, :1] * 0).astype(x.dtype)  # an order between the calls
    return outs


def layer_tail(cfg: dict, copies: int, steps: int) -> list[dict]:
    """A layer's tail after the attention (o_proj + residual, RMSNorm, gate_up + SwiGLU,
    down_proj + residual) over ``copies`` layers' weights, each fed by the one before:
    as the step runs it now (three engine/backends/cuda/products/qstream.py kernels and MLX's RMSNorm; and
    with the norm inside gate_up's kernel) against engine/backends/cuda/products/qlayer.py's one kernel.
    GPU time a layer: the sum of every kernel's, and first start to last end."""
    from engine.backends.cuda.products import qlayer as gpu_qlayer

    class Q:
        def __init__(self, n, k):
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
            self.weight, self.scales, self.biases = mx.quantize(w, group_size=GS, bits=4)
            self.group_size, self.bits, self.mode = GS, 4, "affine"
            mx.eval(self.weight, self.scales, self.biases)

    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    layers = [
        (Q(d, d), Q(2 * f, d), Q(d, f), mx.ones((d,), dtype=mx.bfloat16)) for _ in range(copies)
    ]
    x0 = mx.random.normal((1, d)).astype(mx.bfloat16)

    def qmm(q, v, **kw):
        return gpu_qstream.quantized_matmul(v, q.weight, q.scales, q.biases, GS, **kw)

    def separate(norm_inside: bool):
        x = x0
        for wo, wgu, wd, nw in layers:
            h = qmm(wo, x, residual=x)
            if norm_inside:
                z = qmm(wgu, h, glu=True, norm=(nw, 1e-5))
            else:
                z = qmm(wgu, mx.fast.rms_norm(h, nw, 1e-5), glu=True)
            x = qmm(wd, z, residual=h)
        return x

    def one_kernel():
        x = x0
        for i, (wo, wgu, wd, nw) in enumerate(layers):
            x = gpu_qlayer.post(x, x, wo, wgu, wd, nw, 1e-5, slot=i)
        return x

    # with the next layer's RMSNorm + q/k/v product as the kernel's fourth phase,
    # against the same product as its own kernel (norm inside) after each tail
    kv = cfg["num_key_value_heads"] * (d // cfg["num_attention_heads"])
    wqkv = [Q(d + 2 * kv, d) for _ in range(copies)]

    def with_qkv(one: bool):
        x, outs = x0, []
        for i, (wo, wgu, wd, nw) in enumerate(layers):
            if one:
                x, q = gpu_qlayer.post(x, x, wo, wgu, wd, nw, 1e-5, slot=i,
                                       next_qkv=(wqkv[i], nw, 1e-5))  # fmt: skip
            else:
                x = gpu_qlayer.post(x, x, wo, wgu, wd, nw, 1e-5, slot=i)
                q = qmm(wqkv[i], x, norm=(nw, 1e-5))
            outs.append(q)
            x = x + (q[:, :1] * 0).astype(x.dtype)  # the next layer after q, as in a step
        return [x, *outs]

    rows = []
    for name, fn in (("separate", lambda: separate(False)), ("norm-in", lambda: separate(True)),
                     ("one-kernel", one_kernel), ("+qkv apart", lambda: with_qkv(False)),
                     ("+qkv inside", lambda: with_qkv(True))):  # fmt: skip
        mx.eval(fn())
        events = cupti_events(fn, steps)
        total = sum(e["dur"] for e in events) / (steps * copies)
        span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        span /= steps * copies
        rows.append(dict(product="tail", variant=name, us=total, span_us=span))
        print(f"tail {name:>10}: kernels {total:7.1f} us a layer, first start to last end "
              f"{span:7.1f} us (includes the gaps between the {steps} evaluations)",
              flush=True)  # fmt: skip
    if gpu_qlayer.timed_out():
        print("tail one-kernel: a barrier TIMED OUT (its numbers are wrong)", flush=True)
    return rows


def cupti_events(fn, steps: int) -> list[dict]:
    """Every kernel's CUPTI event (ts, dur in us) over ``steps`` evaluations of fn()."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            mx.eval(fn())
        mx.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    return [e for e in events if e.get("cat") == "kernel"]


def cupti_us(fn, steps: int, name_part: str) -> list[float]:
    """GPU time (us) of each kernel whose name holds ``name_part`` over ``steps``
    evaluations of ``fn()``, from CUPTI (torch.profiler in this process; also used by
    attn_bench.py)."""
    return [e["dur"] for e in cupti_events(fn, steps) if name_part in e.get("name", "")]


def parse_stream(name: str) -> dict | None:
    """``"mma"``/``"qs"``/``"qi"``: engine/backends/cuda/products/qstream.py's tensor-core / float CUDA-core
    / integer CUDA-core form with its defaults; ``"mma3w8"``: 3 slots a lane, 8 warps a
    block; ``"qi8c1"``: 8 slots of 1 chunk each; a trailing ``n`` (``"qin"``): qkv and
    gate_up with their RMSNorm inside; then ``e`` (``"qie"``): the first loads before x's
    conversion (``early``); then ``a`` (``"qia"``, ``"qiea"``): the stream without the
    math (``abl``: is the kernel issue-bound?); None for a name of engine/backends/cuda/products/mma.py's
    kernel."""
    m = re.fullmatch(r"(qs|qi|mma)(\d*)(?:w(\d+))?(?:c(\d+))?(n?)(e?)(a?)", name)
    if not m:
        return None
    return {
        "form": {"qs": "q4", "qi": "q4i", "mma": "mma"}[m[1]],
        "stages": int(m[2]) if m[2] else None,
        "warps": int(m[3]) if m[3] else None,
        "cps": int(m[4]) if m[4] else None,
        "norm": bool(m[5]),
        "early": True if m[6] else None,
        "abl": True if m[7] else None,
    }


def parse(name: str) -> tuple[dict, bool]:
    """``"u2w8"``: u 2, 8 warps; ``p1``: with PIN (every load before the first MMA);
    ``x1``: x read where used (``XL``)."""
    kw: dict = {"xl": "x1" in name}
    for key, num in re.findall(r"([uw])(\d+)", name):
        kw["u" if key == "u" else "warps"] = int(num)
    return kw, "p1" in name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--variants", default="qs,qi,qin,qi6,qi6n")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tail", action="store_true", help="also time a layer's tail as one kernel")
    ap.add_argument("--tail-only", action="store_true")
    ap.add_argument("--time-limit-s", type=float, default=150)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = CONFIGS[args.model]
    t0 = time.perf_counter()
    rows = []
    if args.tail or args.tail_only:
        rows += layer_tail(cfg, args.copies, args.steps)
    for name, n, k, residual, glu in [] if args.tail_only else products(cfg):
        ws = weights(n, k, args.copies)
        x = mx.random.normal((1, k)).astype(mx.bfloat16)
        nbytes = n * k // 2 + n * (k // GS) * 4
        for v in args.variants.split(","):
            if time.perf_counter() - t0 > args.time_limit_s:
                print(f"{name} {v}: time limit reached", flush=True)
                continue
            stream = parse_stream(v)
            norm = None
            if stream is not None:
                if stream.pop("norm") and not residual:  # qkv, gate_up
                    norm = (mx.ones((k,), dtype=mx.bfloat16), gpu_mma.device_scalar(1e-5))
                gpu_qstream.set_knobs(**stream)
            else:
                knobs, pin = parse(v)
                gpu_mma.set_q4_few_rows(**knobs)
            kernel = "mb_qstream" if stream is not None else "mb_mma_q4"
            try:
                args_ = (x, ws, n, k, residual, glu, stream is not None, norm)
                mx.eval(run(*args_))
                us = statistics.median(cupti_us(lambda a=args_: run(*a), args.steps, kernel))
            except Exception as e:  # a variant that does not compile or run: go on
                print(f"{name} {v}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            r = dict(product=name, variant=v, n=n, k=k, us=us, tb_s=nbytes / us / 1e6)
            rows.append(r)
            print(f"{args.model} {name:>8} {v:>6}: {us:7.1f} us ({r['tb_s']:.2f} TB/s)", flush=True)
        del ws
        mx.clear_cache()
    gpu_mma.set_q4_few_rows()
    gpu_qstream.set_knobs()
    # per variant: the layer's four products together
    layer = {}
    for r in rows:
        layer.setdefault(r["variant"], []).append(r["us"])
    for v, us in layer.items():
        if len(us) == 4:
            print(f"{args.model} layer {v:>6}: {sum(us):7.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(stage="q4_bench", rows=rows), indent=1))


if __name__ == "__main__":
    main()
