#!/usr/bin/env python
"""Decode ms/token at growing positions, through the real engine, for a dense and a MoE
model: does a token cost the same at position 8k (32k on a GPU) as at position 0?

For each position P a single request is sent whose prompt is P tokens long (P = 0
means a 1-token prompt), with ``--steps`` greedy tokens (EOS ignored); the decode
time a token is the wall time between its first and last streamed token divided by the
tokens in between, as a client of ``EngineClient`` sees it. The prompt's prefill is
not in it. Flat means within 15% of position 0.

    .venv/bin/python bench/long_context.py                 # CPU: tiny dense + MoE, ~2 minutes
    python3 bench/long_context.py --device-models          # GPU: 1b-shaped llama + Qwen3-30B-A3B shape

Prints one table (rows: model x position) and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"

# CPU models: small enough that an 8k-token prompt prefills in seconds on 2 cores,
# large enough that a decode step is more than Python overhead.
CPU_MODELS = {
    "dense-llama": (
        "llama",
        dict(
            hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
    ),
    "moe-qwen3": (
        "qwen3_moe",
        dict(
            hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
            decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=128,
            rms_norm_eps=1e-6, vocab_size=512, rope_theta=1000000.0, tie_word_embeddings=False,
            max_position_embeddings=40960, norm_topk_prob=True,
        ),
    ),
}  # fmt: skip


def numbered_tokenizer(vocab: int):
    """Every id its own word (``w123``): each generated token streams as its own event
    (the byte-level tokenizer has text only for ids < 256, and the worker sends a row
    nothing until it has text), so per-token times reach the client."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from engine.tokenizer import Tokenizer

    backend = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    return Tokenizer(
        backend,
        special_tokens={},
        eos_token_ids=set(),
        bos_token_id=None,
        chat_template=None,
        has_chat_template=False,
    )


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 50000)) for _ in range(max(1, length))]


async def stream_times(engine, model: str, prompt: list[int], max_tokens: int, rid: str):
    """(submit time, [(time, tokens so far)]) of one greedy request, EOS ignored."""
    from engine.types import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = []
    n = 0
    async for ev in engine.generate(GenerationRequest(rid, model, prompt, params)):
        if ev.error:
            raise RuntimeError(ev.error)
        n += len(ev.token_ids)
        out.append((time.perf_counter(), n, time.process_time()))
    return t0, out


def decode_ms_per_token(events: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(wall ms, process CPU ms) a token between the first and the last streamed token.
    The CPU time (all threads of the process) is what a busy shared machine changes
    least; on a GPU the wall time is the measure."""
    (t_first, n_first, c_first), (t_last, n_last, c_last) = events[0], events[-1]
    tokens = max(1, n_last - n_first)
    return (t_last - t_first) / tokens * 1e3, (c_last - c_first) / tokens * 1e3


def measure_positions(engine, name: str, vocab: int, positions, steps: int, repeat: int = 1):
    """{position: (median wall ms/token, median CPU ms/token)} for one served model."""
    out = {}
    for pos in positions:
        runs = []
        for r in range(repeat):
            prompt = prompt_of(pos, vocab, seed=pos * 7 + r)
            _, events = asyncio.run(stream_times(engine, name, prompt, steps, f"lc-{pos}-{r}"))
            runs.append(decode_ms_per_token(events))
        out[pos] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
    return out


def engine_for(lm, max_context: int, max_num_seqs: int = 4):
    from engine.client import EngineClient
    from engine.config import EngineConfig

    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_kv_tokens=max_context * max_num_seqs + 4096,
        prefix_cache_tokens=0,
        warmup=False,
        queue_timeout_s=600.0,
    )
    return EngineClient.from_loaded([(lm, max_context)], cfg)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | position | decode ms/token (wall) | vs position 0 | CPU ms/token | vs position 0 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['position']:,} | {r['ms_per_token']:.2f} | {r['ratio']:.2f}x "
            f"| {r['cpu_ms_per_token']:.2f} | {r['cpu_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def run(models: dict, positions: list[int], steps: int, repeat: int) -> list[dict]:
    """``models``: name -> LoadedModel. Warms each engine at every position first
    (kernels and buffers of each length: on a GPU a form first used at a new length
    compiles then), then measures every position."""
    rows = []
    for name, lm in models.items():
        engine = engine_for(lm, max(positions) + steps + 64)
        try:
            vocab = lm.config.get("vocab_size", 256)
            t = time.perf_counter()
            measure_positions(engine, lm.name, vocab, positions, 4)  # warm-up
            print(f"{name}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
            got = measure_positions(engine, lm.name, vocab, positions, steps, repeat)
        finally:
            engine.shutdown()
        base, cpu_base = got[positions[0]]
        for pos in positions:
            wall, cpu = got[pos]
            rows.append(dict(model=name, position=pos, ms_per_token=wall, ratio=wall / base,
                             cpu_ms_per_token=cpu, cpu_ratio=cpu / cpu_base))  # fmt: skip
            print(f"{name} position {pos}: {wall:.2f} ms/token wall, {cpu:.2f} CPU", flush=True)
    return rows


def cpu_models() -> dict:
    from engine.loading import build_random_model

    models = {}
    for name, (mt, cfg) in CPU_MODELS.items():
        lm = build_random_model(mt, dict(cfg), seed=1)
        lm.tokenizer = numbered_tokenizer(cfg["vocab_size"])
        models[name] = lm
    return models


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", default="0,1024,4096,8192")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--device-models", action="store_true",
                   help="GPU: bench/gpu/moe_bench.py's 4-bit shapes (qwen3-30b-a3b and a 1b llama)")  # fmt: skip
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    positions = [int(x) for x in args.positions.split(",")]
    if not args.device_models:
        # before MLX loads, as `markbase serve` does: MLX's matmuls then take the sgemm
        # shim (engine/backends/cpu/native), which also runs decode attention's products
        from engine.backends.cpu.blas import ensure_fast_blas

        print(ensure_fast_blas(allow_reexec=False), flush=True)

    import mlx.core as mx

    if args.device_models:
        sys.path.insert(0, str(ROOT / "bench" / "gpu"))
        import moe_bench

        models = {n: moe_bench.build(n) for n in ("llama-1b", "qwen3-30b-a3b")}
    else:
        models = cpu_models()
    t0 = time.perf_counter()
    rows = run(models, positions, args.steps, args.repeat)
    device = str(mx.default_device())
    print()
    print(f"{dt.date.today()} {platform.node()} {device}, {time.perf_counter() - t0:.0f} s")
    print("command: " + " ".join(["python", *sys.argv]))
    print(table(rows))
    out = (
        Path(args.out)
        if args.out
        else RESULTS / f"long_context-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, command=sys.argv, rows=rows), indent=2))


if __name__ == "__main__":
    main()
