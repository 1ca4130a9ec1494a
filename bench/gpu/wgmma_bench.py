"""engine/backends/cuda/products/wgmma.py against the kernels the decode step uses now (gpu_qgemm where
``gpu_qgemm.takes``, else gpu_mma): exactness of each form, then each product's time.

Why: without it, the 8b 4-bit B=128 cell was level with compiled PyTorch (H100,
2026-12-05) and its 4-bit products ran at ~175 TFLOP/s; the wgmma kernel is meant to
take them well past that. Its descriptor layout was written without a GPU, so the
first part prints the largest error of every form on small integers (exact products:
0 is right, anything else is a layout error) for both readings of the descriptor's
offsets (``MARKBASE_GPU_WGMMA_SWAP``) and both x pipelines (``_NX``).

Runs on the GPU machine (docs/gpu-development.md):

    python3 bench/gpu/wgmma_bench.py [--check-only] [--out $OUT/wgmma.json]

Times: CUPTI kernel durations (median over ``--reps`` x ``--calls`` calls over 3
weight copies), us a call, TFLOP/s, and the time over the current kernel's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.backends.cuda.products import qgemm as gpu_qgemm
from engine.backends.cuda.products import wgmma as gpu_wgmma  # noqa: E402
from tests.backends.cuda.emulation.qgemm import pack  # noqa: E402  (MLX's 4-bit packing)

GS = 64


def check(rows: int, n: int, k: int, form: str, dtype=mx.bfloat16, gs: int = 64) -> float:
    """Largest |kernel - exact| on small integers (0 when the layout is right)."""
    rng = np.random.default_rng(rows * 7 + n + k)
    q = rng.integers(0, 16, (n, k))
    wq = mx.array(pack(q))
    s = mx.ones((n, k // gs), dtype=dtype)
    b = mx.full((n, k // gs), -8.0, dtype=dtype)
    x = rng.integers(-3, 4, (rows, k)).astype(np.float32)
    want = x @ (q - 8).T.astype(np.float32)
    xm = mx.array(x).astype(dtype)
    if form == "glu":
        got = gpu_wgmma.quantized_matmul(xm, wq, s, b, gs, glu=True)
        gate, up = want[:, : n // 2], want[:, n // 2 :]
        ref = np.array(
            (mx.array(gate).astype(mx.float32) * mx.sigmoid(mx.array(gate)) * mx.array(up))
            .astype(dtype)
            .astype(mx.float32)
        )
        got = np.array(got.astype(mx.float32))
        return float(np.max(np.abs(got - ref) / (np.abs(ref) + 1.0)))
    res = None
    if form == "res":
        res_np = rng.integers(-4, 5, (rows, n)).astype(np.float32)
        res = mx.array(res_np).astype(dtype)
        want = want + res_np
    got = gpu_wgmma.quantized_matmul(xm, wq, s, b, gs, residual=res)
    ref = np.array(mx.array(want).astype(dtype).astype(mx.float32))
    return float(np.max(np.abs(np.array(got.astype(mx.float32)) - ref)))


# x buffers : warpgroups, "w": the weights' loads right after each step's wgmma
CHECK_FORMS = "3:2,4:2,3:4,4:4,5:4,3:4w,4:4w,4:2w"


def use_form(form: str) -> tuple[str, str]:
    """Set gpu_wgmma's knobs for launchers made from now on: ``"nx:wg"`` (x buffers,
    warpgroups), a trailing ``w`` for MARKBASE_GPU_WGMMA_WEARLY=1; -> (nx, wg)."""
    nx, wgs = form.rstrip("w").split(":")
    os.environ[gpu_wgmma.NX_ENV], os.environ[gpu_wgmma.WG_ENV] = nx, wgs
    os.environ[gpu_wgmma.WEARLY_ENV] = "1" if form.endswith("w") else "0"
    return nx, wgs


def check_all(forms: str = CHECK_FORMS) -> list[dict]:
    out = []
    print("| nx:wg | rows | N | K | form | max error |")
    print("|---|---:|---:|---:|---|---:|")
    for nx in [f for f in forms.split(",") if f]:
        use_form(nx)
        for rows, n, k in (
            (128, 256, 512),
            (40, 384, 256),
            (100, 33792, 128),
            (64, 1024, 4096),
            (130, 256, 1024),
        ):
            for form in ("plain", "res", "glu"):
                try:
                    err = check(rows, n, k, form)
                except Exception as e:  # a form that does not launch
                    print(f"{nx} {rows} {n} {k} {form}: {type(e).__name__}: {e}")
                    err = float("nan")
                print(f"| {nx} | {rows} | {n} | {k} | {form} | {err:g} |")
                out.append(dict(nx=nx, rows=rows, n=n, k=k, form=form, err=err))
    for env in (gpu_wgmma.NX_ENV, gpu_wgmma.WG_ENV, gpu_wgmma.WEARLY_ENV):
        os.environ.pop(env, None)
    return out


def probes() -> dict:
    """Where a wrong layout sends values: one 64-input step, 128 x rows, 128 weight rows,
    scale 1, bias 0. ``k_of``: x row m is one-hot at input m % 64 and weight values are
    their input index % 16, so y[m, n] should be m % 16 (which input a product read);
    ``n_of``: x all ones on input 0 and weight values their row % 16, so y[m, n] should
    be n % 16 (which weight row an output came from). Arrays go to the JSON."""
    out = {}
    rows, n, k = 128, 128, 64
    onehot = np.zeros((rows, k), np.float32)
    onehot[np.arange(rows), np.arange(rows) % k] = 1
    first = np.zeros((rows, k), np.float32)
    first[:, 0] = 1
    for name, x, q in (
        ("k_of", onehot, np.tile(np.arange(k) % 16, (n, 1))),
        ("n_of", first, np.tile((np.arange(n) % 16)[:, None], (1, k))),
    ):
        s = mx.ones((n, 1), dtype=mx.bfloat16)
        b = mx.zeros((n, 1), dtype=mx.bfloat16)
        y = gpu_wgmma.quantized_matmul(mx.array(x).astype(mx.bfloat16), mx.array(pack(q)), s, b, 64)
        out[name] = np.array(y.astype(mx.float32)).astype(int).tolist()
    return out


def current(rows: int, n: int, k: int, residual: bool, glu: bool):
    """The launch the decode step makes now for this product (qgemm or qmma)."""
    from engine.backends.cuda.products import mma as gpu_mma

    if gpu_qgemm.takes(rows, n // 16, glu, k, residual):
        return "qgemm", gpu_qgemm.launcher(mx.bfloat16, rows, n, k, GS, residual, glu)
    return "qmma", gpu_mma.launcher("q4", mx.bfloat16, rows, n, k, GS, residual, glu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--rows", default="128,64")
    ap.add_argument("--forms", default="3:2,4:2,3:4", help="x buffers:warpgroups a block, each")
    ap.add_argument("--products", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-limit-s", type=float, default=200)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-forms", default="", help="only these nx:wg in the check (no probes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    check_forms = args.check_forms or CHECK_FORMS
    result: dict = {
        "engine": "wgmma-bench",
        "check": [] if args.skip_check else check_all(check_forms),
    }
    if not args.skip_check and not args.check_forms:
        try:
            result["probes"] = probes()
        except Exception as e:
            print(f"probes: {type(e).__name__}: {e}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.check_only:
        return
    from q4_bench import products
    from qgemm_sweep import timed
    from shapes import CONFIGS

    t0 = time.perf_counter()
    rows_out = []
    print("| model | product | rows | form | us | TFLOP/s | / current |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name in [m for m in args.models.split(",") if m]:
        for pname, n, k, residual, glu in products(CONFIGS[name], head=True):
            if pname not in args.products.split(","):
                continue
            weights = []
            for _ in range(3):
                w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
                weights.append(mx.quantize(w, group_size=GS, bits=4))
            mx.eval(weights)
            for rows in [int(r) for r in args.rows.split(",") if r]:
                if time.perf_counter() - t0 > args.time_limit_s:
                    print(f"time limit reached at {name} {pname} {rows}")
                    break
                x = mx.random.normal((rows, k)).astype(mx.bfloat16) * 0.1
                extra = [mx.zeros((rows, n), dtype=mx.bfloat16)] if residual else []
                inputs = [[x, *wsb, *extra] for wsb in weights]
                flop = 2.0 * rows * n * k
                label, fn = current(rows, n, k, residual, glu)
                base = timed(fn, inputs, args.calls, args.reps)
                forms = [(label, base)]
                for form in [v for v in args.forms.split(",") if v]:
                    nx, wgs = use_form(form)
                    try:
                        fn = gpu_wgmma.launcher(mx.bfloat16, rows, n, k, GS, residual, glu)
                        us = timed(fn, inputs, args.calls, args.reps)
                    except Exception as e:
                        print(f"wgmma {form}: {type(e).__name__}: {e}")
                        us = float("nan")
                    forms.append(
                        (f"wgmma nx{nx} wg{wgs}" + (" we" if form.endswith("w") else ""), us)
                    )
                os.environ.pop(gpu_wgmma.NX_ENV, None)
                os.environ.pop(gpu_wgmma.WG_ENV, None)
                os.environ.pop(gpu_wgmma.WEARLY_ENV, None)
                for form, s in forms:
                    print(
                        f"| {name} | {pname} | {rows} | {form} | {s * 1e6:.1f} | "
                        f"{flop / s / 1e12:.0f} | {s / base:.2f} |"
                    )
                    rows_out.append(dict(model=name, product=pname, rows=rows, form=form,
                                         us=s * 1e6, tflops=flop / s / 1e12, vs_current=s / base))  # fmt: skip
            del weights
    result["rows"] = rows_out
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
