"""Bearer API keys: every /v1/* request, /tokenize and /detokenize (and /metrics when
configured) need ``Authorization: Bearer <key>``. Keys are compared in constant time
and never logged or echoed back."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_body

MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
INCORRECT = "Incorrect API key provided."


def key_matches(token: bytes, keys: list[bytes]) -> bool:
    ok = False
    for key in keys:  # no early exit: time does not depend on which key matched
        ok |= hmac.compare_digest(token, key)
    return ok


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str], protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return (
            path == "/v1"
            or path.startswith("/v1/")
            or path in ("/tokenize", "/detokenize")
            or (self.protect_metrics and path == "/metrics")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.keys
            or scope["method"] == "OPTIONS"  # CORS preflight carries no credentials
            or not self._protected(scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        auth = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                auth = value
                break
        scheme, _, token = auth.strip().partition(b" ")
        if not auth:
            await _deny(send, MISSING)
        elif scheme.lower() != b"bearer" or not key_matches(token.strip(), self.keys):
            await _deny(send, INCORRECT)
        else:
            await self.app(scope, receive, send)


async def _deny(send: Send, message: str) -> None:
    body = json.dumps(
        error_body(message, "invalid_request_error", None, "invalid_api_key")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="markbase"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
