"""Running the engine sequences behind one HTTP request.

One OpenAI request becomes ``len(prompts) * n`` engine sequences ("choices").
This module builds their ``GenerationRequest``s, checks the context window,
and runs them either to completion (``collect``) or as one merged stream
(``open_stream``), always so that the engine generators are closed when the
client goes away, the request times out, or a sibling choice fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.types import (
    EngineError,
    FinishReason,
    GenerationRequest,
    GrammarSpec,
    ModelInfo,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)
from server import sse
from server.errors import APIError, bad_request, from_engine_error
from server.schemas import PromptTokensDetails, SamplingFields, Usage

T = TypeVar("T")


class Engine(Protocol):
    """What the HTTP layer uses of ``engine.client.EngineClient`` (not imported
    here: the engine pulls in MLX and the HTTP layer must not)."""

    def models(self) -> list[ModelInfo]: ...
    def get_model(self, name: str) -> ModelInfo: ...
    def tokenizer(self, name: str) -> Any: ...
    def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]: ...
    def compile_grammar(self, name: str, spec: GrammarSpec) -> None: ...
    def health(self) -> dict: ...


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


@dataclass
class Choice:
    index: int  # OpenAI choice index
    prompt_index: int
    request: GenerationRequest


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    # with logprobs: every generated token and its logprobs; with prompt logprobs,
    # the prompt's (the first None)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class RequestInfo:
    """Per-request facts for the access log and metrics (set by the middleware,
    filled in by the handlers)."""

    request_id: str
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    stream: bool = False
    n: int | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)


def request_info(request: Request) -> RequestInfo:
    info = request.scope.get("markbase")
    if info is None:  # app used without the middleware (should not happen)
        info = request.scope["markbase"] = RequestInfo(request_id="")
    return info


# --------------------------------------------------------------------------- building requests


def context_error(
    context_length: int, prompt_tokens: int, completion_tokens: int, chat: bool
) -> APIError:
    total = prompt_tokens + completion_tokens
    if chat:
        message = (
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {total} tokens ({prompt_tokens} in the messages, {completion_tokens} in "
            "the completion). Please reduce the length of the messages or completion."
        )
    else:
        message = (
            f"This model's maximum context length is {context_length} tokens, however you "
            f"requested {total} tokens ({prompt_tokens} in your prompt; {completion_tokens} for "
            "the completion). Please reduce your prompt; or completion length."
        )
    return APIError(
        400, message, param="messages" if chat else "prompt", code="context_length_exceeded"
    )


def resolve_max_tokens(
    requested: int | None, default: int, model: ModelInfo, prompt_tokens: int, chat: bool
) -> int:
    """Completion budget: the client's (which must fit the window, as OpenAI
    requires) or the configured default capped at what the window has left."""
    room = model.context_length - prompt_tokens
    if requested is None:
        if room < 1:
            raise context_error(model.context_length, prompt_tokens, 1, chat)
        return min(default, room)
    if requested > room:
        raise context_error(model.context_length, prompt_tokens, requested, chat)
    return requested


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    choice_index: int,
    extra_stops: tuple[str, ...] = (),
    *,
    logit_bias: tuple[tuple[int, float], ...] = (),
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's params for choice ``choice_index``: with a seed, seed + index,
    so choices differ but each is reproducible. ``extra_stops`` are the server's
    own (not counted against the client's limit of 4). ``logit_bias`` (checked ids,
    ``parse_logit_bias``) and the logprobs counts come from the route, which knows
    the model and the endpoint's spelling."""
    # The engine's random keys take an unsigned 64-bit seed; clients send int64
    # (OpenAI's range), so wrap: seeds 0..2**63-1 are used as they are.
    seed = None if body.seed is None else (body.seed + choice_index) % 2**64
    # top_k past the vocabulary keeps every token: the same as off for the engine,
    # whose arrays are int32.
    top_k = 0 if body.top_k is None or body.top_k < 0 or body.top_k >= 2**31 else body.top_k
    # A temperature this small is greedy in effect; far smaller ones (5e-324) are 0 in
    # float32, where logits / temperature turns into inf and NaN (vLLM does the same).
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature < 1e-5:
        temperature = 0.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(dict.fromkeys(body.stop_list() + extra_stops)),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=logit_bias,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
    )


