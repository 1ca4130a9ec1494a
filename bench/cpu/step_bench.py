"""Decode step of a built-in model (`--model`, the default model unless given) on the
CPU, against llama.cpp on the same GGUF, in one run: markbase's decode steps
(engine/backends/cpu/native_step.py's C step, engine/backends/cpu/step.py's lean step
and engine/model/decode_step.py's fused step, each with the quantized products of
engine/backends/cpu/qgemm.py and with float32 OpenBLAS) interleaved in one process, and
llama.cpp (llama-cpp-python's bindings, 2 threads) decoding the same batch sizes.

    .venv/bin/python bench/cpu/step_bench.py --batches 1,4,16
    .venv/bin/python bench/cpu/step_bench.py --batches 1,4,16 --no-llamacpp
    .venv/bin/python bench/cpu/step_bench.py --model gemma3-270m --no-llamacpp

Every row: 256 positions already in the KV cache (as llama.cpp's), 32 timed steps,
median; tok/s = batch / step time. A second table splits each quantized row's step into
the quantized products (wall time inside the shim's quantized route, both threads of its
pool working) and the rest (MLX's other ops, attention, the graph build). llama.cpp
comes from the venv that ``bench/serve/serve_bench.py --setup-llamacpp`` builds
(~/.cache/markbase/llamacpp-venv).
Absolute times move with the machine's load; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # formats.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))  # peers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.backends.cpu import qgemm as cpu_qgemm  # noqa: E402
from engine.backends.cpu.native_step import NativeDecodeStep  # noqa: E402
from engine.backends.cpu.step import CpuDecodeStep  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.model.decode_step import FusedDecodeStep  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402

KV = 256
STEPS = 32


def markbase_rows(batches: list[int], rounds: int, model: str) -> list[dict]:
    # a copy of the model per step, each with its step built (and its fused weights
    # registered with the quantized products) as the server builds them; the fused
    # step only where it takes the model's layers (llama's)
    runners = {}
    for name in ("native", "lean", "fused"):
        os.environ["MARKBASE_CPU_STEP"] = name
        lm = load_model(model, weight_format="float32")
        runners[name] = ModelRunner(lm.model, lm.cpu_shadows)
    os.environ.pop("MARKBASE_CPU_STEP")
    assert isinstance(runners["native"].decode_step, NativeDecodeStep)
    assert isinstance(runners["lean"].decode_step, CpuDecodeStep)
    if not isinstance(runners["fused"].decode_step, FusedDecodeStep):
        del runners["fused"]
    lib = cpu_qgemm._lib() if runners["lean"].qgemm is not None else None
    # (step, quantized products, int8 inputs: MARKBASE_QGEMM_INT8's llama.cpp numerics)
    configs = [
        ("native", True, False),
        ("lean", True, False),
        ("lean", True, True),
        ("fused", True, False),
    ]
    configs = [c for c in configs if lib is not None and (not c[2] or lib.markbase_qw_has_int8())]
    configs = [c for c in configs if c[0] in runners]
    configs.append(("lean", False, False))
    prompt = [(i * 7 + 13) % 40000 + 100 for i in range(KV)]
    layer_kv = {}
    for name, runner in runners.items():
        kv = runner.new_sequence_kv()
        mx.eval(runner.prefill(kv, prompt, True))
        layer_kv[name] = [c.kv() for c in kv]
    rows = []
    for b in batches:
        times: dict[tuple[str, bool, bool], list[float]] = {}
        for _ in range(rounds):
            for name, quant, int8 in configs:
                runner = runners[name]
                if lib is not None:
                    lib.markbase_qw_config(1 if quant else 0, -1, -1, -1)
                    lib.markbase_qw_set_int8(1 if int8 else 0)
                batch = runner.new_batch_kv()
                for _row in range(b):
                    for layer, (k, v) in zip(batch, layer_kv[name]):
                        layer.add(k, v)
                tokens = [1000] * b
                ts = []
                for i in range(STEPS + 4):
                    if i == 4 and lib is not None:
                        lib.markbase_qw_timing(1)
                    t = time.perf_counter()
                    tokens = mx.argmax(runner.decode(batch, tokens), axis=-1).tolist()
                    if i >= 4:
                        ts.append(time.perf_counter() - t)
                products_ms = 0.0
                if lib is not None:
                    lib.markbase_qw_timing(0)
                    products_ms = lib.markbase_qw_time_us() / 1e3 / STEPS
                times.setdefault((name, quant, int8), []).append(
                    (statistics.median(ts), products_ms)
                )
        for (name, quant, int8), ts in times.items():
            dt, products_ms = min(ts)
            rows.append(
                {
                    "config": f"markbase {name} step, "
                    + ("quantized products" if quant else "float32 OpenBLAS")
                    + (", int8 inputs" if int8 else ""),
                    "batch": b,
                    "step_ms": round(dt * 1e3, 2),
                    "tok_s": round(b / dt, 1),
                    "products_ms": round(products_ms, 2) if quant else None,
                }
            )
    if lib is not None:
        lib.markbase_qw_config(1, -1, -1, -1)
        lib.markbase_qw_set_int8(0)
    return rows


def llamacpp_rows(batches: list[int], threads: int, model: str) -> list[dict]:
    import peers
    from formats import run_llamacpp

    if not peers.llamacpp_ok():
        print(f"# llama.cpp skipped: no llama-cpp-python in {peers.LLAMACPP_VENV}")
        return []
    gguf = str(peers.gguf_path(model))
    rows = run_llamacpp(str(peers.llamacpp_python()), gguf, batches, threads)
    for r in rows:
        r["config"] = f"llama.cpp {r['format'].split()[-1]}, {threads} threads"
    return rows


def print_table(rows: list[dict], batches: list[int], cell) -> None:
    """A markdown table: a line per config, ``cell(row)`` per batch size ("-": none)."""
    print("| config | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for config in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for b in batches:
            r = next((r for r in rows if r["config"] == config and r["batch"] == b), None)
            cells.append("-" if r is None else cell(r))
        print(f"| {config} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in GGUF alias")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (best kept)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = [] if args.no_llamacpp else llamacpp_rows(batches, args.threads, args.model)
    rows += markbase_rows(batches, args.rounds, args.model)
    ref = {r["batch"]: r["tok_s"] for r in rows if r["config"].startswith("llama.cpp")}

    def speed(r: dict) -> str:
        cell = f"{r['tok_s']:.0f} ({r['step_ms']:.1f})"
        if r["batch"] in ref and not r["config"].startswith("llama.cpp"):
            cell += f" = {r['tok_s'] / ref[r['batch']]:.2f}x"
        return cell

    print(f"\nload average {os.getloadavg()[0]:.1f}; KV {KV} positions; tok/s (step ms)\n")
    print_table(rows, batches, speed)
    split = [r for r in rows if r.get("products_ms")]
    if split:
        print("\nquantized products / the rest of the step, ms (the same best rounds)\n")
        print_table(
            split,
            batches,
            lambda r: f"{r['products_ms']:.1f} / {r['step_ms'] - r['products_ms']:.1f}",
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
