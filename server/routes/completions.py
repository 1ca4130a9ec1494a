"""POST /v1/completions: prompt(s) as text or token ids -> engine -> answer or SSE chunks."""

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
    check_n,
    check_prompt_chars,
    check_supported,
    default_max_tokens,
    make_choices,
    request_info,
    resolve_max_tokens,
    respond,
    sampling_params,
)
from server.routes.models import lookup
from server.schemas import Completion, CompletionChoice, CompletionRequest, Usage

router = APIRouter()


class CompletionFormat:
    def __init__(self, response_id: str, created: int, model: str, include_usage: bool) -> None:
        self.base = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        self.include_usage = include_usage

    def _chunk(self, index: int, text: str, finish: str | None) -> dict:
        chunk = {
            **self.base,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self, index: int) -> None:
        return None

    def content(self, index: int, text: str) -> dict:
        return self._chunk(index, text, None)

    def finish(self, index: int, reason: str) -> dict:
        return self._chunk(index, "", reason)

    def usage(self, usage: Usage) -> dict:
        return {**self.base, "choices": [], "usage": usage.model_dump()}


def _check_ids(ids: list[int], vocab_size: int | None, where: str) -> list[int]:
    if not ids:
        raise bad_request(f"Invalid '{where}': the prompt is empty.", param="prompt")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = f" (vocabulary size {vocab_size})" if vocab_size is not None else ""
        raise bad_request(
            f"Invalid '{where}': token id {bad[0]} is out of range{limit}.",
            param="prompt",
            code="invalid_value",
        )
    return ids


@router.post(
    "/v1/completions",
    openapi_extra=json_body(CompletionRequest),
    responses=responses(Completion, stream=True),
)
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    settings = settings_of(request)
    engine = engine_of(request)
    info = request_info(request)
    info.stream = bool(body.stream)
    check_supported(body.unsupported())
    limits = settings.server
    n = info.n = check_n(body, limits.max_n)
    check_max_tokens(body.max_tokens, limits.max_tokens_limit, "max_tokens")
    raw_prompts = body.prompts()
    if not raw_prompts:
        raise bad_request("Invalid 'prompt': empty array.", param="prompt", code="empty_array")
    if len(raw_prompts) > limits.max_prompts:
        raise bad_request(
            f"Invalid 'prompt': at most {limits.max_prompts} prompts per request on this "
            f"server (got {len(raw_prompts)}).",
            param="prompt",
        )
    chars = sum(len(p) for p in raw_prompts if isinstance(p, str))
    check_prompt_chars(chars, limits.max_prompt_chars, "prompt")

    model = lookup(request, body.model)
    info.model = model.name
    tokenizer = engine.tokenizer(model.name)
    vocab_size = getattr(tokenizer, "vocab_size", None)
    vocab_size = vocab_size if isinstance(vocab_size, int) else None

    encoded = await prompt_guard_of(request).text_prompts(
        tokenizer, model, raw_prompts, body.max_tokens
    )
    prompts = [
        _check_ids(ids, vocab_size, "prompt" if len(encoded) == 1 else f"prompt[{i}]")
        for i, ids in enumerate(encoded)
    ]
    info.prompt_tokens = sum(len(p) for p in prompts)
    budgets = [
        resolve_max_tokens(
            body.max_tokens,
            default_max_tokens(settings.engine.default_max_tokens, limits.max_tokens_limit),
            model,
            len(p),
            chat=False,
        )
        for p in prompts
    ]

    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    choices = make_choices(
        response_id,
        model.name,
        prompts,
        n,
        lambda i: sampling_params(body, budgets[i // n], i),
    )

    def build(results: dict[int, ChoiceResult], usage: Usage) -> Completion:
        return Completion(
            id=response_id,
            created=created,
            model=model.name,
            choices=[
                CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason)
                for i, r in sorted(results.items())
            ],
            usage=usage,
        )

    fmt = CompletionFormat(response_id, created, model.name, body.include_usage())
    return await respond(request, engine, settings, choices, prompts, body, fmt, build, chat=False)
