#!/usr/bin/env python
"""Hostile load against ``markbase serve`` over loopback, compared in the same run
with the server of an earlier commit (the peer: the same server without these
defences), with the default settings of each.

    .venv/bin/python bench/serve/hostile.py --baseline-ref e8f4a18     # everything (~6 min)
    .venv/bin/python bench/serve/hostile.py --sections flood --baseline-ref e8f4a18
    .venv/bin/python bench/serve/hostile.py --quick                     # this tree only, shorter

Sections (``--sections``, comma-separated):

* ``slowloris``: ``--slow-sockets`` sockets of each kind (nothing sent, half a
  request head, half a body, a 20-hex-digit chunk size, an idle keep-alive after
  one answer), spread over loopback addresses 127.0.0.2-11 so that no per-client
  cap is met; how many are still open 1, 6, 12, 25 and ``--observe`` s later, and
  when the server closed them. /health latency meanwhile.
* ``caps``: 1100 connections from 11 addresses (100 each), then 200 from one
  address, each sending ``GET /health``: how they were answered.
* ``flood``: first the flood alone for 4 s (the server's CPU per answered request),
  then 5 s quiet, then 16 connections POSTing a 990 kB chat prompt (over
  SmolLM2's 8192-token window by its bytes alone) for ``--flood-seconds``; then the
  same with 500 kB (may fit by its bytes, so it is tokenized). A stream runs
  throughout; reported: /health latency, the stream's inter-token gaps, requests
  answered, the server's CPU use (in cores) quiet and flooded.
* ``soak`` (this tree only): prefix cache on (the default 32768 tokens) and off;
  ``--soak-clients`` clients send distinct chats sharing a system prompt for
  ``--soak-seconds`` after ``--soak-warmup`` answers; RSS drift against the prefix
  cache's own accounted bytes (``prefix_cache_bytes`` in /health) and the growth of
  the free buffers MLX keeps for reuse (``mlx_cache_bytes``).

Prints markdown tables and writes everything to bench/results/hostile/hostile-<stamp>.json.
Loopback only; each server is a child process stopped at the end. The baseline
runs from a temporary ``git worktree`` of ``--baseline-ref`` (removed after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers.hostile import (  # noqa: E402
    SLOW_VARIANTS,
    Flood,
    HealthProbe,
    StreamProbe,
    closed_by_server,
    percentile,
    slow_socket,
    sources,
)
from tests.helpers.server import DEFAULT_MODEL, running_server  # noqa: E402

MARKS = (1, 6, 12, 25)
SENTENCE = "The quick brown fox jumps over the lazy dog. "
WORDS = "river stone light winter garden music paper orange window silver cloud".split()


def ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x * 1000:.0f}"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_port(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    return u.host, int(u.port)


# --------------------------------------------------------------------------- slowloris


def slowloris(url: str, per_variant: int, observe_s: float) -> dict:
    host, port = host_port(url)
    addrs = sources(10)
    probe = HealthProbe(url, interval_s=0.2)
    socks = []
    for variant in SLOW_VARIANTS:
        for i in range(per_variant):
            socks.append((variant, slow_socket(host, port, variant, addrs[i % len(addrs)])))
    t0 = time.monotonic()
    closed: dict[int, float] = {}
    open_at: dict[int, dict[str, int]] = {}
    marks = [m for m in MARKS if m < observe_s] + [observe_s]
    while len(closed) < len(socks) and time.monotonic() - t0 < observe_s:
        for i, (_, s) in enumerate(socks):
            if i not in closed and closed_by_server(s):
                closed[i] = time.monotonic() - t0
        now = time.monotonic() - t0
        for m in marks:
            if m not in open_at and now >= m:
                open_at[m] = {v: 0 for v in SLOW_VARIANTS}
                for i, (v, _) in enumerate(socks):
                    open_at[m][v] += i not in closed
        time.sleep(0.1)
    for m in marks:  # marks not reached: everything closed before
        open_at.setdefault(
            m,
            {
                v: sum(1 for i, (w, _) in enumerate(socks) if w == v and i not in closed)
                for v in SLOW_VARIANTS
            },
        )
    probe.stop()
    for _, s in socks:
        s.close()
    rows = {}
    for v in SLOW_VARIANTS:
        times = [closed[i] for i, (w, _) in enumerate(socks) if w == v and i in closed]
        rows[v] = {
            "opened": per_variant,
            "open_at": {str(m): open_at[m][v] for m in marks},
            "closed": len(times),
            "close_s_median": percentile(times, 50) if times else None,
            "close_s_max": max(times) if len(times) == per_variant else None,
        }
    health = [s for _, s in probe.latencies]
    return {
        "rows": rows,
        "observe_s": observe_s,
        "health_p99_s": percentile(health, 99),
        "health_max_s": max(health, default=None),
    }


# --------------------------------------------------------------------------- caps


def _answers(socks: list[socket.socket]) -> dict[str, int]:
    for s in socks:
        with contextlib.suppress(OSError):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    counts: dict[str, int] = {}
    deadline = time.monotonic() + 30
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            key = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
        except OSError as exc:
            key = type(exc).__name__
        counts[key] = counts.get(key, 0) + 1
    return counts


def caps(url: str) -> dict:
    host, port = host_port(url)
    addrs = sources(11)
    out = {}
    if len(addrs) >= 11:
        socks = []
        try:
            for addr in addrs:
                for _ in range(100):
                    s = socket.socket()
                    s.bind((addr, 0))
                    s.connect((host, port))
                    socks.append(s)
            out["1100 from 11 addresses"] = _answers(socks)
        finally:
            for s in socks:
                s.close()
    time.sleep(2)
    socks = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.connect((host, port))
            socks.append(s)
        out["200 from one address"] = _answers(socks)
    finally:
        for s in socks:
            s.close()
    time.sleep(2)
    return out


# --------------------------------------------------------------------------- flood


def flood(url: str, pid: int, text: str, clients: int, seconds: float) -> dict:
    body = json.dumps(
        {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": text}]}
    ).encode()
    # The flood comes from other loopback addresses than the probes (another client:
    # the server's refusal throttle is per address), a fresh one for the measured part.
    alone_from, flood_from = (sources(2) + ["127.0.0.1", "127.0.0.1"])[:2]
    # First alone (no stream, no probe): the server's CPU per answered request.
    cpu_alone = cpu_s(pid)
    alone = Flood(
        url + "/v1/chat/completions", body, clients, min(seconds, 4), source=alone_from
    ).result()
    cpu_alone = cpu_s(pid) - cpu_alone
    answered_alone = sum(alone["status"].values())
    time.sleep(1)
    probe = HealthProbe(url)
    stream = StreamProbe(url, DEFAULT_MODEL, max_tokens=6000)
    t = time.monotonic()
    while len(stream.arrivals) < 5 and stream.error is None and time.monotonic() - t < 120:
        time.sleep(0.05)
    quiet_start = time.monotonic()
    quiet_cpu = cpu_s(pid)
    time.sleep(5)
    flood_start = time.monotonic()
    cpu0 = cpu_s(pid)
    result = Flood(url + "/v1/chat/completions", body, clients, seconds, source=flood_from).result()
    cpu1 = cpu_s(pid)
    flood_end = time.monotonic()
    time.sleep(1)
    probe.stop()
    stream.stop()
    qh, fh = probe.between(quiet_start, flood_start), probe.between(flood_start, flood_end)
    qg, fg = stream.gaps(quiet_start, flood_start), stream.gaps(flood_start, flood_end)
    return {
        "prompt_bytes": len(text.encode()),
        "answers": result["status"],
        "request_p50_s": percentile(result["latency_s"], 50),
        "cpu_ms_per_request_alone": cpu_alone / answered_alone * 1000 if answered_alone else None,
        "answers_alone": alone["status"],
        # the server's CPU use in cores: quiet (the stream alone), then flooded
        "server_cores": [
            (cpu0 - quiet_cpu) / (flood_start - quiet_start),
            (cpu1 - cpu0) / (flood_end - flood_start),
        ],
        "health_quiet": [percentile(qh, 50), percentile(qh, 99), max(qh, default=None)],
        "health_flood": [percentile(fh, 50), percentile(fh, 99), max(fh, default=None)],
        "gap_quiet": [percentile(qg, 50), percentile(qg, 99), max(qg, default=None)],
        "gap_flood": [percentile(fg, 50), percentile(fg, 99), max(fg, default=None)],
        "stream_error": stream.error,
    }


# --------------------------------------------------------------------------- soak


def _soak_client(
    url: str, stop: list[float], seed: int, counts: dict, lock: threading.Lock
) -> None:
    rng = random.Random(seed)
    system = "You are a careful assistant. " * 8
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < stop[0]:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 250)))
            body = {
                "model": DEFAULT_MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"{rng.random()} {words}"},
                ],
                "max_tokens": 8,
                "temperature": 0.7,
            }
            try:
                key = str(c.post(url + "/v1/chat/completions", json=body).status_code)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            with lock:
                counts[key] = counts.get(key, 0) + 1


def _memory(url: str) -> tuple[int, int]:
    """The prefix caches' accounted bytes and MLX's kept free buffers (/health)."""
    models = httpx.get(url + "/health", timeout=30).json()["models"]
    cache = sum(m.get("prefix_cache_bytes", 0) for m in models.values())
    kept = max((m.get("mlx_cache_bytes", 0) for m in models.values()), default=0)
    return cache, kept


def soak(url: str, pid: int, seconds: float, clients: int, warmup: int) -> dict:
    """``clients`` loops for ``seconds`` after ``warmup`` answers (first-use growth:
    MLX's buffers for the first prompt lengths, lazily built tables)."""
    counts: dict[str, int] = {}
    lock = threading.Lock()
    stop = [float("inf")]
    threads = [
        threading.Thread(target=_soak_client, args=(url, stop, i, counts, lock))
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while sum(counts.values()) < warmup and time.monotonic() - t0 < 600:
        time.sleep(0.2)
    done_at_start = sum(counts.values())
    rss0, (cache0, kept0) = rss_mb(pid), _memory(url)
    stop[0] = time.monotonic() + seconds
    samples = []
    # (seconds in, RSS less the prefix cache's and MLX's kept bytes): flat when the
    # drift is the cache and the allocator, rising when something else grows
    trend: list[tuple[float, float]] = []
    while time.monotonic() < stop[0]:
        time.sleep(2)
        samples.append(rss_mb(pid))
        cache, kept = _memory(url)
        trend.append((time.monotonic() - stop[0] + seconds, samples[-1] - (cache + kept) / 2**20))
    for t in threads:
        t.join()
    time.sleep(1)
    rss1, (cache1, kept1) = rss_mb(pid), _memory(url)
    cache_mb = (cache1 - cache0) / 2**20
    kept_mb = (kept1 - kept0) / 2**20
    return {
        "answers": counts,
        "measured_requests": sum(counts.values()) - done_at_start,
        "rss_start_mb": rss0,
        "rss_end_mb": rss1,
        "rss_peak_mb": max(samples + [rss1]),
        "rss_drift_mb": rss1 - rss0,
        "cache_growth_mb": cache_mb,
        "cache_end_mb": cache1 / 2**20,
        "drift_minus_cache_mb": rss1 - rss0 - cache_mb,
        "mlx_kept_growth_mb": kept_mb,
        "rest_mb": rss1 - rss0 - cache_mb - kept_mb,
        "rest_trend_mb": trend,
    }


# --------------------------------------------------------------------------- driver


@contextlib.contextmanager
def baseline_tree(ref: str):
    path = Path(tempfile.mkdtemp(prefix="markbase-baseline-"))
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
            capture_output=True,
        )


def run_sections(name: str, cwd: Path, args, out: dict) -> None:
    sections = args.sections
    print(f"[{name}] starting the server from {cwd}", file=sys.stderr)
    with running_server(DEFAULT_MODEL, cwd=cwd) as srv:
        pid = srv.proc.pid
        res = out.setdefault(name, {})
        if "slowloris" in sections:
            print(f"[{name}] slowloris", file=sys.stderr)
            res["slowloris"] = slowloris(srv.url, args.slow_sockets, args.observe)
        if "caps" in sections:
            print(f"[{name}] caps", file=sys.stderr)
            res["caps"] = caps(srv.url)
        if "flood" in sections:
            for label, size in (("990 kB", 990_000), ("500 kB", 500_000)):
                print(f"[{name}] flood {label}", file=sys.stderr)
                text = (SENTENCE * (size // len(SENTENCE) + 1))[:size]
                res[f"flood {label}"] = flood(
                    srv.url, pid, text, args.flood_clients, args.flood_seconds
                )
    if "soak" in sections and name == "markbase":
        on = (
            ("--prefix-cache-tokens", str(args.soak_cache_tokens)) if args.soak_cache_tokens else ()
        )
        for label, extra in (
            ("prefix cache on", on),
            ("prefix cache off", ("--prefix-cache-tokens", "0")),
        ):
            print(f"[{name}] soak, {label}", file=sys.stderr)
            with running_server(DEFAULT_MODEL, *extra, cwd=cwd) as srv:
                res[f"soak {label}"] = soak(
                    srv.url, srv.proc.pid, args.soak_seconds, args.soak_clients, args.soak_warmup
                )


def print_tables(out: dict, args) -> None:
    names = list(out)
    if any("slowloris" in out[n] for n in names):
        print(f"\n## Slowloris: {args.slow_sockets} sockets per kind, still open after t seconds\n")
        marks = [m for m in MARKS if m < args.observe] + [args.observe]
        print(
            "| server | kind | "
            + " | ".join(f"{m} s" for m in marks)
            + " | closed after (median / max s) |"
        )
        print("|---|---|" + "---|" * len(marks) + "---|")
        for n in names:
            sl = out[n].get("slowloris")
            if not sl:
                continue
            for kind, row in sl["rows"].items():
                med, mx = row["close_s_median"], row["close_s_max"]
                when = (
                    "never" if med is None else f"{med:.1f} / {mx:.1f}" if mx else f"{med:.1f} / -"
                )
                cells = " | ".join(str(row["open_at"][str(m)]) for m in marks)
                print(f"| {n} | {kind} | {cells} | {when} |")
        for n in names:
            sl = out[n].get("slowloris")
            if sl:
                print(
                    f"\n{n}: /health p99 {ms(sl['health_p99_s'])} ms, max {ms(sl['health_max_s'])} ms while held"
                )
    if any("caps" in out[n] for n in names):
        print("\n## Connection caps: each connection sends GET /health\n")
        print("| server | connections | answers |")
        print("|---|---|---|")
        for n in names:
            for label, counts in out[n].get("caps", {}).items():
                print(
                    f"| {n} | {label} | {', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))} |"
                )
    floods = [(n, k) for n in names for k in out[n] if k.startswith("flood")]
    if floods:
        print(
            f"\n## Prompt flood: {args.flood_clients} connections for {args.flood_seconds:g} s, a stream running\n"
        )
        print(
            "| server | prompt | answers | request p50 ms | server cores quiet / flooded | CPU ms / request (flood alone) | /health p50 / p99 / max ms quiet | flooded | gap p50 / p99 / max ms quiet | flooded |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n, k in floods:
            f = out[n][k]
            fmt = lambda xs: " / ".join(ms(x) for x in xs)  # noqa: E731
            cpu = " / ".join(f"{c:.2f}" for c in f["server_cores"])
            alone = f["cpu_ms_per_request_alone"]
            cpu += " | -" if alone is None else f" | {alone:.1f}"
            answers = ", ".join(f"{a}: {c}" for a, c in sorted(f["answers"].items()))
            print(
                f"| {n} | {k[6:]} | {answers} | {ms(f['request_p50_s'])} | {cpu} | {fmt(f['health_quiet'])} | "
                f"{fmt(f['health_flood'])} | {fmt(f['gap_quiet'])} | {fmt(f['gap_flood'])} |"
            )
    soaks = [(n, k) for n in names for k in out[n] if k.startswith("soak")]
    if soaks:
        print(
            f"\n## Soak: {args.soak_clients} clients for {args.soak_seconds:g} s after "
            f"{args.soak_warmup} answers\n"
        )
        print(
            "| server | | answers (measured) | RSS start MB | end | peak | drift | prefix cache growth MB | drift - cache MB | MLX kept buffers growth MB | rest MB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for n, k in soaks:
            s = out[n][k]
            answers = ", ".join(f"{a}: {c}" for a, c in sorted(s["answers"].items()))
            print(
                f"| {n} | {k[5:]} | {answers} ({s['measured_requests']}) | {s['rss_start_mb']:.0f} | {s['rss_end_mb']:.0f} | "
                f"{s['rss_peak_mb']:.0f} | {s['rss_drift_mb']:+.0f} | {s['cache_growth_mb']:+.0f} | "
                f"{s['drift_minus_cache_mb']:+.0f} | {s['mlx_kept_growth_mb']:+.0f} | "
                f"{s['rest_mb']:+.0f} |"
            )
        print("\nRSS less the prefix cache and MLX's kept buffers, MB, at quarters of the run:\n")
        for n, k in soaks:
            trend = out[n][k]["rest_trend_mb"]
            if trend:
                picks = [trend[min(len(trend) - 1, len(trend) * q // 4)] for q in range(5)]
                print(f"- {n}, {k[5:]}: " + ", ".join(f"{t:.0f} s {v:.0f}" for t, v in picks))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="slowloris,caps,flood,soak")
    ap.add_argument(
        "--baseline-ref", default=None, help="git ref of the peer server (e.g. e8f4a18)"
    )
    ap.add_argument("--slow-sockets", type=int, default=100, help="sockets per slowloris kind")
    ap.add_argument("--observe", type=float, default=35.0, help="seconds to watch them")
    ap.add_argument("--flood-clients", type=int, default=16)
    ap.add_argument("--flood-seconds", type=float, default=8.0)
    ap.add_argument("--soak-seconds", type=float, default=40.0)
    ap.add_argument("--soak-clients", type=int, default=4)
    ap.add_argument(
        "--soak-cache-tokens", type=int, default=0, help="prefix cache size when on (0: default)"
    )
    ap.add_argument("--soak-warmup", type=int, default=8, help="answers before measuring")
    ap.add_argument(
        "--quick", action="store_true", help="shorter: 20 sockets, 25 s, 5 s flood, 20 s soak"
    )
    args = ap.parse_args()
    args.sections = set(args.sections.split(","))
    if args.quick:
        args.slow_sockets, args.observe = 20, 25.0
        args.flood_seconds, args.soak_seconds = 5.0, 20.0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))

    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print("# bench/serve/hostile.py")
    print(f"\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"date: {datetime.now().isoformat(timespec='seconds')}; host: {platform.node()}, "
        f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        f"markbase: this tree (HEAD {head} plus any changes); baseline: {args.baseline_ref or 'none'}; "
        f"model {DEFAULT_MODEL}; default settings"
    )
    out: dict = {}
    t0 = time.monotonic()
    run_sections("markbase", REPO, args, out)
    if args.baseline_ref:
        with baseline_tree(args.baseline_ref) as tree:
            run_sections(f"baseline {args.baseline_ref}", tree, args, out)
    print_tables(out, args)
    print(
        f"\n(total {time.monotonic() - t0:.0f} s; load average at the end "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )
    results = REPO / "bench" / "results" / "hostile"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"hostile-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"argv": sys.argv, "results": out}, indent=1, default=str))
    print(f"raw results: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
