"""Hostile connections against a real ``markbase serve`` over raw loopback sockets:
every phase of a connection has a deadline (server.connections), the caps on
open connections answer 429/503 with an OpenAI error body and ``Retry-After``,
and HTTP-level errors are OpenAI-shaped too.

The server runs with short limits (1 s for a head, 1 s plus 1 s per 100 bytes for
a body, 1 s idle) so each case takes about a second; the test measures how long
the server took to close the socket. Bounded: every socket read has a timeout."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEAD_S = 1.0  # --header-timeout-s
BODY_S = 1.0  # --body-timeout-s
RATE = 100  # --body-min-rate-bytes
IDLE_S = 1.0  # --keepalive-timeout-s
PER_CLIENT = 6
PER_SERVER = 10
SLACK_S = 1.5  # scheduling noise on a loaded CI machine
FLAGS = [
    "--header-timeout-s",
    str(HEAD_S),
    "--body-timeout-s",
    str(BODY_S),
    "--body-min-rate-bytes",
    str(RATE),
    "--keepalive-timeout-s",
    str(IDLE_S),
    "--max-connections",
    str(PER_SERVER),
    "--max-connections-per-client",
    str(PER_CLIENT),
    "--max-num-seqs",
    "1",
    "--max-queued-requests",
    "1",
]


@pytest.fixture(scope="module")
def srv():
    with running_server(DEFAULT_MODEL, *FLAGS, api_key=API_KEY) as server:
        yield server


def port(srv) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def connect(srv, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(15)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port(srv)))
    return s


def until_closed(s: socket.socket, limit_s: float = 15) -> tuple[float, bytes]:
    """Seconds until the server closed the socket, and what it sent before."""
    t0 = time.monotonic()
    data = b""
    s.settimeout(limit_s)
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return time.monotonic() - t0, data


def response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def read_response(s: socket.socket, limit_s: float = 60) -> bytes:
    """One whole response with a Content-Length (the connection stays open)."""
    s.settimeout(limit_s)
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        assert chunk, raw
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(response(head + b"\r\n\r\n")[1]["content-length"])
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, raw
        body += chunk
    return head + b"\r\n\r\n" + body


def openai_error(raw: bytes, status: int, code: str | None = None) -> dict:
    got, headers, body = response(raw)
    assert got == status, raw[:400]
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def open_connections(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return float(re.search(r"^markbase_http_connections_open (\S+)$", text, re.M).group(1))


def wait_for_quiet(srv) -> None:
    """Until only the /metrics request itself is open (closed sockets take a moment)."""
    deadline = time.monotonic() + 10
    while open_connections(srv) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)


COMPLETION = json.dumps(
    {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 1}
).encode()


def post_head(length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\n{size}{extra}\r\n"
    ).encode()


# --------------------------------------------------------------------------- head


def test_a_socket_that_sends_nothing_is_closed_after_the_header_timeout(srv):
    dt, data = until_closed(connect(srv))
    assert HEAD_S - 0.1 <= dt <= HEAD_S + SLACK_S and data == b""


@pytest.mark.parametrize(
    "partial",
    [b"POST /v1/comp", b"GET /health HTTP/1.1\r\nHost: x\r\n", post_head(10)[:-2]],
    ids=["half request line", "headers without the end", "no blank line"],
)
def test_half_a_head_gets_408_and_is_closed(srv, partial):
    s = connect(srv)
    s.sendall(partial)
    dt, data = until_closed(s)
    assert HEAD_S - 0.1 <= dt <= HEAD_S + SLACK_S
    assert "did not arrive" in openai_error(data, 408, "request_timeout")["message"]


def test_a_head_trickled_byte_by_byte_still_meets_its_deadline(srv):
    """The deadline is for the whole head, not between bytes (slowloris)."""
    s = connect(srv)
    t0 = time.monotonic()
    sent = b""
    head = b"GET /health HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 200
    try:
        for byte in head:
            s.sendall(bytes([byte]))
            sent += bytes([byte])
            time.sleep(0.05)
            if time.monotonic() - t0 > HEAD_S + SLACK_S + 1:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    dt, data = until_closed(s)
    total = time.monotonic() - t0
    assert total <= HEAD_S + SLACK_S + 0.5, total
    openai_error(data, 408, "request_timeout")


def test_an_oversized_head_is_431_whether_whole_or_in_pieces(srv):
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    s = connect(srv)
    s.sendall(big)
    dt, data = until_closed(s)
    assert dt < 1.0
    openai_error(data, 431, "request_header_too_large")
    s = connect(srv)
    try:
        for i in range(0, 18000, 3000):
            s.sendall(big[i : i + 3000])
            time.sleep(0.02)
    except (BrokenPipeError, ConnectionResetError):
        pass
    openai_error(until_closed(s)[1], 431, "request_header_too_large")


def test_malformed_http_is_an_openai_400(srv):
    s = connect(srv)
    s.sendall(b"HELLO THERE\r\n\r\n")
    openai_error(until_closed(s)[1], 400, "invalid_http_request")


# --------------------------------------------------------------------------- body


def test_half_a_body_gets_408_after_the_body_deadline(srv):
    s = connect(srv)
    s.sendall(post_head(1000) + b'{"model":')  # 9 of 1000 bytes
    dt, data = until_closed(s)
    assert BODY_S - 0.1 <= dt <= BODY_S + 9 / RATE + SLACK_S
    openai_error(data, 408, "request_timeout")


def test_a_body_slower_than_the_minimum_rate_is_cut(srv):
    """20 bytes/s against a minimum of 100: the deadline (1 s + bytes/100) is met
    after about 1.25 s."""
    s = connect(srv)
    s.sendall(post_head(1000))
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 5:
            s.sendall(b" " * 2)
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    dt, data = until_closed(s)
    total = time.monotonic() - t0
    assert 1.0 <= total <= 1.25 + SLACK_S, total
    openai_error(data, 408, "request_timeout")


def test_a_body_faster_than_the_minimum_rate_is_served(srv):
    """The same kind of slow upload at 300 bytes/s (over 2 s) goes through."""
    body = COMPLETION + b" " * (600 - len(COMPLETION))
    s = connect(srv)
    s.sendall(post_head(len(body)))
    for i in range(0, len(body), 30):
        s.sendall(body[i : i + 30])
        time.sleep(0.1)
    raw = read_response(s)
    s.close()
    assert response(raw)[0] == 200, raw[:400]


def test_a_20_hex_digit_chunk_size_is_413_at_once(srv):
    s = connect(srv)
    s.sendall(post_head(None, "Transfer-Encoding: chunked\r\n") + b"FFFFFFFFFFFFFFFFFFFF\r\nabc")
    dt, data = until_closed(s)
    assert dt < 1.0
    openai_error(data, 413, "request_too_large")


def test_a_chunked_body_of_honest_size_is_served(srv):
    s = connect(srv)
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(part), part) for part in (COMPLETION[:10], COMPLETION[10:])
    )
    s.sendall(post_head(None, "Transfer-Encoding: chunked\r\n") + chunks + b"0\r\n\r\n")
    raw = read_response(s)
    s.close()
    assert response(raw)[0] == 200, raw[:400]


def test_an_answer_before_the_body_ends_drains_then_closes(srv):
    """413 from Content-Length alone; the unread body may follow for the idle time."""
    s = connect(srv)
    s.sendall(post_head(10**9) + b"x" * 100)
    t0 = time.monotonic()
    openai_error(read_response(s), 413, "request_too_large")
    dt, _ = until_closed(s)
    assert time.monotonic() - t0 <= IDLE_S + SLACK_S


# --------------------------------------------------------------------------- keep-alive


def test_an_idle_keepalive_connection_is_closed_and_a_busy_one_kept(srv):
    s = connect(srv)
    for _ in range(3):  # three requests on one connection, each within the idle time
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(read_response(s))[0] == 200
        time.sleep(IDLE_S / 3)
    dt, data = until_closed(s)
    assert IDLE_S * 2 / 3 - 0.1 <= dt <= IDLE_S + SLACK_S and data == b""


def test_half_a_head_after_a_response_meets_the_header_deadline(srv):
    """Bytes after a response used to switch uvicorn's keep-alive timer off for good."""
    s = connect(srv)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response(read_response(s))[0] == 200
    s.sendall(b"GET /hea")
    dt, data = until_closed(s)
    assert dt <= HEAD_S + SLACK_S
    openai_error(data, 408, "request_timeout")