def parse_logit_bias(body: SamplingFields, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: each key must be a token id of the
    model's vocabulary written as a decimal integer (OpenAI's form), else a 400
    naming it."""
    out: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        text = key.strip()
        token = int(text) if text.isascii() and text.isdigit() else None
        if token is None or (vocab_size is not None and token >= vocab_size):
            limit = f" 0..{vocab_size - 1}" if vocab_size is not None else ""
            raise bad_request(
                f"Invalid 'logit_bias': key {key!r} is not a token id of this model's "
                f"vocabulary{limit}.",
                param="logit_bias",
                code="invalid_value",
            )
        out[token] = out.get(token, 0.0) + float(value)
    return tuple(out.items())


def check_min_tokens(body: SamplingFields, max_tokens: int) -> None:
    """``min_tokens`` may not pass the completion's budget (vLLM's rule)."""
    if body.min_tokens and body.min_tokens > max_tokens:
        raise bad_request(
            f"Invalid 'min_tokens': {body.min_tokens} is more than the {max_tokens} tokens "
            "the completion may have (max_tokens).",
            param="min_tokens",
            code="invalid_value",
        )


def check_n(body: SamplingFields, max_n: int) -> int:
    n = body.n or 1
    if n > max_n:
        raise bad_request(
            f"Invalid 'n': at most {max_n} choices per request on this server (got {n}).",
            param="n",
            code="invalid_value",
        )
    return n


def check_max_tokens(requested: int | None, limit: int, param: str) -> None:
    """``limit`` (settings.server.max_tokens_limit, 0 = none) bounds what a client may ask."""
    if limit and requested is not None and requested > limit:
        raise bad_request(
            f"Invalid '{param}': at most {limit} tokens per completion on this server "
            f"(got {requested}).",
            param=param,
            code="invalid_value",
        )


def check_prompt_chars(chars: int, limit: int, param: str) -> None:
    if chars > limit:
        raise bad_request(
            f"Invalid '{param}': at most {limit} characters of prompt text per request on this "
            f"server (got {chars}).",
            param=param,
            code="invalid_value",
        )


def default_max_tokens(default: int, limit: int) -> int:
    return min(default, limit) if limit else default


def check_supported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        param, message = problem
        raise bad_request(message, param=param, code="unsupported_parameter")


def make_choices(
    response_id: str,
    model: str,
    prompts: list[list[int]],
    n: int,
    params_for: Any,  # callable(choice_index) -> SamplingParams
    grammar: GrammarSpec | None = None,
    skip_special_tokens: bool = True,
) -> list[Choice]:
    """``grammar``: every choice's output must match it (structured output, tool calls);
    ``skip_special_tokens=False`` keeps special tokens in the text (tool-call markers)."""
    choices = []
    for p, tokens in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            req = GenerationRequest(
                request_id=f"{response_id}-{index}",
                model=model,
                prompt_tokens=tokens,
                params=params_for(index),
                grammar=grammar,
                skip_special_tokens=skip_special_tokens,
            )
            choices.append(Choice(index=index, prompt_index=p, request=req))
    return choices


def usage(
    prompts: list[list[int]], choices: list[Choice], results: dict[int, ChoiceResult]
) -> Usage:
    """prompt tokens counted once per prompt (as OpenAI does for n > 1); the
    cached count of a prompt is the one its first choice saw."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(r.completion_tokens for r in results.values())
    cached = 0
    seen: set[int] = set()
    for c in choices:
        if c.prompt_index not in seen and c.index in results:
            seen.add(c.prompt_index)
            cached += min(results[c.index].cached_tokens, len(prompts[c.prompt_index]))
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


# --------------------------------------------------------------------------- events


def finish_error(ev: TokenEvent) -> APIError | None:
    """A final event that is not a normal finish, as the error to report."""
    if ev.finish_reason is FinishReason.ERROR:
        return APIError(
            500,
            f"The engine failed while generating: {ev.error or 'unknown error'}",
            type="server_error",
            code="engine_error",
        )
    if ev.finish_reason is FinishReason.ABORT:
        return APIError(
            503,
            ev.error or "The request was aborted by the server (shutting down?).",
            type="server_error",
            code="aborted",
        )
    return None


