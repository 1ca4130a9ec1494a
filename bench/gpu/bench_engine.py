"""The engine's own GPU changes, measured through the real code paths.

Runs on the GPU machine (docs/gpu-development.md; ``suite.sh engine-1b``):

    python3 bench/gpu/bench_engine.py ab --model 1b --quant bf16 --batches 1,8,32 --out ab.json
    python3 bench/gpu/bench_engine.py first-request --warmup off --out first-off.json
    python3 bench/gpu/bench_engine.py first-request --warmup on --out first-on.json

``ab``: ``engine.runner.ModelRunner.decode`` with the fused decode step
(``engine.model.decode_step``, what the engine uses now: ``ModelRunner(model)``) against
the same runner without it (``ModelRunner(model, fused_decode=False)``: the model's
own modules, as before), on one model in one process, interleaved (the order of
the two flips every repeat). Each measurement: a fresh ``BatchKV`` of B rows made
from one prefilled row (``equal``: all rows as long, no mask; ``ragged``: rows of
different lengths, an array mask, as the server's batch has), 4 warm-up steps, then
``--steps`` steps of ``runner.decode`` + ``sample_batch`` + ``mx.eval`` +
``.tolist()`` as ``ModelWorker._decode_step`` does them. The modules of the
unfused runner read views into the fused weights (the same memory).

``first-request``: one fresh process, the real ``EngineClient.from_loaded`` with
``EngineConfig.warmup`` on or off, then the first request (its time to first token
and total), a burst of 8 concurrent requests, and one more single request (the
warm reference). The process's PTX cache is whatever ``MLX_PTX_CACHE_DIR`` holds;
``suite.sh`` gives each run its own copy of the same cache.

CPU smoke run (tiny model, float32; ``--check`` also requires equal tokens):

    .venv/bin/python bench/gpu/bench_engine.py ab --model tiny --quant f32 --batches 1,3 \\
        --steps 8 --repeat 1 --check
    .venv/bin/python bench/gpu/bench_engine.py first-request --model tiny --quant f32 --warmup on
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_decode import (  # noqa: E402  (puts the repo root on sys.path)
    build_batch,
    build_model,
    engine_config,
    loaded_model,
    loop_markbase,
    prefill_row,
    ragged_lengths,
    randomize,
    summarize,
)
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda import linear as gpu_linear  # noqa: E402
from engine.model.decode_step import FusedDecodeStep, make_decode_step  # noqa: E402
from engine.platform import on_gpu  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402

now = time.perf_counter


def log(msg: str) -> None:
    print(msg, flush=True)


def meta(args) -> dict:
    return dict(
        engine="mlx-engine",  # report.py skips these; the log has the table
        mlx=mx.__version__,
        device=str(mx.default_device()),
        gpu=args.gpu_name,
        date=time.strftime("%Y-%m-%d"),
        model=args.model,
        quant=args.quant,
    )


def save(args, rows: list[dict], **extra) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta(args), rows=rows, **extra), indent=1))


def make_model(args):
    cfg = CONFIGS[args.model]
    model = build_model(cfg, args.quant)
    if args.quant == "f32":
        randomize(model)  # varied greedy tokens, so a token comparison means something
    return cfg, model


# -- fused vs unfused through ModelRunner -------------------------------------------------
def run_ab(args) -> None:
    t_start = now()
    cfg, model = make_model(args)
    log(f"[{args.model} {args.quant}] built in {now() - t_start:.1f} s on {mx.default_device()}")
    fused = ModelRunner(model)  # the engine's runner: fuses the weights (views) once
    plain = ModelRunner(model, fused_decode=False)
    step = fused.decode_step
    if step is None:
        raise SystemExit("ModelRunner(model) has no fused decode step for this model")
    if not isinstance(step, FusedDecodeStep):  # the CPU's lean step (engine/backends/cpu/step.py)
        step = make_decode_step(model)  # the fused step, for the copies below
    log(
        f"engine step: {type(fused.decode_step).__name__}; fused step: {step.fused_groups} of "
        f"{2 * len(model.layers)} projection groups fused, compiled={step.compiled}, "
        f"flat={step.flat}"
    )
    # fused3d: the same fused step with the hidden state as [B, 1, D]; fused2d: as
    # [B, D]. "fused" is whatever the engine does by default.
    flat3d = ModelRunner(model, fused_decode=False)
    flat3d.decode_step = copy.copy(step)
    flat3d.decode_step.flat = False
    flat2d = ModelRunner(model, fused_decode=False)
    flat2d.decode_step = copy.copy(step)
    flat2d.decode_step.flat = True
    known = {"unfused": plain, "fused": fused, "fused3d": flat3d, "fused2d": flat2d}
    names = [v for v in args.variants.split(",") if v]
    if "lean" in names:  # engine/backends/cpu/step.py's step (written for few graph nodes), here
        try:
            from engine.backends.cpu.step import CpuDecodeStep

            known["lean"] = ModelRunner(model, fused_decode=False)
            known["lean"].decode_step = CpuDecodeStep.build(model)
            if known["lean"].decode_step is None:
                raise ValueError("CpuDecodeStep.build gave None")
        except Exception:
            log(f"lean step not available:\n{traceback.format_exc()}")
            names.remove("lean")
            known.pop("lean", None)
    if "compiled2d" in names:  # fused2d with the per-layer pieces under mx.compile
        # (a second fused step: its own concatenated QKV and gate/up arrays)
        known["compiled2d"] = ModelRunner(model, fused_decode=False)
        known["compiled2d"].decode_step = FusedDecodeStep(
            model, fuse_quantized=True, compile=True, gpu_plans=on_gpu(), flat=True
        )
    # plan variants: the engine's step following other product plans. Plans are
    # process-wide (engine/backends/cuda/linear.py reads the environment once), so they are set
    # before each measurement, not at construction.
    plans = {
        "qk2": (None, "1:qmm,8:qmmk2"),  # split-K quantized products from 8 rows on
        "qk4": (None, "1:qmm,8:qmmk4"),
        "wxt8": ("1:xwt,8:wxt,32:xwt", None),  # float plan wxt from 8 rows, xwt from 32
    }
    for name in plans:
        if name in names:  # a second fused step: its own concatenated QKV and gate/up
            known[name] = ModelRunner(model)
    if len(names) < 2 or any(v not in known for v in names):
        raise SystemExit(f"--variants: two or more of {list(known)}")
    runners = {v: known[v] for v in names}
    base = names[0]
    prompt = [(i * 104729 + 7) % cfg["vocab_size"] for i in range(args.prompt)]
    t = now()
    layer_kv, first = prefill_row(plain, prompt)
    log(f"prefill of {args.prompt} tokens (first call): {now() - t:.2f} s")
    rows: list[dict] = []
    tokens: dict = {}
    batches = [int(b) for b in args.batches.split(",") if b]
    seen: set = set()
    for rep in range(args.repeat):
        for b in batches:
            for shape in args.shapes.split(","):
                if shape == "ragged" and b == 1:
                    shape = "equal"  # one row has no padding
                if (rep, b, shape) in seen:
                    continue
                seen.add((rep, b, shape))
                lengths = ragged_lengths(args.prompt, b) if shape == "ragged" else [args.prompt] * b
                order = list(runners) if rep % 2 == 0 else list(reversed(runners))
                for variant in order:
                    left = args.time_limit_s - (now() - t_start)
                    if left < 5:
                        log(f"B={b} {shape} {variant} rep {rep}: time limit reached, skipped")
                        continue
                    runner = runners[variant]
                    gpu_linear.reset_plans()  # the environment's (or default) plans
                    gpu_linear.set_plans(*plans.get(variant, (None, None)))
                    try:
                        batch, _ = build_batch(runner, layer_kv, lengths)
                        firsts = [first] * b
                        t = now()
                        loop_markbase(runner, batch, firsts, 1)
                        first_step = now() - t
                        loop_markbase(runner, batch, firsts, args.warmup_steps - 1)
                        got: list = []
                        times, extra = loop_markbase(runner, batch, firsts, args.steps, collect=got)
                        del batch
                    except Exception:
                        log(f"B={b} {shape} {variant} FAILED:\n{traceback.format_exc()}")
                        rows.append(
                            dict(kind="error", batch=b, shape=shape, variant=variant,
                                 error=traceback.format_exc()[-2000:])
                        )  # fmt: skip
                        continue
                    tokens.setdefault((b, shape, rep), {})[variant] = got
                    r = summarize(times, b, dict(first_step_s=first_step, **extra))
                    row = dict(kind="decode", variant=f"runner-{variant}", batch=b, shape=shape,
                               rep=rep, model=args.model, quant=args.quant, prompt=args.prompt,
                               **r)  # fmt: skip
                    rows.append(row)
                    log(
                        f"B={b:3d} {shape:6s} {variant:8s} rep {rep}: {r['tok_s']:9.0f} tok/s  "
                        f"step {r['step_ms_median']:.3f} ms (build {r['build_ms']:.2f}, eval "
                        f"{r['eval_ms']:.2f}; first step {first_step:.2f} s)"
                    )
                    save(args, rows)
                    mx.clear_cache()
    gpu_linear.reset_plans()
    # tokens: each variant against the first from the same start (bf16 rounding may
    # flip near ties)
    agree = {}
    for (b, shape, rep), by in tokens.items():
        for v in names[1:]:
            if base in by and v in by:
                a, u = by[v], by[base]
                same = sum(x == y for ra, ru in zip(a, u) for x, y in zip(ra, ru))
                agree[f"{v} B={b} {shape} rep {rep}"] = same / max(1, sum(len(r) for r in a))
    summary = []
    for b in batches:
        for shape in ("equal", "ragged"):
            med = {}
            for variant in runners:
                vals = [
                    r["tok_s"]
                    for r in rows
                    if r.get("kind") == "decode"
                    and r["batch"] == b
                    and r["shape"] == shape
                    and r["variant"] == f"runner-{variant}"
                ]
                if vals:
                    med[variant] = (statistics.median(vals), min(vals), max(vals), len(vals))
            if base not in med:
                continue
            u = med[base]
            for v in names[1:]:
                if v in med:
                    f = med[v]
                    summary.append(
                        dict(batch=b, shape=shape, variant=v, base=base, tok_s=f[0],
                             base_tok_s=u[0], ratio=f[0] / u[0], range=f[1:3],
                             base_range=u[1:3], n=f[3])
                    )  # fmt: skip
    log(
        f"\n[{args.model} {args.quant}] | B | rows | {base} tok/s [min-max] | variant | tok/s [min-max] | ratio |"
    )
    log("|---|---|---|---|---|---|")
    for s in summary:
        log(
            f"| {s['batch']} | {s['shape']} | {s['base_tok_s']:,.0f} "
            f"[{s['base_range'][0]:,.0f}-{s['base_range'][1]:,.0f}] | {s['variant']} | "
            f"{s['tok_s']:,.0f} [{s['range'][0]:,.0f}-{s['range'][1]:,.0f}] | "
            f"{s['ratio']:.2f}x (n={s['n']}) |"
        )
    log(f"token agreement with {base}: {agree}")
    save(args, rows, summary=summary, token_agreement=agree, wall_s=now() - t_start)
    if args.check:
        assert agree and all(v == 1.0 for v in agree.values()), agree
        log(f"check ok: every variant gives the tokens of {base}")


# -- the first request, with and without the warm-up ----------------------------------------
def run_first_request(args) -> None:
    from engine.client import EngineClient
    from engine.types import GenerationRequest, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t_proc = now()
    cfg, model = make_model(args)
    build_s = now() - t_proc
    vocab = cfg["vocab_size"]
    lm = loaded_model(model, cfg, args.quant)
    conf = engine_config(max_num_seqs=args.max_num_seqs, warmup=args.warmup == "on")
    t = now()
    client = EngineClient.from_loaded([(lm, None)], conf)
    start_s = now() - t
    worker = client.worker(lm.name)
    warmup_s = worker.warmup_s
    after_start = worker.stats()
    ids = iter(range(10**6))

    async def one(max_tokens: int, prompt_len: int | None = None) -> dict:
        i = next(ids)
        n = prompt_len or args.prompt
        toks = [(j * 31 + i * 7919 + 1) % vocab for j in range(n)]  # no prefix hits
        req = GenerationRequest(
            request_id=f"q{i}",
            model=lm.name,
            prompt_tokens=toks,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        t0 = now()
        ttft, n = None, 0
        async for ev in client.generate(req):
            if ttft is None and ev.token_ids:
                ttft = now() - t0
            n += len(ev.token_ids)
        return dict(ttft_s=ttft, total_s=now() - t0, tokens=n)

    async def main():
        out = {"first": await one(args.gen)}
        t0 = now()
        burst = await asyncio.gather(*(one(args.gen) for _ in range(args.burst)))
        out["burst"] = dict(
            n=args.burst,
            wall_s=now() - t0,
            ttft_max_s=max(r["ttft_s"] for r in burst),
            ttft_median_s=statistics.median(r["ttft_s"] for r in burst),
        )
        out["again"] = await one(args.gen)
        # a burst wide enough for the many-row decode products (gpu_qgemm from 33 rows)
        t0 = now()
        wide = await asyncio.gather(*(one(8) for _ in range(args.wide_burst)))
        out["wide_burst"] = dict(
            n=args.wide_burst,
            wall_s=now() - t0,
            ttft_max_s=max(r["ttft_s"] for r in wide),
        )
        # prompts of lengths not seen before: a per-shape compile (e.g. a cuDNN attention
        # graph per prompt length) shows as a first TTFT far above the second's
        out["lengths"] = []
        for n in args.lengths:
            a, b = await one(4, n), await one(4, n)
            out["lengths"].append(
                dict(prompt=n, first_ttft_s=a["ttft_s"], again_ttft_s=b["ttft_s"])
            )
        return out

    try:
        res = asyncio.run(main())
    finally:
        client.shutdown()
    row = dict(
        kind="first_request",
        warmup=args.warmup,
        model=args.model,
        quant=args.quant,
        prompt=args.prompt,
        gen=args.gen,
        max_num_seqs=args.max_num_seqs,
        build_s=build_s,
        start_s=start_s,
        warmup_s=warmup_s,
        stats_after_start=after_start,
        **res,
    )
    f, b, a = res["first"], res["burst"], res["again"]
    log(
        f"warm-up {args.warmup}: start {start_s:.2f} s (warm-up {warmup_s or 0:.2f} s); first "
        f"request TTFT {f['ttft_s']:.3f} s, {args.gen} tokens in {f['total_s']:.3f} s; burst of "
        f"{b['n']}: {b['wall_s']:.3f} s (TTFT max {b['ttft_max_s']:.3f} s); again: TTFT "
        f"{a['ttft_s']:.3f} s, total {a['total_s']:.3f} s; state after start {after_start}"
    )
    w = res["wide_burst"]
    log(f"burst of {w['n']}: {w['wall_s']:.3f} s (TTFT max {w['ttft_max_s']:.3f} s)")
    log(
        "new prompt lengths, TTFT first / again: "
        + ", ".join(
            f"{r['prompt']}: {r['first_ttft_s']:.3f} / {r['again_ttft_s']:.3f} s"
            for r in res["lengths"]
        )
    )
    save(args, [row])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["ab", "first-request"])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--quant", default="bf16", help="bf16, q4, q8 or f32")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=None, help="default: ab 512, first-request 256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=4, help="ab: untimed steps first")
    ap.add_argument("--warmup", choices=["on", "off"], help="first-request: EngineConfig.warmup")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--variants",
        default="unfused,fused",
        help="ab: runners, the first is the base: unfused, fused (engine default), "
        "fused3d (hidden state [B, 1, D]), fused2d ([B, D]), wxt8 (the engine's step with "
        "MARKBASE_GPU_FLOAT_PLAN=1:xwt,8:wxt,32:xwt), compiled2d (fused2d, per-layer "
        "pieces under mx.compile), qk2/qk4 (MARKBASE_GPU_QUANT_PLAN=1:qmm,8:qmmk2/4)",
    )
    ap.add_argument("--shapes", default="equal,ragged", help="ab: equal and/or ragged rows")
    ap.add_argument("--time-limit-s", type=float, default=45)
    ap.add_argument("--gen", type=int, default=32, help="first-request: tokens per request")
    ap.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2, 7, 13, 20, 33, 40, 64, 97, 130, 200, 255, 300, 513, 701, 1025, 1500],
        help="first-request: new prompt lengths, each band of the prefill's routes",
    )
    ap.add_argument("--wide-burst", type=int, default=48, help="first-request: concurrent requests")
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--gpu-name", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="ab: every variant's tokens = the first's")
    args = ap.parse_args()
    if args.mode == "ab":
        args.prompt = args.prompt or 512
        run_ab(args)
    else:
        if args.warmup is None:
            ap.error("first-request needs --warmup on or off")
        args.prompt = args.prompt or 256
        run_first_request(args)


if __name__ == "__main__":
    main()