# --------------------------------------------------------------------------- caps


def test_past_the_per_client_cap_a_connection_gets_429_with_retry_after(srv):
    wait_for_quiet(srv)
    held = [connect(srv) for _ in range(PER_CLIENT)]
    try:
        s = connect(srv)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        dt, data = until_closed(s)
        assert dt < HEAD_S
        err = openai_error(data, 429, "too_many_connections")
        assert f"limit {PER_CLIENT}" in err["message"]
        assert response(data)[1]["retry-after"] == "1"
    finally:
        for h in held:
            h.close()


def test_past_the_server_cap_a_connection_gets_503_with_retry_after(srv):
    """Clients on other loopback addresses (127.0.0.2, ...), each under its own cap."""
    try:
        socket.create_connection(("127.0.0.1", port(srv)), source_address=("127.0.0.2", 0)).close()
    except OSError:
        pytest.skip("this system cannot bind 127.0.0.2")
    wait_for_quiet(srv)
    held = []
    try:
        for i in range(PER_SERVER):
            held.append(connect(srv, f"127.0.0.{2 + i % 3}"))
        s = connect(srv, "127.0.0.9")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        dt, data = until_closed(s)
        err = openai_error(data, 503, "too_many_connections")
        assert f"limit {PER_SERVER}" in err["message"]
        assert response(data)[1]["retry-after"] == "1"
    finally:
        for h in held:
            h.close()
    wait_for_quiet(srv)
    assert httpx.get(srv.url + "/health").status_code == 200  # room again


