"""Error paths of the HTTP layer that are decided before the engine is asked
anything: unknown route, wrong method, malformed JSON, validation, unsupported
parameters, body size, API keys, request ids, /metrics.

The app here is built with ``Unreachable`` in place of the engine client: any
use of it fails the test, which proves these answers never reach the engine.
Behaviour that needs the engine is tested against a real server in
test_api_openai.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import ServerSettings, Settings

MSG = [{"role": "user", "content": "hi"}]


class Unreachable:
    def __getattr__(self, name):
        raise AssertionError(f"the engine was used ({name}) on a path that must not need it")


def client(**server) -> TestClient:
    settings = Settings(server=ServerSettings(**server))
    return TestClient(create_app(Unreachable(), settings), raise_server_exceptions=True)


def assert_openai_error(r, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture(scope="module")
def c():
    return client()


def test_unknown_route_404(c):
    err = assert_openai_error(c.get("/v1/nothing-here"), 404, code="unknown_url")
    assert "/v1/nothing-here" in err["message"]
    assert_openai_error(c.post("/nope", json={}), 404)


def test_wrong_method_405(c):
    r = c.get("/v1/chat/completions")
    assert_openai_error(r, 405, code="method_not_allowed")
    assert "POST" in r.headers.get("allow", "")
    assert_openai_error(c.post("/v1/models"), 405)


def test_malformed_json_400(c):
    r = c.post(
        "/v1/chat/completions",
        content=b'{"model": "m", "messages": [',
        headers={"content-type": "application/json"},
    )
    err = assert_openai_error(r, 400, code="invalid_json")
    assert "JSON" in err["message"]
    assert_openai_error(c.post("/v1/completions", content=b""), 400, code="invalid_json")
    assert_openai_error(c.post("/v1/completions", content=b"[1]"), 400, code="invalid_json")


def test_validation_is_400_not_422(c):
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": MSG, "temperature": 5})
    err = assert_openai_error(r, 400, param="temperature")
    assert "'temperature'" in err["message"]
    r = c.post("/v1/completions", json={"model": "m"})
    assert_openai_error(r, 400, param="prompt", code="missing_required_parameter")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "presence_penalty": 2.5},
            "presence_penalty",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "min_p": 1.5}, "min_p"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "repetition_penalty": 0},
            "repetition_penalty",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "n": 9}, "n"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "function", "name": "f", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
        ),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "guided_json": "{"},
            "guided_json",
        ),
        (
            "/v1/responses",
            {"model": "m", "input": "x", "previous_response_id": "r"},
            "previous_response_id",
        ),
        ("/v1/responses", {"model": "m", "input": [{"type": "input_image"}]}, "input[0].type"),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
            "messages[0].content[0].type",
        ),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "logit_bias": {"1": 500}},
            "logit_bias.1",
        ),
        ("/v1/completions", {"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
        ("/tokenize", {"model": "m"}, "prompt"),
        ("/v1/tokenize", {"model": "m", "prompt": "x", "messages": MSG}, "messages"),
        ("/detokenize", {"model": "m", "tokens": [-1]}, "tokens[0]"),
    ],
)
def test_rejected_before_the_engine(c, path, body, param):
    err = assert_openai_error(c.post(path, json=body), 400, param=param)
    assert param.split("[")[0] in err["message"]


def test_body_too_large_413():
    c = client(max_body_bytes=2048)
    big = {"model": "m", "prompt": "x" * 5000}
    assert_openai_error(c.post("/v1/completions", json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: counted while reading
        for _ in range(10):
            yield b" " * 1000

    r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_api_keys():
    c = client(api_keys=["key-one", "key-two"])
    err = assert_openai_error(c.get("/v1/models"), 401, code="invalid_api_key")
    assert "API key" in err["message"]
    r = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
    err = assert_openai_error(r, 401, code="invalid_api_key")
    assert "nope" not in err["message"]  # keys are not echoed
    assert_openai_error(c.get("/v1/models", headers={"Authorization": "Basic key-one"}), 401)
    # An accepted key gets past auth (then fails validation, still without the engine).
    for key in ("key-one", "key-two"):
        r = c.post(
            "/v1/completions", json={"model": "m"}, headers={"Authorization": f"Bearer {key}"}
        )
        assert_openai_error(r, 400, param="prompt")
    # Unknown /v1 routes are behind auth too; /metrics is open by default.
    assert_openai_error(c.get("/v1/unknown"), 401)
    assert c.get("/metrics").status_code == 200


def test_metrics_can_require_auth():
    c = client(api_keys=["k"], metrics_require_auth=True)
    assert_openai_error(c.get("/metrics"), 401)
    assert c.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


def test_request_id_echoed_or_generated(c):
    r = c.get("/v1/nothing", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = c.get("/v1/nothing")
    assert len(r.headers["x-request-id"]) == 32
    r = c.get("/v1/nothing", headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"] != "bad id\twith spaces"


def test_metrics_count_http_requests(c):
    c.get("/v1/nothing")
    c.post("/v1/completions", json={"model": "m"})
    text = c.get("/metrics").text
    assert 'markbase_http_requests_total{method="GET",route="unmatched",status="404"}' in text
    assert (
        'markbase_http_requests_total{method="POST",route="/v1/completions",status="400"}' in text
    )
    assert "markbase_http_request_duration_seconds_bucket" in text


def test_access_log_line_has_no_keys(caplog):
    c = client(api_keys=["secret-key-xyz"])
    with caplog.at_level("INFO", logger="markbase.access"):
        c.post(
            "/v1/completions",
            json={"model": "m"},
            headers={"Authorization": "Bearer secret-key-xyz", "x-request-id": "rid-1"},
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "markbase.access"]
    assert any('"request_id":"rid-1"' in line and '"status":400' in line for line in lines), lines
    assert not any("secret-key-xyz" in line for line in lines)


def test_cors_preflight_passes_auth():
    c = client(api_keys=["k"], cors_origins=["http://localhost:3000"])
    r = c.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = c.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 401  # the real request still needs the key
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
