"""Where the served engine's decode step spends its time, host and GPU on one timeline.

Why: on some H100 hosts the real worker's 8b 4-bit B=128 step ran ~2 ms above the GPU's
busy time measured by ``profile_step.py`` (18.9 against 16.8 ms, 2026-12-05), on others
not; that script times a bench loop, not the worker. Here the real ``ModelWorker``
(behind ``EngineClient``, as ``bench_decode.py``'s ``worker`` variant runs it) decodes
B rows, and the profiler is started and stopped *inside the worker thread*, so the
host phases, marked as ``record_function`` ranges there, and CUPTI's kernels share one
clock. Per step it reports the host phases (the step's graph build, sampling's graph,
``mx.async_eval``'s encoding, waiting for the previous step's tokens, their
bookkeeping, the event hand-over, the gauges), the GPU's busy time inside the step, and
the idle stretches of the GPU with the host phase that was running then: a gap while
the host is in ``deliver_wait`` cannot be the host's fault, one while it builds or
encodes the next step is.

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/worker_timeline.py --model 8b --quant q4 --batch 128 \\
        --out $OUT/timeline-8b-q4-128.json

CPU smoke run (tiny model; no kernels, the host phases only):

    .venv/bin/python bench/gpu/worker_timeline.py --model tiny --quant f32 --batch 4 --steps 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_decode import (  # noqa: E402
    batch_config,
    build_model,
    greedy_requests,
    loaded_model,
    randomize,
)
from shapes import CONFIGS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers.trace import PREFIX, analyse  # noqa: E402


def wrap_worker(worker, record) -> dict:
    """Mark the worker's phases as profiler ranges (``record(name)``: a context manager)
    and count the steps in which every row decodes; returns the shared state."""
    import engine.worker as worker_module

    state = {"steps": 0}

    def ranged(name, fn):
        def inner(*args, **kwargs):
            with record(PREFIX + name):
                return fn(*args, **kwargs)

        return inner

    runner = worker.runner
    # decode_step holds the others but flush and gauges; what it holds beyond them is
    # mx.async_eval (MLX encoding the step into CUDA graphs and launching them)
    worker._decode_step = ranged("decode_step", worker._decode_step)
    runner.decode = ranged("decode_build", runner.decode)
    worker_module.sample_batch = ranged("sample_build", worker_module.sample_batch)
    worker._deliver = ranged("deliver", worker._deliver)
    worker._accept_rows = ranged("accept", worker._accept_rows)
    worker._flush_outbox = ranged("flush", worker._flush_outbox)
    worker._update_gauges = ranged("gauges", worker._update_gauges)
    inner_step = worker.step

    def step():
        full = len(worker.running) == state["batch"] and not (worker.prefilling or worker.waiting)
        hook = state.get("hook")
        if full and hook is not None:
            hook(state["steps"])
        if full:
            state["steps"] += 1
        with record(PREFIX + ("step" if full else "step_partial")):
            inner_step()

    worker.step = step
    return state


def run(model_name: str, quant: str, batch: int, prompt: int, steps: int, skip: int) -> dict:
    """B requests through the real engine; the profiler runs in the worker thread from
    full step ``skip`` for ``steps`` full steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from engine.client import EngineClient

    cfg = CONFIGS[model_name]
    model = build_model(cfg, quant)
    if model_name == "tiny":
        randomize(model)
    on_gpu = mx.cuda.is_available()
    if on_gpu:
        torch.cuda.init()
    max_tokens = skip + steps + batch + 16  # rows join one a step; all B stay for the window
    conf = batch_config(batch, prompt, max_tokens)
    client = EngineClient.from_loaded([(loaded_model(model, cfg, quant), None)], conf)
    worker = client.worker("random")
    state = wrap_worker(worker, record_function)
    state["batch"] = batch
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts):  # the profiler's one-time set-up, on this thread
        pass
    prof = profile(activities=acts)
    trace = Path(tempfile.mkdtemp()) / "trace.json"

    def hook(i: int) -> None:  # in the worker thread: its ranges share CUPTI's clock
        if i == skip:
            prof.start()
        elif i == skip + steps:
            mx.synchronize()
            prof.stop()
            prof.export_chrome_trace(str(trace))

    state["hook"] = hook
    t = time.perf_counter()
    try:
        asyncio.run(greedy_requests(client, batch, prompt, max_tokens, cfg["vocab_size"]))
    finally:
        client.shutdown()
    if not trace.exists():
        raise RuntimeError(f"the window never closed: {state['steps']} full steps")
    out = analyse(json.loads(trace.read_text()).get("traceEvents", []))
    out.update(model=model_name, quant=quant, batch=batch, wall_s=time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12, help="full steps profiled")
    ap.add_argument("--skip", type=int, default=8, help="full steps before the window")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    r = run(a.model, a.quant, a.batch, a.prompt, a.steps, a.skip)
    print(f"{a.model} {a.quant} B={a.batch}: {r['steps']} steps on {mx.default_device()}")
    if r["steps"]:
        print(
            f"step {r['wall_us_median'] / 1e3:.2f} ms, GPU busy {r['busy_us_median'] / 1e3:.2f} ms, "
            f"GPU idle {r['idle_us_median'] / 1e3:.2f} ms (medians)"
        )
        print("(decode_step holds decode_build, sample_build and deliver (which holds accept);")
        print(" the rest of it is mx.async_eval's encoding; step: outside every phase)")
        print("| host phase | ms a step (median) | GPU idle meanwhile, ms a step |")
        print("|---|---:|---:|")
        idle = r["idle_us_per_step_by_host_phase"]
        for k in sorted(set(r["phases_us_median"]) | set(idle)):
            ms = r["phases_us_median"].get(k, 0.0) / 1e3
            print(f"| {k} | {ms:.3f} | {idle.get(k, 0.0) / 1e3:.3f} |")
        calls = sorted(r["api_calls_per_step"].items(), key=lambda kv: -kv[1])[:8]
        print("CUDA API calls a step:", ", ".join(f"{k} {v:.1f}" for k, v in calls))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
