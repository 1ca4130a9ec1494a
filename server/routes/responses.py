"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat path.

A Responses request (``input`` as text or items, ``instructions``, function ``tools``,
``text.format``) is translated into a chat request and prepared by
``chat.prepare_chat`` (template, tools, grammar), so both endpoints answer alike. The
answer is a list of output items: a ``message`` with the text (``output_text``) and one
``function_call`` item per tool call. Streamed, it is the typed events OpenAI sends:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ...
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` (``response.function_call_arguments.delta``/``.done`` for
calls), then ``response.completed`` (``response.incomplete`` when max_output_tokens cut
it short).

Nothing is stored: ``store`` is accepted (the response says ``store: false``) and
``previous_response_id`` is a 400 that says to send the whole conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from engine.types import EngineError
from server import sse
from server.deps import engine_of, json_body, parse_body, responses, settings_of
from server.errors import bad_request, validation_error
from server.generation import (
    KEEPALIVE,
    ChoiceResult,
    ClientGone,
    RequestInfo,
    as_api_error,
    collect,
    finish_error,
    guarded,
    open_stream,
    request_info,
)
from server.routes.chat import prepare_chat
from server.schemas import ChatCompletionRequest
from server.schemas_responses import ResponseObject, ResponsesRequest
from server.tools import ToolPlan
from server.tools.parser import ArgsDelta, CallStart, Content, ToolCallParser

router = APIRouter()


# --------------------------------------------------------------------------- request


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers ``body``."""
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server keeps no responses. Send "
            "the whole conversation in 'input' (earlier output items included).",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": input_messages(body),
        "stream": bool(body.stream),
    }
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        chat["response_format"] = response_format(fmt)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def response_format(fmt: dict) -> dict:
    """``text.format`` as chat's ``response_format``."""
    kind = fmt.get("type")
    if kind == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(
        f"Invalid 'text.format.type': {kind!r}; supported: 'text', 'json_object', 'json_schema'.",
        param="text.format.type",
        code="invalid_value",
    )


def input_messages(body: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages: message items by role, a run of
    ``function_call`` items as one assistant message with tool calls, each
    ``function_call_output`` as a tool message."""
    out: list[dict] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
        return out
    if not body.input:
        raise bad_request("Invalid 'input': empty array.", param="input", code="empty_array")
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"Invalid '{where}.role': {role!r}; expected 'user', 'system', 'developer' "
                    "or 'assistant'.",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _item_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _str_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _str_field(item, "name", where),
                    "arguments": _str_field(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _item_text(output, f"{where}.output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _str_field(item, "call_id", where),
                    "content": output,
                }
            )
        elif kind == "reasoning":
            continue  # a reasoning summary from another server: not for this model
        else:
            raise bad_request(
                f"Invalid '{where}.type': {kind!r} is not supported; send 'message', "
                "'function_call' or 'function_call_output' items.",
                param=f"{where}.type",
                code="unsupported_value",
            )
    return out


def _str_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(
            f"Missing required parameter: '{where}.{key}' (a string).", param=f"{where}.{key}"
        )
    return value


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"Invalid '{where}.content': expected a string or an array of text parts.",
            param=f"{where}.content",
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"Invalid '{where}.content[{j}]': only text parts ('input_text', "
                f"'output_text') are supported, got {kind!r}.",
                param=f"{where}.content[{j}].type",
                code="unsupported_value",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(
                f"Missing required parameter: '{where}.content[{j}].text'.",
                param=f"{where}.content[{j}].text",
            )
        texts.append(text)
    return "\n".join(texts)


# --------------------------------------------------------------------------- output


class OutputItems:
    """The output items of one response, built from its text as it comes. ``feed`` and
    ``finish`` return the stream events that text makes (a non-streamed response ignores
    them and reads ``items``)."""

    def __init__(self, tools: ToolPlan | None) -> None:
        self.parser: ToolCallParser | None = (
            tools.parser() if tools is not None and tools.calls_possible else None
        )
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written

    def feed(self, text: str) -> list[dict]:
        deltas = self.parser.feed(text) if self.parser is not None else [Content(text)]
        return [e for d in deltas for e in self._delta(d)]

    def finish(self) -> list[dict]:
        events = []
        if self.parser is not None:
            events = [e for d in self.parser.finish() for e in self._delta(d)]
        return events + self._close()

    def _delta(self, d) -> list[dict]:
        if isinstance(d, Content):
            events = []
            item = self._open
            if item is None or item["type"] != "message":
                events += self._close()
                item = self._open = {
                    "id": f"msg_{uuid.uuid4().hex}",
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                self.items.append(item)
                events.append(self._added(item))
                events.append(
                    {
                        "type": "response.content_part.added",
                        "item_id": item["id"],
                        "output_index": len(self.items) - 1,
                        "content_index": 0,
                        "part": _text_part(""),
                    }
                )
                item["_text"] = ""
            item["_text"] += d.text
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": item["id"],
                    "output_index": len(self.items) - 1,
                    "content_index": 0,
                    "delta": d.text,
                    "logprobs": [],
                }
            )
            return events
        if isinstance(d, CallStart):
            events = self._close()
            item = self._open = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "status": "in_progress",
                "call_id": d.id,
                "name": d.name,
                "arguments": "",
            }
            self.items.append(item)
            return [*events, self._added(item)]
        assert isinstance(d, ArgsDelta)
        item = self._open
        item["arguments"] += d.fragment
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "delta": d.fragment,
            }
        ]

    def _added(self, item: dict) -> dict:
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": _public(item),
        }

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            text = item.pop("_text")
            item["content"] = [_text_part(text)]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
            )
            events.append({"type": "response.content_part.done", **where, "part": _text_part(text)})
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return events


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _public(item: dict) -> dict:
    """An item as clients see it (without the text being gathered)."""
    return {k: v for k, v in item.items() if not k.startswith("_")}


class ResponseShell:
    """The ``response`` object: the request's settings echoed, status, output, usage."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self.id = response_id
        self.created = int(time.time())
        self.model = model
        self.body = body

    def dump(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        incomplete: str | None = None,
        error: dict | None = None,
    ) -> dict:
        body = self.body
        fmt = (body.text.format if body.text is not None else None) or {"type": "text"}
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [_public(i) for i in output],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt},
            "tool_choice": (
                choice.model_dump()
                if choice is not None and not isinstance(choice, str)
                else choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
            "user": body.user,
        }


def response_usage(prompt_tokens: int, result: ChoiceResult) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": min(result.cached_tokens, prompt_tokens)},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + result.completion_tokens,
    }


def _ending(result: ChoiceResult) -> tuple[str, str | None]:
    """(status, incomplete reason) for how the generation ended."""
    if result.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


# --------------------------------------------------------------------------- route


@router.post(
    "/v1/responses",
    openapi_extra=json_body(ResponsesRequest),
    responses=responses(ResponseObject, stream=True),
)
async def create_response(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    info = request_info(request)
    info.stream = bool(body.stream)
    response_id = f"resp_{uuid.uuid4().hex}"
    job = await prepare_chat(request, chat_request(body), response_id)
    shell = ResponseShell(response_id, job.model.name, body)
    engine = engine_of(request)
    settings = settings_of(request).server
    timeout = settings.request_timeout_s
    try:
        if body.stream:
            merged = await guarded(
                request,
                open_stream(engine, job.choices, settings.stream_keepalive_s, timeout),
                timeout,
            )
            events = stream_events(merged, shell, job, info)
            return sse.SSEResponse(events, on_close=merged.close)
        results = await guarded(request, collect(engine, job.choices), timeout)
    except ClientGone:
        info.error = "client disconnected"
        return Response(status_code=499)
    except (EngineError, TimeoutError) as exc:
        raise as_api_error(exc, chat=True) from None
    result = results[0]
    items = OutputItems(job.tools)
    items.feed(result.text)
    items.finish()
    status, incomplete = _ending(result)
    info.completion_tokens = result.completion_tokens
    usage = response_usage(len(job.prompt), result)
    return JSONResponse(shell.dump(status, items.items, usage, incomplete))


def encode_event(event: dict) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


async def stream_events(merged, shell: ResponseShell, job, info: RequestInfo) -> AsyncIterator[str]:
    """The typed events of a streamed response, numbered by ``sequence_number``."""
    seq = 0

    def emit(event: dict) -> str:
        nonlocal seq
        event["sequence_number"] = seq
        seq += 1
        return encode_event(event)

    items = OutputItems(job.tools)
    result = ChoiceResult()
    try:
        yield emit({"type": "response.created", "response": shell.dump("in_progress", [])})
        yield emit({"type": "response.in_progress", "response": shell.dump("in_progress", [])})
        async for item in merged:
            if item is KEEPALIVE:
                yield sse.KEEPALIVE
                continue
            _, ev = item
            err = as_api_error(ev, True) if isinstance(ev, BaseException) else finish_error(ev)
            if err is not None:
                info.error = err.message
                yield emit(
                    {"type": "error", "code": err.code, "message": err.message, "param": err.param}
                )
                failed = {"code": "server_error", "message": err.message}
                yield emit(
                    {
                        "type": "response.failed",
                        "response": shell.dump("failed", items.items, error=failed),
                    }
                )
                return
            result.text += ev.text
            result.completion_tokens = ev.completion_tokens
            result.cached_tokens = ev.cached_tokens
            if ev.text:
                for event in items.feed(ev.text):
                    yield emit(event)
            if ev.finish_reason is not None:
                result.finish_reason = ev.finish_reason.value
        for event in items.finish():
            yield emit(event)
        status, incomplete = _ending(result)
        usage = response_usage(len(job.prompt), result)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield emit({"type": kind, "response": shell.dump(status, items.items, usage, incomplete)})
    finally:
        merged.close()
        info.completion_tokens = result.completion_tokens
