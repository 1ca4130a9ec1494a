"""Property-based fuzzing of the HTTP API with schemathesis, driven by the
server's own /openapi.json, against a real ``markbase serve`` with the real
default model. No response may be a 5xx; every response must match the
documented status codes, content types and bodies (the OpenAI shapes of
server.schemas, errors included); every stream must be well-formed SSE.

The schema says what this server serves and allows (server.openapi_served): the
model id as an enum, its limits as bounds, parameters it takes only at their
neutral value, roles and content parts the chat route takes. So positive
examples are requests the engine runs (at least half of them must be), not 404s
for made-up model ids; negative ones must all be refused with a 4xx. Generation
is slow on CPU, so the server caps what one request may cost (max_tokens 2, a
48-token context, short prompts, n <= 2). Half the positive bodies are streamed.
Stateful scenarios follow the schema's links (GET /v1/models, then a served id
into the other operations).

Examples are deterministic (derandomized) and bounded: MARKBASE_FUZZ_EXAMPLES per
operation and mode (default 20), MARKBASE_FUZZ_STATEFUL_EXAMPLES scenarios of up
to 3 steps (default 6), and a time limit for each operation and mode,
MARKBASE_FUZZ_SECONDS_PER_TEST (default 12 s), after which the rest are drawn but
not sent."""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # in the test extra

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.stateful.state_machine import StepOutput  # noqa: E402
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
EXAMPLES = int(os.environ.get("MARKBASE_FUZZ_EXAMPLES", "20"))
STATEFUL_EXAMPLES = int(os.environ.get("MARKBASE_FUZZ_STATEFUL_EXAMPLES", "6"))
SECONDS_PER_TEST = float(os.environ.get("MARKBASE_FUZZ_SECONDS_PER_TEST", "12"))
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
OPERATIONS = [  # cheap ones first: generation takes most of the time limit
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]
HAS_BODY = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}
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


def _ints(value):
    """JSON Schema counts 128.0 as an integer; the server, strict like OpenAI, does
    not: integer-valued floats become ints (a float field takes an int too)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    return value


# Fields whose valid values JSON Schema cannot describe: a regex or grammar that
# compiles, a JSON Schema as a string, more than one kind of structured output at once.
GRAMMAR_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _servable(body):
    """A positive example as sent: integers as integers, no ``best_of`` (taken only
    equal to n), none of vLLM's ``guided_*`` grammar extras (random strings are not
    regexes or grammars; tests/api/test_structured_output.py sends real ones) and no
    named ``tool_choice`` (it must name one of ``tools``: a rule across two fields).
    The rest, ``tools`` and ``response_format`` included, is as generated within the
    bounds /openapi.json gives (server.openapi_served)."""
    if not isinstance(body, dict):
        return body
    body = _ints(body)
    body.pop("best_of", None)
    for field in GRAMMAR_EXTRAS:
        body.pop(field, None)
    if isinstance(body.get("tool_choice"), dict):
        body.pop("tool_choice")
    return body


def _send(server, case, checks, label: str, force: bool = False):
    if _deadline and time.monotonic() > _deadline[-1] and not force:
        STATS["skipped (time limit reached)"] += 1
        return None
    response = case.call(base_url=server.url, headers=AUTH, timeout=90)
    STATS["sent"] += 1
    STATS[f"{label} -> {response.status_code}"] += 1
    if response.status_code >= 400:
        code = response.json()["error"]["code"]  # an OpenAI error body (checked below too)
        STATS[f"{label} -> {response.status_code} {code}"] += 1
    case.validate_response(response, checks=checks)
    if (
        response.status_code == 200
        and "text/event-stream" in response.headers.get("content-type", [""])[0]
    ):
        _check_stream(response.text)
        STATS["streams"] += 1
    return response


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_fuzz(server, schema, method, path, mode):
    if mode == "negative" and path not in HAS_BODY:
        pytest.skip("no input that can be made invalid (a path string is any string)")
    op = schema[path][method]
    _deadline.append(time.monotonic() + SECONDS_PER_TEST)
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
    @given(case=op.as_strategy(generation_mode=generation), stream=st.booleans())
    def run(case, stream):
        if mode == "positive":
            case.body = _servable(case.body)
            if stream and isinstance(case.body, dict):
                case.body["stream"] = True  # half the bodies streamed
        _send(server, case, checks, f"{method} {path} {mode}")

    run()


def test_stateful_links(server, schema):
    """Scenarios that follow the links of /openapi.json: GET /v1/models, then a
    served id from its answer into GET /v1/models/{id}, a chat or a completion."""
    machine = schema.as_state_machine()

    class Scenario(machine):
        def step(self, input):
            case = input.case
            case.body = _servable(case.body)
            label = f"stateful {case.method} {case.path}"
            response = _send(server, case, POSITIVE_CHECKS, label, force=True)
            return StepOutput(response, case)

    Scenario.run(
        settings=settings(
            max_examples=STATEFUL_EXAMPLES,
            stateful_step_count=3,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
    )


def test_after_fuzzing_the_server_is_healthy_and_correct(server):
    print("\nfuzz stats:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(STATS.items())))
    assert STATS["sent"] > 0
    # The schema names the served model and the server's limits: most positive
    # examples are requests the engine runs, not 404s for made-up model ids.
    for path in sorted(HAS_BODY):
        answers = {
            k: v for k, v in STATS.items() if re.fullmatch(f"POST {path} positive -> \\d+", k)
        }
        ran = answers.get(f"POST {path} positive -> 200", 0)
        assert ran >= sum(answers.values()) / 2 > 0, (path, answers)
    assert STATS["streams"] > 0
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
