"""POST /v1/completions: prompt(s) as text or token ids -> engine -> answer or SSE chunks.

``echo`` puts each choice's prompt text in front of its completion (streamed: the first
chunk of the choice); with ``logprobs`` the prompt's tokens and logprobs come first in
the choice's logprobs (server/logprobs.py), computed by the engine from a forward pass
over the prompt (engine/worker.py ``_prefill_scoring``)."""

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
from server.logprobs import CompletionLogprobsBuilder, TokenTexts, merge_completion
from server.routes.models import lookup
from server.schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)
from server.structured import check_grammar, requested_grammar

router = APIRouter()


class Echo:
    """What ``echo`` and ``logprobs`` add to each choice (index -> its prompt): the
    prompt's text in front, and the logprobs' running state (server/logprobs.py)."""

    def __init__(
        self,
        echo: bool,
        prompt_texts: list[str],
        prompts: list[list[int]],
        n: int,
        texts: TokenTexts | None,
        top_n: int,
    ) -> None:
        self.echo = echo
        self.prompt_texts = prompt_texts
        self.prompts = prompts
        self.n = n
        self.texts = texts  # set when the request asked for logprobs
        self.top_n = top_n
        self._builders: dict[int, CompletionLogprobsBuilder] = {}

    def prefix(self, index: int) -> str:
        return self.prompt_texts[index // self.n] if self.echo else ""

    def builder(self, index: int) -> CompletionLogprobsBuilder:
        found = self._builders.get(index)
        if found is None:
            found = self._builders[index] = CompletionLogprobsBuilder(self.texts, self.top_n)
        return found

    def logprobs(self, index: int, token_ids, lps, prompt_lps) -> dict | None:
        """This part of choice ``index``'s logprobs: the prompt's first when given
        (``prompt_lps``, with echo), then the tokens'."""
        if self.texts is None:
            return None
        parts = []
        if self.echo and prompt_lps is not None:
            parts.append(self.builder(index).add(self.prompts[index // self.n], prompt_lps))
        if lps is not None:
            parts.append(self.builder(index).add(token_ids, lps))
        return merge_completion(parts)


class CompletionFormat:
    def __init__(
        self, response_id: str, created: int, model: str, include_usage: bool, echo: Echo
    ) -> None:
        self.echo = echo
        self.base = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        self.include_usage = include_usage

    def _chunk(
        self, index: int, text: str, finish: str | None, logprobs: dict | None = None
    ) -> dict:
        chunk = {
            **self.base,
            "choices": [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            ],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self, index: int) -> dict | None:
        """The echoed prompt as the choice's first chunk; with logprobs it waits for
        the prompt's logprobs, which come with the first event (``content``)."""
        if self.echo.echo and self.echo.texts is None:
            return self._chunk(index, self.echo.prefix(index), None)
        return None

    def content(self, index: int, text: str, event) -> list[dict]:
        prompt_lps = event.prompt_logprobs
        if self.echo.echo and self.echo.texts is not None and prompt_lps is not None:
            text = self.echo.prefix(index) + text
        logprobs = self.echo.logprobs(index, event.token_ids, event.logprobs, prompt_lps)
        return [self._chunk(index, text, None, logprobs)]

    def finish(self, index: int, reason: str) -> list[dict]:
        return [self._chunk(index, "", reason)]

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

    grammar = requested_grammar(body)

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

    if grammar is not None:
        await check_grammar(engine, model.name, *grammar)
    for budget in budgets:
        check_min_tokens(body, budget)
    logit_bias = parse_logit_bias(body, vocab_size)
    top_n = body.logprobs  # None: no logprobs; 0-5: the sampled token's and top n
    echo = Echo(
        bool(body.echo),
        [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(raw_prompts, prompts)]
        if body.echo
        else [],
        prompts,
        n,
        TokenTexts(tokenizer) if top_n is not None else None,
        top_n or 0,
    )
    prompt_top = top_n if body.echo else None  # the prompt's logprobs: only echoed

    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    choices = make_choices(
        response_id,
        model.name,
        prompts,
        n,
        lambda i: sampling_params(
            body,
            budgets[i // n],
            i,
            logit_bias=logit_bias,
            logprobs=top_n,
            prompt_logprobs=prompt_top,
        ),
        grammar=grammar[0] if grammar else None,
    )

    def build(results: dict[int, ChoiceResult], usage: Usage) -> Completion:
        out = []
        for i, r in sorted(results.items()):
            lps = echo.logprobs(
                i, r.token_ids, r.logprobs if top_n is not None else None, r.prompt_logprobs
            )
            out.append(
                CompletionChoice(
                    index=i,
                    text=echo.prefix(i) + r.text,
                    logprobs=None if lps is None else CompletionLogprobs(**lps),
                    finish_reason=r.finish_reason,
                )
            )
        return Completion(
            id=response_id, created=created, model=model.name, choices=out, usage=usage
        )

    fmt = CompletionFormat(response_id, created, model.name, body.include_usage(), echo)
    return await respond(request, engine, settings, choices, prompts, body, fmt, build, chat=False)