def apply_event(result: ChoiceResult, ev: TokenEvent) -> None:
    result.text += ev.text
    result.completion_tokens = ev.completion_tokens
    result.cached_tokens = ev.cached_tokens
    if ev.logprobs is not None:
        result.token_ids.extend(ev.token_ids)
        result.logprobs.extend(ev.logprobs)
    if ev.prompt_logprobs is not None:
        result.prompt_logprobs = ev.prompt_logprobs
    if ev.finish_reason is not None:
        result.finish_reason = ev.finish_reason.value


def as_api_error(exc: BaseException, chat: bool) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc, param=None if chat else "prompt")
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc) or "Request timed out.", type="timeout", code="timeout")
    return APIError(
        500, "The server had an error while processing your request.", type="server_error"
    )


# --------------------------------------------------------------------------- guarding


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the body is already read)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a transport that answers other messages: do not spin


async def guarded(request: Request, aw: Awaitable[T], timeout_s: float) -> T:
    """Await ``aw`` unless the client disconnects (ClientGone) or the time runs out
    (TimeoutError); either way ``aw`` is cancelled, which closes its engine streams."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {task, watcher},
            timeout=timeout_s if timeout_s and timeout_s > 0 else None,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if task in done:
            return task.result()
        if watcher in done:
            raise ClientGone()
        raise TimeoutError(f"Request timed out after {timeout_s:g} s.")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _consume(engine: Engine, choice: Choice) -> ChoiceResult:
    result = ChoiceResult()
    gen = engine.generate(choice.request)
    try:
        async for ev in gen:
            err = finish_error(ev)
            if err is not None:
                raise err
            apply_event(result, ev)
    finally:
        await gen.aclose()
    if result.finish_reason is None:
        raise APIError(500, "The engine stream ended without a finish reason.", type="server_error")
    return result


async def collect(engine: Engine, choices: list[Choice]) -> dict[int, ChoiceResult]:
    """Run every choice to the end; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(_consume(engine, c)) for c in choices]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        await _cancel_all(tasks)
        raise
    return {c.index: r for c, r in zip(choices, results, strict=True)}


# --------------------------------------------------------------------------- streaming


KEEPALIVE = object()  # MergedStream item: nothing for a while, send a comment


