"""Limits on every phase of an HTTP connection, in uvicorn's h11 protocol.

uvicorn times out only idle keep-alive connections, and only after a first
response; a socket that sends nothing, half a request head or half a body is kept
open for ever, and nothing caps how many are open. ``protocol_class(limits)``
returns a subclass of uvicorn's ``H11Protocol`` (pass it as ``uvicorn.Config(http=
...)``) that gives each connection exactly one deadline at a time, from the phase
the HTTP state machine (h11) is in:

=========  ===========================================  ==========================
phase      what the server waits for                    deadline, then
=========  ===========================================  ==========================
head       the request line and headers, from the       ``header_timeout_s``; 408
           connection's start or the next request's     (or a silent close when
           first byte                                   nothing came), closed
body       the request body                             ``body_timeout_s`` + 1 s per
                                                        ``body_min_rate_bytes``
                                                        received; 408, closed
drain      the rest of a body the app answered without  ``keepalive_timeout_s``
           reading (413, 401, 404...)                   after the answer; closed
idle       a next request on a kept-alive connection    ``keepalive_timeout_s``;
                                                        closed
=========  ===========================================  ==========================

While the app works on a request whose body is in, no connection deadline runs:
``request_timeout_s`` bounds the request. Caps: past ``max_connections`` open
connections (per server) or ``max_connections_per_client`` (per client IP), a new
connection's request is answered 503 or 429 with an OpenAI error body and
``Retry-After``, and the connection is closed. A declared chunk larger than
``max_body_bytes`` is answered 413 at once; a request head over
``max_header_bytes`` 431 (h11 measures it; uvicorn answered a plain-text 400).
A client address whose refused requests (4xx) add up to ``refused_bytes_per_client``
within ``refusal_window_s`` has its next POSTs held ``refusal_delay_s``, bodies
unread, then answered 429 and closed (server.refusals says why).
Every answer here is an OpenAI error body. Timeouts and caps of 0 are off.
"""

from __future__ import annotations

import json
import logging
import math
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server import metrics
from server.errors import error_body
from server.middleware import RETRY_AFTER_S
from server.refusals import RefusalThrottle

log = logging.getLogger("markbase.server")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 20.0
    body_min_rate_bytes: int = 1024
    keepalive_timeout_s: float = 5.0
    max_connections: int = 1024
    max_connections_per_client: int = 128
    max_header_bytes: int = 16384
    max_body_bytes: int = 4 * 1024 * 1024
    refused_bytes_per_client: int = 16 * 1024 * 1024
    refusal_window_s: float = 10.0
    refusal_delay_s: float = 1.0

    @classmethod
    def from_settings(cls, s: Any) -> ConnectionLimits:
        """From ``server.config.ServerSettings``."""
        return cls(
            header_timeout_s=s.header_timeout_s,
            body_timeout_s=s.body_timeout_s,
            body_min_rate_bytes=s.body_min_rate_bytes,
            keepalive_timeout_s=s.keepalive_timeout_s,
            max_connections=s.max_connections,
            max_connections_per_client=s.max_connections_per_client,
            max_header_bytes=s.max_header_bytes,
            max_body_bytes=s.max_body_bytes,
            refused_bytes_per_client=s.refused_bytes_per_client,
            refusal_window_s=s.refusal_window_s,
            refusal_delay_s=s.refusal_delay_s,
        )


_STATUS_LINES = {
    408: b"HTTP/1.1 408 Request Timeout\r\n",
    413: b"HTTP/1.1 413 Content Too Large\r\n",
    429: b"HTTP/1.1 429 Too Many Requests\r\n",
    431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
    400: b"HTTP/1.1 400 Bad Request\r\n",
    503: b"HTTP/1.1 503 Service Unavailable\r\n",
}


def _error_json(status: int, message: str, code: str) -> bytes:
    kind = (
        "rate_limit_error"
        if status == 429
        else ("server_error" if status >= 500 else "invalid_request_error")
    )
    return json.dumps(error_body(message, kind, None, code)).encode()


def raw_error(status: int, message: str, code: str, retry: bool | int = False) -> bytes:
    """A whole HTTP/1.1 error response with ``Connection: close``, written to the
    socket directly (h11 cannot send one where the request head never arrived).
    ``retry``: a ``Retry-After`` header (True: the usual seconds, or that many)."""
    body = _error_json(status, message, code)
    head = _STATUS_LINES[status] + (
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
    )
    if retry:
        head += b"retry-after: %d\r\n" % (RETRY_AFTER_S if retry is True else retry)
    return head + b"\r\n" + body


