"""In-process checks of what the hostile-client defences add to the app: every
429/503 carries ``Retry-After``; the connection and tokenizing limits are
settings (YAML, ``MARKBASE_*``, flags) validated at start; /openapi.json names
the served models, the server's limits and the values it takes only at their
neutral value. Real sockets and a real model: tests/reliability/test_hostile_*.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.types import EngineDeadError, ModelInfo
from server.app import create_app
from server.cli import build_parser, overrides_from_args
from server.config import ConfigError, ServerSettings, Settings, load_settings
from server.connections import ConnectionLimits

MODEL = ModelInfo(
    name="served-model",
    architecture="llama",
    context_length=512,
    source="x",
    created=0,
    has_chat_template=True,
)


class Tok:
    vocab_size = 1000

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]


class DownEngine:
    """An engine whose worker has died: health says so, requests get 503."""

    def models(self):
        return [MODEL]

    def tokenizer(self, name):
        return Tok()

    def get_model(self, name):
        raise EngineDeadError("The engine for model 'served-model' is not running.")

    def health(self):
        return {"status": "error", "detail": "engine worker down"}


def test_every_503_says_when_to_retry():
    c = TestClient(create_app(DownEngine(), Settings()))
    r = c.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    r = c.post("/v1/completions", json={"model": "served-model", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "engine_unavailable"
    r = c.get("/v1/models")
    assert r.status_code == 200 and "retry-after" not in r.headers


def test_limit_settings_come_from_every_layer_and_are_checked(tmp_path):
    s = load_settings(None, env={})
    limits = ConnectionLimits.from_settings(s.server)
    assert limits == ConnectionLimits()  # the documented defaults, one source
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  header_timeout_s: 3\n  max_connections: 50\n")
    s = load_settings(str(cfg), env={"MARKBASE_MAX_CONNECTIONS_PER_CLIENT": "7"})
    assert (s.server.header_timeout_s, s.server.max_connections) == (3.0, 50)
    assert s.server.max_connections_per_client == 7
    args = build_parser().parse_args(
        ["serve", "--body-min-rate-bytes", "0", "--keepalive-timeout-s", "2"]
    )
    s = load_settings(None, env={}, overrides=overrides_from_args(args))
    assert (s.server.body_min_rate_bytes, s.server.keepalive_timeout_s) == (0, 2.0)
    for key, bad in [
        ("header_timeout_s", -1),
        ("max_connections", -5),
        ("max_header_bytes", 100),
        ("max_large_tokenizations", 0),
        ("large_prompt_bytes", 0),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_settings(None, env={}, overrides={key: bad})


def test_openapi_names_the_served_model_and_the_limits():
    settings = Settings(server=ServerSettings(max_n=3, max_messages=5, max_prompts=4))
    doc = create_app(DownEngine(), settings).openapi()
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        assert props["model"]["enum"] == ["served-model"]
        assert props["max_tokens"]["anyOf"][0]["maximum"] == 511  # the window less one
        assert props["n"]["anyOf"][0]["maximum"] == 3
        # OpenAI's range, so the fuzzer's bodies reach the sampler's penalties
        assert props["presence_penalty"]["anyOf"][0] == {
            "maximum": 2.0,
            "minimum": -2.0,
            "type": "number",
        }
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 5 and chat["messages"]["minItems"] == 1
    # what is served: forced calls and every response_format (the schema follows
    # what the request checks accept, so these change only with them)
    assert chat["tool_choice"]["anyOf"][0]["enum"] == ["none", "auto", "required"]
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == [
        "text",
        "json_object",
        "json_schema",
    ]
    # a tool message alone (no tool_call_id) is refused, so the fuzzer is not told to send one
    assert "tool" not in schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert schemas["ContentPart"]["properties"]["type"]["enum"] == ["text"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    token_ids = next(b for b in prompt if b.get("items", {}).get("type") == "integer")
    assert token_ids["items"]["maximum"] == 999 and token_ids["maxItems"] == 511
    several = next(b for b in prompt if b.get("items", {}).get("type") == "string")
    assert several["maxItems"] == 4
    path = doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]
    assert path["schema"]["enum"] == ["served-model"]
    links = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["links"]
    assert links["ChatWithModel"]["requestBody"] == {"model": "$response.body#/data/0/id"}
