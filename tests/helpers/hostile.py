"""Client-side tools for hostile-load tests and bench/serve/hostile.py, loopback only.

* ``Flood``: a separate process whose connections POST one prepared body again
  and again (its own process, so its CPU and GIL do not skew what this process
  measures); ``result()`` gives the status counts and latencies.
* ``HealthProbe``: a thread timing ``GET /health`` every ``interval_s``.
* ``StreamProbe``: a thread reading one streamed completion and recording the
  gap between chunks.
* ``slow_socket``: a raw socket that starts a request the way a slowloris
  client does and then stops.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_FLOOD = r"""
import asyncio, json, sys, time
host, port, path, body_path, clients, seconds, grace, headers, source = sys.argv[1:10]
local = (source, 0) if source else None
body = open(body_path, "rb").read()
head = "".join(f"{k}: {v}\r\n" for k, v in json.loads(headers).items())
request = (
    f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{head}"
    f"Content-Length: {len(body)}\r\n\r\n"
).encode() + body
out = {"status": {}, "latency_s": []}

async def client(stop):
    reader = writer = None
    while time.monotonic() < stop:
        t0 = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, int(port), local_addr=local)
            writer.write(request)
            await writer.drain()
            status_line = await reader.readline()
            length, close = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
                close |= name.lower() == "connection" and "close" in value.lower()
            await reader.readexactly(length)
            key = status_line.split()[1].decode()
            if close:
                writer.close()
                writer = None
        except asyncio.CancelledError:
            out["status"]["no answer"] = out["status"].get("no answer", 0) + 1
            raise
        except Exception as exc:
            key = type(exc).__name__
            if writer is not None:
                writer.close()
            writer = None
        out["status"][key] = out["status"].get(key, 0) + 1
        out["latency_s"].append(time.monotonic() - t0)
    if writer is not None:
        writer.close()

async def main():
    print("ready", flush=True)
    stop = time.monotonic() + float(seconds)
    tasks = [asyncio.ensure_future(client(stop)) for _ in range(int(clients))]
    # requests still unanswered this long after the end are given up
    await asyncio.wait(tasks, timeout=float(seconds) + float(grace))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

asyncio.run(main())
print(json.dumps(out), flush=True)
"""


def sources(n: int) -> list[str]:
    """Loopback addresses this system lets a client bind (Linux: all of 127/8)."""
    out = []
    for i in range(2, 2 + n):
        addr = f"127.0.0.{i}"
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
            out.append(addr)
        except OSError:
            break
    return out or ["127.0.0.1"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Flood:
    """``clients`` connections of a child process POSTing ``body`` to ``url`` again and
    again for ``seconds`` (asyncio over raw sockets: the flood itself costs little CPU),
    from the loopback address ``source`` if given (another client than the probes').
    Requests unanswered ``grace_s`` after that are given up ("no answer")."""

    def __init__(
        self,
        url: str,
        body: bytes,
        clients: int,
        seconds: float,
        headers: dict[str, str] | None = None,
        tmp_dir: Path | None = None,
        grace_s: float = 20.0,
        source: str | None = None,
    ) -> None:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="markbase-flood-", suffix=".json", dir=tmp_dir)
        with open(fd, "wb") as f:
            f.write(body)
        self._body_path = path
        where = httpx.URL(url)
        args = [where.host, str(where.port), where.path, path, str(clients), str(seconds)]
        args.append(str(grace_s))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FLOOD, *args, json.dumps(headers or {}), source or ""],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # "ready": the clients are starting now

    def result(self, timeout_s: float = 300) -> dict:
        out, _ = self.proc.communicate(timeout=timeout_s)
        Path(self._body_path).unlink(missing_ok=True)
        return json.loads(out.strip().splitlines()[-1])


@dataclass
class HealthProbe:
    url: str
    interval_s: float = 0.05
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (when, seconds)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                c.get(self.url + "/health").raise_for_status()
                self.latencies.append((t0, time.monotonic() - t0))
                time.sleep(self.interval_s)

    def between(self, start: float, end: float) -> list[float]:
        return [s for t, s in self.latencies if start <= t < end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@dataclass
class StreamProbe:
    """One streamed completion of ``max_tokens`` tokens; ``arrivals`` of its chunks."""

    url: str
    model: str
    max_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    stopped_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {
            "model": self.model,
            "prompt": "Once upon a time",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=body, headers=self.headers, timeout=600
            ) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return  # closing the stream cancels the sequence
                    if line.startswith("data: {"):
                        self.arrivals.append(time.monotonic())
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = str(chunk["error"])
                        else:
                            self.text += chunk["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            self.error = repr(exc)

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between consecutive chunks (the first one, prefill, left out) that
        overlap [start, end); a stream still waiting when ``stop`` was called counts
        its wait so far as a gap too (a stall is not hidden by never ending)."""
        a = list(self.arrivals)
        if self.stopped_at is not None and a and a[-1] < self.stopped_at:
            a.append(self.stopped_at)
        return [a[i] - a[i - 1] for i in range(2, len(a)) if a[i] >= start and a[i - 1] < end]

    def join(self, timeout_s: float = 600) -> None:
        self._thread.join(timeout=timeout_s)

    def stop(self) -> None:
        """Hang up (at the next chunk) and wait for the thread."""
        self.stopped_at = time.monotonic()
        self._stop.set()
        self.join(timeout_s=60)


# What a slowloris client sends before it stops; each must be closed by the server.
SLOW_VARIANTS: dict[str, bytes] = {
    "nothing": b"",
    "half head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
    "half body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model":'
    ),
    "20-hex-digit chunk": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"FFFFFFFFFFFFFFFFFFFF\r\nab"
    ),
    "idle keep-alive": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
}


def slow_socket(host: str, port: int, variant: str, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect((host, port))
    if SLOW_VARIANTS[variant]:
        s.sendall(SLOW_VARIANTS[variant])
    s.setblocking(False)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (reads and drops what it sent)."""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
