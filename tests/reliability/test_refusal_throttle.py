"""server/refusals.py's budget per client address, on a fake clock (the server-level
behaviour is tested in test_hostile_prompts.py)."""

from __future__ import annotations

from server import refusals
from server.refusals import RefusalThrottle


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_refused_bytes_add_up_per_address_within_the_window():
    clock = Clock()
    th = RefusalThrottle(budget_bytes=1000, window_s=10.0, clock=clock)
    for _ in range(3):
        th.record("10.0.0.1", 400, 300)
    assert not th.throttled("10.0.0.1")  # 900 bytes
    th.record("10.0.0.2", 413, 900)  # another address has its own budget
    assert not th.throttled("10.0.0.1") and not th.throttled("10.0.0.2")
    th.record("10.0.0.1", 429, 100)
    assert th.throttled("10.0.0.1") and not th.throttled("10.0.0.2")
    clock.t += 9.9
    assert th.throttled("10.0.0.1")
    clock.t += 0.2  # the first three are out of the window
    assert not th.throttled("10.0.0.1")
    clock.t += 10
    assert not th.throttled("10.0.0.1") and "10.0.0.1" not in th._seen  # forgotten


def test_only_refusals_count():
    th = RefusalThrottle(budget_bytes=10, clock=Clock())
    for status in (200, 201, 304, 500, 503):
        th.record("a", status, 1000)
    assert not th.throttled("a")
    th.record("a", 404, 1000)
    assert th.throttled("a")
    th.record(None, 400, 1000)  # no address (a Unix socket): nothing to throttle
    assert not th.throttled(None)


def test_off_with_a_zero_budget():
    th = RefusalThrottle(budget_bytes=0, clock=Clock())
    th.record("a", 400, 10**9)
    assert not th.throttled("a") and not th._seen


def test_the_table_of_addresses_stays_bounded(monkeypatch):
    monkeypatch.setattr(refusals, "MAX_ADDRESSES", 8)
    clock = Clock()
    th = RefusalThrottle(budget_bytes=10**6, window_s=1.0, clock=clock)
    for i in range(8):
        th.record(f"old{i}", 400, 5)
    clock.t += 2  # all stale
    th.record("new", 400, 5)
    assert set(th._seen) == {"new"}
