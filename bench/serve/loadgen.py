"""Load generator: deterministic chat workload, streaming requests, per-level metrics.

Everything here talks to one base URL on 127.0.0.1. A *level* is one concurrency
setting: ``concurrency`` closed-loop workers take the next request from a fixed list
until the list is empty or the level's deadline passes; at the deadline the requests
still in flight are cancelled (the client disconnects) and counted as ``cut``.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# ----------------------------------------------------------------------------- workload

# Shared by every request (a prefix cache may reuse it; that is part of the workload).
SYSTEM_PROMPT = (
    "You are a patient writing assistant for a small public library. You answer in plain "
    "English, in full sentences, without lists or headings. When asked for a story you "
    "write one continuous story with a clear beginning, a middle and an end, and you keep "
    "going until the reader has a complete picture of the characters and the place."
)

_SUBJECTS = [
    "a lighthouse keeper",
    "a retired train driver",
    "a young beekeeper",
    "a night baker",
    "a river ferry pilot",
    "a museum guard",
    "a mountain postman",
    "a clockmaker",
    "a school gardener",
    "a street musician",
    "a ship's cook",
    "a village doctor",
    "a bicycle courier",
    "a glass blower",
    "an old bookbinder",
    "a weather observer",
]
_PLACES = [
    "a fishing town in winter",
    "a city during a power cut",
    "an island with one road",
    "a desert railway station",
    "a market on the first day of spring",
    "a snowed-in inn",
    "a harbour before a storm",
    "a valley full of orchards",
    "a quiet university town",
    "a border crossing at night",
    "a river delta in the rainy season",
    "a hill monastery",
    "a new suburb",
    "a ferry crossing a wide lake",
    "an abandoned observatory",
    "a busy airport in fog",
    "a forest camp",
]
_EVENTS = [
    "finds a letter that was never delivered",
    "has to keep a promise to a stranger",
    "loses the key to an important door",
    "meets a childhood friend after forty years",
    "must guide a group of travellers home",
    "discovers a mistake in an old map",
    "is asked to keep a secret for one week",
    "hears a song nobody else remembers",
    "receives a parcel with no name on it",
]
# Neutral filler: common words, roughly one token each for a BPE vocabulary.
_FILLER = (
    "Please describe the weather, the sounds, the smells and the light of the place, what "
    "the main character eats and wears, who they talk to, what they worry about and what "
    "they hope for, how the day begins and how it ends, and what changes for them by the "
    "last line of the story. Take your time and use simple words that a child could read "
    "aloud, with short sentences and a calm voice from the first line to the last one."
).split()

# Chat-template tokens around the two messages (ChatML-style templates add ~10-15).
TEMPLATE_OVERHEAD_TOKENS = 14


def _approx_tokens(text: str) -> int:
    # ~1.12 tokens per word of this text with the SmolLM2 BPE (measured: the system
    # prompt is 66 tokens, the template adds 14); other tokenizers land near it.
    return round(len(text.split()) * 1.12)


def user_message(index: int, prompt_tokens: int) -> str:
    """Distinct, deterministic user message for request ``index``."""
    s = _SUBJECTS[index % len(_SUBJECTS)]
    p = _PLACES[(index // len(_SUBJECTS)) % len(_PLACES)]
    e = _EVENTS[(index * 7) % len(_EVENTS)]
    head = f"Request number {index}. Write a long story about {s} in {p} who {e}."
    target = prompt_tokens - TEMPLATE_OVERHEAD_TOKENS - _approx_tokens(SYSTEM_PROMPT)
    words = head.split()
    k = (index * 5) % len(_FILLER)  # rotate the filler so messages differ throughout
    while _approx_tokens(" ".join(words)) < target:
        words.append(_FILLER[k % len(_FILLER)])
        k += 1
    return " ".join(words)


def build_messages(index: int, prompt_tokens: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(index, prompt_tokens)},
    ]


# ----------------------------------------------------------------------------- requests


@dataclass
class RequestResult:
    index: int
    status: str = "pending"  # ok | failed | cut
    start: float = 0.0  # seconds since the level started
    end: float = 0.0
    ttft: float | None = None  # seconds from send to the first content chunk
    chunk_times: list[float] = field(default_factory=list)  # content chunk arrival, from send
    content_chunks: int = 0
    completion_tokens: int | None = None  # from usage, when the server sent it
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    got_done: bool = False
    http_status: int | None = None
    error: str | None = None
    text: str = ""

    @property
    def tokens(self) -> int:
        """Output tokens delivered: usage when present, else one per content chunk."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.content_chunks

    def itl_median(self) -> float | None:
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        return statistics.median(gaps) if gaps else None

    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first chunk) / (tokens - 1)."""
        if len(self.chunk_times) < 2 or self.tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)


def _handle_event(r: RequestResult, data: str, t_send: float) -> None:
    now = time.perf_counter()
    obj = json.loads(data)
    if not isinstance(obj, dict):
        return
    if obj.get("error"):
        err = obj["error"]
        r.error = json.dumps(err)[:300] if not isinstance(err, str) else err[:300]
        return
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            r.completion_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            r.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            r.cached_tokens = int(details["cached_tokens"])
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        content = delta.get("content")
        if content:
            t = now - t_send
            if r.ttft is None:
                r.ttft = t
            r.chunk_times.append(t)
            r.content_chunks += 1
            r.text += content
        if ch.get("finish_reason"):
            r.finish_reason = ch["finish_reason"]


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], r: RequestResult, t0: float
) -> None:
    """One streaming chat completion; fills ``r`` in place (so a cancel keeps partial data)."""
    t_send = time.perf_counter()
    r.start = t_send - t0
    try:
        async with client.stream("POST", url, json=body) as resp:
            r.http_status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                r.status = "failed"
                r.error = f"HTTP {resp.status_code}: {raw[:300].decode(errors='replace')}"
                return
            async for line in resp.aiter_lines():
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r.got_done = True
                    break
                try:
                    _handle_event(r, data, t_send)
                except json.JSONDecodeError:
                    r.error = f"bad JSON in stream: {data[:200]}"
            if r.error:
                r.status = "failed"
            elif not r.got_done:
                r.status = "failed"
                r.error = "stream ended without [DONE]"
            else:
                r.status = "ok"
    except asyncio.CancelledError:
        r.status = "cut"
        raise
    except httpx.HTTPError as e:
        r.status = "failed"
        r.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        r.end = time.perf_counter() - t0


@dataclass
class LevelResult:
    server: str
    concurrency: int
    planned: int
    wall_s: float
    deadline_hit: bool
    results: list[RequestResult]

    def summary(self, max_tokens: int | None = None) -> dict[str, Any]:
        res = self.results
        ok = [r for r in res if r.status == "ok"]
        failed = [r for r in res if r.status == "failed"]
        cut = [r for r in res if r.status == "cut"]
        tokens = sum(r.tokens for r in res if r.status in ("ok", "cut"))
        ttfts = sorted(r.ttft for r in res if r.ttft is not None and r.status != "failed")
        itls = [x for x in (r.itl_median() for r in ok) if x is not None]
        tpots = [x for x in (r.tpot() for r in ok) if x is not None]
        errors: dict[str, int] = {}
        for r in failed:
            key = (r.error or "?")[:120]
            errors[key] = errors.get(key, 0) + 1
        usage_missing = sum(1 for r in ok if r.completion_tokens is None)
        chunk_mismatch = sum(
            1
            for r in ok
            if r.completion_tokens is not None and r.completion_tokens != r.content_chunks
        )
        short = sum(1 for r in ok if max_tokens is not None and r.tokens < max_tokens)
        long_ = sum(1 for r in ok if max_tokens is not None and r.tokens > max_tokens)
        prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        return {
            "server": self.server,
            "concurrency": self.concurrency,
            "planned": self.planned,
            "sent": len(res),
            "not_sent": self.planned - len(res),
            "ok": len(ok),
            "failed": len(failed),
            "cut": len(cut),
            "deadline_hit": self.deadline_hit,
            "wall_s": self.wall_s,
            "output_tokens": tokens,
            "output_tok_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p99_s": _pct(ttfts, 99),
            "itl_p50_s": statistics.median(itls) if itls else None,
            "tpot_p50_s": statistics.median(tpots) if tpots else None,
            "tokens_per_ok_request": (sum(r.tokens for r in ok) / len(ok)) if ok else None,
            "short_requests": short,
            "over_max_tokens": long_,
            "usage_missing": usage_missing,
            "chunks_ne_usage": chunk_mismatch,
            "prompt_tokens_mean": (sum(prompt) / len(prompt)) if prompt else None,
            "cached_tokens_mean": (sum(cached) / len(cached)) if cached else None,
            "finish_reasons": _count(r.finish_reason for r in ok),
            "errors": errors,
        }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def _pct(sorted_vals: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p99 of fewer than 100 values is the maximum)."""
    if not sorted_vals:
        return None
    k = max(0, math.ceil(p / 100 * len(sorted_vals)) - 1)
    return sorted_vals[k]


