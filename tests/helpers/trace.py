"""Reading a profiler trace of the served engine's decode steps (bench/gpu/worker_timeline.py
records it): the GPU's idle stretches inside a step charged to the host phase running at
their midpoint, busy time as the union of kernel intervals. Here so that
tests/backends/cuda/test_worker_timeline.py checks it on synthetic traces."""

from __future__ import annotations

import statistics
from collections import defaultdict

PREFIX = "mb:"


def analyse(events: list[dict]) -> dict:
    """Per full step (``mb:step`` ranges): wall, each host phase (``mb:*`` ranges inside
    it), GPU busy time (the union of kernel intervals clipped to the step), and the GPU's
    idle stretches over 20 us with the innermost host phase at their midpoint."""
    ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(PREFIX)]
    steps = sorted((e for e in ranges if e["name"] == PREFIX + "step"), key=lambda e: e["ts"])
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e
    )
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    rows = []
    gap_phase: dict = defaultdict(float)
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in ranges if e is not s and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1]
        phase_us: dict = defaultdict(float)
        for e in inside:
            phase_us[e["name"][len(PREFIX) :]] += e["dur"]
        # the encoding: what the step's decode call leaves after building and sampling
        # (mx.async_eval, the deliver of the previous step, inside _decode_step)
        spans = [(max(a, t0), min(b, t1)) for a, b in kernels if b > t0 and a < t1]
        busy, idle = _union(spans), []
        cur = t0
        for a, b in spans:
            if a - cur > 20:
                idle.append((cur, a))
            cur = max(cur, b)
        if t1 - cur > 20:
            idle.append((cur, t1))
        for a, b in idle:
            mid = (a + b) / 2
            covering = [e for e in inside if e["ts"] <= mid <= e["ts"] + e["dur"]]
            name = (
                min(covering, key=lambda e: e["dur"])["name"][len(PREFIX) :] if covering else "step"
            )
            gap_phase[name] += b - a
        calls: dict = defaultdict(int)
        for e in api:
            if t0 <= e["ts"] <= t1:
                calls[e["name"][:40]] += 1
        rows.append(
            dict(
                wall_us=s["dur"],
                busy_us=busy,
                idle_us=sum(b - a for a, b in idle),
                phases_us=dict(phase_us),
                api_calls=dict(calls),
            )
        )
    n = len(rows)
    if not n:
        return dict(steps=0)
    med = statistics.median
    names = sorted({k for r in rows for k in r["phases_us"]})
    return dict(
        steps=n,
        wall_us_median=med(r["wall_us"] for r in rows),
        busy_us_median=med(r["busy_us"] for r in rows),
        idle_us_median=med(r["idle_us"] for r in rows),
        kernels=len(kernels),
        phases_us_median={k: med(r["phases_us"].get(k, 0.0) for r in rows) for k in names},
        idle_us_per_step_by_host_phase={k: v / n for k, v in sorted(gap_phase.items())},
        api_calls_per_step={
            k: sum(r["api_calls"].get(k, 0) for r in rows) / n
            for k in sorted({k for r in rows for k in r["api_calls"]})
        },
        per_step=rows,
    )


def _union(spans: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
