"""Server-sent events as OpenAI sends them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``.

``SSEResponse`` streams an async iterator of already-encoded events and, whatever
ASGI spec version the server speaks, listens for the client going away at the
same time: on disconnect the body iterator is cancelled, so its ``finally``
closes the engine streams at once instead of at the next token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


def encode(obj: Any) -> str:
    """One event carrying a JSON object (a pydantic model or a dict)."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump()
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        self.on_close = on_close  # runs however the response ends, even if never iterated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._run(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while we were sending
                finally:
                    tg.cancel_scope.cancel()

            async def listen() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            tg.start_soon(listen)
        # An iterator left unfinished by the cancellation is closed here, outside
        # the cancelled scope, so its cleanup is not cancelled in turn.
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()
