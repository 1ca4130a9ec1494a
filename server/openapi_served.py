"""What /openapi.json says about this server in particular.

The request models in server.schemas describe OpenAI's API; a running server
knows more: which model ids it serves, its configured limits (``max_n``,
``max_tokens_limit``, ``max_messages``, ...), the context window, and which
parameters it accepts only at their neutral value (``unsupported()``). Written
into the schema, these tell a client the limits before it meets them, and let a
schema-driven fuzzer (schemathesis, tests/reliability/test_reliability_fuzz.py)
generate requests that reach the engine instead of 404s for made-up model ids.

Also links (OpenAPI 3 ``links``) from ``GET /v1/models`` to the operations that take
a model id, which stateful fuzzing follows.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import BaseModel, ValidationError

from engine.types import ModelInfo
from server.errors import APIError
from server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

_BASES: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"model": "m", "prompt": "x"},
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
}


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null alternatives of a property (itself when it is no union)."""
    if "anyOf" in prop:
        return [b for b in prop["anyOf"] if b.get("type") != "null"]
    return [prop]


def _only_branch(prop: dict[str, Any]) -> dict[str, Any] | None:
    branches = _branches(prop)
    return branches[0] if len(branches) == 1 else None


def _bound(prop: dict[str, Any] | None, type_: str | None = None, **bounds: Any) -> None:
    """Tighten every non-null alternative of ``prop`` (of JSON type ``type_`` if given)."""
    if prop is None:
        return
    for branch in _branches(prop):
        if type_ is None or branch.get("type") == type_:
            for key, value in bounds.items():
                old = branch.get(key)
                if key.startswith("max") and old is not None:
                    value = min(old, value)
                if key.startswith("min") and old is not None:
                    value = max(old, value)
                branch[key] = value


# JSON type -> (a value that asks for something, the neutral value, the bounds that
# allow only the neutral value)
_PROBES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "number": (1.0, 0.0, {"minimum": 0, "maximum": 0}),
    "integer": (1, 0, {"maximum": 0}),
    "boolean": (True, False, {"enum": [False]}),
    "string": ("x", "", {"maxLength": 0}),
    "array": ([{}], [], {"maxItems": 0}),
    "object": ({"1": 1.0}, {}, {"maxProperties": 0}),
}


def _flagged(model: type[BaseModel], field: str, value: Any) -> bool | None:
    """Whether ``unsupported()`` names ``field`` when it is ``value`` (None: invalid)."""
    try:
        req = model.model_validate({**_BASES[model], field: value}, strict=False)
    except ValidationError:
        return None
    problem = req.unsupported()  # type: ignore[attr-defined]
    return problem is not None and problem[0] == field


