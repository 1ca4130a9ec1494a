"""The engine's batched metric updates give what one update per value gives."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from engine import metrics

BOUNDS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)


def samples(h: Histogram) -> dict:
    return {
        (s.name, s.labels.get("le")): s.value
        for m in h.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


rng = random.Random(0)
CASES = {
    "none": [],
    "one": [0.03],
    "two": [0.03, 0.5],
    "one step": [0.031] * 128,  # every row's gap the same
    "joined rows": [0.031] * 120 + [0.2] * 5 + [0.004] * 3,
    "on the bounds": [0.005, 0.01, 0.02, 1, 2, 0.1, 0.1],  # le: counted at the bound
    "past the last bound": [3.0, 2.0000001, 100.0, 0.0],
    "random": [rng.expovariate(20) for _ in range(500)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_observe_many_equals_observe_per_value(case):
    registry = CollectorRegistry()
    batched = Histogram("batched", "", ["model"], buckets=BOUNDS, registry=registry)
    single = Histogram("single", "", ["model"], buckets=BOUNDS, registry=registry)
    b, s = batched.labels("m"), single.labels("m")
    for _ in range(2):  # onto earlier counts too
        metrics.observe_many(b, CASES[case])
        for v in CASES[case]:
            s.observe(v)
    got = {(n.replace("batched", ""), le): v for (n, le), v in samples(batched).items()}
    want = {(n.replace("single", ""), le): v for (n, le), v in samples(single).items()}
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key


def test_observe_many_without_prometheus_internals():
    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, v):
            self.seen.append(v)

    h = Plain()
    metrics.observe_many(h, [0.1, 0.2, 0.2, 0.3])
    assert h.seen == [0.1, 0.2, 0.2, 0.3]
