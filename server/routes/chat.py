"""POST /v1/chat/completions: messages -> chat template -> engine -> answer or SSE chunks."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

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
    Usage,
)

router = APIRouter()


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages as the plain ``{"role", "content": str}`` dicts chat
    templates expect; ``developer`` is a system message."""
    if not messages:
        raise bad_request(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
            code="empty_array",
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role in ("tool", "function"):
            raise bad_request(
                f"Invalid '{where}.role': role '{m.role}' is not supported yet "
                "(markbase does not do tool calling).",
                param=f"{where}.role",
                code="unsupported_value",
            )
        if m.tool_calls:
            raise bad_request(
                f"'{where}.tool_calls' is not supported yet (markbase does not do tool calling).",
                param=f"{where}.tool_calls",
                code="unsupported_parameter",
            )
        if m.content is None:
            if m.role != "assistant":
                raise bad_request(
                    f"Missing required parameter: '{where}.content'.", param=f"{where}.content"
                )
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
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
            text = "\n".join(texts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


class ChatFormat:
    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
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

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {**self.base, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage  # OpenAI: null on every chunk but the last
        return chunk

    def _choice(
        self, index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None
    ) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def start(self, index: int) -> dict:
        return self._chunk([self._choice(index, {"role": "assistant", "content": ""})])

    def content(self, index: int, text: str, event) -> dict:
        logprobs = None
        if self.texts is not None and event.logprobs is not None:
            content = chat_content(self.texts, event.token_ids, event.logprobs, self.top_n)
            logprobs = chat_logprobs(content)
        return self._chunk([self._choice(index, {"content": text}, logprobs=logprobs)])

    def finish(self, index: int, reason: str) -> dict:
        return self._chunk([self._choice(index, {}, reason)])

    def usage(self, usage: Usage) -> dict:
        return {**self.base, "choices": [], "usage": usage.model_dump()}


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest),
    responses=responses(ChatCompletion, stream=True),
)
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    settings = settings_of(request)
    engine = engine_of(request)
    info = request_info(request)
    info.stream = bool(body.stream)
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
    messages = template_messages(body.messages)
    check_prompt_chars(
        sum(len(m["content"]) for m in messages), limits.max_prompt_chars, "messages"
    )

    model = lookup(request, body.model)
    info.model = model.name
    tokenizer = engine.tokenizer(model.name)
    prompt = await prompt_guard_of(request).chat_prompt(
        tokenizer, model, messages, body.effective_max_tokens()
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

    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    # A model without its own chat template is served with the tokenizer's documented
    # fallback transcript format, which needs its stop strings (e.g. "\nUser:").
    extra_stops = tuple(getattr(tokenizer, "fallback_stop_strings", ()) or ())
    choices = make_choices(
        response_id,
        model.name,
        [prompt],
        n,
        lambda i: sampling_params(
            body, max_tokens, i, extra_stops, logit_bias=logit_bias, logprobs=top_n
        ),
    )

    def build(results: dict[int, ChoiceResult], usage: Usage) -> ChatCompletion:
        return ChatCompletion(
            id=response_id,
            created=created,
            model=model.name,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=r.text),
                    logprobs=None
                    if texts is None
                    else ChatLogprobs(
                        content=chat_content(texts, r.token_ids, r.logprobs, top_n or 0)
                    ),
                    finish_reason=r.finish_reason,
                )
                for i, r in sorted(results.items())
            ],
            usage=usage,
        )

    fmt = ChatFormat(response_id, created, model.name, body.include_usage(), texts, top_n or 0)
    return await respond(request, engine, settings, choices, [prompt], body, fmt, build, chat=True)


def _vocab_size(tokenizer) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) else None
