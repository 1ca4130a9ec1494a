"""HTTP layer pieces that need no engine: request validation messages, settings
precedence (defaults < YAML < MARKBASE_* < flags), SSE encoding, and that the
HTTP layer never imports MLX."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from server import sse
from server.auth import key_matches
from server.cli import build_parser, overrides_from_args
from server.config import ConfigError, load_settings
from server.errors import validation_error
from server.schemas import ChatCompletionRequest, CompletionRequest

REPO = Path(__file__).resolve().parents[2]
MSG = [{"role": "user", "content": "hi"}]


def error_for(model, body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps(body))
    err = validation_error(info.value.errors(include_url=False))
    assert err.status_code == 400
    return err.param, err.message


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "greater than or equal to 1"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": 5}, "stop", "a string or an array of strings"),
        ({"stream": "yes"}, "stream", "boolean"),
        ({"seed": 1.5}, "seed", "integer"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"messages": "hi"}, "messages", "valid array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'system'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
            "valid string",
        ),
    ],
)
def test_chat_validation_names_the_field(extra, param, words):
    body = {"model": "m", "messages": MSG, **extra}
    got_param, message = error_for(ChatCompletionRequest, body)
    assert got_param == param
    assert f"'{param}'" in message and words in message


def test_missing_required_fields():
    assert error_for(ChatCompletionRequest, {"model": "m"}) == (
        "messages",
        "Missing required parameter: 'messages'.",
    )
    assert error_for(CompletionRequest, {"prompt": "x"})[0] == "model"


def test_malformed_and_non_object_bodies():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(b"{not json")
    err = validation_error(info.value.errors())
    assert err.code == "invalid_json" and "could not parse the JSON" in err.message
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(b"[1, 2]")
    assert "JSON object" in validation_error(info.value.errors()).message


def test_unknown_fields_are_ignored_and_neutral_values_accepted():
    body = {
        "model": "m",
        "messages": MSG,
        "user": "u1",
        "metadata": {"a": 1},
        "store": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "logprobs": False,
        "top_logprobs": 0,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "tools": [],
        "stop": None,
    }
    req = ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert req.unsupported() is None
    assert req.stop_list() == ()


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
    ],
)
def test_unsupported_non_neutral_values_are_named(extra, param):
    req = ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": MSG, **extra})
    )
    problem = req.unsupported()
    assert problem is not None and problem[0] == param and param in problem[1]


def test_completion_prompt_forms():
    def prompts(p):
        return CompletionRequest.model_validate_json(
            json.dumps({"model": "m", "prompt": p})
        ).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]
    assert prompts([]) == []
    param, message = error_for(CompletionRequest, {"model": "m", "prompt": [1, "a"]})
    assert param == "prompt" and "an array of integers" in message
    req = CompletionRequest.model_validate_json(
        json.dumps({"model": "m", "prompt": "x", "echo": True, "stop": ["", "END"]})
    )
    assert req.unsupported() is None
    req = CompletionRequest.model_validate_json(
        json.dumps({"model": "m", "prompt": "x", "suffix": "y", "stop": ["", "END"]})
    )
    assert req.unsupported()[0] == "suffix"
    assert req.stop_list() == ("END",)


def test_max_completion_tokens_wins_over_max_tokens():
    req = ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": MSG, "max_tokens": 9, "max_completion_tokens": 4})
    )
    assert req.effective_max_tokens() == 4


# --------------------------------------------------------------------------- settings


def test_settings_precedence(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        "server:\n  port: 9001\n  max_n: 3\n  api_keys: [from-yaml]\n"
        "engine:\n  max_num_seqs: 4\n  default_max_tokens: 64\n"
        "  models:\n    - source: a.gguf\n    - {source: b, name: bee}\n"
    )
    s = load_settings(yaml_file, env={})
    assert (s.server.port, s.server.max_n, s.server.api_keys) == (9001, 3, ["from-yaml"])
    assert s.engine.max_num_seqs == 4 and s.engine.default_max_tokens == 64
    assert [(m.source, m.name) for m in s.engine.models] == [("a.gguf", None), ("b", "bee")]
    assert s.server.host == "127.0.0.1"  # default kept

    env = {
        "MARKBASE_CONFIG": str(yaml_file),
        "MARKBASE_PORT": "9002",
        "MARKBASE_MAX_NUM_SEQS": "6",
        "MARKBASE_API_KEY": "k1, k2",
        "MARKBASE_MODEL": "smollm2-135m-instruct",
        "MARKBASE_METRICS_REQUIRE_AUTH": "true",
    }
    s = load_settings(None, env=env)
    assert (s.server.port, s.engine.max_num_seqs, s.server.max_n) == (9002, 6, 3)
    assert s.server.api_keys == ["k1", "k2"] and s.server.metrics_require_auth is True
    assert [m.source for m in s.engine.models] == ["smollm2-135m-instruct"]

    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9003",
            "--max-num-seqs",
            "2",
            "--api-key",
            "cli1,cli2",
            "--model",
            "x=some/dir",
            "--model",
            "other.gguf",
            "--no-metrics-require-auth",
        ]
    )
    s = load_settings(None, env=env, overrides=overrides_from_args(args))
    assert (s.server.port, s.engine.max_num_seqs) == (9003, 2)
    assert s.server.api_keys == ["cli1", "cli2"] and s.server.metrics_require_auth is False
    assert [(m.name, m.source) for m in s.engine.models] == [
        ("x", "some/dir"),
        (None, "other.gguf"),
    ]
    assert s.engine.default_max_tokens == 64  # from YAML, untouched by env and flags


def test_shipped_default_yaml_loads():
    s = load_settings(REPO / "configs" / "default.yaml", env={})
    assert s.server.host == "127.0.0.1" and s.server.port == 8000 and s.server.api_keys == []
    assert [m.source for m in s.engine.models] == ["smollm2-135m-instruct"]


@pytest.mark.parametrize(
    "yaml_text, words",
    [
        ("server:\n  prot: 1\n", "unknown setting 'prot'"),
        ("server:\n  port: eighty\n", "expected an integer"),
        ("serv:\n  port: 1\n", "unknown section"),
        ("engine:\n  models: []\n", "non-empty list"),
    ],
)
def test_bad_config_files_are_named(tmp_path, yaml_text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError, match=words):
        load_settings(f, env={})


def test_bad_env_value():
    with pytest.raises(ConfigError, match="MARKBASE_PORT"):
        load_settings(None, env={"MARKBASE_PORT": "x"})


# --------------------------------------------------------------------------- misc


def test_sse_encoding():
    assert sse.encode({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert sse.DONE == "data: [DONE]\n\n"


def test_key_matching():
    keys = [b"alpha", b"beta"]
    assert key_matches(b"beta", keys) and not key_matches(b"gamma", keys)
    assert not key_matches(b"", keys)


def test_http_layer_never_imports_mlx():
    code = (
        "import sys, server.app, server.cli, server.routes.chat;"
        "bad = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