def _refusal_app(status: int, message: str, code: str) -> Any:
    """An ASGI app for a connection over a cap: answers its request and closes."""
    body = _error_json(status, message, code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each phase of a connection and
    caps on open connections (see the module docstring). ``limits``,
    ``per_client`` and ``refusals`` are set by ``protocol_class``."""

    limits: ConnectionLimits = ConnectionLimits()
    per_client: Counter = Counter()
    refusals: RefusalThrottle = RefusalThrottle(budget_bytes=0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._phase_started = 0.0
        self._phase_bytes = 0
        self._timer: Any = None
        self._head_tail = b""  # the last bytes of the head so far (a separator may straddle reads)
        self._client_ip: str | None = None
        self._request_bytes = 0  # received of the current request, head and body
        self._held: Any = None  # the timer of a held request (refusal throttle)
        self.app = self._observed(self.app)

    def _observed(self, app: Any) -> Any:
        """``app`` with each answer's status noted for the refusal throttle."""

        async def observed(scope: Any, receive: Any, send: Any) -> None:
            async def noted(message: Any) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    self.refusals.record(self._client_ip, status, self._request_bytes)
                await send(message)

            await app(scope, receive, noted)

        return observed

    # -- connection lifetime -------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        metrics.CONNECTIONS_OPEN.inc()
        if self.client:
            self._client_ip = self.client[0]
            self.per_client[self._client_ip] += 1
        refusal = self._over_cap()
        if refusal is not None:
            self.app = refusal
        self._enter("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._held is not None:
            self._held.cancel()
        self._phase = None
        metrics.CONNECTIONS_OPEN.dec()
        if self._client_ip is not None:
            self.per_client[self._client_ip] -= 1
            if self.per_client[self._client_ip] <= 0:
                del self.per_client[self._client_ip]
            self._client_ip = None
        super().connection_lost(exc)

    def _over_cap(self) -> Any:
        lim = self.limits
        if lim.max_connections and len(self.connections) > lim.max_connections:
            metrics.CONNECTIONS_REJECTED.labels("server_limit").inc()
            return _refusal_app(
                503,
                f"The server has too many open connections (limit {lim.max_connections}); "
                "retry in a moment.",
                "too_many_connections",
            )
        cap = lim.max_connections_per_client
        if cap and self._client_ip is not None and self.per_client[self._client_ip] > cap:
            metrics.CONNECTIONS_REJECTED.labels("client_limit").inc()
            return _refusal_app(
                429,
                f"Too many open connections from your address (limit {cap}); close some "
                "or retry in a moment.",
                "too_many_connections",
            )
        return None

    # -- events --------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._held is not None:
            return  # a held request's bytes are dropped unread
        if self._phase == "idle":
            self._enter("head")  # the first byte of the next request
        if self._phase == "head" and not self._phase_bytes and self._hold_if_throttled(data):
            return
        if self._phase == "head" and self._head_too_large(data):
            return
        self._phase_bytes += len(data)
        self._request_bytes += len(data)
        super().data_received(data)
        self._follow()

    def _hold_if_throttled(self, data: bytes) -> bool:
        """A POST from an address over its refusal budget: nothing of it is parsed;
        reading stops for ``refusal_delay_s`` (the client's sending blocks), then it is
        answered 429 and the rest of what it sends is dropped until it closes (so it
        reads the answer instead of a reset). GETs (/health, /v1/models) still pass."""
        if not data.startswith(b"POST") or not self.refusals.throttled(self._client_ip):
            return False
        metrics.CONNECTIONS_REJECTED.labels("refusals").inc()
        self._enter(None)
        self.transport.pause_reading()
        self._held = self.loop.call_later(self.limits.refusal_delay_s, self._answer_held)
        return True

    def _answer_held(self) -> None:
        if self.transport.is_closing():
            return
        lim = self.limits
        window = math.ceil(lim.refusal_window_s)
        self.transport.write(
            raw_error(
                429,
                f"Too many refused requests from your address (over "
                f"{lim.refused_bytes_per_client} bytes of them in {lim.refusal_window_s:g} "
                f"s); retry in {window} s.",
                "too_many_refusals",
                retry=window,
            )
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._held = self.loop.call_later(lim.keepalive_timeout_s or 5.0, self.transport.close)

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the request head outgrows ``max_header_bytes`` with ``data``. h11
        bounds only a head still incomplete after a read; one that arrives whole in
        a single read would pass at any size."""
        seen = self._phase_bytes
        window = self._head_tail + data
        ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := window.find(sep)) >= 0]
        head = seen - len(self._head_tail) + (min(ends) if ends else len(window))
        self._head_tail = window[-3:]
        if head <= self.limits.max_header_bytes:
            return False
        self._close_with(self._header_too_large())
        return True

    def _header_too_large(self) -> bytes:
        return raw_error(
            431,
            f"The request line and headers are over {self.limits.max_header_bytes} bytes.",
            "request_header_too_large",
        )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timer: the idle phase here closes such connections."""

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request: 431 when the head outgrew
        ``max_header_bytes``, else 400; an OpenAI error body either way."""
        if len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:
            self._close_with(self._header_too_large())
        else:
            self._close_with(
                raw_error(400, "Invalid HTTP request received.", "invalid_http_request")
            )

    # -- phases --------------------------------------------------------------------
    def _follow(self) -> None:
        """Set the phase from where h11 is in the request/response cycle."""
        if self.transport is None or self.transport.is_closing():
            self._cancel_timer()
            return
        theirs, ours = self.conn.their_state, self.conn.our_state
        if theirs is h11.SEND_BODY:
            phase = "body" if ours is h11.SEND_RESPONSE else "drain"
            if phase == "body" and self._chunk_too_large():
                return
        elif theirs is h11.IDLE or (theirs is h11.DONE and ours is h11.DONE):
            pending = bool(self.conn.trailing_data[0])
            phase = "head" if pending or self._phase == "head" else "idle"
        else:
            phase = None  # the app has the whole request: request_timeout_s applies
        if phase != self._phase:
            self._enter(phase)

    def _enter(self, phase: str | None) -> None:
        if phase == "head":
            self._request_bytes = 0
        self._phase = phase
        self._phase_started = self.loop.time()
        self._phase_bytes = 0
        self._head_tail = b""
        self._cancel_timer()
        self._arm()

    def _deadline(self) -> float | None:
        lim = self.limits
        limit = {
            "head": lim.header_timeout_s,
            "body": lim.body_timeout_s,
            "drain": lim.keepalive_timeout_s,
            "idle": lim.keepalive_timeout_s,
        }.get(self._phase or "", 0)
        if not limit:
            return None
        if self._phase == "body" and lim.body_min_rate_bytes:
            limit += self._phase_bytes / lim.body_min_rate_bytes
        return self._phase_started + limit

    def _arm(self) -> None:
        deadline = self._deadline()
        if deadline is not None:
            self._timer = self.loop.call_at(deadline, self._on_deadline)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_deadline(self) -> None:
        self._timer = None
        deadline = self._deadline()
        if deadline is None or self.transport.is_closing():
            return
        if self.loop.time() < deadline:  # bytes came meanwhile and moved it
            self._arm()
            return
        phase = self._phase
        waited = self.loop.time() - self._phase_started
        metrics.CONNECTIONS_CLOSED.labels(f"{phase}_timeout").inc()
        log.debug(
            "closing connection from %s: %s phase over after %.1f s", self.client, phase, waited
        )
        if phase == "head" and self.conn.trailing_data[0]:
            self._close_with(
                raw_error(
                    408,
                    f"The request line and headers did not arrive within "
                    f"{self.limits.header_timeout_s:g} s.",
                    "request_timeout",
                )
            )
        elif phase == "body" and not (self.cycle and self.cycle.response_started):
            self._close_with(
                raw_error(
                    408,
                    f"The request body did not arrive in time ({waited:.0f} s; a body gets "
                    f"{self.limits.body_timeout_s:g} s plus 1 s per "
                    f"{self.limits.body_min_rate_bytes} bytes).",
                    "request_timeout",
                )
            )
        else:
            self._close_with(b"")

    def _chunk_too_large(self) -> bool:
        """A chunk header announcing more than ``max_body_bytes``: answer 413 now
        instead of waiting for bytes that would be refused. (h11 accepts chunk sizes
        of up to 20 hex digits and keeps the announced size in its reader.)"""
        reader = getattr(self.conn, "_reader", None)
        announced = getattr(reader, "_bytes_in_chunk", 0)
        if not isinstance(announced, int) or announced <= self.limits.max_body_bytes:
            return False
        if self.cycle is not None and self.cycle.response_started:
            return False  # the app has answered; the drain deadline will close it
        metrics.CONNECTIONS_CLOSED.labels("chunk_too_large").inc()
        self._close_with(
            raw_error(
                413,
                f"Request body too large: a chunk of {announced} bytes was announced; the "
                f"limit on this server is {self.limits.max_body_bytes} bytes.",
                "request_too_large",
            )
        )
        return True

    def _close_with(self, response: bytes) -> None:
        """Write ``response`` (may be empty), close, and tell the app the client is gone."""
        self._cancel_timer()
        self._phase = None
        if response:
            self.refusals.record(self._client_ip, int(response[9:12]), self._request_bytes)
        if not self.transport.is_closing():
            if response:
                self.transport.write(response)
            self.transport.close()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class bound to ``limits``, with its own per-client counts and
    refusal throttle (one per server)."""
    refusals = RefusalThrottle(
        budget_bytes=limits.refused_bytes_per_client,
        window_s=limits.refusal_window_s,
    )
    return type(
        "MarkbaseH11Protocol",
        (GuardedH11Protocol,),
        {"limits": limits, "per_client": Counter(), "refusals": refusals},
    )


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments these limits need."""
    return {
        "http": protocol_class(limits),
        "ws": "none",  # no WebSocket routes: an Upgrade request is plain HTTP
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        # uvicorn's own keep-alive timer does nothing here (the idle phase closes)
        "timeout_keep_alive": limits.keepalive_timeout_s or 365 * 24 * 3600,
    }


def raise_open_file_limit(limits: ConnectionLimits, reserve: int = 256) -> None:
    """Lift the soft limit on open files so ``max_connections`` sockets fit beside
    the model's files (macOS starts processes at 256); warn when it cannot."""
    if not limits.max_connections:
        return
    want = limits.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "open-file limit %d is below max_connections %d + %d: the server may run out "
            "of sockets before the connection cap answers 503 (raise ulimit -n)",
            soft,
            limits.max_connections,
            reserve,
        )
