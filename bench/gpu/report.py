"""Tables from bench_decode.py (MLX) and torch_ref.py (PyTorch) JSON files.

    python3 bench/gpu/report.py mlx.json [more_mlx.json ...] [torch.json]

Decode tok/s per (model, quant, B): markbase's path and its variants, PyTorch with CUDA
graphs, and the bandwidth floor: (weight bytes + KV bytes read per step) / the copy
bandwidth measured in the same MLX run, at the mean KV length of the timed steps.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

VARIANTS = ["markbase", "ragged", "async", "static", "compiled_sync", "compiled", "worker"]


def load(paths):
    mlx, torch = [], []
    for p in paths:
        docs = json.load(open(p))
        for d in docs if isinstance(docs, list) else [docs]:
            if d.get("engine") == "mlx-engine":
                continue  # bench_engine.py: it prints its own table
            (torch if d.get("engine") == "torch" else mlx).append(d)
    return mlx, torch


def fmt(x, nd=0):
    return "-" if x is None else f"{x:,.{nd}f}"


def main(paths) -> None:
    mlx, torch = load(paths)
    # the hardware ceiling: the best device copy measured (MLX's own elementwise copy is slower)
    bw = max((d["copy_bw"] for d in mlx + torch if d.get("copy_bw")), default=None)
    heads = [
        f"{d.get('date')} {d.get('gpu') or d.get('device')} mlx {d.get('mlx')} "
        f"copy {d['copy_bw'] / 1e12:.2f} TB/s"
        for d in mlx
    ]
    heads += [
        f"{d.get('date')} {d.get('gpu')} torch {d.get('torch')} copy {d['copy_bw'] / 1e12:.2f} TB/s"
        for d in torch
    ]
    print("\n".join(heads))
    dec = defaultdict(dict)
    info = {}
    for d in mlx:
        for r in d["rows"]:
            if r.get("kind") == "decode":
                key = (r["model"], r["quant"], r["batch"])
                dec[key][r["variant"]] = r
                info[key] = r
    tdec = {}
    for d in torch:
        for r in d["rows"]:
            if r.get("kind") == "decode":
                tdec[(r["model"], r["quant"], r["batch"])] = r
    print("\n## Decode tokens/s (median step; B rows per step)\n")
    seen = {v for row in dec.values() for v in row}
    variants = [v for v in VARIANTS if v in seen] + sorted(seen - set(VARIANTS))
    # "served": the engine as the server runs it (the worker variant where measured)
    cols = variants + ["torch graph", "torch sync", "floor", "served/torch bf16", "served x floor"]
    print("| model | quant | B | " + " | ".join(cols) + " |")
    print("|" + "---|" * (3 + len(cols)))
    for key in sorted(set(dec) | set(tdec), key=lambda k: (k[0], k[1], k[2])):
        row = dec.get(key, {})
        vals = [row.get(v, {}).get("tok_s") for v in variants]
        t = tdec.get(key)
        vals += [t and t["tok_s"], t and t["tok_s_synced"]]
        floor = None
        r = info.get(key) or t
        if bw and r:
            b = key[2]
            kv_len = r["prompt"] + r.get("steps", 128) / 2
            step_bytes = r["weight_bytes"] + b * kv_len * r["kv_bytes_token"]
            floor = b / (step_bytes / bw)
        vals.append(floor)
        served = (row.get("worker") or row.get("markbase") or {}).get("tok_s")
        ref = tdec.get((key[0], "bf16", key[2]))
        vs_torch = f"{served / ref['tok_s']:.2f}x" if (served and ref) else "-"
        # the step's time over the floor's: how far from reading weights + KV at copy speed
        x_floor = f"{floor / served:.2f}x" if (served and floor) else "-"
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | "
            + " | ".join(fmt(v) for v in vals)
            + f" | {vs_torch} | {x_floor} |"
        )

    print(
        "\n## markbase step breakdown (ms, medians): graph build (Python) / mx.eval / .tolist()\n"
    )
    print(
        "| model | quant | B | step | build | eval | tolist | first step s | add s (B rows) | max step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(dec):
        r = dec[key].get("markbase")
        if r:
            print(
                f"| {key[0]} | {key[1]} | {key[2]} | {r['step_ms_median']:.3f} | {r['build_ms']:.3f} | "
                f"{r['eval_ms']:.3f} | {r['tolist_ms']:.3f} | {r['first_step_s']:.2f} | {r['add_s']:.3f} | "
                f"{r['step_ms_max']:.1f} |"
            )
    print("\n## pipelined (async) step breakdown (ms, medians): build / mx.async_eval / wait\n")
    print(
        "| model | quant | B | variant | step | build | async_eval (encode+launch) | wait for GPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(dec):
        for v, r in sorted(dec[key].items()):
            if "enqueue_ms" in r:
                print(
                    f"| {key[0]} | {key[1]} | {key[2]} | {v} | {r['step_ms_median']:.3f} | "
                    f"{r['build_ms']:.3f} | {r['enqueue_ms']:.3f} | {r['wait_ms']:.3f} |"
                )
    mm = [r for d in mlx for r in d["rows"] if r.get("kind") == "matmul"]
    if mm:
        print(
            "\n## MLX MLP matmuls of 16 layers (48 ops), bf16 / q4: time and weight bytes / time\n"
        )
        print("| model | quant | rows | one eval ms | TB/s | eval per op ms | extra us per op |")
        print("|---|---|---|---|---|---|---|")
        for r in mm:
            extra = (r["sync_each_ms"] - r["one_eval_ms"]) / r["ops"] * 1e3
            print(
                f"| {r['model']} | {r['quant']} | {r['rows']} | {r['one_eval_ms']:.3f} | "
                f"{r['one_eval_bw'] / 1e12:.2f} | {r['sync_each_ms']:.3f} | {extra:.0f} |"
            )
    comp = [(k, v["compiled"]) for k, v in sorted(dec.items()) if "compiled" in v]
    if comp:
        print(
            "\nmx.compile first call (trace + JIT), s: "
            + ", ".join(f"{k[0]} {k[1]} B={k[2]}: {r.get('first_call_s', 0):.1f}" for k, r in comp)
        )

    print("\n## Prefill (one sequence)\n")
    print("| engine | model | quant | tokens | chunk | tok/s | ms | first call s |")
    print("|---|---|---|---|---|---|---|---|")
    for d in mlx:
        for r in d["rows"]:
            if r.get("kind") == "prefill":
                print(
                    f"| mlx markbase | {r['model']} | {r['quant']} | {r['n']} | {r['chunk']} | {fmt(r['tok_s'])} | "
                    f"{r['ms']:.1f} | {r['first_s']:.2f} |"
                )
    for d in torch:
        for r in d["rows"]:
            if r.get("kind") == "prefill":
                print(
                    f"| torch eager | {r['model']} | {r['quant']} | {r['n']} | {r['n']} | {fmt(r['tok_s'])} | "
                    f"{r['ms']:.1f} | {r['first_s']:.2f} |"
                )
    reps = defaultdict(list)
    for d in mlx:
        for r in d["rows"]:
            if r.get("kind") == "decode" and "rep" in r:
                reps[(r["model"], r["quant"], r["batch"], r["variant"])].append(r["tok_s"])
    multi = {k: v for k, v in reps.items() if len(v) > 1}
    if multi:
        print("\n## Repeated in one process (interleaved): tok/s median [min, max]\n")
        print("| model | quant | B | variant | runs | median | min | max |")
        print("|---|---|---|---|---|---|---|---|")
        for k in sorted(
            multi,
            key=lambda k: (
                k[0],
                k[1],
                k[2],
                VARIANTS.index(k[3]) if k[3] in VARIANTS else 99,
                k[3],
            ),
        ):
            v = sorted(multi[k])
            med = v[len(v) // 2]
            print(
                f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {len(v)} | {med:,.0f} | {v[0]:,.0f} | {v[-1]:,.0f} |"
            )
    errs = [r for d in mlx for r in d["rows"] if r.get("kind") == "error"]
    for r in errs:
        print(
            f"\nERROR {r.get('model')} {r.get('quant')} B={r.get('batch')} {r.get('variant')}: "
            f"{r['error'].strip().splitlines()[-1]}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
