"""POST /tokenize and /detokenize (also under /v1/), in vLLM's shapes.

``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt"}`` ->
``{"count", "max_model_len", "tokens", "token_strs"}``: the token ids the completions
or chat endpoint would feed the model for the same input (same tokenizer, same chat
template, same message checks). ``{"model", "tokens"}`` -> ``{"prompt"}``: the text of
the ids, special tokens written out. Both need the API key when one is set.
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request

from engine.types import ModelInfo
from server.deps import engine_of, json_body, parse_body, responses, settings_of
from server.errors import APIError, bad_request
from server.generation import check_prompt_chars
from server.routes.chat import template_messages
from server.routes.models import lookup
from server.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()


def _model(request: Request, name: str | None) -> ModelInfo:
    if name is not None:
        return lookup(request, name)
    served = engine_of(request).models()
    if len(served) != 1:
        raise bad_request(
            "Missing required parameter: 'model' (this server serves several models).",
            param="model",
            code="missing_required_parameter",
        )
    return served[0]


async def tokenize(request: Request) -> dict:
    body = await parse_body(request, TokenizeRequest)
    limits = settings_of(request).server
    if (body.prompt is None) == (body.messages is None):
        raise bad_request(
            "Send either 'prompt' (text) or 'messages' (a conversation), not both or neither.",
            param="prompt" if body.prompt is None else "messages",
            code="invalid_value",
        )
    if body.messages is not None:
        if len(body.messages) > limits.max_messages:
            raise bad_request(
                f"Invalid 'messages': at most {limits.max_messages} messages per request on "
                f"this server (got {len(body.messages)}).",
                param="messages",
                code="invalid_value",
            )
        messages = template_messages(body.messages)
        check_prompt_chars(
            sum(len(m["content"]) for m in messages), limits.max_prompt_chars, "messages"
        )
    else:
        check_prompt_chars(len(body.prompt), limits.max_prompt_chars, "prompt")
    model = _model(request, body.model)
    tokenizer = engine_of(request).tokenizer(model.name)

    def encode() -> list[int]:
        if body.messages is None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return list(tokenizer.encode(body.prompt, add_special_tokens=special))
        ids = list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt
            )
        )
        if body.add_special_tokens and tokenizer.add_bos and tokenizer.bos_token_id is not None:
            if not ids or ids[0] != tokenizer.bos_token_id:
                ids.insert(0, tokenizer.bos_token_id)
        return ids

    try:
        tokens = await anyio.to_thread.run_sync(encode)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
        raise APIError(
            400, f"The chat template rejected the messages: {exc}", param="messages"
        ) from None
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=model.context_length,
        tokens=tokens,
        token_strs=[s or "" for s in strs] if strs is not None else None,
    ).model_dump()


async def detokenize(request: Request) -> dict:
    body = await parse_body(request, DetokenizeRequest)
    model = _model(request, body.model)
    tokenizer = engine_of(request).tokenizer(model.name)
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab, int):
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise bad_request(
                f"Invalid 'tokens': token id {bad[0]} is out of range (vocabulary size {vocab}).",
                param="tokens",
                code="invalid_value",
            )
    text = await anyio.to_thread.run_sync(
        lambda: tokenizer.decode(body.tokens, skip_special_tokens=False)
    )
    return DetokenizeResponse(prompt=text).model_dump()


_TOKENIZE_BODY = json_body(TokenizeRequest)
_DETOKENIZE_BODY = json_body(DetokenizeRequest)
for _prefix in ("", "/v1"):
    _name = _prefix.strip("/").replace("/", "_")
    router.add_api_route(
        f"{_prefix}/tokenize",
        tokenize,
        methods=["POST"],
        response_model=None,
        openapi_extra=_TOKENIZE_BODY,
        responses=responses(TokenizeResponse),
        name=f"tokenize{_name}",
    )
    router.add_api_route(
        f"{_prefix}/detokenize",
        detokenize,
        methods=["POST"],
        response_model=None,
        openapi_extra=_DETOKENIZE_BODY,
        responses=responses(DetokenizeResponse),
        name=f"detokenize{_name}",
    )
