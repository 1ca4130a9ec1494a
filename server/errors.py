"""OpenAI error bodies, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

``APIError`` is what handlers raise; engine errors (``engine.types.EngineError``)
carry their own status and type; Starlette's 404/405 and anything unexpected are
mapped here too, so no FastAPI-shaped body (``{"detail": ...}``) ever leaves.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import EngineError

log = logging.getLogger("markbase.server")


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: EngineError, param: str | None = None) -> APIError:
    """An engine error as an APIError; ``param`` overrides the class default
    (a completion's prompt is ``prompt``, not ``messages``)."""
    message = str(exc) or type(exc).__name__
    return APIError(
        exc.status_code,
        message,
        type=exc.error_type,
        param=param if param is not None and exc.param is not None else exc.param,
        code=exc.code,
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "ContentPart"}
_READABLE = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "list[str]": "an array of strings",
    "list[int]": "an array of integers",
    "list[list[int]]": "an array of arrays of integers",
    "list[ContentPart]": "an array of content parts",
    "dict[str,any]": "an object",
}


def _is_tag(part: Any) -> bool:
    """pydantic names union members in ``loc`` ('str', 'list[str]', 'StreamOptions')."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper())


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (part == "body" and not out) or _is_tag(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _depth(err: dict[str, Any]) -> int:
    return sum(1 for p in err.get("loc", ()) if not _is_tag(p))


def _pick(errors: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str] | None]:
    """The error to report and, when every branch of a union only disagreed
    on the type, the readable list of types that would have been accepted."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    tag_at = next((i for i, p in enumerate(loc) if _is_tag(p)), None)
    if tag_at is None:
        return first, None
    root = loc[:tag_at]
    group = [
        e
        for e in errors
        if tuple(e.get("loc", ()))[:tag_at] == root
        and len(e.get("loc", ())) > tag_at
        and _is_tag(e["loc"][tag_at])
    ]
    deepest = max(_depth(e) for e in group)
    at_deepest = [e for e in group if _depth(e) == deepest]
    if deepest > len(root) and len(at_deepest) == 1:
        return at_deepest[0], None
    if all(str(e.get("type", "")).endswith("_type") for e in group):
        tags = list(dict.fromkeys(str(e["loc"][tag_at]) for e in group))
        readable = [
            _READABLE.get(t.replace(" ", "").lower() if t.startswith("dict") else t, t)
            for t in tags
        ]
        return {**first, "loc": root}, readable
    return next(e for e in group if not str(e.get("type", "")).endswith("_type")), None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error as OpenAI phrases it: "Invalid 'temperature': ..."."""
    if not errors:
        return bad_request("Invalid request body.")
    if errors[0].get("type") == "json_invalid":
        return APIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
            "but what was sent was not valid JSON.)",
            code="invalid_json",
        )
    err, expected = _pick(errors)
    param = _loc_to_param(tuple(err.get("loc", ())))
    if err.get("type") == "model_type" and not param:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    if err.get("type") == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    if expected:
        msg = "expected " + " or ".join(expected)
    else:
        msg = err.get("msg", "invalid value")
    return bad_request(
        f"Invalid '{param}': {msg} (got {shown}).", param=param, code="invalid_value"
    )


def _json(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def _note(request: Request, exc: APIError) -> APIError:
    info = request.scope.get("markbase")  # server.generation.RequestInfo, for the access log
    if info is not None:
        info.error = exc.code or exc.type
    return exc


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _json(_note(request, exc))


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return _json(_note(request, from_engine_error(exc)))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, (RequestValidationError, ValidationError)) else []
    return _json(_note(request, validation_error(list(errors))))


_HTTP_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    headers = dict(exc.headers or {})
    if status == 404:
        message = (
            f"Unknown request URL: {request.method} {request.url.path}. Please check the URL "
            "for typos, or see the docs at https://platform.openai.com/docs/api-reference/."
        )
        err = APIError(404, message, code="unknown_url", headers=headers)
    elif status == 405:
        err = APIError(
            405,
            f"Method {request.method} is not allowed for {request.url.path}.",
            code="method_not_allowed",
            headers=headers,
        )
    else:
        err = APIError(
            status,
            str(exc.detail),
            type=_HTTP_TYPES.get(
                status, "invalid_request_error" if status < 500 else "server_error"
            ),
            headers=headers,
        )
    return _json(_note(request, err))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body("The server had an error while processing your request.", "server_error"),
        status_code=500,
    )


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
