"""POST /v1/chat/completions: messages -> chat template -> engine -> answer or SSE chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.types import ModelInfo
from server.deps import (
    engine_of,
    json_body,
    parse_body,
    prompt_guard_of,
    responses,
    settings_of,
)
from server.errors import bad_request
from server.generation import (
    Choice,
    ChoiceResult,
    check_max_tokens,
    check_min_tokens,
    check_n,
    check_prompt_chars,
    check_supported,
    default_max_tokens,
    make_choices,
    parse_logit_bias,
    request_info,
    resolve_max_tokens,
    respond,
    sampling_params,
)
from server.logprobs import TokenTexts, chat_content, chat_logprobs
from server.routes.models import lookup
from server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    FunctionCall,
    ToolCall,
    Usage,
)
from server.structured import check_grammar, requested_grammar
from server.tools import ToolPlan, check_tools, delta_of, plan_tools, tool_format_for
from server.tools.parser import ToolCallParser
from server.tools.prompt import assistant_turn, tool_list, tool_turn, with_tools_prompt

router = APIRouter()


def template_messages(messages: list[ChatMessage], native_tools: bool = False) -> list[dict]:
    """OpenAI messages as the plain dicts chat templates expect: ``{"role", "content":
    str}``, ``developer`` as a system message, tool turns (an assistant's ``tool_calls``,
    ``tool`` results) as server/tools/prompt.py writes them for a template that renders
    tools (``native_tools``) or one that does not."""
    if not messages:
        raise bad_request(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
            code="empty_array",
        )
    out = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for tool turns
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "function":
            raise bad_request(
                f"Invalid '{where}.role': the deprecated role 'function' is not supported; "
                "send tool results as role 'tool' with a 'tool_call_id'.",
                param=f"{where}.role",
                code="unsupported_value",
            )
        if m.tool_calls and m.role != "assistant":
            raise bad_request(
                f"Invalid '{where}.tool_calls': only assistant messages have tool calls.",
                param=f"{where}.tool_calls",
            )
        text = _message_text(m, where)
        if m.tool_calls:
            calls = [
                _checked_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)
            ]
            for c in calls:
                if c.get("id"):
                    call_names[c["id"]] = c["function"]["name"]
            out.append(assistant_turn(text, calls, native_tools))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(
                    f"Missing required parameter: '{where}.tool_call_id'.",
                    param=f"{where}.tool_call_id",
                )
            name = call_names.get(m.tool_call_id) or m.name
            out.append(tool_turn(text, m.tool_call_id, name, native_tools))
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def _message_text(m: ChatMessage, where: str) -> str:
    if m.content is None:
        if m.role != "assistant":
            raise bad_request(
                f"Missing required parameter: '{where}.content'.", param=f"{where}.content"
            )
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            what = (
                "the served models are text-only"
                if part.type in ("image_url", "input_image", "input_audio", "file")
                else "only text parts are supported"
            )
            raise bad_request(
                f"Invalid '{where}.content[{j}]': content part type '{part.type}' is not "
                f"supported ({what}); send {{'type': 'text', 'text': ...}} parts.",
                param=f"{where}.content[{j}].type",
                code="unsupported_value",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _checked_call(call: dict, where: str) -> dict:
    """An assistant message's tool call in OpenAI's shape, or a 400 naming what is wrong."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(
            f"Invalid '{where}.function': expected {{'name': str, 'arguments': str}}.",
            param=f"{where}.function",
        )
    args = fn.get("arguments", "{}")
    if not isinstance(args, str | dict):
        raise bad_request(
            f"Invalid '{where}.function.arguments': expected a JSON string.",
            param=f"{where}.function.arguments",
        )
    return call


class ChatFormat:
    """chat.completion.chunk's: text as ``content`` deltas, or, when the request has
    tools, what each choice's tool-call parser tells (content, then per call its name
    and argument fragments; finish_reason ``tool_calls`` once a call was made)."""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
        tools: ToolPlan | None = None,
        texts: TokenTexts | None = None,
        top_n: int = 0,
    ) -> None:
        self.texts = texts  # set when the request asked for logprobs
        self.top_n = top_n
        self.base = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        self.include_usage = include_usage
        self.tools = tools if tools is not None and tools.calls_possible else None
        self._parsers: dict[int, ToolCallParser] = {}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {**self.base, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage  # OpenAI: null on every chunk but the last
        return chunk

    def _choice(
        self, index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None
    ) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _parser(self, index: int) -> ToolCallParser:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.tools.parser()
        return parser

    def start(self, index: int) -> dict:
        return self._chunk([self._choice(index, {"role": "assistant", "content": ""})])

    def content(self, index: int, text: str, event) -> list[dict]:
        logprobs = None
        if self.texts is not None and event.logprobs is not None:
            content = chat_content(self.texts, event.token_ids, event.logprobs, self.top_n)
            logprobs = chat_logprobs(content)
        if self.tools is None:
            return [self._chunk([self._choice(index, {"content": text}, logprobs=logprobs)])]
        deltas = [delta_of(d) for d in self._parser(index).feed(text)] if text else []
        if logprobs is not None and not deltas:  # text held back: its logprobs go now
            deltas = [{}]
        return [
            self._chunk([self._choice(index, d, logprobs=logprobs if k == 0 else None)])
            for k, d in enumerate(deltas)
        ]

    def finish(self, index: int, reason: str) -> list[dict]:
        chunks = []
        if self.tools is not None:
            parser = self._parser(index)
            chunks = [self._chunk([self._choice(index, delta_of(d))]) for d in parser.finish()]
            reason = tool_finish_reason(reason, parser)
        return [*chunks, self._chunk([self._choice(index, {}, reason)])]

    def usage(self, usage: Usage) -> dict:
        return {**self.base, "choices": [], "usage": usage.model_dump()}


def tool_finish_reason(reason: str, parser: ToolCallParser) -> str:
    """OpenAI's ``tool_calls`` when the model ended after calling (not when cut short)."""
    return "tool_calls" if parser.calls and reason == "stop" else reason


def assistant_message(result: ChoiceResult, tools: ToolPlan | None) -> tuple[AssistantMessage, str]:
    """A whole answer's message and finish reason, its tool calls parsed out."""
    if tools is None or not tools.calls_possible:
        return AssistantMessage(content=result.text), result.finish_reason
    parser = tools.parser()
    parser.feed(result.text)
    parser.finish()
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parser.calls
    ]
    message = AssistantMessage(content=parser.content, tool_calls=calls or None)
    return message, tool_finish_reason(result.finish_reason, parser)


