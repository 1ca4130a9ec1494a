"""A corpus of bad input, sent to a real ``markbase serve`` WHILE two greedy
streams are running; then those streams must have completed with exactly the
text they produce alone, and the server must still answer a normal request
correctly, hold no sequence or KV reservation, have logged every request
(request id, status) and never the API key.

Every corpus entry says what must come back: the status, and for 4xx the
OpenAI error body's ``param``/``code`` and words of its message (a limit's
message names the limit and its value). Entries that are valid but odd (NUL
in content, seed -1, huge top_k) reach the engine with max_tokens 1; clients
that drop mid-stream, mid-request or mid-upload are in the corpus too.

The server runs with small limits (a 256-token context, 2000 prompt characters,
8 messages, max_tokens <= 128, n <= 2, 64 KiB bodies) so every limit is hit
cheaply."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import pytest

from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

M = DEFAULT_MODEL
API_KEY = "corpus-secret-key-7f3a"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 256
LIMITS = {
    "--max-context": CONTEXT,
    "--max-tokens-limit": 128,
    "--max-n": 2,
    "--max-prompts": 4,
    "--max-messages": 8,
    "--max-prompt-chars": 2000,
    "--max-body-bytes": 65536,
    "--max-num-seqs": 8,
}
HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def chat(**kw) -> dict:
    return {"model": M, "messages": HI, "max_tokens": 1, **kw}


def cmpl(**kw) -> dict:
    return {"model": M, "prompt": "Hi", "max_tokens": 1, **kw}


def raw(text: str) -> bytes:
    """Bytes as they are (JSON no serializer would write); $M is the model id."""
    return text.replace("$M", M).encode()


@dataclass
class Bad:
    name: str
    path: str
    body: dict | bytes | None = None  # dict: sent as JSON; bytes: as they are
    status: int = 400
    param: str | None = None
    code: str | None = None
    says: str | None = None  # words of the error message
    method: str = "POST"
    headers: dict = field(default_factory=dict)
    auth: bool = True


def _corpus() -> list[Bad]:
    c: list[Bad] = []
    add = c.append
    # ---- malformed JSON
    for name, body in [
        ("truncated", b'{"model": "m", "messages": ['),
        ("trailing garbage", raw(json.dumps(cmpl()) + " xyz")),
        ("single quotes", b"{'model': 'm'}"),
        ("bare word", b"hello"),
        ("utf-8 BOM", b"\xef\xbb\xbf" + raw(json.dumps(cmpl()))),
        ("deep nesting", b"[" * 30_000 + b"]" * 30_000),
        (
            "5000-digit integer",
            raw('{"model":"$M","prompt":"Hi","max_tokens":1' + "0" * 5000 + "}"),
        ),
        ("lone surrogate", raw('{"model":"$M","prompt":"\\ud800","max_tokens":1}')),
        ("NUL byte outside a string", b'{"model": "m",\x00 "prompt": "x"}'),
    ]:
        add(Bad(f"malformed JSON: {name}", CMPL, body, code="invalid_json", says="JSON"))
    add(Bad("empty body", CHAT, b"", code="invalid_json", says="empty"))
    add(Bad("whitespace body", CHAT, b"  \n ", code="invalid_json", says="empty"))
    for name, body in [("array", b"[]"), ("null", b"null"), ("string", b'"hi"'), ("number", b"5")]:
        add(Bad(f"non-object body: {name}", CHAT, body, code="invalid_json", says="JSON object"))
    # ---- invalid UTF-8 (raw bytes inside a JSON string)
    for name, bad in [
        ("0xFF byte", b"\xff\xfe"),
        ("overlong encoding", b"\xc0\xaf"),
        ("truncated sequence", b"\xe2\x82"),
        ("UTF-16 surrogate as UTF-8", b"\xed\xa0\x80"),
    ]:
        body = b'{"model":"%s","messages":[{"role":"user","content":"a%sb"}]}' % (M.encode(), bad)
        add(Bad(f"invalid UTF-8: {name}", CHAT, body, code="invalid_json"))
    # ---- wrong types
    for name, body, param in [
        ("model is a number", chat(model=123), "model"),
        ("messages is a string", chat(messages="hi"), "messages"),
        ("message is a string", chat(messages=["hi"]), "messages[0]"),
        (
            "content is a number",
            chat(messages=[{"role": "user", "content": 5}]),
            "messages[0].content",
        ),
        (
            "content part text is a number",
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
            "messages[0].content[0].text",
        ),
        ("max_tokens is a string", chat(max_tokens="5"), "max_tokens"),
        ("max_tokens is a float", chat(max_tokens=5.5), "max_tokens"),
        ("max_tokens is a boolean", chat(max_tokens=True), "max_tokens"),
        ("temperature is a string", chat(temperature="hot"), "temperature"),
        ("stream is a string", chat(stream="yes"), "stream"),
        ("stream_options is a string", chat(stream_options="x"), "stream_options"),
        ("stop is a number", chat(stop=5), "stop"),
        ("stop has a number", chat(stop=["a", 5]), "stop[1]"),
        ("n is a string", chat(n="2"), "n"),
        ("seed is a float", chat(seed=1.5), "seed"),
        ("logit_bias is a list", chat(logit_bias=[1]), "logit_bias"),
    ]:
        add(Bad(f"wrong type: {name}", CHAT, body, param=param, says=f"'{param}'"))
    for name, body, param in [
        ("prompt is an object", cmpl(prompt={"a": 1}), "prompt"),
        ("prompt mixes ints and strings", cmpl(prompt=[1, "a"]), "prompt"),
        ("prompt is a float list", cmpl(prompt=[1.5]), "prompt"),
        ("stop_token_ids are strings", cmpl(stop_token_ids=["a"]), "stop_token_ids[0]"),
    ]:
        add(Bad(f"wrong type: {name}", CMPL, body, param=param))
    # ---- missing / empty
    add(
        Bad(
            "missing model",
            CHAT,
            {"messages": HI},
            param="model",
            code="missing_required_parameter",
        )
    )
    add(
        Bad(
            "missing messages",
            CHAT,
            {"model": M},
            param="messages",
            code="missing_required_parameter",
        )
    )
    add(
        Bad("missing prompt", CMPL, {"model": M}, param="prompt", code="missing_required_parameter")
    )
    add(Bad("empty messages", CHAT, chat(messages=[]), param="messages", code="empty_array"))
    add(
        Bad(
            "empty message object",
            CHAT,
            chat(messages=[{}]),
            param="messages[0].role",
            code="missing_required_parameter",
        )
    )
    add(
        Bad(
            "user message without content",
            CHAT,
            chat(messages=[{"role": "user"}]),
            param="messages[0].content",
        )
    )
    add(
        Bad(
            "user message with null content",
            CHAT,
            chat(messages=[{"role": "user", "content": None}]),
            param="messages[0].content",
        )
    )
    add(Bad("empty prompt string", CMPL, cmpl(prompt=""), param="prompt", says="empty"))
    add(Bad("empty prompt array", CMPL, cmpl(prompt=[]), param="prompt", code="empty_array"))
    add(Bad("empty token prompt", CMPL, cmpl(prompt=[[]]), param="prompt", says="empty"))
    add(
        Bad(
            "one empty prompt of two",
            CMPL,
            cmpl(prompt=["Hi", ""]),
            param="prompt",
            says="prompt[1]",
        )
    )
    add(
        Bad(
            "image content part",
            CHAT,
            chat(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            ),
            param="messages[0].content[0].type",
        )
    )
    # ---- invalid roles
    for role in ["robot", "", "USER", None, 5]:
        add(
            Bad(
                f"invalid role {role!r}",
                CHAT,
                chat(messages=[{"role": role, "content": "x"}]),
                param="messages[0].role",
            )
        )
    add(
        Bad(
            "function role (deprecated)",
            CHAT,
            chat(messages=[{"role": "function", "name": "f", "content": "x"}]),
            param="messages[0].role",
            says="function",
        )
    )
    add(
        Bad(
            "second message bad role",
            CHAT,
            chat(messages=[*HI, {"role": "wizard", "content": "x"}]),
            param="messages[1].role",
        )
    )
    # ---- huge numbers
    for name, body, path, param in [
        ("max_tokens 10**30", chat(max_tokens=10**30), CHAT, "max_tokens"),
        (
            "max_tokens 1e400 (inf)",
            raw('{"model":"$M","prompt":"Hi","max_tokens":1e400}'),
            CMPL,
            "max_tokens",
        ),
        ("n 10**30", chat(n=10**30), CHAT, "n"),
        ("seed 10**30", chat(seed=10**30), CHAT, "seed"),
        ("seed 2**63", chat(seed=2**63), CHAT, "seed"),
        ("temperature 1e308", chat(temperature=1e308), CHAT, "temperature"),
        (
            "temperature NaN",
            raw('{"model":"$M","prompt":"Hi","temperature":NaN}'),
            CMPL,
            "temperature",
        ),
        ("top_p Infinity", raw('{"model":"$M","prompt":"Hi","top_p":Infinity}'), CMPL, "top_p"),
        ("logit_bias 1e308", cmpl(logit_bias={"1": 1e308}), CMPL, "logit_bias.1"),
        ("token id 10**30", cmpl(prompt=[10**30]), CMPL, "prompt"),
        ("token id past the vocabulary", cmpl(prompt=[49152]), CMPL, "prompt"),
        (
            "max_completion_tokens 2**64",
            chat(max_completion_tokens=2**64),
            CHAT,
            "max_completion_tokens",
        ),
        ("logprobs 10**9", cmpl(logprobs=10**9), CMPL, "logprobs"),
    ]:
        add(Bad(f"huge number: {name}", path, body, param=param))
    # ---- negative values
    for name, body, path, param in [
        ("max_tokens -1", chat(max_tokens=-1), CHAT, "max_tokens"),
        ("max_tokens 0", chat(max_tokens=0), CHAT, "max_tokens"),
        ("max_completion_tokens -5", chat(max_completion_tokens=-5), CHAT, "max_completion_tokens"),
        ("n 0", chat(n=0), CHAT, "n"),
        ("n -1", chat(n=-1), CHAT, "n"),
        ("temperature -1", chat(temperature=-1), CHAT, "temperature"),
        ("top_p -0.5", chat(top_p=-0.5), CHAT, "top_p"),
        ("top_p 0", chat(top_p=0), CHAT, "top_p"),
        ("top_k -2", chat(top_k=-2), CHAT, "top_k"),
        ("stop_token_ids [-1]", cmpl(stop_token_ids=[-1]), CMPL, "stop_token_ids[0]"),
        ("token id -1", cmpl(prompt=[-1]), CMPL, "prompt"),
        ("presence_penalty -3", chat(presence_penalty=-3), CHAT, "presence_penalty"),
        ("seed -2**63-1", chat(seed=-(2**63) - 1), CHAT, "seed"),
    ]:
        add(Bad(f"negative value: {name}", path, body, param=param))
    # ---- over the context window (256 tokens here)
    long_text = "hello " * 330  # ~330 tokens in under 2000 characters
    add(
        Bad(
            "token prompt over the context",
            CMPL,
            cmpl(prompt=[504] * (CONTEXT + 5)),
            param="prompt",
            code="context_length_exceeded",
            says=f"maximum context length is {CONTEXT}",
        )
    )
    add(
        Bad(
            "text prompt over the context",
            CMPL,
            cmpl(prompt=long_text),
            param="prompt",
            code="context_length_exceeded",
        )
    )
    add(
        Bad(
            "chat over the context",
            CHAT,
            chat(messages=[{"role": "user", "content": long_text}]),
            param="messages",
            code="context_length_exceeded",
        )
    )
    add(
        Bad(
            "prompt + max_tokens over the context",
            CMPL,
            cmpl(prompt=[504] * 200, max_tokens=64),
            param="prompt",
            code="context_length_exceeded",
            says="264 tokens",
        )
    )
    # ---- unknown model
    for name, model in [
        ("nope", "nope"),
        ("empty", ""),
        ("10k chars", "m" * 10_000),
        ("unicode", "模型-🚀"),
        ("path-like", "../../etc/passwd"),
    ]:
        add(
            Bad(
                f"unknown model: {name}",
                CHAT,
                chat(model=model),
                status=404,
                param="model",
                code="model_not_found",
            )
        )
    add(
        Bad(
            "unknown model (completions)",
            CMPL,
            cmpl(model="nope"),
            status=404,
            code="model_not_found",
        )
    )
    add(
        Bad(
            "unknown model card",
            "/v1/models/nope",
            method="GET",
            status=404,
            code="model_not_found",
        )
    )
    # ---- stop lists
    add(Bad("stop list of 5", CHAT, chat(stop=list("abcde")), param="stop", says="at most 4"))
    add(Bad("stop list of 1000", CMPL, cmpl(stop=["x"] * 1000), param="stop", says="at most 4"))
    # ---- unsupported parameters at non-neutral values
    for name, body, path, param in [
        ("functions", chat(functions=[{"name": "f"}]), CHAT, "functions"),
        ("top_logprobs without logprobs", chat(top_logprobs=3), CHAT, "top_logprobs"),
        ("suffix", cmpl(suffix="x"), CMPL, "suffix"),
        ("best_of 3", cmpl(best_of=3), CMPL, "best_of"),
    ]:
        add(Bad(f"unsupported: {name}", path, body, param=param, code="unsupported_parameter"))
    # ---- structured output and tools the server cannot honour
    bad_schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    add(
        Bad(
            "json_schema with an unsupported keyword",
            CHAT,
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": bad_schema},
                }
            ),
            param="response_format",
            code="invalid_grammar",
            says="not",
        )
    )
    add(
        Bad("guided_regex that does not parse", CMPL, cmpl(guided_regex="(("), param="guided_regex")
    )
    weather = {"type": "function", "function": {"name": "get_weather"}}
    add(
        Bad(
            "tool_choice names a missing function",
            CHAT,
            chat(tools=[weather], tool_choice={"type": "function", "function": {"name": "nope"}}),
            param="tool_choice",
            says="nope",
        )
    )
    add(
        Bad(
            "tool parameters with an unsupported keyword",
            CHAT,
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": bad_schema}}]),
            param="tools",
            code="invalid_grammar",
        )
    )
    add(
        Bad(
            "responses with previous_response_id",
            "/v1/responses",
            {"model": M, "input": "hi", "previous_response_id": "resp_1"},
            param="previous_response_id",
        )
    )
    # ---- sampling values the model decides
    for name, body, path, says in [
        ("logit_bias id past the vocabulary", cmpl(logit_bias={"49152": 1}), CMPL, "49152"),
        ("logit_bias key not an id", chat(logit_bias={"hello": 1}), CHAT, "hello"),
        ("logit_bias negative id", chat(logit_bias={"-5": 1}), CHAT, "-5"),
        ("min_tokens over max_tokens", chat(min_tokens=5, max_tokens=2), CHAT, "min_tokens"),
    ]:
        param = "min_tokens" if "min_tokens" in name else "logit_bias"
        add(Bad(f"sampling: {name}", path, body, param=param, code="invalid_value", says=says))
    # ---- the server's limits: each names itself and its value
    add(
        Bad(
            "limit: max_tokens",
            CHAT,
            chat(max_tokens=129),
            param="max_tokens",
            says="at most 128 tokens",
        )
    )
    add(
        Bad(
            "limit: max_completion_tokens",
            CHAT,
            chat(max_completion_tokens=200),
            param="max_completion_tokens",
            says="at most 128 tokens",
        )
    )
    add(
        Bad(
            "limit: max_tokens (completions)",
            CMPL,
            cmpl(max_tokens=129),
            param="max_tokens",
            says="at most 128 tokens",
        )
    )
    add(Bad("limit: n", CHAT, chat(n=3), param="n", says="at most 2 choices"))
    add(
        Bad(
            "limit: prompts", CMPL, cmpl(prompt=["a"] * 5), param="prompt", says="at most 4 prompts"
        )
    )
    add(
        Bad(
            "limit: messages",
            CHAT,
            chat(messages=HI * 9),
            param="messages",
            says="at most 8 messages",
        )
    )
    add(
        Bad(
            "limit: prompt characters (chat)",
            CHAT,
            chat(
                messages=[
                    {"role": "user", "content": "x" * 1500},
                    {"role": "user", "content": "y" * 501},
                ]
            ),
            param="messages",
            says="at most 2000 characters",
        )
    )
    add(
        Bad(
            "limit: prompt characters (completions)",
            CMPL,
            cmpl(prompt=["x" * 1000, "y" * 1001]),
            param="prompt",
            says="at most 2000 characters",
        )
    )
    add(
        Bad(
            "limit: body size",
            CMPL,
            cmpl(prompt="x" * 70_000),
            status=413,
            code="request_too_large",
            says="65536 bytes",
        )
    )
    # ---- HTTP level
    add(Bad("no API key", CHAT, chat(), status=401, code="invalid_api_key", auth=False))
    add(
        Bad(
            "wrong API key",
            CHAT,
            chat(),
            status=401,
            code="invalid_api_key",
            auth=False,
            headers={"Authorization": "Bearer nope"},
        )
    )
    add(
        Bad(
            "Basic auth",
            "/v1/models",
            method="GET",
            status=401,
            auth=False,
            headers={"Authorization": f"Basic {API_KEY}"},
        )
    )
    add(Bad("GET on a POST route", CHAT, method="GET", status=405, code="method_not_allowed"))
    add(Bad("unknown route", "/v1/engines", method="GET", status=404, code="unknown_url"))
    add(
        Bad(
            "form content type",
            CMPL,
            b"model=x&prompt=y",
            headers={"content-type": "application/x-www-form-urlencoded"},
            code="invalid_json",
        )
    )
    # ---- valid but odd: must be answered 200 (each reaches the engine for one token)
    for name, body, path in [
        ("unknown fields are ignored", cmpl(some_future_field={"a": [1]}, foo=None), CMPL),
        (
            "NUL and control characters in content",
            chat(messages=[{"role": "user", "content": "a\u0000b\u0007c\u202e"}]),
            CHAT,
        ),
        ("empty content", chat(messages=[{"role": "user", "content": ""}]), CHAT),
        ("seed -1", cmpl(seed=-1, temperature=1.0), CMPL),
        ("seed 2**63-1 with n=2", cmpl(seed=2**63 - 1, temperature=1.0, n=2), CMPL),
        ("top_k 3e9", cmpl(top_k=3_000_000_000, temperature=1.0), CMPL),
        ("temperature 5e-324", cmpl(temperature=5e-324), CMPL),
        ("stop_token_ids 10**30", cmpl(stop_token_ids=[10**30]), CMPL),
        (
            "duplicate keys",
            raw('{"model":"nope","model":"$M","prompt":"Hi","max_tokens":1}'),
            CMPL,
        ),
        ("text/plain content type", cmpl(), CMPL),
        (
            "every penalty at its extreme, min_p 1, a +-100 bias",
            chat(
                temperature=1.0,
                frequency_penalty=-2,
                presence_penalty=2,
                repetition_penalty=10,
                min_p=1.0,
                min_tokens=1,
                logit_bias={"0": 100, "1": -100},
            ),
            CHAT,
        ),
        (
            "min_tokens with stop_token_ids 10**30",
            cmpl(min_tokens=1, stop_token_ids=[10**30]),
            CMPL,
        ),
        ("echo with logprobs 5", cmpl(echo=True, logprobs=5), CMPL),
        ("top_logprobs 20", chat(logprobs=True, top_logprobs=20), CHAT),
    ]:
        headers = {"content-type": "text/plain"} if "text/plain" in name else {}
        add(Bad(f"valid: {name}", path, body, status=200, headers=headers))
    return c


CORPUS = _corpus()


# --------------------------------------------------------------------------- shared checks


def send(client: httpx.Client, i: int, bad: Bad) -> httpx.Response:
    headers = {"x-request-id": f"corpus-{i}", **(AUTH if bad.auth else {}), **bad.headers}
    kwargs: dict = {"headers": headers}
    if isinstance(bad.body, dict):
        kwargs["content"] = json.dumps(bad.body).encode()
        headers.setdefault("content-type", "application/json")
    elif isinstance(bad.body, bytes):
        kwargs["content"] = bad.body
        headers.setdefault("content-type", "application/json")
    return client.request(bad.method, bad.path, **kwargs)


def check(bad: Bad, r: httpx.Response) -> str | None:
    """What is wrong with the answer to ``bad``, or None."""
    if r.status_code != bad.status:
        return f"status {r.status_code}, expected {bad.status}: {r.text[:300]}"
    if bad.status == 200:
        body = r.json()
        ok = all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
        return None if ok and body["usage"]["completion_tokens"] >= 1 else f"bad answer {body}"
    try:
        err = r.json()["error"]
    except (ValueError, KeyError):
        return f"not an OpenAI error body: {r.text[:300]}"
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}"
    if bad.param is not None and err["param"] != bad.param:
        return f"param {err['param']!r}, expected {bad.param!r}: {err['message']}"
    if bad.code is not None and err["code"] != bad.code:
        return f"code {err['code']!r}, expected {bad.code!r}: {err['message']}"
    if bad.says is not None and bad.says not in err["message"]:
        return f"message {err['message']!r} lacks {bad.says!r}"
    return None


class Stream(threading.Thread):
    """Reads one SSE stream to the end, noting when each chunk came."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, {**body, "stream": True}
        self.text = ""
        self.finish: str | None = None
        self.errors: list = []
        self.done = False
        self.chunk_times: list[float] = []
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, headers=AUTH, timeout=300) as c:
                with c.stream("POST", self.path, json=self.body) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[len("data: ") :]
                        if payload == "[DONE]":
                            self.done = True
                            continue
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            self.errors.append(chunk["error"])
                            continue
                        self.chunk_times.append(time.monotonic())
                        for ch in chunk["choices"]:
                            self.text += (
                                ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                            )
                            self.finish = ch.get("finish_reason") or self.finish
                        if self.text:
                            self.started.set()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(exc))
        finally:
            self.started.set()


