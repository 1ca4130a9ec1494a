"""Recent history of the engine's metrics, for the dashboard (``GET /v1/stats``).

Prometheus answers "how much so far"; a person looking at a dashboard asks "what is
happening now and in the last minutes". ``StatsRecorder`` reads the engine's own
Prometheus metrics (``engine/metrics.py``, registered in the default registry) once
a second into a ring buffer of snapshots, and ``series`` turns consecutive snapshots
into per-model time series: requests running and waiting, KV-cache use, tokens per
second (from counter deltas), TTFT and inter-token latency percentiles (from histogram
bucket deltas over a short window, as Prometheus' ``histogram_quantile`` does) and the
prefix-cache hit rate.

Only the metric names are shared with the engine: this module reads the registry and
never imports the engine (which pulls in MLX).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import REGISTRY
from prometheus_client.registry import CollectorRegistry

GAUGES = {
    "markbase_num_requests_running": "running",
    "markbase_num_requests_waiting": "waiting",
    "markbase_kv_cache_usage_ratio": "kv_cache_usage",
    "markbase_prefix_cache_tokens": "prefix_cache_tokens",
}
COUNTERS = {
    "markbase_generation_tokens_total": "generation_tokens",
    "markbase_prompt_tokens_total": "prompt_tokens",
    "markbase_prefix_cache_queries_total": "prefix_cache_queries",
    "markbase_prefix_cache_hits_total": "prefix_cache_hits",
}
HISTOGRAMS = {
    "markbase_time_to_first_token_seconds": "ttft",
    "markbase_inter_token_latency_seconds": "itl",
}
FINISHED = "markbase_requests_finished_total"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Histogram:
    """Cumulative bucket counts of one histogram child, ``bounds[-1]`` = +Inf."""

    bounds: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)


@dataclass
class ModelSample:
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)  # by finish reason


@dataclass
class Snapshot:
    t: float  # wall clock (time.time()), for the page's axis
    models: dict[str, ModelSample]


def take_snapshot(registry: CollectorRegistry = REGISTRY) -> Snapshot:
    """The engine metrics now, by model label."""
    models: dict[str, ModelSample] = {}
    for family in registry.collect():
        if not family.name.startswith("markbase_"):
            continue
        for s in family.samples:
            model = s.labels.get("model")
            if model is None:
                continue
            m = models.setdefault(model, ModelSample())
            if s.name in GAUGES:
                m.gauges[GAUGES[s.name]] = s.value
            elif s.name in COUNTERS:
                m.counters[COUNTERS[s.name]] = s.value
            elif s.name == FINISHED:
                m.finished[s.labels.get("finish_reason", "")] = s.value
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in HISTOGRAMS:
                h = m.histograms.setdefault(HISTOGRAMS[s.name[: -len("_bucket")]], Histogram())
                h.bounds.append(float(s.labels["le"]))
                h.counts.append(s.value)
    return Snapshot(time.time(), models)


def quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """The ``q`` quantile of a histogram given cumulative ``counts`` per upper bound
    (the last bound +Inf), interpolating linearly inside the bucket, as Prometheus'
    ``histogram_quantile``. None when the histogram is empty. A quantile in the +Inf
    bucket is the highest finite bound."""
    if not counts or counts[-1] <= 0:
        return None
    target = q * counts[-1]
    prev_count, prev_bound = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= target and count > prev_count:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (target - prev_count) / (count - prev_count)
        prev_count, prev_bound = count, bound
    return prev_bound


def _delta_quantiles(new: Histogram | None, old: Histogram | None) -> dict[float, float | None]:
    if new is None:
        return {q: None for q in QUANTILES}
    old_counts = (
        old.counts if old is not None and old.bounds == new.bounds else [0.0] * len(new.counts)
    )
    counts = [max(0.0, a - b) for a, b in zip(new.counts, old_counts)]
    return {q: quantile(q, new.bounds, counts) for q in QUANTILES}


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def series(
    snapshots: list[Snapshot], latency_window: int = 10
) -> dict[str, dict[str, list | dict]]:
    """Per-model series over ``snapshots`` (oldest first): one point per snapshot after
    the first. Rates are per second between neighbours; latency percentiles and the
    prefix-cache hit rate cover the last ``latency_window`` snapshots, so a point with
    one slow request does not flicker to nothing a second later."""
    out: dict[str, dict[str, list | dict]] = {}
    names = sorted({name for s in snapshots for name in s.models})
    for name in names:
        cols: dict[str, list] = {
            "t": [],
            "running": [],
            "waiting": [],
            "kv_cache_usage": [],
            "prefix_cache_tokens": [],
            "generation_tok_s": [],
            "prompt_tok_s": [],
            "prefix_cache_hit_rate": [],
            **{f"{h}_p{int(q * 100)}_s": [] for h in HISTOGRAMS.values() for q in QUANTILES},
        }
        for i in range(1, len(snapshots)):
            cur, prev = snapshots[i], snapshots[i - 1]
            base = snapshots[max(0, i - latency_window)]
            m = cur.models.get(name)
            if m is None:
                continue
            p = prev.models.get(name, ModelSample())
            b = base.models.get(name, ModelSample())
            dt = max(cur.t - prev.t, 1e-6)
            cols["t"].append(round(cur.t, 3))
            for key in ("running", "waiting", "kv_cache_usage", "prefix_cache_tokens"):
                cols[key].append(m.gauges.get(key, 0.0))
            for key, col in (
                ("generation_tokens", "generation_tok_s"),
                ("prompt_tokens", "prompt_tok_s"),
            ):
                d = m.counters.get(key, 0.0) - p.counters.get(key, 0.0)
                cols[col].append(round(max(0.0, d) / dt, 2))
            queries = m.counters.get("prefix_cache_queries", 0.0) - b.counters.get(
                "prefix_cache_queries", 0.0
            )
            hits = m.counters.get("prefix_cache_hits", 0.0) - b.counters.get(
                "prefix_cache_hits", 0.0
            )
            cols["prefix_cache_hit_rate"].append(_round(hits / queries) if queries > 0 else None)
            for h in HISTOGRAMS.values():
                qs = _delta_quantiles(m.histograms.get(h), b.histograms.get(h))
                for q, v in qs.items():
                    cols[f"{h}_p{int(q * 100)}_s"].append(_round(v))
        last = snapshots[-1].models.get(name, ModelSample()) if snapshots else ModelSample()
        queries = last.counters.get("prefix_cache_queries", 0.0)
        totals = {
            "generation_tokens": int(last.counters.get("generation_tokens", 0.0)),
            "prompt_tokens": int(last.counters.get("prompt_tokens", 0.0)),
            "prefix_cache_hit_rate": _round(last.counters.get("prefix_cache_hits", 0.0) / queries)
            if queries > 0
            else None,
            "requests_finished": {k: int(v) for k, v in sorted(last.finished.items())},
        }
        for h in HISTOGRAMS.values():
            qs = _delta_quantiles(last.histograms.get(h), None)
            for q, v in qs.items():
                totals[f"{h}_p{int(q * 100)}_s"] = _round(v)
        out[name] = {**cols, "totals": totals}
    return out


class StatsRecorder:
    """Snapshots of the engine metrics every ``interval_s``, the last ``window_s`` kept."""

    def __init__(self, interval_s: float = 1.0, window_s: float = 600.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.snapshots: deque[Snapshot] = deque(maxlen=int(window_s / interval_s) + 1)
        self.snapshots.append(take_snapshot())

    def sample(self) -> None:
        self.snapshots.append(take_snapshot())

    def recent(self, seconds: float) -> list[Snapshot]:
        """Snapshots of the last ``seconds`` (plus the one before, for the first rate)
        and one taken now, so the newest point is never a second old."""
        now = take_snapshot()
        start = now.t - seconds
        kept = [s for s in self.snapshots if s.t >= start]
        older = [s for s in self.snapshots if s.t < start]
        if older:
            kept.insert(0, older[-1])
        if not kept or now.t - kept[-1].t > 0.2:
            kept.append(now)
        return kept

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()


@contextlib.asynccontextmanager
async def recording(app) -> AsyncIterator[None]:
    """App lifespan: a ``StatsRecorder`` sampling while the server runs."""
    recorder = StatsRecorder()
    app.state.stats_recorder = recorder
    task = asyncio.create_task(recorder.run(), name="markbase-stats")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
