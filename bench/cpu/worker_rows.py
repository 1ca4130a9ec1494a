"""The engine worker's per-row host work after a decode step, on the CPU.

    .venv/bin/python bench/cpu/worker_rows.py
    .venv/bin/python bench/cpu/worker_rows.py --compare REV   # and a git revision's engine, same run
    .venv/bin/python bench/cpu/worker_rows.py --model gemma3-270m --rows 1,8,32,128,256

Times ``ModelWorker._accept_rows`` (the step's tokens -> detokenized text, stop strings,
metrics, one ``TokenEvent`` per row into the outbox) on a real ``ModelWorker`` with the
real tokenizer of ``--model`` (the default model's, SmolLM2, unless told otherwise). The
model itself never runs: the worker gets a tiny random llama, and B sequences are
submitted the way the server submits them (a chat prompt, ``submit``, the inbox) and put
straight into the running batch. Each step hands every row the next token of a real
token stream (a mixed text corpus: prose, code, markdown, accents, CJK, emoji, encoded
by the tokenizer; each row starts at its own offset), as a decode step with sampled
tokens read back would. The outbox is cleared after each step, untimed.

Per batch size: ``--warmup`` untimed steps, then ``--steps`` (default: enough for about
20000 rows) timed ones; the table gives the median step and the median per row
(step / B), the best of ``--rounds`` rounds (a shared machine's noise only adds), each
round in a fresh process. ``--compare REV`` also runs rounds on ``git archive REV engine``
(this script, the old engine), alternating with this tree's, so before and after come
from one run on one machine. ``--stop STR`` (repeatable) gives every request stop strings; ``--json`` prints
the rows as JSON instead of the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CORPUS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum "
    "and its cafés along the Seine. About 2.1 million people live in the city itself, and "
    "more than 12 million in the greater metropolitan area.\n\n",
    "Here are three tips for better sleep:\n\n1. Keep a regular schedule, even on weekends.\n"
    "2. Avoid screens for an hour before bed.\n3. Keep your bedroom cool, dark and quiet.\n\n",
    "```python\ndef fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n"
    "    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n    return out\n```\n\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It happens mainly in the chloroplasts of leaf cells, "
    "where chlorophyll absorbs red and blue light.\n\n",
    "| City | Country | Population |\n|---|---|---|\n| Tokyo | Japan | 37,400,068 |\n"
    "| Delhi | India | 28,514,000 |\n\n",
    "Café naïve résumé — «quotes» and “curly” ones; 東京 is Tokyo, 北京 is Beijing. "
    "Emoji: 🙂 👍🏽 👩‍👩‍👧 🚀. Math: α + β = γ, x² ≤ 10⁶.\n\n",
    "Sure! To install the package, run `pip install requests`, then:\n\n"
    "    import requests\n    r = requests.get('https://example.com', timeout=10)\n"
    "    print(r.status_code)\n\nLet me know if you have any other questions.\n\n",
]

TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
)


def measure(model: str, rows: list[int], steps: int | None, warmup: int, stops: list[str]):
    import asyncio

    import engine
    from engine import events as engine_events
    from engine.config import EngineConfig
    from engine.loading import build_random_model
    from engine.loading.builtin import resolve_builtin
    from engine.loading.convert_cache import cache_root
    from engine.loading.gguf_reader import GGUFFile
    from engine.loading.loader import gguf_tokenizer
    from engine.sequence import SeqState
    from engine.types import GenerationRequest, SamplingParams
    from engine.worker import ModelWorker

    with GGUFFile(resolve_builtin(model, cache_root())) as gf:
        tok = gguf_tokenizer(gf, cache_root())
    stream = tok.encode("".join(CORPUS), add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me something."}])
    loaded = dataclasses.replace(
        build_random_model("llama", TINY_LLAMA), name="bench", tokenizer=tok, context_length=1 << 24
    )
    config = EngineConfig(
        max_num_seqs=max(rows),
        max_kv_tokens=1 << 24,
        prefix_cache_tokens=0,
        warmup=False,
        pipeline_decode=False,
    )
    loop = asyncio.new_event_loop()  # never run: _accept_rows only queues events
    loop_emit = getattr(engine_events, "LoopEmit", None)

    def emit_for(_i):
        return loop_emit(loop, lambda e: None) if loop_emit else (lambda e: None)

    out = []
    for b in rows:
        n_steps = steps or max(200, 20000 // b)
        worker = ModelWorker(loaded, config)  # not started: this thread plays its loop
        worker.alive = lambda: True  # submit() takes requests only from a live worker
        for i in range(b):
            params = SamplingParams(max_tokens=10**9, temperature=0.0, stop=tuple(stops))
            req = GenerationRequest(f"r{i}", "bench", list(prompt), params)
            worker.submit(req, emit_for(i))
        worker._drain_inbox()
        seqs = list(worker.waiting)
        worker.waiting.clear()
        for seq in seqs:
            seq.state = SeqState.RUNNING
        worker.running = seqs
        offsets = [(r * 997) % len(stream) for r in range(b)]
        total = warmup + n_steps
        tokens = [[stream[(o + s) % len(stream)] for o in offsets] for s in range(total)]
        times = []
        gc.collect()
        for s in range(total):
            t0 = time.perf_counter_ns()
            worker._accept_rows(seqs, tokens[s])
            t1 = time.perf_counter_ns()
            worker._outbox.clear()
            if s >= warmup:
                times.append(t1 - t0)
        assert all(seq.state is SeqState.RUNNING for seq in seqs), "a row ended"
        step_us = statistics.median(times) / 1e3
        out.append(dict(rows=b, steps=n_steps, step_us=step_us, row_us=step_us / b))
    loop.close()
    return dict(engine=str(Path(engine.__file__).parent), model=model, tokens=len(stream), rows=out)


def best_of(a: dict | None, b: dict) -> dict:
    """Per batch size, the round with the lower median (the machine's noise only adds)."""
    if a is None:
        return b
    a["rows"] = [x if x["step_us"] <= y["step_us"] else y for x, y in zip(a["rows"], b["rows"])]
    return a


def run_engine(root: str, args) -> dict:
    """One round of this script in a fresh process, importing ``engine`` from ``root``."""
    cmd = [sys.executable, __file__, "--engine-root", root, "--json", "--model", args.model]
    cmd += ["--rows", args.rows, "--warmup", str(args.warmup), "--rounds", "1"]
    cmd += ["--steps", str(args.steps)] if args.steps else []
    for s in args.stop:
        cmd += ["--stop", s]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def run_revision(rev: str, args) -> dict:
    """One round on ``git archive REV engine``."""
    with tempfile.TemporaryDirectory(prefix="worker-rows-") as tmp:
        archive = subprocess.run(
            ["git", "archive", rev, "engine"], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        result = run_engine(tmp, args)
        result["engine"] = f"{rev} ({result['engine']})"
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,8,32,128", help="batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per batch size")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="repeats; the best median counts")
    ap.add_argument("--stop", action="append", default=[], help="a stop string for every row")
    ap.add_argument("--compare", metavar="REV", help="also measure REV's engine (git revision)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine-root", help=argparse.SUPPRESS)  # import `engine` from here
    args = ap.parse_args()

    if args.json:  # one round, here (the parent runs each round in a fresh process)
        sys.path.insert(0, args.engine_root or str(REPO))
        from engine.backends.cpu.blas import ensure_fast_blas

        ensure_fast_blas()
        rows = [int(r) for r in args.rows.split(",")]
        print(json.dumps(measure(args.model, rows, args.steps, args.warmup, args.stop)))
        return
    base = new = None
    for _ in range(args.rounds):  # before and after alternate; each keeps its best round
        if args.compare:
            base = best_of(base, run_revision(args.compare, args))
        new = best_of(new, run_engine(str(REPO), args))

    print(f"model {new['model']}, token stream of {new['tokens']} tokens, stop={args.stop}")
    print(f"CPU: {os.cpu_count()} cores; median of the timed steps, best of {args.rounds} rounds")
    if base:
        print(f"before: {base['engine']}\nafter:  {new['engine']}\n")
        print("| rows | before us/step | before us/row | after us/step | after us/row | speed-up |")
        print("|---:|---:|---:|---:|---:|---:|")
        for a, b in zip(base["rows"], new["rows"]):
            print(
                f"| {b['rows']} | {a['step_us']:.1f} | {a['row_us']:.2f} | {b['step_us']:.1f} "
                f"| {b['row_us']:.2f} | {a['row_us'] / b['row_us']:.2f}x |"
            )
    else:
        print(f"engine: {new['engine']}\n")
        print("| rows | steps | us/step | us/row |")
        print("|---:|---:|---:|---:|")
        for b in new["rows"]:
            print(f"| {b['rows']} | {b['steps']} | {b['step_us']:.1f} | {b['row_us']:.2f} |")


if __name__ == "__main__":
    main()
