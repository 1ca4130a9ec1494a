"""Request context as a pure ASGI middleware (no BaseHTTPMiddleware, which
would buffer streams and break disconnect detection): request id in and out,
``Retry-After`` on every 429 and 503, HTTP metrics, and one JSON access-log line
per request."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import metrics
from server.errors import error_body
from server.generation import RequestInfo

access_log = logging.getLogger("markbase.access")
log = logging.getLogger("markbase.server")

_INTERNAL_ERROR_BODY = json.dumps(
    error_body("The server had an error while processing your request.", "server_error")
).encode()


def _internal_error_start() -> Message:
    return {
        "type": "http.response.start",
        "status": 500,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_INTERNAL_ERROR_BODY)).encode()),
        ],
    }


# Every 429 (queue full, no slot in time, tokenizer busy) and 503 (engine down,
# shutting down) says when to try again, unless its handler said already.
RETRY_STATUSES = frozenset({429, 503})
RETRY_AFTER_S = 1
RETRY_AFTER = (b"retry-after", str(RETRY_AFTER_S).encode())

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,128}$")


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if _CLIENT_ID.match(text):
                return text
            break
    return uuid.uuid4().hex


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, log_requests: bool = True) -> None:
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info = RequestInfo(request_id=_request_id(scope))
        scope["markbase"] = info
        status = 500
        started = False
        completed = False
        header = (b"x-request-id", info.request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status, started, completed
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = [*message.get("headers", []), header]
                if status in RETRY_STATUSES and not any(k == b"retry-after" for k, _ in headers):
                    headers.append(RETRY_AFTER)
                message["headers"] = headers
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True
            await send(message)

        metrics.HTTP_IN_PROGRESS.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Handlers map every expected failure to an OpenAI error; this is a bug.
            log.exception("unhandled error, request %s", info.request_id)
            info.error = "internal error"
            if not started:
                await send_with_id(_internal_error_start())
                await send_with_id({"type": "http.response.body", "body": _INTERNAL_ERROR_BODY})
        finally:
            metrics.HTTP_IN_PROGRESS.dec()
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            duration = time.monotonic() - info.started
            if not completed:
                metrics.HTTP_CLIENT_DISCONNECTS.labels(route).inc()
                if status < 400:
                    status = 499  # nginx's "client closed request"
            metrics.HTTP_REQUESTS.labels(route, scope["method"], str(status)).inc()
            metrics.HTTP_DURATION.labels(route).observe(duration)
            if self.log_requests:
                access_log.info(
                    json.dumps(
                        {
                            "request_id": info.request_id,
                            "method": scope["method"],
                            "route": route,
                            "status": status,
                            "model": info.model,
                            "stream": info.stream,
                            "n": info.n,
                            "prompt_tokens": info.prompt_tokens,
                            "completion_tokens": info.completion_tokens,
                            "duration_ms": round(duration * 1000, 1),
                            "error": info.error,
                        },
                        separators=(",", ":"),
                    )
                )
