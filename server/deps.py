"""Small functions every handler uses: the engine and settings of the app, and
reading a JSON body under the size limit into a request model."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from server.config import Settings
from server.errors import APIError, validation_error
from server.generation import Engine
from server.prompt_guard import PromptGuard
from server.schemas import ErrorResponse

M = TypeVar("M", bound=BaseModel)


def engine_of(request: Request) -> Engine:
    return request.app.state.engine


def settings_of(request: Request) -> Settings:
    return request.app.state.settings


def prompt_guard_of(request: Request) -> PromptGuard:
    return request.app.state.prompt_guard


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"Request body too large: the limit on this server is {limit} bytes.",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to pass ``limit``
    (from Content-Length before reading, or while reading a chunked body)."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise _too_large(limit)
        except ValueError:
            raise APIError(400, "Invalid Content-Length header.") from None
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: nobody to answer, and not a server error
        raise APIError(
            499,
            "The client closed the connection before sending the whole body.",
            code="client_disconnected",
        ) from None
    return b"".join(chunks)


DOCUMENTED_BODIES: list[type[BaseModel]] = []  # added to /openapi.json by server.app


def json_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that reads its body with ``parse_body``: FastAPI
    cannot see such a body, so this describes it in /openapi.json without changing
    how it is read (size limit first, strict validation, OpenAI error bodies)."""
    DOCUMENTED_BODIES.append(model)
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def responses(model: type[BaseModel], stream: bool = False) -> dict:
    """``responses`` for /openapi.json: the 200 body (or SSE stream) and the error body."""
    ok: dict = {"model": model}
    if stream:
        # Before OpenAPI 3.2 (itemSchema), an event stream's schema is that of one event.
        event = {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {"type": "string", "description": "a JSON chunk, an error body, or [DONE]"}
            },
        }
        ok["content"] = {"text/event-stream": {"schema": event}}
        ok["description"] = "The answer, or with stream=true its chunks as server-sent events"
    return {200: ok, "default": {"model": ErrorResponse, "description": "An OpenAI error body"}}


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the JSON body (whatever the Content-Type, as curl -d sends a
    form type) as ``model``; errors become OpenAI 400 bodies naming the field."""
    raw = await read_body(request, settings_of(request).server.max_body_bytes)
    if not raw.strip():
        raise APIError(
            400,
            "The request body is empty; send a JSON object (Content-Type: application/json).",
            code="invalid_json",
        )
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
