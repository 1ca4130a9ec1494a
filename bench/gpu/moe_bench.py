#!/usr/bin/env python
"""Mixture-of-experts models of published shapes through the real engine on a GPU:
grouped expert products (engine/model/moe.py) against mlx-lm's own ``SwitchGLU``
forward, in one process.

Models (random 4-bit weights, group size 64, bf16 activations, built on the device
without ever holding float weights): ``qwen3-30b-a3b`` (Qwen3-30B-A3B's published
config: 48 layers, 128 experts, 8 a token), ``gemma4-26b-a4b`` (Gemma 4 26B-A4B: 30
layers, 128 experts, 8 a token, a dense MLP beside them), ``gemma4-e2b`` (Gemma 4 E2B,
dense with per-layer inputs and shared KV: no experts, measured as it serves),
``llama-1b`` (dense, for bench/long_context.py), and ``tiny-*`` for CPU smoke runs.

Per model and mode (``grouped``, ``mlx`` = mlx-lm's SwitchGLU), through
``EngineClient`` (the worker, its batcher and sampler, tokens streamed back):

- decode tok/s at B = 1, 8, 32, 128: B requests with distinct 128-token prompts sent at
  once, ``--steps`` greedy tokens each (EOS ignored); tokens streamed by all rows
  between the moment every row has its first token and the moment the first row
  finishes, over that time;
- TTFT of one 128-token prompt alone (median of 3, after a warm-up);
- prefill tok/s of one 2048-token prompt (2048 / its time to first token);
- the floor: bytes a decode step at B reads (weights other than the embedding table,
  the experts a step is expected to touch, ``E * (1 - (1 - k/E)^B)`` a layer, and the
  KV cache at the mean position) at the read bandwidth measured in the same run.

Also one MoE layer alone (stock call against each grouped route, GPU time a call).
mlx-lm's forward is slow at large B (96 tok/s at B=32 on an H100, 42 s to the first
token), so the baseline runs ``--stock-batches`` with ``--stock-steps``.

    source bench/gpu/env.sh && python3 bench/gpu/moe_bench.py --out $OUT/moe.json
    .venv/bin/python bench/gpu/moe_bench.py --models tiny-qwen3-moe,tiny-gemma4 --batches 1,4 --steps 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import long_context  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

now = time.perf_counter

_GEMMA4_ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}  # fmt: skip

MODELS = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=48, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768, rms_norm_eps=1e-6,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
        max_position_embeddings=40960, norm_topk_prob=True,
    )),
    # google/gemma-4-26B-A4B text_config
    "gemma4-26b-a4b": ("gemma4_text", dict(
        hidden_size=2816, num_hidden_layers=30, intermediate_size=2112, num_attention_heads=16,
        num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704, vocab_size=262144, vocab_size_per_layer_input=262144,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
        sliding_window=1024, sliding_window_pattern=6, rms_norm_eps=1e-6,
        final_logit_softcapping=30.0, max_position_embeddings=262144, tie_word_embeddings=True,
        rope_parameters=_GEMMA4_ROPE,
    )),
    # google/gemma-4-E2B text_config (mlx-lm's gemma4_text defaults are this model's)
    "gemma4-e2b": ("gemma4_text", dict(
        hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
        num_kv_shared_layers=20, use_double_wide_mlp=True, sliding_window=512,
        sliding_window_pattern=5, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=_GEMMA4_ROPE,
    )),
    "llama-1b": ("llama", dict(
        hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, max_position_embeddings=65536,
    )),
    "tiny-qwen3-moe": ("qwen3_moe", dict(
        hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6,
        vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=8192, norm_topk_prob=True,
    )),
    "tiny-gemma4": ("gemma4_text", dict(
        hidden_size=128, num_hidden_layers=6, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1, num_global_key_value_heads=1, head_dim=64, global_head_dim=64,
        attention_k_eq_v=True, enable_moe_block=True, num_experts=16, top_k_experts=4,
        moe_intermediate_size=64, vocab_size=512, vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=64,
        sliding_window_pattern=6, max_position_embeddings=8192, rope_parameters=_GEMMA4_ROPE,
    )),
}  # fmt: skip


_TOKENS: dict[str, list[int]] = {}  # request id -> its greedy tokens (last run)


def log(msg: str) -> None:
    print(msg, flush=True)


# -- models --------------------------------------------------------------------------
def build(name: str, seed: int = 0):
    """A ``LoadedModel`` of ``MODELS[name]``: every matrix 4-bit (group 64) with random
    codes, scales of ~1/sqrt(fan-in) and centred biases, float parameters bf16. The
    float initialisation mlx-lm's constructors ask for stays lazy and is never
    computed (Qwen3-30B-A3B in float32 would need ~120 GB)."""
    from mlx.utils import tree_flatten, tree_unflatten

    from engine.loading.loaded_model import LoadedModel
    from engine.loading.loader import model_classes
    from engine.loading.materialize import materialize
    from engine.loading.safetensors_folder import model_quantization

    model_type, cfg = MODELS[name]
    config = {"model_type": model_type, **cfg}
    model_cls, args_cls = model_classes(model_type)
    model = model_cls(args_cls.from_dict(config))
    nn.quantize(model, group_size=64, bits=4)  # lazy: only shapes so far
    mx.random.seed(seed)
    dtype = mx.bfloat16
    new = []
    for pname, p in tree_flatten(model.parameters()):
        if p.dtype == mx.uint32:
            hi = mx.random.randint(0, 1 << 16, p.shape, dtype=mx.uint32)
            lo = mx.random.randint(0, 1 << 16, p.shape, dtype=mx.uint32)
            new.append((pname, (hi << 16) | lo))  # eight random 4-bit codes a word
        elif pname.endswith(".scales"):
            fan_in = p.shape[-1] * 64
            s = mx.random.uniform(0.8, 1.2, p.shape) / (4.6 * math.sqrt(fan_in))
            if "embed" in pname:
                s = mx.random.uniform(0.8, 1.2, p.shape) * 0.2
            new.append((pname, s.astype(dtype)))
        elif pname.endswith(".biases"):
            continue  # from the scales below
        else:
            new.append((pname, p.astype(dtype)))
    arrays = dict(new)
    for pname in list(arrays):
        if pname.endswith(".scales"):
            arrays[pname[: -len("scales")] + "biases"] = (-8 * arrays[pname]).astype(dtype)
    model.update(tree_unflatten(list(arrays.items())))
    model.eval()
    materialize(model)
    vocab = cfg["vocab_size"]
    return LoadedModel(
        name=name,
        architecture=model_type,
        model=model,
        tokenizer=long_context.numbered_tokenizer(vocab),
        context_length=cfg.get("max_position_embeddings", 8192),
        source="random",
        weight_format="random-q4g64",
        config=config,
        compute_dtype="bfloat16",
        quantization=model_quantization(model),
    )


def switch_modules(model):
    from mlx_lm.models.switch_layers import SwitchGLU

    return [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]


def top_k_of(cfg: dict) -> int:
    return cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 0


def weight_bytes(model) -> dict:
    """Bytes of the experts (all of them), one expert (all its projections), the
    embedding table, and the rest."""
    from mlx.utils import tree_flatten

    out = dict(experts=0, embedding=0, dense=0)
    for pname, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in pname or ".switch_glu." in pname:
            out["experts"] += p.nbytes
        elif "embed_tokens" in pname and "per_layer" not in pname:
            out["embedding"] += p.nbytes
        else:
            out["dense"] += p.nbytes
    return out


def kv_bytes_per_position(cfg: dict, position: int) -> int:
    """KV bytes (bf16) a decode step reads for one row at ``position``, all layers."""
    layers = cfg["num_hidden_layers"]
    if "layer_types" in cfg or "sliding_window_pattern" in cfg:
        pattern = cfg.get("sliding_window_pattern", 1)
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    else:
        types = ["full_attention"] * layers
    shared = cfg.get("num_kv_shared_layers", 0)
    total = 0
    for t in types[: layers - shared]:
        full = t == "full_attention"
        hd = (
            cfg.get("global_head_dim")
            if full and cfg.get("global_head_dim")
            else cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        )
        kvh = (
            cfg.get("num_global_key_value_heads") if full and cfg.get("attention_k_eq_v") else None
        )
        kvh = kvh or cfg["num_key_value_heads"]
        span = position if full else min(position, cfg.get("sliding_window", position))
        total += 2 * kvh * hd * 2 * span
    return total


def floor_tok_s(lm, batch: int, position: int, bandwidth: float) -> tuple[float, float]:
    """(bytes a decode step at ``batch`` reads, tok/s at ``bandwidth``)."""
    cfg = lm.config
    wb = weight_bytes(lm.model)
    step = wb["dense"]
    if not hasattr(lm.model, "lm_head"):  # tied: the output layer reads the whole table
        step += wb["embedding"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        k = top_k_of(cfg)
        n_moe = len(switch_modules(lm.model))
        per_expert = wb["experts"] / (n_moe * experts)
        touched = experts * (1 - (1 - k / experts) ** batch)
        step += n_moe * touched * per_expert
    step += batch * kv_bytes_per_position(cfg, position)
    return step, batch * bandwidth / step


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes a second an MLX reduction reads from device memory (a row sum of a
    ``nbytes`` bf16 array, median of 5)."""
    if mx.default_device() == mx.cpu:
        nbytes = 64 << 20
    a = mx.random.uniform(shape=(nbytes // 2 // 8192, 8192)).astype(mx.bfloat16)
    mx.eval(a)
    times = []
    for i in range(7):
        t = now()
        mx.eval(mx.sum(a, axis=-1))
        if i >= 2:
            times.append(now() - t)
    del a
    mx.clear_cache()
    return nbytes / statistics.median(times)


# -- the engine ----------------------------------------------------------------------
def make_engine(lm, mode: str, max_batch: int, max_context: int):
    from engine.client import EngineClient
    from engine.config import EngineConfig
    from engine.model import moe

    os.environ["MARKBASE_MOE"] = mode
    moe.uninstall(lm.model)  # the runner installs it again unless mode == mlx
    cfg = EngineConfig(
        max_num_seqs=max_batch,
        max_kv_tokens=max_batch * max_context + 8192,
        prefill_chunk_tokens=2048,
        prefix_cache_tokens=0,
        warmup=False,
        queue_timeout_s=900.0,
        max_queued_requests=1024,
    )
    return EngineClient.from_loaded([(lm, max_context)], cfg)


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    hi = min(vocab, 50000)
    return [[rng.randrange(3, hi) for _ in range(length)] for _ in range(n)]


async def _stream(engine, model, prompt, max_tokens, rid):
    from engine.types import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = now()
    events = []
    n = 0
    ids: list[int] = []
    async for ev in engine.generate(GenerationRequest(rid, model, prompt, params)):
        if ev.error:
            raise RuntimeError(ev.error)
        n += len(ev.token_ids)
        ids.extend(ev.token_ids)
        events.append((now(), n))
    _TOKENS[rid] = ids
    return t0, events


def run_requests(engine, model: str, prompts, max_tokens: int, tag: str):
    async def all_():
        return await asyncio.gather(
            *(_stream(engine, model, p, max_tokens, f"{tag}-{i}") for i, p in enumerate(prompts))
        )

    return asyncio.run(all_())


def decode_rate(results) -> tuple[float, float]:
    """(aggregate decode tok/s, slowest time to first token in s) of one batch: tokens
    streamed after every row had its first one and before the first row finished."""
    start = min(t0 for t0, _ in results)
    first = max(ev[0][0] for _, ev in results)
    end = min(ev[-1][0] for _, ev in results)
    if end <= first:  # a row finished before another started: up to the last row's end
        end = max(ev[-1][0] for _, ev in results)
    tokens = 0
    for _, ev in results:
        prev = None
        for t, n in ev:
            if first <= t <= end:
                tokens += n - (prev if prev is not None else n - 1)
            prev = n
    rate = tokens / (end - first) if end > first else float("nan")
    return rate, first - start


def ttft(engine, model: str, length: int, vocab: int, seed: int, repeat: int) -> list[float]:
    out = []
    for r in range(repeat):
        (t0, ev), = run_requests(engine, model, prompts_for(1, length, vocab, seed + r), 1, f"ttft{length}-{r}")  # fmt: skip
        out.append(ev[0][0] - t0)
    return out


def bench_mode(lm, mode: str, batches, steps: int, prompt_len: int, prefill: bool, deadline: float):
    """Rows for one model and mode."""
    max_batch = max(batches)
    engine = make_engine(lm, mode, max_batch, prompt_len + steps + 2200)
    vocab = lm.config["vocab_size"]
    rows = []
    try:
        t = now()
        ttft(engine, lm.name, prompt_len, vocab, seed=1, repeat=1)  # compile the first shapes
        log(f"  [{mode}] first request {now() - t:.1f} s")
        ttfts = ttft(engine, lm.name, prompt_len, vocab, seed=10, repeat=3)
        rows.append(dict(metric=f"ttft_{prompt_len}_s", value=statistics.median(ttfts), runs=ttfts))
        log(f"  [{mode}] TTFT {prompt_len} tokens alone: {[round(x * 1e3, 1) for x in ttfts]} ms")
        for b in batches:
            if now() > deadline:
                log(f"  [{mode}] B={b}: skipped (time limit)")
                continue
            warm = prompts_for(b, prompt_len, vocab, seed=100 + b)
            run_requests(engine, lm.name, warm, 4, f"warm{b}")
            t = now()
            res = run_requests(
                engine, lm.name, prompts_for(b, prompt_len, vocab, seed=200 + b), steps, f"b{b}"
            )
            rate, first = decode_rate(res)
            rows.append(dict(metric="decode_tok_s", batch=b, value=rate, slowest_ttft_s=first,
                             wall_s=now() - t, steps=steps, tokens=_TOKENS.get(f"b{b}-0", [])[:16]))  # fmt: skip
            log(f"  [{mode}] B={b}: {rate:,.1f} tok/s, slowest first token {first:.2f} s")
        if prefill and now() < deadline:
            ttft(engine, lm.name, 2048, vocab, seed=300, repeat=1)
            p = ttft(engine, lm.name, 2048, vocab, seed=310, repeat=2)
            rows.append(dict(metric="prefill_2048_tok_s", value=2048 / min(p), runs=p))
            log(
                f"  [{mode}] prefill 2048: {2048 / min(p):,.0f} tok/s ({[round(x * 1e3) for x in p]} ms)"
            )
    finally:
        engine.shutdown()
        os.environ.pop("MARKBASE_MOE", None)
    return rows


# -- one MoE layer alone ----------------------------------------------------------------
def layer_bench(lm, tokens_list, reps: int = 10) -> list[dict]:
    """GPU time of one ``SwitchGLU`` call (mlx-lm's) against ``GroupedSwitchGLU``'s
    routes at each token count, with random expert choices."""
    import numpy as np

    from engine.model import moe

    glu = switch_modules(lm.model)[0]
    moe.uninstall(lm.model)
    cfg = lm.config
    k = top_k_of(cfg)
    experts = (
        glu.gate_proj.num_experts
        if hasattr(glu.gate_proj, "num_experts")
        else glu.gate_proj["weight"].shape[0]
    )
    d = cfg["hidden_size"]
    per_expert = sum(
        sum(v.nbytes for v in (p["weight"], p["scales"], p.get("biases")) if v is not None)
        // experts
        for p in (glu.gate_proj, glu.up_proj, glu.down_proj)
    )
    rows = []
    rng = np.random.default_rng(0)

    class Pinned(moe.GroupedSwitchGLU):
        def route(self, xf, pairs):
            return self.pinned

    def timed(fn):
        for _ in range(2):
            mx.eval(fn())
        ts = []
        for _ in range(reps):
            t = now()
            mx.eval(fn())
            ts.append(now() - t)
        return statistics.median(ts)

    for tokens in tokens_list:
        x = mx.random.normal((tokens, d)).astype(mx.bfloat16) * 0.5
        idx = mx.array(
            np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(
                np.uint32
            )
        )
        touched = len(set(np.array(idx).reshape(-1).tolist()))
        glu.__class__ = moe.SwitchGLU
        stock = timed(lambda x=x, idx=idx: glu(x, idx))
        want = glu(x, idx).astype(mx.float32)
        scale = mx.abs(want).max()
        row = dict(tokens=tokens, experts_touched=touched, stock_ms=stock * 1e3)
        glu.__class__ = Pinned
        for route in ("kernel", "dequant", "sorted"):
            if route == "kernel" and tokens > 256:
                continue
            glu.pinned = route
            try:
                got = glu(x, idx).astype(mx.float32)
                row[f"{route}_err"] = (mx.abs(got - want).max() / scale).item()
                row[f"{route}_ms"] = timed(lambda x=x, idx=idx: glu(x, idx)) * 1e3
            except Exception as e:  # a route that does not take this shape
                row[f"{route}_ms"] = float("nan")
                log(f"  layer {route} T={tokens}: {e!r}")
        glu.__class__ = moe.SwitchGLU
        row["expert_bytes"] = touched * per_expert
        rows.append(row)
        best = min(v for kk, v in row.items() if kk.endswith("_ms") and kk != "stock_ms" and v == v)
        log(f"  layer T={tokens}: stock {stock * 1e3:.3f} ms, " + ", ".join(
            f"{r} {row.get(r + '_ms', float('nan')):.3f} (err {row.get(r + '_err', float('nan')):.1e})"
            for r in ("kernel", "dequant", "sorted")
        ) + f" ms; best {touched * per_expert / best / 1e6:,.0f} GB/s of expert weights")  # fmt: skip
    return rows


# -- main ------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,gemma4-26b-a4b,gemma4-e2b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--stock-batches", default="1,8")
    p.add_argument("--stock-steps", type=int, default=16)
    p.add_argument(
        "--stock-prefill", action="store_true", help="also the 2048-token prefill (slow)"
    )
    p.add_argument("--layer-tokens", default="1,8,32,128,2048")
    p.add_argument(
        "--time-limit-s", type=float, default=480.0, help="per model, then later parts are skipped"
    )
    p.add_argument(
        "--long-context",
        default="",
        help="positions for bench/long_context.py on these models, e.g. 0,1024,4096,8192,32768",
    )
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    stock_batches = [int(x) for x in args.stock_batches.split(",") if x]
    layer_tokens = [int(x) for x in args.layer_tokens.split(",") if x]

    device = str(mx.default_device())
    bw = read_bandwidth()
    log(
        f"{dt.datetime.now():%Y-%m-%d %H:%M} {platform.node()} {device}; read bandwidth {bw / 1e12:.2f} TB/s"
    )
    report = dict(date=str(dt.date.today()), device=device, command=sys.argv,
                  read_bandwidth=bw, models={})  # fmt: skip
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / f"moe_bench-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(report, indent=2, default=float))

    for name in [m for m in args.models.split(",") if m]:
        t0 = now()
        deadline = t0 + args.time_limit_s
        entry = report["models"].setdefault(name, {})
        try:
            lm = build(name)
            wb = weight_bytes(lm.model)
            entry["weights_gb"] = {k: v / 1e9 for k, v in wb.items()}
            log(f"{name}: built in {now() - t0:.1f} s, weights {sum(wb.values()) / 1e9:.2f} GB "
                f"(experts {wb['experts'] / 1e9:.2f})")  # fmt: skip
            entry["floor"] = []
            for b in batches:
                nbytes, rate = floor_tok_s(lm, b, args.prompt + args.steps // 2, bw)
                entry["floor"].append(dict(batch=b, step_gb=nbytes / 1e9, tok_s=rate))
                log(f"  floor B={b}: {nbytes / 1e9:.2f} GB a step, {rate:,.0f} tok/s")
            if switch_modules(lm.model) and layer_tokens:
                entry["layer"] = layer_bench(lm, layer_tokens)
                save()
            entry["grouped"] = bench_mode(
                lm, "grouped", batches, args.steps, args.prompt, True, deadline
            )
            save()
            if switch_modules(lm.model) and stock_batches and now() < deadline:
                entry["mlx"] = bench_mode(lm, "mlx", stock_batches, args.stock_steps, args.prompt,
                                          args.stock_prefill, deadline)  # fmt: skip
                save()
            if args.long_context and now() < deadline:
                positions = [int(x) for x in args.long_context.split(",")]
                os.environ["MARKBASE_MOE"] = "grouped"
                entry["long_context"] = long_context.run({name: lm}, positions, 32, 1)
                os.environ.pop("MARKBASE_MOE", None)
                save()
        except Exception as e:
            entry["error"] = repr(e)
            log(f"{name}: FAILED {e!r}")
            traceback.print_exc()
        finally:
            entry["seconds"] = now() - t0
            save()
            lm = None
            mx.clear_cache()
    print_table(report)


def print_table(report: dict) -> None:
    log("")
    log(
        f"{report['date']}, {report['device']}, read bandwidth {report['read_bandwidth'] / 1e12:.2f} TB/s"
    )
    log("command: " + " ".join(["python3", *report["command"]]))
    log("| model | mode | B=1 | B=8 | B=32 | B=128 | TTFT (ms) | prefill 2k tok/s |")
    log("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, e in report["models"].items():
        for mode in ("grouped", "mlx"):
            rows = e.get(mode)
            if not rows:
                continue
            dec = {r["batch"]: r["value"] for r in rows if r["metric"] == "decode_tok_s"}
            tt = next((r["value"] for r in rows if r["metric"].startswith("ttft")), None)
            pf = next((r["value"] for r in rows if r["metric"] == "prefill_2048_tok_s"), None)
            cells = [f"{dec[b]:,.1f}" if b in dec else "-" for b in (1, 8, 32, 128)]
            cells.append(f"{tt * 1e3:.1f}" if tt is not None else "-")
            cells.append(f"{pf:,.0f}" if pf is not None else "-")
            log(f"| {name} | {mode} | " + " | ".join(cells) + " |")
        toks = {
            mode: next((r.get("tokens") for r in e.get(mode) or [] if r.get("batch") == 1), None)
            for mode in ("grouped", "mlx")
        }
        if toks["grouped"] and toks["mlx"]:
            a, b = toks["grouped"], toks["mlx"]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            log(
                f"| {name} | B=1 greedy | first {same} of {min(len(a), len(b))} tokens equal (grouped vs mlx) |"
            )
        if e.get("floor"):
            cells = {f["batch"]: f["tok_s"] for f in e["floor"]}
            floor = [f"{cells[b]:,.0f}" if b in cells else "-" for b in (1, 8, 32, 128)]
            log(f"| {name} | floor | " + " | ".join(floor) + " | | |")
        if e.get("error"):
            log(f"| {name} | error | {e['error']} |")


if __name__ == "__main__":
    main()
