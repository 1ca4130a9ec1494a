"""The OpenAI API end to end: a real ``markbase serve`` subprocess with the
default model (SmolLM2-135M-Instruct on CPU), spoken to with raw httpx and with
the unmodified ``openai`` SDK. One server for the whole module, started with an
API key so auth is exercised on every call. Generations are kept short."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with running_server(DEFAULT_MODEL, "--max-num-seqs", "8", api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def sse_events(r: httpx.Response) -> list:
    """Parsed ``data:`` payloads of an SSE response; ``[DONE]`` as the string."""
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(r: httpx.Response, status: int, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


def same_usage(a: dict, b: dict) -> bool:
    """Token counts equal; the cached count may differ (the first request fills
    the prefix cache the second one reads)."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    cached = a["prompt_tokens_details"]["cached_tokens"]
    return all(a[k] == b[k] for k in keys) and 0 <= cached <= a["prompt_tokens"]


def generated_tokens(http: httpx.Client) -> float:
    """The engine's counter of generated tokens, all models."""
    text = http.get("/metrics").text
    values = re.findall(r"^markbase_generation_tokens_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in values)


def assert_generation_stops(http: httpx.Client, started_at: float, budget: int) -> None:
    """After a client left, the engine stops generating for it within a second:
    the token counter stops growing, far short of the request's budget."""
    time.sleep(1.0)
    a = generated_tokens(http)
    time.sleep(1.5)
    b = generated_tokens(http)
    assert b == a, f"still generating: {b - a:.0f} tokens in 1.5 s after the client left"
    assert b - started_at < budget / 4


# --------------------------------------------------------------------------- models, health


def test_models_list(http, sdk, model):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == DEFAULT_MODEL == model
    assert card["object"] == "model" and card["owned_by"] == "markbase"
    assert isinstance(card["created"], int)
    assert [m.id for m in sdk.models.list()] == [model]
    assert sdk.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_health_and_metrics_need_no_key(server, http):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    assert "markbase_http_requests_total" in text and "markbase_num_requests_running" in text


def test_auth(server, model):
    url = server.v1 + "/models"
    assert_error(httpx.get(url), 401, "invalid_api_key")
    assert_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    bad = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)


# --------------------------------------------------------------------------- chat


def test_chat_capital_of_france(sdk, model):
    r = sdk.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=30)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == model
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream(http, model):
    req = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 20}
    full = http.post("/v1/chat/completions", json=req).json()
    r = http.post(
        "/v1/chat/completions",
        json={**req, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith(
        "chatcmpl-"
    )
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert {c["model"] for c in chunks} == {model}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert same_usage(usage_chunk["usage"], full["usage"])
    body = chunks[:-1]
    assert all(c["usage"] is None for c in body)
    assert body[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in body)
    assert text == full["choices"][0]["message"]["content"]


def test_chat_stream_with_sdk(sdk, model):
    stream = sdk.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    finish = chunks[-2].choices[0].finish_reason
    assert finish in ("stop", "length")
    if finish == "length":
        assert chunks[-1].usage.completion_tokens == 12


def test_chat_message_forms(http, model):
    messages = [
        {"role": "developer", "content": "You are a geography expert. Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": messages,
            "temperature": 0,
            "max_completion_tokens": 8,
            "user": "u-1",
            "some_future_field": True,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 8
    assert_error(
        http.post("/v1/chat/completions", json={"model": model, "messages": []}), 400, "empty_array"
    )
    r = http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "function", "name": "f", "content": "x"}]},
    )
    assert "function" in assert_error(r, 400)["message"]


# --------------------------------------------------------------------------- completions


def test_completion_text_and_token_prompts(http, sdk, model):
    r = sdk.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    ids = [504, 3575, 282, 4649, 314]  # any valid ids: prompt_tokens must equal their number
    body = http.post(
        "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 3, "temperature": 0}
    ).json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    two = http.post(
        "/v1/completions",
        json={"model": model, "prompt": [ids, ids[:3]], "max_tokens": 2, "temperature": 0},
    ).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["prompt_tokens"] == len(ids) + 3
    if all(c["finish_reason"] == "length" for c in two["choices"]):
        assert two["usage"]["completion_tokens"] == 4
    assert two["usage"]["completion_tokens"] <= 4


