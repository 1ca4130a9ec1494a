"""GET /v1/stats (recent engine metrics as time series) and the page routes, against a
real server with an API key; the quantile arithmetic on known histograms."""

from __future__ import annotations

import time

import httpx
import pytest

from server.stats import quantile
from tests.helpers.server import running_server

MODEL = "smollm2-135m-instruct"
KEY = "sk-stats-test"


def test_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    bounds = [0.1, 0.5, 1.0, float("inf")]
    # 10 observations: 2 <= 0.1, 6 in (0.1, 0.5], 2 in (0.5, 1.0]
    counts = [2, 8, 10, 10]
    assert quantile(0.5, bounds, counts) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6)
    assert quantile(0.2, bounds, counts) == pytest.approx(0.1)
    assert quantile(0.99, bounds, counts) == pytest.approx(0.5 + 0.5 * (9.9 - 8) / 2)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.99, bounds, [0, 0, 0, 3]) == 1.0  # only +Inf: the top finite bound


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, api_key=KEY) as srv:
        yield srv


def test_pages_are_public_and_stats_need_the_key(server):
    for path, kind in (
        ("/", "text/html"),
        ("/dashboard", "text/html"),
        ("/static/chat.js", "javascript"),
    ):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200, path
        assert kind in r.headers["content-type"], path
    assert "<title>markbase chat</title>" in httpx.get(server.url + "/", timeout=10).text
    assert httpx.get(server.url + "/static/nope.js", timeout=10).status_code == 404
    r = httpx.get(server.v1 + "/stats", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"]
    r = httpx.get(
        server.v1 + "/stats", params={"seconds": -1}, headers=server.headers(), timeout=10
    )
    assert r.status_code == 400


def test_stats_count_the_tokens_served(server):
    # The series' first point is the rate since the recorder's first snapshot, which the
    # sum below cannot weigh (no interval before it): wait for a second snapshot, so that
    # every token of this test falls in a point the sum counts (a fresh server otherwise
    # answers inside that first second).
    deadline = time.monotonic() + 10
    while True:
        before = httpx.get(server.v1 + "/stats", headers=server.headers(), timeout=10).json()
        if len(before["models"].get(MODEL, {}).get("t", [])) >= 2:
            break
        assert time.monotonic() < deadline, "the stats recorder took no second snapshot"
        time.sleep(0.2)
    start = before["models"][MODEL]["totals"]["generation_tokens"]
    served = 0
    for i in range(3):
        r = httpx.post(
            server.v1 + "/chat/completions",
            headers=server.headers(),
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Say a number bigger than {i}."}],
                "max_tokens": 12,
                "temperature": 0,
            },
            timeout=120,
        )
        served += r.json()["usage"]["completion_tokens"]
    time.sleep(1.2)  # one more sample after the last token
    body = httpx.get(
        server.v1 + "/stats", params={"seconds": 60}, headers=server.headers(), timeout=10
    ).json()
    assert body["limits"]["max_num_seqs"] == 16
    m = body["models"][MODEL]
    assert m["totals"]["generation_tokens"] - start == served
    n = len(m["t"])
    assert n >= 2 and all(len(m[k]) == n for k in m if k != "totals")
    assert m["t"] == sorted(m["t"])
    # The rate series add up to the tokens served (within the sampling of the last point).
    dt = [b - a for a, b in zip(m["t"], m["t"][1:])]
    generated = sum(r * d for r, d in zip(m["generation_tok_s"][1:], dt))
    assert generated == pytest.approx(served, rel=0.05, abs=2)
    assert max(m["generation_tok_s"]) > 0
    assert m["running"][-1] == 0 and m["waiting"][-1] == 0
    assert any(v is not None and v > 0 for v in m["ttft_p50_s"])
    assert any(v is not None and v > 0 for v in m["itl_p99_s"])
    assert m["totals"]["ttft_p50_s"] > 0
    assert (
        m["totals"]["requests_finished"].get("length", 0)
        + m["totals"]["requests_finished"].get("stop", 0)
        >= 3
    )
