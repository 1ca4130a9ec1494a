"""Decode throughput with grammar-constrained rows: what structured output's masks cost.

    .venv/bin/python bench/structured_bench.py                       # B=1,8,32; 0/50/100%
    .venv/bin/python bench/structured_bench.py --tokens 128 --rounds 3
    .venv/bin/python bench/structured_bench.py --model gemma3-270m --batches 8
    .venv/bin/python bench/structured_bench.py --batches 8 --top-logprobs 5  # logprobs on too
    .venv/bin/python bench/structured_bench.py --orders read-first,forward-first  # GPU: A/B

For each batch size B and share of constrained rows (``--fractions``), B requests with
one chat prompt are run together through the real engine (``EngineClient``, the served
model's worker, its sampler, prefix cache and, on a GPU, its pipelined decode). The
constrained rows carry a JSON schema (an array of at least 10000 objects with an
integer, an enum, a bounded string and a boolean: the grammar never ends within
``--tokens`` and the end of sequence stays masked, so every row decodes exactly
``--tokens`` tokens); the others are free text with ``ignore_eos``. All rows sample
(temperature 0.8, a seed per row).

Decode tok/s counts the tokens delivered after the last row's first token (every
prefill done) over the time from then to the last token. Each configuration runs
``--rounds`` times, interleaved with the others (a shared machine's noise only slows
a run down), and the table gives the best; "vs 0%" is the ratio to the unconstrained
run of the same B in the same process. "fill ms" is the host time of llguidance's mask
fill per constrained step (``MaskFiller.fill``, which runs in its own thread while the
worker waits for the forward, or on a GPU queues it); "wait ms" is how long the worker then waited
for the masks, i.e. what the fill added to the step. The command, the device and the date are printed with the
table; raw numbers go to bench/results/structured-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu"))  # shapes.py

from shapes import CONFIGS as GPU_SHAPES  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "kind": {"enum": ["book", "film", "song", "game"]},
            "title": {"type": "string", "maxLength": 24},
            "liked": {"type": "boolean"},
        },
        "required": ["id", "kind", "title", "liked"],
        "additionalProperties": False,
    },
}
PROMPT = "List the books, films, songs and games you like as JSON records."

# --model random-smollm2: SmolLM2-135M's shape with random bfloat16 weights, for a machine
# without the model's package (an offline GPU machine); --tokenizer gives the real vocabulary,
# which is what the masks depend on. random-llama-1b / random-llama-8b: the GPU table's 1b and
# 8b layers (bench/gpu/shapes.py: Llama 3.2 1B's and Llama 3 8B's) with the same vocabulary,
# for the mask's cost beside a forward that is not bound by the host.
RANDOM_SHAPES = {
    "random-smollm2": dict(
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        head_dim=64,
    ),
    **{
        name: {**GPU_SHAPES[size], "vocab_size": 49152}
        for name, size in (("random-llama-1b", "1b"), ("random-llama-8b", "8b"))
    },
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help=f"a model source, or {', '.join(RANDOM_SHAPES)} (with --tokenizer)",
    )
    p.add_argument("--tokenizer", help="a saved tokenizer folder (engine.tokenizer.Tokenizer.save)")
    p.add_argument(
        "--bits", type=int, default=None, help="a random model's weights quantized (4 or 8)"
    )
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated")
    p.add_argument("--fractions", default="0,0.5,1", help="shares of constrained rows")
    p.add_argument("--tokens", type=int, default=48, help="tokens decoded per row")
    p.add_argument("--rounds", type=int, default=2, help="runs per configuration (best kept)")
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        help="every row (constrained or not) also asks for its tokens' logprobs and this many top",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's warm-up (default: by backend, on for a GPU)",
    )
    p.add_argument(
        "--orders",
        default="auto",
        help="the pipelined constrained step's orders to run (auto, read-first, forward-first; "
        "engine/structured/step_order.py), comma-separated",
    )
    p.add_argument(
        "--fill",
        choices=("parallel", "serial"),
        default=None,
        help="llguidance's fill (default: by backend)",
    )
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p.parse_args()


class MaskClock:
    """Sums, per step with constrained rows, the host time of llguidance's fill
    (``MaskFiller.fill``: in a thread of its own on the CPU, overlapping the forward)
    and the time the worker spent getting a step's masks (``ModelWorker._step_masks``
    and the pipelined step's wait for the fill: what the fill added to the step), and the host
    time of applying them (``apply_token_masks``: on the CPU the masking itself, on a
    GPU building its lazy ops)."""

    def __init__(self, worker) -> None:
        import engine.sampler

        self.fill_s = self.wait_s = self.apply_s = 0.0
        self.fills = self.waits = self.applies = 0
        fill, wait = worker.masks.fill, worker._step_masks
        apply = engine.sampler.apply_token_masks

        def timed_apply(logits, masks, on_host):
            t = time.perf_counter()
            try:
                return apply(logits, masks, on_host)
            finally:
                self.apply_s += time.perf_counter() - t
                self.applies += 1

        def timed_fill(rows):
            t = time.perf_counter()
            try:
                return fill(rows)
            finally:
                self.fill_s += time.perf_counter() - t
                self.fills += 1

        def timed_wait(seqs, pending=None):
            t = time.perf_counter()
            try:
                return wait(seqs, pending)
            finally:
                self.wait_s += time.perf_counter() - t
                self.waits += 1

        worker.masks.fill = timed_fill
        worker._step_masks = timed_wait
        engine.sampler.apply_token_masks = timed_apply

    def take(self) -> tuple[float, float, float]:
        """(fill, wait, apply) ms per step since the last call."""
        out = (
            1e3 * self.fill_s / self.fills if self.fills else 0.0,
            1e3 * self.wait_s / self.waits if self.waits else 0.0,
            1e3 * self.apply_s / self.applies if self.applies else 0.0,
        )
        self.fill_s = self.wait_s = self.apply_s = 0.0
        self.fills = self.waits = self.applies = 0
        return out


async def run_batch(
    client,
    model: str,
    prompt: list[int],
    b: int,
    n_constrained: int,
    tokens: int,
    spec,
    tag: str,
    top_logprobs: int | None = None,
) -> dict:
    from engine.types import GenerationRequest, SamplingParams

    reqs = []
    for i in range(b):
        constrained = i < n_constrained
        params = SamplingParams(
            max_tokens=tokens,
            temperature=0.8,
            seed=1000 + i,
            ignore_eos=not constrained,
            logprobs=top_logprobs,
        )
        reqs.append(
            GenerationRequest(
                f"{tag}-{i}", model, list(prompt), params, grammar=spec if constrained else None
            )
        )
    arrivals: list[tuple[float, int]] = []

    async def one(req):
        first = last = None
        n = 0
        async for ev in client.generate(req):
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(ev.token_ids)
            arrivals.append((now, len(ev.token_ids)))
            if ev.error:
                raise RuntimeError(ev.error)
        return first, last, n

    done = await asyncio.gather(*(one(r) for r in reqs))
    t0 = max(d[0] for d in done)
    t1 = max(d[1] for d in done)
    counted = sum(n for t, n in arrivals if t > t0)
    assert all(d[2] == tokens for d in done), [d[2] for d in done]
    return {
        "tok_s": counted / (t1 - t0) if t1 > t0 else 0.0,
        "decode_s": t1 - t0,
        "tokens": counted,
    }


def random_model(name: str, tokenizer_dir: str | None, bits: int | None = None):
    import dataclasses

    import mlx.core as mx

    from engine.loading import build_random_model
    from engine.tokenizer import Tokenizer

    if not tokenizer_dir:
        raise SystemExit(f"--model {name} needs --tokenizer DIR")
    lm = build_random_model("llama", RANDOM_SHAPES[name], seed=0, quantize_bits=bits, group_size=64)
    lm.model.set_dtype(mx.bfloat16)
    mx.eval(lm.model.parameters())
    return dataclasses.replace(
        lm,
        name=name,
        tokenizer=Tokenizer.load(tokenizer_dir),
        compute_dtype="bfloat16",
        weight_format=f"random-q{bits}" if bits else "random-bfloat16",
    )


def main() -> None:
    args = parse_args()
    # as `markbase serve` does, before MLX is imported: a fast BLAS for the CPU's
    # matmuls, the CUDA kernel cache and MLX's own attention (each a no-op elsewhere)
    from engine.backends.cpu.blas import ensure_fast_blas
    from engine.backends.cuda.setup import default_cuda_attention, default_ptx_cache_dir

    default_ptx_cache_dir()
    default_cuda_attention()
    ensure_fast_blas()
    import mlx.core as mx

    from engine.client import EngineClient
    from engine.config import EngineConfig
    from engine.loading import load_model
    from engine.structured import StepOrder
    from engine.types import GrammarSpec

    batches = [int(x) for x in args.batches.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]

    def counts(b: int) -> list[int]:
        """Constrained rows per run at batch size b (a share that rounds to a count
        already run is not run twice)."""
        return sorted({round(b * f) for f in fractions})

    t = time.perf_counter()
    lm = (
        random_model(args.model, args.tokenizer, args.bits)
        if args.model in RANDOM_SHAPES
        else load_model(args.model)
    )
    load_s = time.perf_counter() - t
    config = EngineConfig(max_num_seqs=max(batches), warmup=args.warmup)
    t = time.perf_counter()
    client = EngineClient.from_loaded([(lm, None)], config)
    start_s = time.perf_counter() - t
    worker = client.worker(lm.name)
    clock = MaskClock(worker)
    if args.fill:
        worker.masks.parallel = args.fill == "parallel"
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    t = time.perf_counter()
    client.compile_grammar(lm.name, spec)
    compile_s = time.perf_counter() - t
    try:
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    except ImportError:  # no jinja2 here: the plain text is as good a prompt for timing
        prompt = lm.tokenizer.encode(PROMPT)
    print(
        f"# load {load_s:.1f} s, engine start {start_s:.1f} s, grammar (+ token bridge) "
        f"{compile_s:.2f} s, device {mx.default_device()}",
        file=sys.stderr,
    )

    async def bench():
        # untimed: every batch size once, constrained, so the first timed run is warm
        for b in batches:
            await run_batch(client, lm.name, prompt, b, b, 8, spec, f"warm{b}", args.top_logprobs)
        clock.take()
        best: dict[tuple[int, int], dict] = {}
        for r in range(args.rounds):
            for b, order in ((b, o) for b in batches for o in args.orders.split(",")):
                worker.step_order = StepOrder(fixed=None if order == "auto" else order)
                for n_c in counts(b):
                    res = await run_batch(
                        client,
                        lm.name,
                        prompt,
                        b,
                        n_c,
                        args.tokens,
                        spec,
                        f"r{r}-{b}-{n_c}",
                        args.top_logprobs,
                    )
                    fill, wait, apply = clock.take()
                    res.update(
                        fill_ms_per_step=fill, wait_ms_per_step=wait, apply_ms_per_step=apply
                    )
                    res["constrained_rows"] = n_c
                    print(
                        f"# round {r} B={b} order={order} constrained={n_c}: "
                        f"{res['tok_s']:.1f} tok/s (order now {worker.step_order.chosen})",
                        file=sys.stderr,
                    )
                    key = (b, n_c, order)
                    if key not in best or res["tok_s"] > best[key]["tok_s"]:
                        best[key] = res
        return best

    best = asyncio.run(bench())
    client.shutdown()

    device = str(mx.default_device())
    lines = [
        "command: " + " ".join([Path(sys.executable).name, *sys.argv]),
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}, host: {platform.node()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, MLX {mx.__version__} "
        f"on {device}",
        f"model: {args.model}, {args.tokens} tokens a row, best of {args.rounds} rounds, "
        "temperature 0.8"
        + (f", every row with logprobs (top {args.top_logprobs})" if args.top_logprobs else ""),
        "",
        "| B | order | constrained rows | decode tok/s | step ms | vs 0% | fill ms | wait ms | apply ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, order in ((b, o) for b in batches for o in args.orders.split(",")):
        base = best[(b, 0, order)]["tok_s"] if (b, 0, order) in best else None
        for n_c in counts(b):
            res = best[(b, n_c, order)]
            ratio = f"{res['tok_s'] / base:.2f}" if base else "-"
            step = 1e3 * b / res["tok_s"] if res["tok_s"] else 0.0
            ms = [
                f"{res[k]:.2f}" if n_c else "-"
                for k in ("fill_ms_per_step", "wait_ms_per_step", "apply_ms_per_step")
            ]
            lines.append(
                f"| {b} | {order} | {n_c} ({n_c / b:.0%}) | {res['tok_s']:.1f} | {step:.1f} | {ratio} | "
                + " | ".join(ms)
                + " |"
            )
    print("\n".join(lines))
    out = Path(os.environ.get("OUT", args.out))
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"structured-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "argv": sys.argv,
                "device": device,
                "model": args.model,
                "tokens": args.tokens,
                "rows": [{"batch": b, "order": o, **best[(b, n, o)]} for (b, n, o) in sorted(best)],
                "table": lines,
            },
            indent=1,
        )
    )
    print(f"# raw: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
