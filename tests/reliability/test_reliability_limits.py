"""Request limits and input hardening of the HTTP layer, in process (no model):
every limit answers 400/413 with a message naming the limit and its value, and
a request exactly at a limit gets past it; the limit settings are validated;
values that would crash the engine unmapped (seed outside uint64, top_k past int32,
a temperature that is 0 in float32) are mapped before it; a client that hangs
up mid-upload is a 499, not a logged server error; /openapi.json describes the
request bodies and every reference in it resolves.

The fake engine here knows no model: a 404 model_not_found means the request
got past every limit that is checked before the engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from engine.types import UnknownModelError
from server.app import create_app
from server.cli import build_parser, overrides_from_args
from server.config import ConfigError, ServerSettings, Settings, load_settings
from server.generation import default_max_tokens, sampling_params
from server.schemas import ChatCompletionRequest, CompletionRequest

LIMITS = dict(
    max_tokens_limit=64,
    max_n=2,
    max_prompts=3,
    max_messages=4,
    max_prompt_chars=100,
    max_body_bytes=4096,
)


class NoModels:
    def get_model(self, name):
        raise UnknownModelError(f"The model '{name}' does not exist.")

    def __getattr__(self, name):
        raise AssertionError(f"the engine was used ({name}) before the limits were checked")


@pytest.fixture(scope="module")
def c():
    settings = Settings(server=ServerSettings(**LIMITS))
    return TestClient(create_app(NoModels(), settings))


def msgs(n: int, chars: int = 1) -> list[dict]:
    return [{"role": "user", "content": "x" * chars} for _ in range(n)]


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"

# (path, at the limit, over it, param, words of the message)
CASES = [
    (CHAT, {"max_tokens": 64}, {"max_tokens": 65}, "max_tokens", "at most 64 tokens"),
    (
        CHAT,
        {"max_completion_tokens": 64},
        {"max_completion_tokens": 65},
        "max_completion_tokens",
        "at most 64 tokens",
    ),
    (CMPL, {"max_tokens": 64}, {"max_tokens": 10**20}, "max_tokens", "at most 64 tokens"),
    (CHAT, {"n": 2}, {"n": 3}, "n", "at most 2 choices"),
    (CMPL, {"prompt": ["a"] * 3}, {"prompt": ["a"] * 4}, "prompt", "at most 3 prompts"),
    (CHAT, {"messages": msgs(4)}, {"messages": msgs(5)}, "messages", "at most 4 messages"),
    (
        CHAT,
        {"messages": msgs(4, 25)},
        {"messages": msgs(3, 25) + msgs(1, 26)},
        "messages",
        "at most 100 characters of prompt text per request on this server (got 101)",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 100}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 101}]}]},
        "messages",
        "at most 100 characters",
    ),
    (CMPL, {"prompt": "x" * 100}, {"prompt": "x" * 101}, "prompt", "at most 100 characters"),
    (
        CMPL,
        {"prompt": ["x" * 50, "y" * 50]},
        {"prompt": ["x" * 50, "y" * 51]},
        "prompt",
        "at most 100 characters of prompt text per request on this server (got 101)",
    ),
]


@pytest.mark.parametrize("path, at, over, param, words", CASES)
def test_each_limit_names_itself(c, path, at, over, param, words):
    base = {"model": "m", "messages": msgs(1)} if path == CHAT else {"model": "m", "prompt": "x"}
    r = c.post(path, json={**base, **at})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = c.post(path, json={**base, **over})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_body_limit_names_its_value(c):
    r = c.post(CMPL, json={"model": "m", "prompt": "x" * 5000})
    assert r.status_code == 413
    assert "4096 bytes" in r.json()["error"]["message"]


def test_token_prompts_are_not_counted_as_characters(c):
    r = c.post(CMPL, json={"model": "m", "prompt": [5] * 500})
    assert r.status_code == 404  # got past the character limit (the context is the engine's)


def test_limit_settings_are_validated(tmp_path):
    for key, bad in [
        ("max_messages", 0),
        ("max_prompt_chars", 0),
        ("max_prompts", 0),
        ("max_tokens_limit", -1),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_settings(None, env={}, overrides={key: bad})
    s = load_settings(None, env={"MARKBASE_MAX_TOKENS_LIMIT": "32", "MARKBASE_MAX_MESSAGES": "7"})
    assert (s.server.max_tokens_limit, s.server.max_messages) == (32, 7)
    args = build_parser().parse_args(
        ["serve", "--max-prompt-chars", "99", "--max-tokens-limit", "5"]
    )
    s = load_settings(None, env={}, overrides=overrides_from_args(args))
    assert (s.server.max_prompt_chars, s.server.max_tokens_limit) == (99, 5)
    assert load_settings(None, env={}).server.max_tokens_limit == 0  # default: no cap


def test_default_max_tokens_is_capped_too():
    assert default_max_tokens(512, 0) == 512
    assert default_max_tokens(512, 64) == 64
    assert default_max_tokens(16, 64) == 16


def _params(**body):
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "x", **body}))


@pytest.mark.parametrize(
    "body, index, field, value",
    [
        ({"seed": -1}, 0, "seed", 2**64 - 1),
        ({"seed": 2**63 - 1}, 1, "seed", 2**63),
        ({"seed": 5}, 2, "seed", 7),  # ordinary seeds are as they were
        ({"top_k": 3_000_000_000}, 0, "top_k", 0),
        ({"top_k": 40}, 0, "top_k", 40),
        ({"top_k": -1}, 0, "top_k", 0),
        ({"temperature": 5e-324}, 0, "temperature", 0.0),
        ({"temperature": 1e-6}, 0, "temperature", 0.0),
        ({"temperature": 0.5}, 0, "temperature", 0.5),
        ({}, 0, "temperature", 1.0),
    ],
)
def test_sampling_values_fit_the_engine(body, index, field, value):
    params = sampling_params(_params(**body), 8, index)
    assert getattr(params, field) == value
    if params.seed is not None:
        assert 0 <= params.seed < 2**64


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seed_outside_int64_is_a_400(c, seed):
    r = c.post(CHAT, json={"model": "m", "messages": msgs(1), "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_upload_cut_short_is_499_not_a_server_error(caplog):
    app = create_app(NoModels(), Settings())
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    messages = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CMPL,
        "raw_path": CMPL.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level("INFO"):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "markbase.access"]
    assert access and access[0]["status"] == 499 and access[0]["error"] == "client_disconnected"


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_openapi_declares_bodies_and_every_ref_resolves():
    doc = create_app(NoModels(), Settings()).openapi()
    components = doc["components"]["schemas"]
    for path, model in [(CHAT, ChatCompletionRequest), (CMPL, CompletionRequest)]:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert schema["schema"]["$ref"] == f"#/components/schemas/{model.__name__}"
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
        ok = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(ok)
    refs = set(_refs(doc))
    assert refs and all(r.startswith("#/components/schemas/") for r in refs)
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(components)
    assert "$defs" not in json.dumps(doc)