def make_body(
    model: str,
    index: int,
    prompt_tokens: int,
    max_tokens: int,
    extra_body: dict[str, Any],
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": build_messages(index, prompt_tokens),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra_body)
    return body


async def run_level(
    *,
    server: str,
    base_url: str,
    model: str,
    indices: list[int],
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    extra_body: dict[str, Any],
    deadline_s: float,
    request_timeout_s: float,
    ramp_s: float = 0.0,
) -> LevelResult:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    results: list[RequestResult] = []
    todo = iter(indices)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()

        async def worker(k: int) -> None:
            if ramp_s > 0:  # spread the first connections (a burst can overflow a backlog)
                await asyncio.sleep(ramp_s * k / concurrency)
            for idx in todo:  # shared iterator: each index goes to one worker
                if time.perf_counter() - t0 >= deadline_s:
                    return
                r = RequestResult(index=idx)
                results.append(r)
                body = make_body(model, idx, prompt_tokens, max_tokens, extra_body)
                await stream_chat(client, url, body, r, t0)

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        _done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        # Wall time of the level: until the last request ended, or the deadline.
        ends = [r.end for r in results]
        wall = deadline_s if pending else (max(ends) if ends else 0.0)
    for r in results:
        if r.status == "pending":
            r.status = "cut"
    return LevelResult(
        server=server,
        concurrency=concurrency,
        planned=len(indices),
        wall_s=wall,
        deadline_hit=bool(pending),
        results=results,
    )


def result_to_json(r: RequestResult) -> dict[str, Any]:
    d = asdict(r)
    d["tokens"] = r.tokens
    d["itl_median_s"] = r.itl_median()
    d["tpot_s"] = r.tpot()
    # chunk times are the bulk of the file; keep them rounded
    d["chunk_times"] = [round(t, 4) for t in r.chunk_times]
    return d
