"""Benchmark serving: markbase and every peer installed here, one table and one plot.

    markbase bench                                   # markbase + installed peers, 1,2,4,8,16
    markbase bench --quick                           # a smoke run (about a minute per server)
    markbase bench --servers markbase --concurrency 1,4 --plot out.png

Runs bench/serve/serve_bench.py (a source checkout's bench/ folder): each server is started
on a free loopback port and sent the same streaming chat workload at each concurrency
level. Prints its markdown table, writes the raw results under bench/results/ and a
PNG of output tok/s and TTFT p50 against concurrency (matplotlib). Arguments after
``--`` go to serve_bench.py as they are (``-- --help`` lists them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "serve"
RESULTS = REPO / "bench" / "results" / "serve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--servers",
        default=None,
        help="comma-separated from markbase, markbase-nobatch, mlx_lm, llama-server, llamacpp "
        "(default: markbase and the peers installed here)",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or .gguf file")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="concurrency levels")
    p.add_argument("--requests", type=int, default=None, help="most requests per level")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request")
    p.add_argument("--quick", action="store_true", help="smoke run: few requests, 32 tokens")
    p.add_argument(
        "--plot", default=None, metavar="PNG", help="plot file (default: next to the results)"
    )
    p.add_argument("--out", default=str(RESULTS), help="results folder")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then serve_bench.py arguments")


def installed_peers() -> list[str]:
    """Peers that can run here without a build step: mlx_lm.server when mlx-lm is
    installed, llama.cpp's llama-server when it was built into the bench cache
    (``serve_bench.py --setup-llama-server``; see bench/serve/README.md)."""
    peers = []
    if importlib.util.find_spec("mlx_lm") is not None:
        peers.append("mlx_lm")
    sys.path.insert(0, str(BENCH))
    try:
        from peers import llama_server_ok

        if llama_server_ok():
            peers.append("llama-server")
    finally:
        sys.path.remove(str(BENCH))
    return peers


def bench_argv(args: argparse.Namespace, servers: list[str], tag: str) -> list[str]:
    argv = [
        "--servers",
        ",".join(servers),
        "--model",
        args.model,
        "--concurrency",
        args.concurrency,
        "--tag",
        tag,
        "--out",
        args.out,
    ]
    if args.requests is not None:
        argv += ["--requests", str(args.requests)]
    if args.max_tokens is not None:
        argv += ["--max-tokens", str(args.max_tokens)]
    if args.quick:
        argv.append("--quick")
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return argv + rest


def load_points(result: Path) -> dict[str, list[tuple[int, float | None, float | None]]]:
    """server -> [(concurrency, output tok/s, TTFT p50 s)] from serve_bench's JSON."""
    data = json.loads(result.read_text())
    out: dict[str, list] = {}
    for rec in data["servers"]:
        pts = [
            (
                lv["summary"]["concurrency"],
                lv["summary"].get("output_tok_s"),
                lv["summary"].get("ttft_p50_s"),
            )
            for lv in rec["levels"]
        ]
        if pts:
            out[rec["server"]] = sorted(pts)
    return out


def plot(points: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for name, pts in points.items():
        c = [p[0] for p in pts]
        ax1.plot(c, [p[1] or 0 for p in pts], marker="o", label=name)
        ttft = [(p[0], p[2] * 1000) for p in pts if p[2] is not None]
        if ttft:
            ax2.plot([t[0] for t in ttft], [t[1] for t in ttft], marker="o", label=name)
    for ax, ylabel in ((ax1, "output tokens/s (all requests)"), (ax2, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        levels = sorted({p[0] for pts in points.values() for p in pts})
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(levels))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%d"))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.margins(y=0.12)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    if not (BENCH / "serve_bench.py").is_file():
        print("markbase bench: needs the bench/ folder of a source checkout", file=sys.stderr)
        return 2
    servers = args.servers.split(",") if args.servers else ["markbase", *installed_peers()]
    tag = "cli-" + time.strftime("%H%M%S")
    argv = bench_argv(args, servers, tag)
    sys.path.insert(0, str(BENCH))
    import serve_bench

    sys.argv[0] = "bench/serve/serve_bench.py"  # the command its report names: re-runnable
    code = serve_bench.main(argv)
    results = sorted(Path(args.out).glob(f"serve-*-{tag}.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        print("markbase bench: no results were written", file=sys.stderr)
        return code or 1
    points = load_points(results[-1])
    if not points:
        print("markbase bench: no level finished; nothing to plot", file=sys.stderr)
        return code or 1
    png = Path(args.plot) if args.plot else results[-1].with_suffix(".png")
    title = f"markbase bench: {args.model}, concurrency {args.concurrency} ({results[-1].stem})"
    print(f"plot: {plot(points, png, title)}")
    return code
