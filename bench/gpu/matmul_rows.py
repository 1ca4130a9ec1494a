"""The decode step's products by row count: which formulation is fastest on this GPU.

    python3 bench/gpu/matmul_rows.py --out $OUT/matmul_rows.json --plans $OUT/plans.env

For the 1b and 8b shapes (bench/gpu/shapes.py) it times one layer's four products
(fused QKV, O, fused gate/up, down) over enough distinct weight copies that L2 holds
none of them, at 1-128 rows, in every formulation engine/backends/cuda/linear.py knows (bf16:
``xwt``, ``wxt``; 4-bit group 64: ``qmm``, ``deq``, ``deqwxt``). Prints ms per layer
and the weight bandwidth, and writes the plans that pick the fastest formulation
per row count (geometric mean over both models of its time / the default's) as
``export MARKBASE_GPU_FLOAT_PLAN=... MARKBASE_GPU_QUANT_PLAN=...``.
On the CPU (``--models tiny --rows 1,4 --copies 2``) it only checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from shapes import CONFIGS  # noqa: E402

from engine.backends.cuda.linear import (  # noqa: E402
    FLOAT_FORMS,
    QUANT_FORMS,
    GpuLinear,
    GpuQuantizedLinear,
    parse_plan,
)


def layer_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of one llama layer's decode products, QKV and gate/up fused."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    return [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f)]


def make_layers(cfg: dict, quant: bool, copies: int) -> list[list]:
    layers = []
    for _ in range(copies):
        mods = []
        for n, k in layer_shapes(cfg):
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
            if quant:
                wq, s, b = mx.quantize(w, group_size=64, bits=4)
                mods.append(GpuQuantizedLinear(wq, s, b, 64, 4, "affine"))
            else:
                mods.append(GpuLinear(w))
        mx.eval([m.weight for m in mods])
        layers.append(mods)
    return layers


def in_dim(m) -> int:
    """K of a product: 4-bit weights pack 8 values per uint32."""
    return m.weight.shape[1] * (8 if isinstance(m, GpuQuantizedLinear) else 1)


def time_form(layers, rows: int, form: str, plan_forms, reps: int) -> float:
    """Seconds of GPU kernel time for one layer's products (all copies in one eval, /
    copies), from CUPTI: the products are independent, and MLX's CUDA graph may run
    them side by side, so wall time flattered small grids (64-block kernels looked ~2x
    faster than in the decode step). Wall time (median) without a GPU."""
    plan = parse_plan(f"1:{form}", plan_forms)
    for mods in layers:
        for m in mods:
            m.set_plan(plan)
    xs = {
        k: (mx.random.normal((rows, k)) * 0.1).astype(mx.bfloat16) for k in map(in_dim, layers[0])
    }
    mx.eval(list(xs.values()))

    def outs():
        return [m(xs[in_dim(m)]) for mods in layers for m in mods]

    def run():
        mx.eval(outs())

    run()  # JIT, cuBLAS heuristics
    if mx.cuda.is_available():
        from q4_bench import cupti_events

        events = cupti_events(outs, reps)
        return sum(e["dur"] for e in events) * 1e-6 / reps / len(layers)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) / len(layers)


def plan_text(winners: dict[int, str]) -> str:
    steps, last = [], None
    for rows in sorted(winners):
        if winners[rows] != last:
            steps.append(f"{1 if not steps else rows}:{winners[rows]}")
            last = winners[rows]
    return ",".join(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--copies", type=int, default=0, help="weight copies (0: >= 1 GB each)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plans", default=None, help="write the winning plans here (shell)")
    ap.add_argument(
        "--forms", default="", help="only these forms (e.g. xwt,qmm,deq: prefill's question)"
    )
    a = ap.parse_args()
    only = set(filter(None, a.forms.split(",")))
    rows_list = [int(r) for r in a.rows.split(",")]
    results = []
    ratios: dict[tuple[str, int, str], list[float]] = {}
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    print("| model | weights | rows | form | ms/layer | weight TB/s | vs default |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in a.models.split(","):
        cfg = CONFIGS[name]
        for quant, forms in ((False, FLOAT_FORMS), (True, QUANT_FORMS)):
            forms = tuple(f for f in forms if not only or f in only)
            if not forms:
                continue
            bpe = 0.5 + 4 / 64 if quant else 2  # 4-bit + bf16 scale and bias per 64
            layer_bytes = sum(n * k for n, k in layer_shapes(cfg)) * bpe
            copies = a.copies or max(2, math.ceil(1e9 / layer_bytes))
            layers = make_layers(cfg, quant, copies)
            kind = "q4" if quant else "bf16"
            for rows in rows_list:
                base = None
                for form in forms:
                    t = time_form(layers, rows, form, forms, a.reps)
                    base = base or t
                    ratios.setdefault((kind, rows, form), []).append(t / base)
                    bw = layer_bytes / t
                    results.append(
                        dict(model=name, quant=kind, rows=rows, form=form, s=t, weight_bw=bw)
                    )
                    print(
                        f"| {name} | {kind} | {rows} | {form} | {t * 1e3:.3f} | "
                        f"{bw / 1e12:.2f} | {t / base:.2f} |",
                        flush=True,
                    )
            del layers
            mx.clear_cache()
    plans = {}
    for kind, forms in (("bf16", FLOAT_FORMS), ("q4", QUANT_FORMS)):
        forms = tuple(f for f in forms if not only or f in only)
        if not forms:
            plans[kind] = ""
            continue
        winners = {}
        for rows in rows_list:
            score = {
                f: math.exp(statistics.fmean(math.log(r) for r in ratios[(kind, rows, f)]))
                for f in forms
            }
            best = min(score, key=score.get)
            # another form only when clearly faster than the default (noise: a few %)
            winners[rows] = best if score[best] < 0.95 else forms[0]
        plans[kind] = plan_text(winners)
    print(f"plans: MARKBASE_GPU_FLOAT_PLAN={plans['bf16']} MARKBASE_GPU_QUANT_PLAN={plans['q4']}")
    if a.plans:
        Path(a.plans).write_text(
            f"export MARKBASE_GPU_FLOAT_PLAN={plans['bf16']}\n"
            f"export MARKBASE_GPU_QUANT_PLAN={plans['q4']}\n"
        )
    if a.out:
        doc = dict(
            engine="matmul-rows",
            mlx=mx.__version__,
            device=str(mx.default_device()),
            date=time.strftime("%Y-%m-%d"),
            rows=results,
            plans=plans,
        )
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