def drop_mid_stream(url: str) -> str:
    body = {
        "model": M,
        "prompt": "Count to one hundred:",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(
        base_url=url, headers={**AUTH, "x-request-id": "drop-stream"}, timeout=60
    ) as c:
        with c.stream("POST", CMPL, json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines >= 2:
                    break
    return "dropped after 2 chunks"


def drop_waiting(url: str) -> str:
    body = {"model": M, "prompt": "Count to one hundred:", "max_tokens": 64, "ignore_eos": True}
    headers = {**AUTH, "x-request-id": "drop-plain"}
    try:
        httpx.post(url + CMPL, json=body, headers=headers, timeout=0.5)
    except httpx.TimeoutException:
        return "gave up after 0.5 s"
    return "answered within 0.5 s"


def raw_socket(url: str, data: bytes, read: bool) -> str:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(data)
        if not read:
            return "closed without reading"
        try:
            reply = s.recv(200)
        except (TimeoutError, ConnectionError) as exc:
            return f"no reply ({exc!r})"
    status = reply.split(b"\r\n", 1)[0].decode(errors="replace")
    assert b" 5" not in status[:13].encode(), status  # HTTP/1.1 5xx
    return status


def raw_cases(url: str) -> list[tuple[str, bytes, bool]]:
    host = urlparse(url).netloc
    body = json.dumps(cmpl(max_tokens=30, ignore_eos=True)).encode()
    head = (
        f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\n"
    )
    return [
        (
            "request sent, client gone before the answer",
            (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body,
            False,
        ),
        (
            "half the body, then gone",
            (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body[:10],
            False,
        ),
        ("headers only, then gone", (head + "Content-Length: 100\r\n\r\n").encode(), False),
        ("Content-Length not a number", (head + "Content-Length: abc\r\n\r\n{}").encode(), True),
        ("negative Content-Length", (head + "Content-Length: -5\r\n\r\n{}").encode(), True),
        ("garbage request line", b"HELLO WORLD\r\n\r\n", True),
        ("HTTP/0.9 style", b"GET /health\r\n\r\n", True),
    ]


# --------------------------------------------------------------------------- the test

REFERENCE_STREAMS = [
    (
        CMPL,
        {
            "model": M,
            "prompt": "Once upon a time, in a small village,",
            "max_tokens": 128,
            "temperature": 0,
            "ignore_eos": True,
        },
    ),
    (
        CHAT,
        {
            "model": M,
            "messages": [{"role": "user", "content": "Write a poem about the sea."}],
            "max_tokens": 128,
            "temperature": 0,
            "ignore_eos": True,
        },
    ),
]


@pytest.fixture(scope="module")
def server():
    flags = [str(x) for kv in LIMITS.items() for x in kv]
    with running_server(M, *flags, api_key=API_KEY) as srv:
        yield srv


def reply_text(body: dict) -> str:
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def test_corpus_while_streams_run(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as c:
        reference = []
        for path, body in REFERENCE_STREAMS:  # alone, one after the other
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            reference.append(reply_text(r.json()))

    streams = [Stream(server.url, path, body) for path, body in REFERENCE_STREAMS]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120), "a stream never started"
    assert not any(s.finish for s in streams), "a stream finished before the corpus began"

    corpus_start = time.monotonic()
    failures, statuses = [], {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for i, bad in enumerate(CORPUS):
            r = send(client, i, bad)
            statuses[f"corpus-{i}"] = r.status_code
            problem = check(bad, r)
            if problem:
                failures.append(f"{bad.name}: {problem}")
            if i == len(CORPUS) // 2:  # the dropping clients, mid-corpus
                extra = [drop_mid_stream(server.url), drop_waiting(server.url)]
                extra += [
                    raw_socket(server.url, data, read) for _, data, read in raw_cases(server.url)
                ]
    corpus_end = time.monotonic()
    n_inputs = len(CORPUS) + 2 + len(raw_cases(server.url))
    print(f"\ncorpus: {n_inputs} inputs in {corpus_end - corpus_start:.1f} s; drops/raw: {extra}")
    assert not failures, "\n".join(failures)
    if not all(s.finish for s in streams):
        print("streams still running after the corpus")

    for s in streams:
        s.join(300)
    for s, ref in zip(streams, reference):
        assert not s.is_alive(), "a stream hung"
        assert not s.errors, s.errors
        assert s.done and s.finish == "length"
        assert s.text == ref, f"stream text changed under the corpus:\n{s.text!r}\n{ref!r}"
        during = [t for t in s.chunk_times if corpus_start <= t <= corpus_end]
        assert during, "the stream made no progress while the corpus ran"

    # A normal request is still answered correctly.
    r = httpx.post(
        server.v1 + "/chat/completions",
        json={
            "model": M,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 10,
        },
        headers=AUTH,
        timeout=120,
    )
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text

    # Nothing is left behind: no sequence, queue entry or KV reservation.
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(server.url + "/health").json()["models"][M]
        idle = all(
            stats[k] == 0 for k in ("running", "prefilling", "waiting", "kv_reserved_tokens")
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, stats

    # Every request was logged as one JSON line with its id and status; never the key.
    log = server.log_path.read_text(errors="replace")
    assert API_KEY not in log
    logged = {}
    for line in log.splitlines():
        if "markbase.access:" in line:
            entry = json.loads(line.split("markbase.access: ", 1)[1])
            assert {
                "request_id",
                "route",
                "status",
                "model",
                "prompt_tokens",
                "duration_ms",
            } <= set(entry)
            logged[entry["request_id"]] = entry["status"]
    missing = {rid: st for rid, st in statuses.items() if logged.get(rid) != st}
    assert not missing, f"not logged as answered: {missing}"
    assert logged.get("drop-stream") == 499 and logged.get("drop-plain") == 499
    assert "unhandled error" not in log and "Traceback" not in log, "the server logged a crash"