def neutral_only(model: type[BaseModel], schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fields of ``model`` accepted only at their neutral value (0, false, empty),
    found by asking ``unsupported()``: each with the bounds that say so. A field is
    listed only when a non-neutral value is refused and the neutral one accepted,
    so a parameter that becomes supported drops out by itself."""
    out = {}
    for field, prop in schema.get("properties", {}).items():
        branch = _only_branch(prop)
        if field in _BASES[model] or branch is None or branch.get("type") not in _PROBES:
            continue
        probe, neutral, bounds = _PROBES[branch["type"]]
        if _flagged(model, field, probe) and _flagged(model, field, neutral) is False:
            out[field] = bounds
    return out


def _rejected(messages: list[dict[str, Any]]) -> bool:
    """Whether the chat route refuses these messages (server.routes.chat.template_messages)."""
    from server.routes.chat import template_messages  # the route module imports this one's users

    try:
        template_messages([ChatMessage.model_validate(m, strict=False) for m in messages])
    except (APIError, ValidationError):
        return True
    return False


def _describe_messages(components: dict[str, Any]) -> None:
    """Roles, tool calls and content parts the chat route takes, as it answers them."""
    message = components.get("ChatMessage", {}).get("properties", {})
    role = message.get("role")
    if role is not None and "enum" in role:
        role["enum"] = [r for r in role["enum"] if not _rejected([{"role": r, "content": "x"}])]
    calls = message.get("tool_calls")
    if (
        calls is not None
        and _rejected([{"role": "assistant", "content": "x", "tool_calls": [{}]}])
        and not _rejected([{"role": "assistant", "content": "x", "tool_calls": []}])
    ):
        _bound(calls, "array", maxItems=0)
    roles = [r for r in (role or {}).get("enum", []) if r != "assistant"]
    if (
        roles
        and all(_rejected([{"role": r}]) for r in roles)
        and not _rejected([{"role": "assistant"}])
    ):
        # content may be left out (or null) only by the assistant
        body = components["ChatMessage"]
        body["if"] = {"properties": {"role": {"enum": roles}}}
        body["then"] = {
            "required": ["content"],
            "properties": {"content": {"not": {"type": "null"}}},
        }
    part = components.get("ContentPart")
    if (
        part is not None
        and _rejected([{"role": "user", "content": [{"type": "image_url"}]}])
        and not _rejected([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    ):
        part["properties"]["type"] = {**part["properties"]["type"], "enum": ["text"]}
        part["properties"]["text"] = {"type": "string", "title": "Text"}
        part["required"] = sorted({*part.get("required", []), "type", "text"})


def describe_server(
    schema: dict[str, Any],
    models: list[ModelInfo],
    server: Any,
    tokenizers: dict[str, Any] | None = None,
) -> None:
    """Write the served models, limits and accepted values into ``schema`` (a FastAPI
    OpenAPI dict); ``server`` is ``server.config.ServerSettings``, ``tokenizers`` the
    served models' (for the vocabulary size and whether an empty prompt has tokens)."""
    components = schema.get("components", {}).get("schemas", {})
    names = [m.name for m in models]
    toks = list((tokenizers or {}).values())
    vocab = min(
        (t.vocab_size for t in toks if isinstance(getattr(t, "vocab_size", None), int)),
        default=None,
    )
    empty_has_tokens = any(_encodes_empty(t) for t in toks) or not toks
    context = max((m.context_length for m in models), default=0)
    max_tokens = context - 1 if context else None
    if server.max_tokens_limit:
        max_tokens = min(max_tokens or server.max_tokens_limit, server.max_tokens_limit)

    for model in (CompletionRequest, ChatCompletionRequest):
        body = components.get(model.__name__)
        if body is None:
            continue
        props = body["properties"]
        if names:
            props["model"] = {**props["model"], "enum": names}
        for field in ("max_tokens", "max_completion_tokens"):
            if max_tokens and field in props:
                _bound(props[field], "integer", maximum=max_tokens)
        _bound(props.get("n"), "integer", maximum=server.max_n)
        for field, bounds in neutral_only(model, body).items():
            _bound(props[field], **bounds)
        for field in ("tool_choice", "function_call"):
            # "none" and "auto" only (no forced call), when that is what is accepted
            if field in props and all(
                _flagged(model, field, v) is (v not in ("none", "auto"))
                for v in ("none", "auto", "required", {"type": "function"})
            ):
                props[field]["anyOf"] = [
                    {"type": "string", "enum": ["none", "auto"]},
                    {"type": "null"},
                ]
    response_format = components.get("ResponseFormat", {}).get("properties", {}).get("type")
    if response_format is not None and (
        _flagged(ChatCompletionRequest, "response_format", {"type": "json_object"})
        and _flagged(ChatCompletionRequest, "response_format", {"type": "text"}) is False
    ):
        response_format["enum"] = ["text"]

    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    text = {"maxLength": server.max_prompt_chars, **({} if empty_has_tokens else {"minLength": 1})}
    ids = {"minimum": 0, **({"maximum": vocab - 1} if vocab else {})}
    window = {"minItems": 1, **({"maxItems": context - 1} if context else {})}
    if prompt is not None:
        for branch in _branches(prompt):
            items = branch.get("items", {})
            if branch.get("type") == "string":
                branch.update(text)
            elif items.get("type") == "string":  # several prompts
                branch.update(minItems=1, maxItems=server.max_prompts)
                items.update(text)
            elif items.get("type") == "integer":  # one prompt of token ids
                branch.update(window)
                items.update(ids)
            elif items.get("type") == "array":  # several prompts of token ids
                branch.update(minItems=1, maxItems=server.max_prompts)
                items.update(window)
                items.setdefault("items", {}).update(ids)
    messages = components.get("ChatCompletionRequest", {}).get("properties", {}).get("messages")
    if messages is not None:
        messages.update(minItems=1, maxItems=server.max_messages)
    content = components.get("ChatMessage", {}).get("properties", {}).get("content")
    if content is not None:
        _bound(content, "string", maxLength=server.max_prompt_chars)
    _describe_messages(components)
    _describe_tokenize(components, names, server, ids)

    paths = schema.get("paths", {})
    with contextlib.suppress(KeyError):
        for param in paths["/v1/models/{model_id}"]["get"]["parameters"]:
            if param.get("name") == "model_id" and names:
                param["schema"] = {**param["schema"], "enum": names}
    _add_links(paths)


def _describe_tokenize(
    components: dict[str, Any], names: list[str], server: Any, ids: dict[str, Any]
) -> None:
    """/tokenize and /detokenize (server.routes.tokenize): the served ids, the
    prompt and message limits, token ids within the vocabulary, and text or a
    conversation, one of the two."""
    tokenize = components.get("TokenizeRequest")
    if tokenize is not None:
        props = tokenize["properties"]
        if names:
            _bound(props.get("model"), "string", enum=names)
        _bound(props.get("prompt"), "string", maxLength=server.max_prompt_chars)
        _bound(props.get("messages"), "array", minItems=1, maxItems=server.max_messages)
        tokenize["oneOf"] = [
            {"required": [one], "properties": {other: {"type": "null"}}}
            for one, other in (("prompt", "messages"), ("messages", "prompt"))
        ]
    detokenize = components.get("DetokenizeRequest")
    if detokenize is not None:
        props = detokenize["properties"]
        if names:
            _bound(props.get("model"), "string", enum=names)
        tokens = props.get("tokens")
        if tokens is not None:
            tokens.setdefault("items", {}).update(ids)


def _encodes_empty(tokenizer: Any) -> bool:
    try:
        return bool(tokenizer.encode(""))
    except Exception:  # noqa: BLE001
        return True  # unknown: do not claim the empty prompt is refused


def _operation_id(paths: dict[str, Any], path: str, method: str) -> str | None:
    return paths.get(path, {}).get(method, {}).get("operationId")


def _add_links(paths: dict[str, Any]) -> None:
    """``GET /v1/models`` -> the operations that take one of its model ids."""
    get_model = _operation_id(paths, "/v1/models/{model_id}", "get")
    chat = _operation_id(paths, "/v1/chat/completions", "post")
    completion = _operation_id(paths, "/v1/completions", "post")
    model_id = "$response.body#/data/0/id"
    links: dict[str, Any] = {}
    if get_model:
        links["GetModel"] = {"operationId": get_model, "parameters": {"model_id": model_id}}
    if chat:
        links["ChatWithModel"] = {"operationId": chat, "requestBody": {"model": model_id}}
    if completion:
        links["CompleteWithModel"] = {"operationId": completion, "requestBody": {"model": model_id}}
    ok = paths.get("/v1/models", {}).get("get", {}).get("responses", {}).get("200")
    if ok is not None and links:
        ok["links"] = links
