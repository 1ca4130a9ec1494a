#!/usr/bin/env python
"""Serving benchmark: markbase (batching on and off) against mlx_lm.server and llama.cpp.

Starts each server itself on 127.0.0.1 (a free port), sends every server the same
deterministic streaming chat workload at each concurrency level, kills the server, and
prints one markdown table plus ratios; the full results go to bench/results/serve/.

    .venv/bin/python bench/serve/serve_bench.py --quick --servers markbase
    .venv/bin/python bench/serve/serve_bench.py            # all servers, concurrency 1,2,4,16,64

See bench/serve/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import LevelResult, result_to_json, run_level  # noqa: E402
from peers import (  # noqa: E402
    ALL_SERVERS,
    REPO,
    ServerProcess,
    Unavailable,
    make_specs,
    setup_llama_server,
    setup_llamacpp,
)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "serve"


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--servers",
        default=",".join(ALL_SERVERS),
        help=f"comma-separated, from {', '.join(ALL_SERVERS)}",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="markbase alias or .gguf path; the GGUF goes to llama.cpp, its mlx-lm export to mlx_lm",
    )
    p.add_argument("--concurrency", default="1,2,4,16,64", help="concurrency levels")
    p.add_argument("--requests", type=int, default=64, help="most requests per level")
    p.add_argument(
        "--requests-per-level",
        default="auto",
        help="'auto' = min(--requests, max(4, 4*concurrency)); an int; or one int per level",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument(
        "--eos",
        choices=["ignore", "natural"],
        default="ignore",
        help="ignore: markbase gets ignore_eos, peers a logit_bias of -100 on the EOS tokens",
    )
    p.add_argument(
        "--sampling",
        default="",
        help='JSON merged into every request, e.g. \'{"temperature": 1.0, "top_p": 0.9}\' '
        "(default: temperature 0, greedy)",
    )
    p.add_argument(
        "--max-level-seconds",
        type=float,
        default=300.0,
        help="a level stops after this long: requests in flight are cut, the rest not sent",
    )
    p.add_argument(
        "--ramp-s",
        type=float,
        default=0.0,
        help="spread the clients' first requests over this many seconds (0: all at once)",
    )
    p.add_argument("--request-timeout", type=float, default=900.0, help="per-request timeout, s")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="server start timeout, s")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (unmeasured)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="markbase batch size; mlx_lm decode concurrency",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument("--markbase-model", default=None, help="--model for markbase (default: --model)")
    p.add_argument("--markbase-model-field", default=None, help="request 'model' for markbase")
    p.add_argument(
        "--markbase-arg", action="append", default=[], help="extra markbase serve argument (repeat)"
    )
    p.add_argument(
        "--weight-format",
        default="auto",
        help="markbase --weight-format; mlx_lm gets the loader's export of the same format",
    )
    p.add_argument("--mlx-folder", default=None, help="mlx-lm folder for mlx_lm (skips the export)")
    p.add_argument("--refresh-export", action="store_true", help="re-export the mlx-lm folder")
    p.add_argument(
        "--server-env", action="append", default=[], help="KEY=VALUE for every server (repeat)"
    )
    p.add_argument(
        "--peer-env", action="append", default=[], help="KEY=VALUE for mlx_lm and llamacpp only"
    )
    p.add_argument(
        "--peer-blas",
        default="auto",
        help="BLAS for mlx_lm: auto (when markbase runs float32 on CPU, LD_PRELOAD the fast "
        "BLAS it uses), off, or a library path",
    )
    p.add_argument(
        "--baseline-tree",
        default=None,
        help="another markbase source tree (e.g. a git worktree of the commit before a change), "
        "served as markbase-base with the same arguments: before/after in one run",
    )
    p.add_argument(
        "--base-env",
        action="append",
        default=[],
        help="KEY=VALUE for markbase-base only (repeat): with --baseline-tree . the same "
        "tree with a switch set, e.g. MARKBASE_QGEMM_INT8=1",
    )
    p.add_argument(
        "--setup-llama-server",
        action="store_true",
        help="build llama.cpp's llama-server if missing (~/.cache/markbase/bench; ~5 minutes)",
    )
    p.add_argument(
        "--setup-llamacpp",
        action="store_true",
        help="build the llama-cpp-python venv if missing (~/.cache/markbase/bench; 12+ minutes)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 8 requests, concurrency 1,4, 32 tokens"
    )
    p.add_argument("--tag", default="", help="suffix for the result file names")
    p.add_argument("--out", default=str(RESULTS), help="results folder")
    args = p.parse_args(argv)
    if args.quick:
        defaults = {"concurrency": "1,2,4,16,64", "requests": 64, "max_tokens": 128}
        if args.concurrency == defaults["concurrency"]:
            args.concurrency = "1,4"
        if args.requests == defaults["requests"]:
            args.requests = 8
        if args.max_tokens == defaults["max_tokens"]:
            args.max_tokens = 32
        if args.max_level_seconds == 300.0:
            args.max_level_seconds = 120.0
        args.warmup = min(args.warmup, 1)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if args.baseline_tree and "markbase-base" not in args.servers:
        at = args.servers.index("markbase") + 1 if "markbase" in args.servers else 0
        args.servers.insert(at, "markbase-base")
    args.concurrency = _csv_ints(args.concurrency)
    args.level_requests = _level_requests(args)
    for kv in [*args.server_env, *args.peer_env]:
        if "=" not in kv:
            p.error(f"--server-env wants KEY=VALUE, got {kv!r}")
    return args


def _level_requests(args) -> list[int]:
    rpl = args.requests_per_level
    if rpl == "auto":
        return [min(args.requests, max(4, 4 * c)) for c in args.concurrency]
    vals = _csv_ints(rpl)
    if len(vals) == 1:
        return vals * len(args.concurrency)
    if len(vals) != len(args.concurrency):
        raise SystemExit("--requests-per-level: give one value or one per concurrency level")
    return vals


# ----------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "?"
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    versions = {}
    for mod in ("mlx", "mlx_lm", "httpx"):
        try:
            versions[mod] = __import__(mod).__version__ if mod != "mlx" else _mlx_version()
        except Exception:  # noqa: BLE001 -- informational only
            versions[mod] = "?"
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_start": os.getloadavg(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": (git or "no commit") + (" (dirty)" if dirty else ""),
        "versions": versions,
    }


def _mlx_version() -> str:
    from importlib.metadata import version

    return version("mlx")


# ----------------------------------------------------------------------------- running


def _fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def _batch(s: dict) -> str:
    b = (s.get("server_metrics") or {}).get("mean_decode_batch")
    return "-" if b is None else f"{b:.1f}"


def _fmt_x(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def scrape_metrics(base_url: str) -> dict[str, float]:
    """markbase_* Prometheus samples summed over labels ({} when there are none)."""
    import httpx

    try:
        r = httpx.get(base_url + "/metrics", timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.startswith("markbase_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if "_bucket" in name:
            continue
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    if not after:
        return {}
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out: dict[str, Any] = {}
    if d.get("markbase_decode_batch_size_count"):
        out["decode_steps"] = d["markbase_decode_batch_size_count"]
        out["mean_decode_batch"] = d["markbase_decode_batch_size_sum"] / out["decode_steps"]
    if d.get("markbase_prefix_cache_queries_total"):
        out["prefix_hit_ratio"] = (
            d.get("markbase_prefix_cache_hits_total", 0.0)
            / d["markbase_prefix_cache_queries_total"]
        )
    for k in ("markbase_generation_tokens_total", "markbase_prompt_tokens_total"):
        if k in d:
            out[k.removeprefix("markbase_").removesuffix("_total")] = d[k]
    return out


def wait_drained(base_url: str, limit_s: float = 30.0) -> dict[str, Any] | None:
    """After cut requests: how long until markbase reports nothing running or waiting."""
    t0 = time.monotonic()
    while True:
        m = scrape_metrics(base_url)
        if "markbase_num_requests_running" not in m:
            return None
        busy = m["markbase_num_requests_running"] + m.get("markbase_num_requests_waiting", 0.0)
        if busy == 0:
            return {"drained": True, "after_s": round(time.monotonic() - t0, 2)}
        if time.monotonic() - t0 > limit_s:
            return {"drained": False, "after_s": limit_s, "still_busy": busy}
        time.sleep(0.5)


def run_server(spec, args, log_dir: Path, offsets: list[int], records: list[dict], log) -> None:
    """Start one server, run every level, stop it. Appends its JSON record to ``records``
    as soon as it is ready, so an interrupted run still reports the finished levels."""
    record: dict[str, Any] = {"server": spec.name, "notes": list(spec.notes), "levels": []}
    log(f"# {spec.name}: starting: {shlex.join(spec.argv)}")
    t_start = time.monotonic()
    with ServerProcess(spec, log_dir / f"{spec.name}.log", args.ready_timeout) as sp:
        record["argv"] = sp.argv
        record["ready_s"] = sp.ready_s
        log(f"# {spec.name}: ready in {sp.ready_s:.1f} s at {sp.base_url}")
        records.append(record)
        m = re.search(r"loaded \S+ \(([^)]*)\) in", sp.log_tail(200))
        if m:
            record["notes"].append(f"loaded as ({m.group(1)})")
        if args.warmup:
            w = asyncio.run(
                run_level(
                    server=spec.name,
                    base_url=sp.base_url,
                    model=spec.model_field,
                    indices=[-(i + 1) for i in range(args.warmup)],
                    concurrency=args.warmup,
                    prompt_tokens=args.prompt_tokens,
                    max_tokens=8,
                    extra_body=spec.extra_body,
                    deadline_s=args.max_level_seconds,
                    request_timeout_s=args.request_timeout,
                )
            )
            ws = w.summary()
            record["warmup"] = ws
            log(f"# {spec.name}: warm-up {ws['ok']}/{ws['sent']} ok in {ws['wall_s']:.1f} s")
            if ws["ok"] == 0:
                records.remove(record)
                errs = "; ".join(f"{k} (x{v})" for k, v in ws["errors"].items())
                raise Unavailable(f"warm-up requests failed: {errs or 'cut at the deadline'}")
        bar = tqdm(  # on a terminal only: requests done over all levels
            total=sum(args.level_requests), desc=spec.name, unit="req", disable=None, leave=False
        )
        for c, n, off in zip(args.concurrency, args.level_requests, offsets):
            bar.set_postfix_str(f"concurrency {c}")
            if not sp.alive():
                record["notes"].append(f"server died before concurrency {c}: {sp.log_tail(4)}")
                log(f"# {spec.name}: DIED before concurrency {c}")
                break
            m_before = scrape_metrics(sp.base_url)
            lr: LevelResult = asyncio.run(
                run_level(
                    server=spec.name,
                    base_url=sp.base_url,
                    model=spec.model_field,
                    indices=list(range(off, off + n)),
                    concurrency=c,
                    prompt_tokens=args.prompt_tokens,
                    max_tokens=args.max_tokens,
                    extra_body=spec.extra_body,
                    deadline_s=args.max_level_seconds,
                    request_timeout_s=args.request_timeout,
                    ramp_s=args.ramp_s,
                )
            )
            s = lr.summary(args.max_tokens)
            s["server_alive_after"] = sp.alive()
            s["server_metrics"] = metrics_delta(m_before, scrape_metrics(sp.base_url))
            if s["cut"] and sp.alive():
                # cancelled streams must stop their generation (a known peer problem)
                s["after_cut"] = wait_drained(sp.base_url)
            s["load_avg"] = os.getloadavg()
            record["levels"].append(
                {"summary": s, "requests": [result_to_json(r) for r in lr.results]}
            )
            bar.update(n)
            log(
                f"# {spec.name} c={c}: {s['ok']}/{s['planned']} ok, {s['failed']} failed, "
                f"{s['cut']} cut, {s['output_tok_s']:.1f} tok/s, TTFT p50 {_fmt_ms(s['ttft_p50_s'])} ms"
                + (f", errors {s['errors']}" if s["errors"] else "")
            )
        bar.close()
    record["total_s"] = time.monotonic() - t_start


def summaries(records: list[dict]) -> dict[tuple[str, int], dict]:
    out = {}
    for rec in records:
        for lv in rec["levels"]:
            s = lv["summary"]
            out[(rec["server"], s["concurrency"])] = s
    return out


def text_agreement(records: list[dict], a: str, b: str) -> dict[int, tuple[int, int, int]]:
    """Per concurrency: (identical outputs, compared, median common-prefix characters)
    between servers a and b, over requests ok on both."""
    texts: dict[str, dict[int, str]] = {}
    for rec in records:
        texts[rec["server"]] = {
            r["index"]: r["text"]
            for lv in rec["levels"]
            for r in lv["requests"]
            if r["status"] == "ok"
        }
    if a not in texts or b not in texts:
        return {}
    out: dict[int, tuple[int, int, int]] = {}
    for rec in records:
        if rec["server"] != a:
            continue
        for lv in rec["levels"]:
            c = lv["summary"]["concurrency"]
            idx = [
                r["index"] for r in lv["requests"] if r["index"] in texts[b] and r["status"] == "ok"
            ]
            same = sum(1 for i in idx if texts[a][i] == texts[b][i])
            common = sorted(len(os.path.commonprefix([texts[a][i], texts[b][i]])) for i in idx)
            out[c] = (same, len(idx), common[len(common) // 2] if common else 0)
    return out


def render(args, argv: list[str], info: dict, records: list[dict], skipped: dict[str, str]) -> str:
    L: list[str] = []
    L.append(f"command: `{shlex.join(argv)}`")
    L.append("")
    L.append(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), {info['memory']}, {info['platform']}, "
        f"python {info['python']}; load avg at start {', '.join(f'{x:.2f}' for x in info['load_avg_start'])}"
    )
    L.append(
        f"date: {info['date']}; git {info['git']}; "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    )
    L.append(
        f"workload: model {args.model}; requests per level "
        f"{dict(zip(args.concurrency, args.level_requests))}; prompt ~{args.prompt_tokens} tokens "
        f"(shared system prompt + distinct user message); max_tokens {args.max_tokens}; "
        f"{json.dumps(sampling_of(args)) if args.sampling else 'temperature 0'}; "
        f"stream with include_usage; eos={args.eos}; level cap {args.max_level_seconds:.0f} s"
        + (f"; clients ramped over {args.ramp_s:g} s" if args.ramp_s else "")
        + ("; QUICK smoke run" if args.quick else "")
    )
    L.append("")
    L.append(
        "| server | conc | ok/sent (fail, cut) | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| TPOT p50 ms | tok/req | prompt tok | dec batch | wall s | load |"
    )
    L.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    S = summaries(records)
    for rec in records:
        for lv in rec["levels"]:
            s = lv["summary"]
            okcol = f"{s['ok']}/{s['sent']}"
            if s["failed"] or s["cut"] or s["not_sent"]:
                okcol += f" ({s['failed']}, {s['cut']}"
                okcol += f", {s['not_sent']} not sent)" if s["not_sent"] else ")"
            tpr = "-" if s["tokens_per_ok_request"] is None else f"{s['tokens_per_ok_request']:.1f}"
            pt = "-" if s["prompt_tokens_mean"] is None else f"{s['prompt_tokens_mean']:.0f}"
            L.append(
                f"| {rec['server']} | {s['concurrency']} | {okcol} | {s['output_tok_s']:.1f} | "
                f"{_fmt_ms(s['ttft_p50_s'])} | {_fmt_ms(s['ttft_p99_s'])} | {_fmt_ms(s['itl_p50_s'])} | "
                f"{_fmt_ms(s['tpot_p50_s'])} | {tpr} | {pt} | {_batch(s)} | {s['wall_s']:.1f} | "
                f"{s['load_avg'][0]:.1f} |"
            )
    names = [r["server"] for r in records]
    if "markbase" in names and len(names) > 1:
        others = [n for n in names if n != "markbase"]
        L.append("")
        L.append(
            "ratios, markbase / other: output tok/s (higher is better for markbase), TTFT p50 (lower is better)"
        )
        L.append("")
        L.append("| conc | " + " | ".join(f"tok/s vs {o} | TTFT vs {o}" for o in others) + " |")
        L.append("|---:|" + "---:|---:|" * len(others))
        for c in args.concurrency:
            m = S.get(("markbase", c))
            if not m:
                continue
            cells = []
            for o in others:
                s = S.get((o, c))
                cells.append(_fmt_x(m["output_tok_s"], s["output_tok_s"] if s else None))
                cells.append(_fmt_x(m["ttft_p50_s"], s["ttft_p50_s"] if s else None))
            L.append(f"| {c} | " + " | ".join(cells) + " |")
    # correctness signals
    checks: list[str] = []
    for rec in records:
        for lv in rec["levels"]:
            s = lv["summary"]
            c = s["concurrency"]
            if args.eos == "ignore" and s["short_requests"]:
                checks.append(
                    f"{rec['server']} c={c}: {s['short_requests']}/{s['ok']} ok requests returned fewer "
                    f"than max_tokens={args.max_tokens} (finish {s['finish_reasons']})"
                )
            if s["over_max_tokens"]:
                checks.append(
                    f"{rec['server']} c={c}: {s['over_max_tokens']} requests over max_tokens"
                )
            if s["chunks_ne_usage"]:
                checks.append(
                    f"{rec['server']} c={c}: {s['chunks_ne_usage']} requests where content chunks != "
                    "usage.completion_tokens (ITL is per chunk)"
                )
            if s["usage_missing"] and not rec["server"].startswith("llamacpp"):
                checks.append(
                    f"{rec['server']} c={c}: {s['usage_missing']} ok requests without usage"
                )
            if s["errors"]:
                checks.append(f"{rec['server']} c={c}: errors {s['errors']}")
            ac = s.get("after_cut")
            if ac and not ac["drained"]:
                checks.append(
                    f"{rec['server']} c={c}: {ac['still_busy']:.0f} requests still running/waiting "
                    f"{ac['after_s']:.0f} s after their clients disconnected"
                )
            elif ac:
                checks.append(
                    f"{rec['server']} c={c}: cut requests stopped; idle {ac['after_s']:.1f} s after"
                )
            if not s.get("server_alive_after", True):
                checks.append(f"{rec['server']}: process died during concurrency {c}")
    for a, b in (
        ("markbase", "markbase-nobatch"),
        ("markbase", "markbase-base"),
        ("markbase", "mlx_lm"),
        ("markbase", "llama-server"),
        ("markbase", "llamacpp"),
    ):
        agree = text_agreement(records, a, b)
        if agree:
            cells = ", ".join(f"c={c}: {same}/{n}" for c, (same, n, _) in agree.items())
            pref = ", ".join(str(p) for (_s, _n, p) in agree.values())
            checks.append(
                f"identical greedy text {a} vs {b} (same request): {cells} "
                f"(median common prefix, characters: {pref})"
            )
    L.append("")
    L.append("notes:")
    for rec in records:
        L.append(
            f"- {rec['server']}: "
            + "; ".join(rec["notes"])
            + f"; ready in {rec.get('ready_s') or 0:.0f} s"
        )
    for name, why in skipped.items():
        lines = [x.strip() for x in why.splitlines() if x.strip()]
        short = lines[0] + (" ... " + " | ".join(lines[-2:]) if len(lines) > 1 else "")
        L.append(f"- {name}: SKIPPED: {short}")
    for ch in checks:
        L.append(f"- check: {ch}")
    return "\n".join(L)


def sampling_of(args) -> dict:
    """``--sampling`` as a dict (empty: the workload's greedy default)."""
    return json.loads(args.sampling) if args.sampling else {}


def main(argv: list[str] | None = None) -> int:
    argv_full = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    args = parse_args(argv)

    # SIGTERM/SIGHUP unwind like Ctrl-C, so every started server is killed.
    def _raise(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGHUP, _raise)

    def log(msg: str) -> None:
        tqdm.write(msg, file=sys.stderr)  # above a progress bar, if one is drawn

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S") + (f"-{args.tag}" if args.tag else "")
    out_dir = Path(args.out)
    log_dir = out_dir / "logs" / stamp
    info = machine_info()
    print(f"command: {shlex.join(argv_full)}", flush=True)
    print(
        f"machine: {info['nproc']} CPUs, {info['cpu']}, {info['memory']}; date {info['date']}",
        flush=True,
    )

    if args.setup_llama_server and "llama-server" in args.servers:
        try:
            setup_llama_server(log)
        except (Unavailable, subprocess.CalledProcessError) as e:
            log(f"# llama-server build failed: {e}")
    if args.setup_llamacpp and "llamacpp" in args.servers:
        try:
            setup_llamacpp(log)
        except (Unavailable, subprocess.CalledProcessError) as e:
            log(f"# llama-cpp-python setup failed: {e}")

    specs, skipped, setup = make_specs(args, log)
    for spec in specs:  # every server gets the same sampling settings
        spec.extra_body.update(sampling_of(args))
    log(f"# markbase setup here: {setup}")
    info["markbase_setup"] = setup
    for name, why in skipped.items():
        log(f"# {name}: SKIPPED: {why}")

    offsets, o = [], 0
    for n in args.level_requests:  # distinct prompts per level, the same for every server
        offsets.append(o)
        o += n

    records: list[dict] = []
    interrupted = False
    try:
        for spec in specs:
            try:
                run_server(spec, args, log_dir, offsets, records, log)
            except Unavailable as e:
                skipped[spec.name] = str(e)
                log(f"# {spec.name}: SKIPPED: {e}")
    except KeyboardInterrupt:
        interrupted = True
        log("# interrupted: servers stopped; writing what was measured")

    table = render(args, argv_full, info, records, skipped)
    print()
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": argv_full,
        "args": {k: v for k, v in vars(args).items()},
        "machine": info,
        "load_avg_end": os.getloadavg(),
        "interrupted": interrupted,
        "skipped": skipped,
        "servers": records,
    }
    jpath = out_dir / f"serve-{stamp}.json"
    jpath.write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / f"serve-{stamp}.md").write_text(table + "\n")
    log(f"# results: {jpath} (+ .md); server logs: {log_dir}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
