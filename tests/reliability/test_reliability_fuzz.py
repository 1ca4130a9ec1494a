"""Property-based fuzzing of the HTTP API with schemathesis, driven by the
server's own /openapi.json, against a real ``markbase serve`` with the real
default model. No response may be a 5xx; every response must match the
documented status codes, content types and bodies (the OpenAI shapes of
server.schemas, errors included); every stream must be well-formed SSE.

Generation is slow on CPU, so the server caps what one request may cost
(max_tokens 2, a 48-token context, short prompts, n <= 2): requests over the
caps are answered 400 at once, requests under them reach the engine. Half of
the positive examples are made servable (the served model's id, no unsupported
parameters, integers as integers, within the caps; half of those streamed), since
a random model id is a 404 that never reaches the engine. Examples are deterministic (derandomized) and
bounded: MARKBASE_FUZZ_EXAMPLES per operation and mode (default 100), and a
time budget for the whole module, MARKBASE_FUZZ_BUDGET_S (default 150 s),
after which the remaining examples are drawn but not sent."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # in the test extra

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers.server import DEFAULT_MODEL, running_server  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key-1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = int(os.environ.get("MARKBASE_FUZZ_EXAMPLES", "100"))
BUDGET_S = float(os.environ.get("MARKBASE_FUZZ_BUDGET_S", "150"))
FLAGS = [
    "--max-num-seqs",
    "4",
    "--max-context",
    "48",
    "--max-tokens-limit",
    "2",
    "--max-n",
    "2",
    "--max-prompts",
    "2",
    "--max-messages",
    "3",
    "--max-prompt-chars",
    "32",
    "--request-timeout-s",
    "60",
]
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
HAS_BODY = {"/v1/chat/completions", "/v1/completions"}
POSITIVE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
NEGATIVE_CHECKS = [not_a_server_error, negative_data_rejection, content_type_conformance]

STATS: Counter = Counter()
_deadline: list[float] = []


@pytest.fixture(scope="module")
def server():
    with running_server(DEFAULT_MODEL, *FLAGS, api_key=API_KEY) as srv:
        _deadline.append(time.monotonic() + BUDGET_S)
        yield srv


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_openapi_describes_the_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    components = doc["components"]["schemas"]
    for path, name, fields in [
        ("/v1/chat/completions", "ChatCompletionRequest", {"model", "messages", "max_tokens"}),
        ("/v1/completions", "CompletionRequest", {"model", "prompt", "max_tokens"}),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}"
        assert fields <= set(components[name]["properties"])
        assert set(components[name]["required"]) >= {"model"}
    role = components["ChatMessage"]["properties"]["role"]
    assert "user" in role["enum"]


def _check_stream(text: str) -> None:
    """Well-formed SSE: data lines of JSON chunks (or one error), then [DONE]."""
    payloads = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", text[-500:]
    for p in payloads[:-1]:
        chunk = json.loads(p)
        assert "error" not in chunk, chunk  # an error after a 200 is an engine failure
        assert {"id", "object", "created", "model", "choices"} <= set(chunk)


UNSUPPORTED = {  # accepted only at their neutral value (server.schemas ... unsupported())
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
}
INTEGERS = {"max_tokens", "max_completion_tokens", "n", "seed", "top_k"}


def _as_int(value):
    # JSON Schema counts 128.0 as an integer; the server, strict like OpenAI, does not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _make_servable(body: dict) -> None:
    """Turn a generated body into one the served model will run: its id, no
    unsupported parameters, integers as integers, within the server's caps. The
    rest (prompts, messages, stop strings, sampling values) stays as generated."""
    body["model"] = DEFAULT_MODEL
    for key in UNSUPPORTED & set(body):
        del body[key]
    for key in INTEGERS & set(body):
        body[key] = _as_int(body[key])
    for key in ("max_tokens", "max_completion_tokens", "n"):
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 1 + body[key] % 2
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = [_as_int(t) for t in body["stop_token_ids"]]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:2]  # at most 2 prompts (a list of ints is one prompt)
    if isinstance(body.get("messages"), list):
        body["messages"] = [_servable_message(m) for m in body["messages"][:3]]


def _servable_message(m):
    if not isinstance(m, dict):
        return m
    if m.get("role") in ("tool", "function"):  # no tool calling yet
        m["role"] = "user"
    m.pop("tool_calls", None)
    content = m.get("content")
    if isinstance(content, list):  # only text parts are supported
        m["content"] = [
            p for p in content if isinstance(p, dict) and p.get("type") == "text" and p.get("text")
        ] or ""
    elif content is None and m.get("role") != "assistant":
        m["content"] = ""
    return m


def _send(server, case, checks, label: str) -> None:
    if time.monotonic() > _deadline[0]:
        STATS["skipped (time limit reached)"] += 1
        return
    response = case.call(base_url=server.url, headers=AUTH, timeout=90)
    STATS["sent"] += 1
    STATS[f"{label} -> {response.status_code}"] += 1
    case.validate_response(response, checks=checks)
    if (
        response.status_code == 200
        and "text/event-stream" in response.headers.get("content-type", [""])[0]
    ):
        _check_stream(response.text)
        STATS["streams"] += 1


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_fuzz(server, schema, method, path, mode):
    if mode == "negative" and path not in HAS_BODY:
        pytest.skip("no input that can be made invalid (a path string is any string)")
    op = schema[path][method]
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    checks = POSITIVE_CHECKS if mode == "positive" else NEGATIVE_CHECKS

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: each call costs seconds
        suppress_health_check=list(HealthCheck),
    )
    @given(
        case=op.as_strategy(generation_mode=generation),
        real_model=st.booleans(),
        stream=st.booleans(),
    )
    def run(case, real_model, stream):
        if mode == "positive" and real_model:
            if isinstance(case.body, dict):
                _make_servable(case.body)
                case.body["stream"] = stream
            if path == "/v1/models/{model_id}":
                case.path_parameters = {"model_id": DEFAULT_MODEL}
            STATS["served model"] += 1
        _send(server, case, checks, f"{method} {path} {mode}")

    run()


def test_after_fuzzing_the_server_is_healthy_and_correct(server):
    print("\nfuzz stats:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(STATS.items())))
    assert STATS["sent"] > 0
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(
        server.v1 + "/completions",
        json={"model": DEFAULT_MODEL, "prompt": "The capital of France is", "temperature": 0},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == " Paris." and body["usage"]["completion_tokens"] == 2
    assert "unhandled error" not in server.log_tail(100000)
