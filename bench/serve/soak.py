#!/usr/bin/env python
"""Soak test: many concurrent clients, some of which hang up at random, for a
bounded time, over loopback; then checks that nothing leaked.

    .venv/bin/python bench/serve/soak.py                      # 2 minutes, 32 clients
    .venv/bin/python bench/serve/soak.py --duration 60 --clients 32
    .venv/bin/python bench/serve/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server

Without --url it starts ``markbase serve`` itself (tests/helpers/server.py) with a
bounded prefix cache, so the cache's own growth stays small and known. Each client
loops over a mix of requests: greedy chat and completion streams and plain
requests from a fixed prompt pool (whose text must equal a reference taken alone
at the start: batching must not change greedy output), sampled requests with
n = 1 or 2, stop strings and token-id prompts, and a few bad requests (which must
get a 4xx OpenAI error). With probability --disconnect a client hangs up early:
mid-stream after a few chunks, or before a plain answer arrives.

Every completed response is checked: JSON or SSE well-formed, one id, every
choice finished exactly once with stop/length, usage adding up, no error
chunk. Reported: requests done, client disconnects, 4xx as expected, 429s,
errors (with samples), tokens, the server's RSS before / mid-way / after /
peak, and whether the engine is idle afterwards (no running or waiting
sequence, no KV reservation). Exit status 1 if there were errors, the server
was not idle afterwards, or RSS grew by more than --rss-growth-mb.

Not a CI test (it runs for minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers.server import DEFAULT_MODEL, running_server  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Say hello in Spanish.",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Describe a cloud in five words.",
]
STOPS = [["."], ["\n"], [" the", ","], ["!", "?", ";", ":"]]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Stats:
    counts: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0

    def error(self, what: str) -> None:
        self.counts["errors"] += 1
        if len(self.errors) < 20:
            self.errors.append(what[:500])


class Malformed(Exception):
    pass


def check_json(body: dict, n: int, max_tokens: int, chat: bool) -> list[str]:
    obj = "chat.completion" if chat else "text_completion"
    if body.get("object") != obj or not body.get("id"):
        raise Malformed(f"object/id: {str(body)[:200]}")
    choices = body["choices"]
    if sorted(c["index"] for c in choices) != list(range(n)):
        raise Malformed(f"choice indexes {[c['index'] for c in choices]} for n={n}")
    texts = []
    for c in sorted(choices, key=lambda c: c["index"]):
        if c["finish_reason"] not in ("stop", "length"):
            raise Malformed(f"finish_reason {c['finish_reason']!r}")
        texts.append(c["message"]["content"] if chat else c["text"])
    u = body["usage"]
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        raise Malformed(f"usage does not add up: {u}")
    if not 0 < u["completion_tokens"] <= max_tokens * n:
        raise Malformed(f"completion_tokens {u['completion_tokens']} for max_tokens {max_tokens}")
    return texts


class StreamCheck:
    """Accumulates one SSE stream and checks it as it goes."""

    def __init__(self, n: int, chat: bool, include_usage: bool) -> None:
        self.n, self.chat, self.include_usage = n, chat, include_usage
        self.ids: set[str] = set()
        self.texts = [""] * n
        self.finished: dict[int, str] = {}
        self.done = False
        self.usage: dict | None = None
        self.chunks = 0

    def feed(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        payload = line[len("data: ") :]
        if self.done:
            raise Malformed("data after [DONE]")
        if payload == "[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise Malformed(f"error chunk: {chunk['error']}")
        self.chunks += 1
        self.ids.add(chunk["id"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk["choices"]:
            i = c["index"]
            if i in self.finished:
                raise Malformed(f"choice {i} continued after its finish")
            if self.chat:
                self.texts[i] += c["delta"].get("content") or ""
            else:
                self.texts[i] += c["text"]
            if c["finish_reason"] is not None:
                if c["finish_reason"] not in ("stop", "length"):
                    raise Malformed(f"finish_reason {c['finish_reason']!r}")
                self.finished[i] = c["finish_reason"]

    def close(self) -> list[str]:
        if not self.done:
            raise Malformed("stream ended without [DONE]")
        if len(self.ids) != 1:
            raise Malformed(f"{len(self.ids)} ids in one stream")
        if sorted(self.finished) != list(range(self.n)):
            raise Malformed(f"finished choices {sorted(self.finished)} for n={self.n}")
        if self.include_usage and not self.usage:
            raise Malformed("no usage chunk")
        return self.texts


@dataclass
class Job:
    kind: str
    path: str
    body: dict
    chat: bool
    n: int = 1
    reference_key: tuple | None = None  # greedy: must equal the reference
    expect_4xx: bool = False
    raw: bytes | None = None


def greedy_job(kind: str, prompt: str, max_tokens: int, stream: bool) -> Job:
    chat = kind == "chat"
    body = {"model": DEFAULT_MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Job(f"greedy {kind}{' stream' if stream else ''}", path, body, chat, 1, (kind, prompt))


def random_job(rng: random.Random, max_tokens: int) -> Job:
    r = rng.random()
    prompt = rng.choice(PROMPTS)
    stream = rng.random() < 0.5
    if r < 0.45:
        return greedy_job(rng.choice(["chat", "completion"]), prompt, max_tokens, stream)
    if r < 0.95:
        chat = rng.random() < 0.5
        n = rng.choice([1, 1, 2])
        body: dict = {
            "model": DEFAULT_MODEL,
            "max_tokens": rng.randint(1, max_tokens),
            "temperature": rng.choice([0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": rng.randint(0, 2**31),
            "n": n,
            "stream": stream,
        }
        if rng.random() < 0.3:
            body["stop"] = rng.choice(STOPS)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = [504, 3575, 282, 4649, 314] if rng.random() < 0.3 else prompt
            path = "/v1/completions"
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return Job(f"sampled {'chat' if chat else 'completion'}", path, body, chat, n)
    bad = rng.choice(
        [
            (b'{"model": "x", "messages": [', None),
            (None, {"model": DEFAULT_MODEL, "messages": []}),
            (None, {"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": -1}),
            (None, {"model": "no-such-model", "prompt": "x"}),
            (None, {"model": DEFAULT_MODEL, "prompt": "x", "n": 999}),
        ]
    )
    return Job("bad request", "/v1/completions", bad[1] or {}, False, expect_4xx=True, raw=bad[0])


async def run_job(
    client: httpx.AsyncClient,
    job: Job,
    rng: random.Random,
    disconnect: float,
    references: dict,
    stats: Stats,
) -> None:
    hang_up = rng.random() < disconnect and not job.expect_4xx
    max_tokens = job.body.get("max_tokens", 16)
    try:
        if job.expect_4xx:
            kw = {"content": job.raw} if job.raw is not None else {"json": job.body}
            r = await client.post(job.path, **kw)
            err = (
                r.json().get("error")
                if r.headers.get("content-type", "").startswith("application/json")
                else None
            )
            if (
                400 <= r.status_code < 500
                and err
                and {"message", "type", "param", "code"} <= set(err)
            ):
                stats.counts["4xx as expected"] += 1
            else:
                stats.error(f"{job.kind}: {r.status_code} {r.text[:200]}")
            return
        if job.body.get("stream"):
            check = StreamCheck(job.n, job.chat, bool(job.body.get("stream_options")))
            cut_after = rng.randint(1, 4)
            async with client.stream("POST", job.path, json=job.body) as r:
                if r.status_code == 429:
                    stats.counts["429 overloaded"] += 1
                    await r.aread()
                    return
                if r.status_code != 200:
                    stats.error(f"{job.kind}: status {r.status_code} {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    check.feed(line)
                    if hang_up and check.chunks >= cut_after:
                        stats.counts["client disconnects"] += 1
                        return
            texts = check.close()
            if check.usage:
                stats.tokens += check.usage["completion_tokens"]
        else:
            request = client.post(job.path, json=job.body)
            if hang_up:
                try:
                    r = await asyncio.wait_for(request, timeout=rng.uniform(0.05, 2.0))
                except asyncio.TimeoutError:
                    stats.counts["client disconnects"] += 1
                    return
            else:
                r = await request
            if r.status_code == 429:
                stats.counts["429 overloaded"] += 1
                return
            if r.status_code != 200:
                stats.error(f"{job.kind}: status {r.status_code} {r.text[:200]}")
                return
            body = r.json()
            texts = check_json(body, job.n, max_tokens, job.chat)
            stats.tokens += body["usage"]["completion_tokens"]
        if job.reference_key is not None:
            ref = references[job.reference_key]
            if texts[0] != ref:
                stats.counts["greedy mismatches"] += 1
                stats.error(f"{job.kind}: greedy text {texts[0]!r} != reference {ref!r}")
                return
            stats.counts["greedy checked"] += 1
        stats.counts["completed ok"] += 1
    except Malformed as exc:
        stats.error(f"{job.kind}: malformed response: {exc}")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        stats.error(f"{job.kind}: {type(exc).__name__}: {exc}")


async def client_loop(
    url: str, seed: int, until: float, args: argparse.Namespace, refs: dict, stats: Stats
) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, headers=args.headers, timeout=args.timeout) as c:
        while time.monotonic() < until:
            job = random_job(rng, args.max_tokens)
            stats.counts["requests started"] += 1
            await run_job(c, job, rng, args.disconnect, refs, stats)


async def references(url: str, args: argparse.Namespace) -> dict:
    """Greedy text of every pool prompt, each request alone."""
    refs = {}
    async with httpx.AsyncClient(base_url=url, headers=args.headers, timeout=300) as c:
        for kind in ("chat", "completion"):
            for prompt in PROMPTS:
                job = greedy_job(kind, prompt, args.max_tokens, stream=False)
                r = await c.post(job.path, json=job.body)
                r.raise_for_status()
                refs[(kind, prompt)] = check_json(r.json(), 1, args.max_tokens, job.chat)[0]
    return refs


async def idle_after(url: str, headers: dict, wait_s: float = 30) -> dict:
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as c:
        while True:
            models = (await c.get("/health")).json().get("models", {})
            busy = {
                m: s
                for m, s in models.items()
                if any(s[k] for k in ("running", "prefilling", "waiting", "kv_reserved_tokens"))
            }
            if not busy or time.monotonic() > deadline:
                return busy
            await asyncio.sleep(0.5)


async def soak(url: str, pid: int | None, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    print(f"soak: references for {len(PROMPTS)} prompts x 2 endpoints ...", flush=True)
    refs = await references(url, args)
    print(f"soak: references took {time.monotonic() - t0:.0f} s", flush=True)
    rss: dict[str, int] = {}
    if pid:
        rss["at start"] = rss["peak"] = rss_kb(pid)
    stats = Stats()
    start = time.monotonic()
    measured = start + args.warmup  # RSS "before": after a warm-up under the same load
    until = measured + args.duration

    async def sampler() -> None:
        while time.monotonic() < until:
            await asyncio.sleep(1)
            if pid:
                now = rss_kb(pid)
                rss["peak"] = max(rss["peak"], now)
                if "before" not in rss and time.monotonic() >= measured:
                    rss["before"] = now
                if "mid" not in rss and time.monotonic() >= measured + args.duration / 2:
                    rss["mid"] = now

    clients = [
        client_loop(url, args.seed * 1000 + i, until, args, refs, stats)
        for i in range(args.clients)
    ]
    await asyncio.gather(sampler(), *clients)
    elapsed = time.monotonic() - start
    busy = await idle_after(url, args.headers)
    if pid:
        await asyncio.sleep(2)
        rss["after"] = rss_kb(pid)

    c = stats.counts
    report = {
        "load_s": args.warmup + args.duration,  # warm-up + measured; then in-flight ones finish
        "elapsed_s": round(elapsed, 1),
        "clients": args.clients,
        "requests_started": c["requests started"],
        "completed_ok": c["completed ok"],
        "greedy_checked": c["greedy checked"],
        "client_disconnects": c["client disconnects"],
        "rejected_4xx_as_expected": c["4xx as expected"],
        "overloaded_429": c["429 overloaded"],
        "errors": c["errors"],
        "greedy_mismatches": c["greedy mismatches"],
        "completion_tokens": stats.tokens,
        "idle_after": not busy,
    }
    if pid:
        growth_mb = (rss["after"] - rss["before"]) / 1024
        report["rss_mb"] = {k: round(v / 1024, 1) for k, v in rss.items()}
        report["rss_growth_mid_to_after_mb"] = round((rss["after"] - rss["mid"]) / 1024, 1)
        report["rss_growth_mb"] = round(growth_mb, 1)
        report["rss_growth_limit_mb"] = args.rss_growth_mb
    print(json.dumps(report, indent=1))
    for e in stats.errors:
        print("error:", e)
    if busy:
        print("not idle after the soak:", busy)
    ok = c["errors"] == 0 and not busy and c["completed ok"] > 0
    if pid and report["rss_growth_mb"] > args.rss_growth_mb:
        print(f"RSS grew {report['rss_growth_mb']} MB > {args.rss_growth_mb} MB")
        ok = False
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120, help="seconds of load (default 120)")
    p.add_argument(
        "--warmup",
        type=float,
        default=20,
        help="seconds of the same load before RSS 'before' is taken (batch KV, allocator "
        "pools and the bounded prefix cache fill up then); counted in the totals",
    )
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.2, help="chance a client hangs up early")
    p.add_argument("--max-tokens", type=int, default=12, help="max_tokens of each request")
    p.add_argument("--timeout", type=float, default=300, help="client timeout per request (s)")
    p.add_argument("--rss-growth-mb", type=float, default=150, help="allowed RSS growth (MB)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--url", help="soak a running server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--api-key", default="soak-key")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for the started server (repeatable; e.g. --server-arg=--max-num-seqs=8)",
    )
    args = p.parse_args(argv)
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url:
        return asyncio.run(soak(args.url.rstrip("/"), args.pid, args))
    # A bounded prefix cache (2048 tokens is ~90 MB of float32 KV for SmolLM2-135M), so
    # its filling up is not mistaken for a leak; generous queue timeout for a slow CPU.
    flags = ["--prefix-cache-tokens", "2048", "--max-num-seqs", "16", "--queue-timeout-s", "120"]
    flags += args.server_arg
    with running_server(DEFAULT_MODEL, *flags, api_key=args.api_key) as srv:
        print(f"soak: server pid {srv.proc.pid} at {srv.url}, log {srv.log_path}", flush=True)
        code = asyncio.run(soak(srv.url, srv.proc.pid, args))
        with contextlib.suppress(OSError):
            log = srv.log_path.read_text(errors="replace")
            crashes = log.count("unhandled error") + log.count("Traceback")
            print(f"soak: server log: {crashes} crash traces")
            if crashes:
                code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