# --------------------------------------------------------------------------- app errors


def test_a_full_queue_is_429_with_retry_after(srv):
    """One slot, one waiting place: of three long requests at once, one is refused.
    "Long": the first must still be decoding when the third arrives 0.6 s later, on a
    fast machine too (24 tokens were done in ~0.5 s at ~50 tok/s)."""
    body = {
        "model": DEFAULT_MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
    }
    results: list[httpx.Response] = []

    def post() -> None:
        results.append(httpx.post(srv.v1 + "/completions", json=body, headers=AUTH, timeout=120))

    threads = [threading.Thread(target=post) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join()
    refused = [r for r in results if r.status_code == 429]
    assert refused, [r.status_code for r in results]
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"


def test_framework_errors_are_openai_shaped(srv):
    r = httpx.get(srv.url + "/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(srv.v1 + "/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(srv.v1 + "/completions", content=b'{"model": ', headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_open_metrics_with_api_keys_is_a_startup_warning(srv):
    log = srv.log_tail(10_000)
    assert re.search(r"WARNING .*API keys are set but /metrics is open", log), log[-2000:]


def test_after_all_that_the_server_is_healthy_and_correct(srv):
    wait_for_quiet(srv)
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(
        srv.v1 + "/completions",
        json={
            "model": DEFAULT_MODEL,
            "prompt": "The capital of France is",
            "temperature": 0,
            "max_tokens": 2,
        },
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris."
    metrics = httpx.get(srv.url + "/metrics").text
    for reason in ("head_timeout", "body_timeout", "idle_timeout", "chunk_too_large"):
        assert re.search(
            rf'markbase_http_connections_closed_by_limit_total{{reason="{reason}"}} [1-9]', metrics
        ), reason
    assert "unhandled error" not in srv.log_tail(100_000)