@dataclass
class ChatJob:
    """A chat request made ready to run: its model, prompt, engine choices and tools."""

    model: ModelInfo
    prompt: list[int]
    choices: list[Choice]
    tools: ToolPlan | None
    texts: TokenTexts | None  # set when the request asked for logprobs
    top_n: int  # top_logprobs


async def prepare_chat(request: Request, body: ChatCompletionRequest, response_id: str) -> ChatJob:
    """Checks, the prompt (chat template, tools), the grammar, the engine choices. Shared
    by /v1/chat/completions and /v1/responses."""
    settings = settings_of(request)
    engine = engine_of(request)
    info = request_info(request)
    check_supported(body.unsupported())
    limits = settings.server
    n = info.n = check_n(body, limits.max_n)
    check_max_tokens(
        body.effective_max_tokens(),
        limits.max_tokens_limit,
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
    )
    if len(body.messages) > limits.max_messages:
        raise bad_request(
            f"Invalid 'messages': at most {limits.max_messages} messages per request on this "
            f"server (got {len(body.messages)}).",
            param="messages",
            code="invalid_value",
        )
    # Everything that needs no model is checked before the engine is asked anything.
    messages = template_messages(body.messages, native_tools=False)
    check_prompt_chars(
        sum(len(m["content"]) for m in messages), limits.max_prompt_chars, "messages"
    )
    checked_tools = check_tools(body.tools, body.tool_choice)
    calls_possible = checked_tools is not None and checked_tools[0] != "none"
    grammar = requested_grammar(body)
    if grammar is not None and calls_possible:
        raise bad_request(
            f"'{grammar[1]}' cannot be combined with tool calling; send tool_choice 'none' "
            "or leave one of them out.",
            param=grammar[1],
        )

    model = lookup(request, body.model)
    info.model = model.name
    tokenizer = engine.tokenizer(model.name)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer)
    native = tool_format_for(tokenizer).native
    if native:  # tool turns in the shape a tool-aware template expects
        messages = template_messages(body.messages, native_tools=True)
    template_kwargs = {}
    if calls_possible:
        if native:
            template_kwargs["tools"] = tool_list(tools.tools)
        else:
            messages = with_tools_prompt(messages, tools.tools)
    if grammar is None and calls_possible and tools.grammar is not None:
        grammar = (tools.grammar, "tools")
    if grammar is not None:
        await check_grammar(engine, model.name, *grammar)

    prompt = await prompt_guard_of(request).chat_prompt(
        tokenizer, model, messages, body.effective_max_tokens(), **template_kwargs
    )
    info.prompt_tokens = len(prompt)
    max_tokens = resolve_max_tokens(
        body.effective_max_tokens(),
        default_max_tokens(settings.engine.default_max_tokens, limits.max_tokens_limit),
        model,
        len(prompt),
        chat=True,
    )
    check_min_tokens(body, max_tokens)
    logit_bias = parse_logit_bias(body, _vocab_size(tokenizer))
    # logprobs: true -> each token's logprob and its top_logprobs most likely (0-20)
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    texts = TokenTexts(tokenizer) if top_n is not None else None
    # A model without its own chat template is served with the tokenizer's documented
    # fallback transcript format, which needs its stop strings (e.g. "\nUser:").
    extra_stops = tuple(getattr(tokenizer, "fallback_stop_strings", ()) or ())
    keep_special = calls_possible and tools.fmt.keep_special_tokens
    choices = make_choices(
        response_id,
        model.name,
        [prompt],
        n,
        lambda i: sampling_params(
            body, max_tokens, i, extra_stops, logit_bias=logit_bias, logprobs=top_n
        ),
        grammar=grammar[0] if grammar else None,
        skip_special_tokens=not keep_special,
    )
    return ChatJob(model, prompt, choices, tools, texts, top_n or 0)


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest),
    responses=responses(ChatCompletion, stream=True),
)
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    request_info(request).stream = bool(body.stream)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    job = await prepare_chat(request, body, response_id)
    model = job.model

    def build(results: dict[int, ChoiceResult], usage: Usage) -> ChatCompletion:
        choices = []
        for i, r in sorted(results.items()):
            message, finish = assistant_message(r, job.tools)
            logprobs = None
            if job.texts is not None:
                content = chat_content(job.texts, r.token_ids, r.logprobs, job.top_n)
                logprobs = ChatLogprobs(content=content)
            choices.append(
                ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish)
            )
        return ChatCompletion(
            id=response_id, created=created, model=model.name, choices=choices, usage=usage
        )

    fmt = ChatFormat(
        response_id, created, model.name, body.include_usage(), job.tools, job.texts, job.top_n
    )
    return await respond(
        request,
        engine_of(request),
        settings_of(request),
        job.choices,
        [job.prompt],
        body,
        fmt,
        build,
        chat=True,
    )


def _vocab_size(tokenizer) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) else None