def test_completion_stream(http, model):
    req = {"model": model, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    full = http.post("/v1/completions", json=req).json()
    r = http.post(
        "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("cmpl-")
    assert chunks[-1]["choices"] == [] and same_usage(chunks[-1]["usage"], full["usage"])
    assert chunks[-2]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full["choices"][0]["text"]


def test_max_tokens_gives_length(http, sdk, model):
    r = sdk.completions.create(
        model=model, prompt="Write a long story about a dragon:", max_tokens=5, temperature=0
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_completion_tokens=4,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


# --------------------------------------------------------------------------- stop strings


def test_stop_strings(http, model):
    req = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    full = http.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    assert len(full) >= 12, full
    # A stop string that starts inside one token and ends inside another.
    stop = full[5:10]
    expected = full[: full.find(stop)]
    r = http.post("/v1/chat/completions", json={**req, "stop": [stop, "zzzz-never"]}).json()
    assert r["choices"][0]["message"]["content"] == expected
    assert r["choices"][0]["finish_reason"] == "stop"
    events = sse_events(
        http.post("/v1/chat/completions", json={**req, "stop": stop, "stream": True})
    )
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    assert text == expected and stop not in text
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert_error(
        http.post("/v1/chat/completions", json={**req, "stop": ["a", "b", "c", "d", "e"]}), 400
    )


# --------------------------------------------------------------------------- n, seeds


def test_seed_reproducible(sdk, model):
    def ask(seed):
        return (
            sdk.completions.create(
                model=model,
                prompt="My favourite animal is",
                max_tokens=8,
                temperature=1.0,
                seed=seed,
            )
            .choices[0]
            .text
        )

    first = ask(1234)
    assert ask(1234) == first
    others = {ask(s) for s in (1, 2)}
    assert len(others | {first}) > 1  # different seeds do sample differently


@pytest.mark.parametrize("n", [2, 3])
def test_n_choices(http, sdk, model, n):
    req = {
        "model": model,
        "messages": QUESTION,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "n": n,
    }
    a = http.post("/v1/chat/completions", json=req).json()
    assert [c["index"] for c in a["choices"]] == list(range(n))
    texts = [c["message"]["content"] for c in a["choices"]]
    assert len(set(texts)) > 1  # seed + i per choice: they differ...
    b = http.post("/v1/chat/completions", json=req).json()
    assert [c["message"]["content"] for c in b["choices"]] == texts  # ...and reproduce
    if all(c["finish_reason"] == "length" for c in a["choices"]):
        assert a["usage"]["completion_tokens"] == 6 * n
    assert a["usage"]["completion_tokens"] <= 6 * n
    events = sse_events(http.post("/v1/chat/completions", json={**req, "stream": True}))
    assert events[-1] == "[DONE]"
    streamed = {i: "" for i in range(n)}
    roles = set()
    for e in events[:-1]:
        for c in e["choices"]:
            if c["delta"].get("role"):
                roles.add(c["index"])
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert roles == set(range(n))
    assert [streamed[i] for i in range(n)] == texts
    r = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, n=n, seed=3)
    assert len(r.choices) == n
    assert_error(http.post("/v1/chat/completions", json={**req, "n": 99}), 400)


# --------------------------------------------------------------------------- errors


def test_context_overflow(http, sdk, model):
    ctx = http.get(f"/v1/models/{model}").json()["context_length"]
    r = http.post("/v1/completions", json={"model": model, "prompt": [504] * (ctx + 5)})
    err = assert_error(r, 400, "context_length_exceeded")
    assert str(ctx) in err["message"] and str(ctx + 5) in err["message"]
    r = http.post(
        "/v1/chat/completions", json={"model": model, "messages": QUESTION, "max_tokens": ctx}
    )
    err = assert_error(r, 400, "context_length_exceeded")
    assert f"maximum context length is {ctx} tokens" in err["message"]
    assert f"{ctx} in the completion" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=model, prompt="hi", max_tokens=ctx + 1)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_404(http, sdk):
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": QUESTION})
    assert_error(r, 404, "model_not_found")
    assert_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=QUESTION)


def test_bad_params_400(http, sdk, model):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=QUESTION, temperature=3)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=QUESTION, presence_penalty=2.5)
    assert info.value.param == "presence_penalty"
    r = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": "3"})
    assert assert_error(r, 400)["param"] == "max_tokens"
    r = http.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert_error(http.get("/v1/does-not-exist"), 404)
    assert_error(http.delete("/v1/completions"), 405)


def test_request_id(http, model):
    r = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"x-request-id": "my-id-42"},
    )
    assert r.headers["x-request-id"] == "my-id-42"
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


# --------------------------------------------------------------------------- disconnects


def test_stream_disconnect_aborts_generation(server, http, model):
    budget = 2000
    req = {
        "model": model,
        "prompt": "Count from one to one thousand:",
        "max_tokens": budget,
        "ignore_eos": True,  # extension: never finish early, so only the disconnect can stop it
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = generated_tokens(http)
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=req) as r:
            data_lines = 0
            for line in r.iter_lines():
                data_lines += line.startswith("data: ")
                if data_lines >= 3:
                    break
    assert_generation_stops(http, before, budget)


def test_non_stream_disconnect_aborts_generation(server, http, model):
    budget = 2000
    req = {
        "model": model,
        "prompt": "Count from one to one thousand:",
        "max_tokens": budget,
        "ignore_eos": True,  # extension: never finish early, so only the disconnect can stop it
        "temperature": 0,
    }
    before = generated_tokens(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/completions", json=req, headers=server.headers(), timeout=1.5)
    assert_generation_stops(http, before, budget)