class MergedStream:
    """Events of several engine streams in arrival order, as ``(index, event)``.

    Opened by ``open_stream`` once every stream has produced its first event, so
    errors the engine raises up front become ordinary HTTP errors. A failure
    later is yielded as ``(index, exception)``. ``close()`` (sync, safe in a
    cancelled ``finally``) cancels the readers, which closes the generators.
    """

    def __init__(
        self,
        primed: list[tuple[int, AsyncIterator[TokenEvent], TokenEvent]],
        keepalive_s: float,
        deadline: float | None,
    ) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._keepalive_s = keepalive_s if keepalive_s > 0 else None
        self._deadline = deadline
        self._open = len(primed)
        self._closed = False
        self._gens = [gen for _, gen, _ in primed]
        self._tasks = [asyncio.ensure_future(self._read(i, gen, first)) for i, gen, first in primed]

    async def _read(self, index: int, gen: AsyncIterator[TokenEvent], first: TokenEvent) -> None:
        try:
            await self._queue.put((index, first))
            if first.finish_reason is None:
                async for ev in gen:
                    await self._queue.put((index, ev))
                    if ev.finish_reason is not None:
                        break
            await self._queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await self._queue.put((index, exc))
        finally:
            await gen.aclose()

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> Any:
        while self._open > 0:
            timeout = self._keepalive_s
            if self._deadline is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._open = 0
                    return (-1, TimeoutError("Request timed out."))
                timeout = left if timeout is None else min(timeout, left)
            try:
                index, item = await asyncio.wait_for(self._queue.get(), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    continue
                return KEEPALIVE
            if item is None:
                self._open -= 1
                continue
            return index, item
        raise StopAsyncIteration

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        # A reader cancelled before it ever ran has not closed its generator.
        task = asyncio.ensure_future(_close_after(self._tasks, self._gens))
        _cleanups.add(task)
        task.add_done_callback(_cleanups.discard)


_cleanups: set[asyncio.Task] = set()


async def _close_after(tasks: list[asyncio.Task], gens: list[AsyncIterator[TokenEvent]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    for gen in gens:
        with contextlib.suppress(BaseException):
            await gen.aclose()


async def _prime(
    engine: Engine, choice: Choice
) -> tuple[int, AsyncIterator[TokenEvent], TokenEvent]:
    gen = engine.generate(choice.request)
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        await gen.aclose()
        raise APIError(
            500, "The engine stream ended before any event.", type="server_error"
        ) from None
    except BaseException:
        await gen.aclose()
        raise
    return choice.index, gen, first


async def open_stream(
    engine: Engine, choices: list[Choice], keepalive_s: float, timeout_s: float
) -> MergedStream:
    """Start every choice and wait for each one's first event."""
    started = time.monotonic()
    tasks = [asyncio.ensure_future(_prime(engine, c)) for c in choices]
    try:
        primed = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                await t.result()[1].aclose()
        await _cancel_all(tasks)
        raise
    deadline = started + timeout_s if timeout_s and timeout_s > 0 else None
    return MergedStream(list(primed), keepalive_s, deadline)


class StreamFormat(Protocol):
    """How one endpoint spells its chunks (chat and text completions differ). ``content``
    gets the event too, for its logprobs. ``content`` and ``finish`` give the chunks a
    piece of text or the end makes (none while text is held back, several when a piece
    ends one tool call and starts another)."""

    def start(self, index: int) -> dict | None: ...
    def content(self, index: int, text: str, event: TokenEvent) -> list[dict]: ...
    def finish(self, index: int, reason: str) -> list[dict]: ...
    def usage(self, usage: Usage) -> dict: ...


async def stream_body(
    stream: MergedStream,
    choices: list[Choice],
    prompts: list[list[int]],
    fmt: StreamFormat,
    include_usage: bool,
    info: RequestInfo,
    chat: bool,
) -> AsyncIterator[str]:
    """SSE text for a merged stream: start chunks, deltas, finishes, optional
    usage chunk, ``[DONE]``. A failure mid-stream is sent as an error event
    followed by ``[DONE]``. Closing this iterator closes the engine streams."""
    results = {c.index: ChoiceResult() for c in choices}
    try:
        for c in choices:
            start = fmt.start(c.index)
            if start is not None:
                yield sse.encode(start)
        async for item in stream:
            if item is KEEPALIVE:
                yield sse.KEEPALIVE
                continue
            index, ev = item
            err = as_api_error(ev, chat) if isinstance(ev, BaseException) else finish_error(ev)
            if err is not None:
                info.error = err.message
                yield sse.encode(err.body())
                yield sse.DONE
                return
            apply_event(results[index], ev)
            if ev.text or ev.logprobs or ev.prompt_logprobs:
                for chunk in fmt.content(index, ev.text, ev):
                    yield sse.encode(chunk)
            if ev.finish_reason is not None:
                for chunk in fmt.finish(index, ev.finish_reason.value):
                    yield sse.encode(chunk)
        if include_usage:
            yield sse.encode(fmt.usage(usage(prompts, choices, results)))
        yield sse.DONE
    finally:
        stream.close()
        info.completion_tokens = sum(r.completion_tokens for r in results.values())


async def respond(
    request: Request,
    engine: Engine,
    settings: Any,  # server.config.Settings
    choices: list[Choice],
    prompts: list[list[int]],
    body: SamplingFields,
    fmt: StreamFormat,
    build: Any,  # callable(results: dict[int, ChoiceResult], usage: Usage) -> pydantic model
    chat: bool,
) -> Response:
    """Run the choices and answer: one JSON body, or an SSE stream."""
    info = request_info(request)
    timeout = settings.server.request_timeout_s
    try:
        if body.stream:
            merged = await guarded(
                request,
                open_stream(engine, choices, settings.server.stream_keepalive_s, timeout),
                timeout,
            )
            events = stream_body(merged, choices, prompts, fmt, body.include_usage(), info, chat)
            return sse.SSEResponse(events, on_close=merged.close)
        results = await guarded(request, collect(engine, choices), timeout)
    except ClientGone:
        info.error = "client disconnected"
        return Response(status_code=499)
    except (EngineError, TimeoutError) as exc:
        raise as_api_error(exc, chat) from None
    u = usage(prompts, choices, results)
    info.completion_tokens = u.completion_tokens
    return JSONResponse(build(results, u).model_dump())
