"""Logprobs, penalties and biases, echo, /tokenize and the smaller request fields,
end to end: a real ``markbase serve`` with the default model (SmolLM2-135M-Instruct
on the CPU), spoken to with the unmodified ``openai`` SDK and raw httpx, streaming and
not, alone and inside a mixed batch.

Logprobs are checked against an independent reference: ``log_softmax`` of the same
model's logits from a plain mlx-lm forward pass in this process over the same tokens
(the GGUF's own quantization, ``weight_format="native"``; the server's float32
copy of the same weights agrees to ~1e-5)."""

from __future__ import annotations

import json
import math
import threading

import httpx
import numpy as np
import openai
import pytest

from tests.helpers.models import real_model, sequence_logits
from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

API_KEY = "sampling-key-5"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
HELLO = [{"role": "user", "content": "Repeat the word hello ten times."}]
YES = [{"role": "user", "content": "Say just the word yes."}]
REF_TOL = 2e-3  # server vs in-process reference, nats


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
def ref():
    """The reference model and a bytes -> token id map over its vocabulary."""
    lm = real_model(DEFAULT_MODEL, "native")
    tok = lm.tokenizer
    ids = {}
    for i in range(tok.vocab_size):
        ids.setdefault(tok.token_bytes(i), i)
    return lm, ids


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sse(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]"
    return out[:-1]


def chat(http, messages, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def cmpl(http, prompt, **kw) -> dict:
    r = http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": prompt, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_prompt(http, messages) -> list[int]:
    return http.post("/tokenize", json={"messages": messages}).json()["tokens"]


# --------------------------------------------------------------------------- logprobs


def test_chat_logprobs_are_the_models_log_softmax(http, sdk, ref):
    """Greedy chat with logprobs and top_logprobs 5 through the SDK: OpenAI's shapes;
    the chosen token is the argmax (the first of its top list, same logprob); the top
    list is sorted and 5 long; each logprob is the reference's log_softmax at that
    position; bytes are the token's text; the tokens' text is the content."""
    lm, ids_of = ref
    r = sdk.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=5,
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    gen = []
    for entry in content:
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.token == token_text(bytes(entry.bytes))
        gen.append(ids_of[bytes(entry.bytes)])
    text = b"".join(bytes(e.bytes) for e in content).decode()
    if choice.finish_reason == "stop":  # the end token's text is its own, not content
        assert text == choice.message.content + "<|im_end|>"
    else:
        assert text == choice.message.content
    prompt = chat_prompt(http, FRANCE)
    expect = log_softmax(sequence_logits(lm, prompt + gen[:-1]))
    for j, entry in enumerate(content):
        row = expect[len(prompt) - 1 + j]
        assert int(np.argmax(row)) == gen[j]
        assert abs(entry.logprob - row[gen[j]]) < REF_TOL, (j, entry.token)
        top_ids = [ids_of[bytes(t.bytes)] for t in entry.top_logprobs]
        assert top_ids == np.argsort(-row)[:5].tolist()


def test_chat_logprobs_stream_matches_non_stream(http, sdk):
    req = {
        "model": DEFAULT_MODEL,
        "messages": FRANCE,
        "temperature": 0,
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = http.post("/v1/chat/completions", json=req).json()["choices"][0]
    chunks = sse(http.post("/v1/chat/completions", json={**req, "stream": True}))
    streamed, text = [], ""
    for c in chunks:
        choice = c["choices"][0]
        text += choice["delta"].get("content") or ""
        if choice["logprobs"] is not None:
            assert set(choice["logprobs"]) == {"content", "refusal"}
            streamed += choice["logprobs"]["content"]
    assert text == full["message"]["content"]
    want = full["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in want]
    for a, b in zip(streamed, want):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
    # the SDK parses the streamed entries
    sdk_tokens = []
    for chunk in sdk.chat.completions.create(**req, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            sdk_tokens += [e.token for e in chunk.choices[0].logprobs.content]
    assert sdk_tokens == [e["token"] for e in want]
    # top_logprobs 0 and no logprobs
    zero = chat(http, FRANCE, temperature=0, max_tokens=3, logprobs=True, top_logprobs=0)
    assert all(e["top_logprobs"] == [] for e in zero["choices"][0]["logprobs"]["content"])
    assert chat(http, FRANCE, temperature=0, max_tokens=3)["choices"][0]["logprobs"] is None


def test_completion_logprobs_and_echo(http, sdk, ref):
    """Completions' legacy shape: with echo the prompt's tokens first (the first with
    null), the sampled token always in its top dict (up to logprobs + 1 keys), text
    offsets into the echoed text; the prompt's logprobs are the reference's; the
    stream carries the same lists."""
    lm, _ = ref
    prompt_text = "The capital of France is"
    r = sdk.completions.create(
        model=DEFAULT_MODEL, prompt=prompt_text, max_tokens=6, temperature=0, logprobs=3, echo=True
    )
    c = r.choices[0]
    lp = c.logprobs
    prompt = lm.tokenizer.encode(prompt_text)
    n = len(prompt) + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == n
    assert c.text.startswith(prompt_text) and len(c.text) > len(prompt_text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, value, top, off in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert c.text[off : off + len(tok)] == tok
        if top is not None:
            assert tok in top and top[tok] == value and len(top) <= 4
    expect = log_softmax(sequence_logits(lm, prompt))
    for j in range(1, len(prompt)):
        assert abs(lp.token_logprobs[j] - expect[j - 1][prompt[j]]) < REF_TOL
    # generated part: greedy = the most likely of its top dict
    for top, value in zip(lp.top_logprobs[len(prompt) :], lp.token_logprobs[len(prompt) :]):
        assert value == max(top.values())
    # streamed: the same text and lists, the echo in the first chunk
    req = {
        "model": DEFAULT_MODEL,
        "prompt": prompt_text,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 3,
        "echo": True,
        "stream": True,
    }
    chunks = [ch for ch in sse(http.post("/v1/completions", json=req)) if ch["choices"]]
    assert chunks[0]["choices"][0]["text"].startswith(prompt_text)
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in chunks:
        part = ch["choices"][0]["logprobs"]
        if part:
            for key in got:
                got[key] += part[key]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c.text
    assert got["tokens"] == lp.tokens and got["text_offset"] == lp.text_offset
    assert np.allclose(got["token_logprobs"][1:], lp.token_logprobs[1:], atol=1e-4)
    # echo without logprobs; logprobs without echo (no prompt entries)
    plain = cmpl(http, prompt_text, max_tokens=3, temperature=0, echo=True)["choices"][0]
    assert plain["text"].startswith(prompt_text) and plain["logprobs"] is None
    alone = cmpl(http, prompt_text, max_tokens=3, temperature=0, logprobs=0)["choices"][0]
    assert len(alone["logprobs"]["tokens"]) == 3 and alone["logprobs"]["text_offset"][0] == 0
    assert all(len(t) == 1 for t in alone["logprobs"]["top_logprobs"])
    streamed = sse(http.post("/v1/completions", json={**req, "logprobs": None}))
    assert streamed[0]["choices"][0]["text"] == prompt_text  # the echo chunk comes first


def test_decode_and_prompt_logprobs_agree(http, ref):
    """A chat answer's logprobs (decode steps) and the same tokens scored as an
    echoed prompt (one forward over the prompt) are the same numbers."""
    _, ids_of = ref
    body = chat(http, FRANCE, temperature=0, max_tokens=8, logprobs=True)
    content = body["choices"][0]["logprobs"]["content"]
    gen = [ids_of[bytes(e["bytes"])] for e in content]
    prompt = chat_prompt(http, FRANCE)
    scored = cmpl(http, prompt + gen, max_tokens=1, temperature=0, echo=True, logprobs=0)
    values = scored["choices"][0]["logprobs"]["token_logprobs"][len(prompt) : len(prompt) + 8]
    assert len(values) == len(content)
    assert np.allclose(values, [e["logprob"] for e in content], atol=REF_TOL)


# --------------------------------------------------------------------------- penalties


def repeats(text: str, word: str = "hello") -> int:
    return text.lower().count(word)


def test_penalties_and_bias_change_greedy_text_as_defined(http, sdk):
    base = chat(http, HELLO, temperature=0, max_tokens=30)["choices"][0]["message"]["content"]
    assert repeats(base) >= 10
    for field in (
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 1.8},
    ):
        text = chat(http, HELLO, temperature=0, max_tokens=30, **field)["choices"][0]["message"][
            "content"
        ]
        assert repeats(text) < repeats(base), (field, text)
    # negative frequency penalty keeps (or strengthens) the repetition
    text = chat(http, HELLO, temperature=0, max_tokens=30, frequency_penalty=-1.0)
    assert repeats(text["choices"][0]["message"]["content"]) >= 8

    # logit_bias: -100 bans " Paris", +100 forces a token
    greedy = chat(http, FRANCE, temperature=0, max_tokens=10, logprobs=True)
    paris = next(e for e in greedy["choices"][0]["logprobs"]["content"] if e["token"] == " Paris")
    paris_id = http.post("/tokenize", json={"prompt": " Paris"}).json()["tokens"]
    assert len(paris_id) == 1 and paris["token"] == " Paris"
    banned = sdk.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=10,
        logit_bias={str(paris_id[0]): -100},
        logprobs=True,
    )
    assert " Paris" not in [e.token for e in banned.choices[0].logprobs.content]
    forced = cmpl(
        http, "Hello", max_tokens=4, temperature=0.8, seed=1, logit_bias={str(paris_id[0]): 100}
    )
    assert forced["choices"][0]["text"] == " Paris" * 4


def test_min_tokens_and_min_p(http, sdk):
    short = chat(http, YES, temperature=0, max_tokens=40)
    assert short["choices"][0]["finish_reason"] == "stop"
    assert short["usage"]["completion_tokens"] < 8
    held = chat(http, YES, temperature=0, max_tokens=40, min_tokens=12)
    assert held["usage"]["completion_tokens"] >= 12
    assert_error(
        http.post(
            "/v1/chat/completions",
            json={"model": DEFAULT_MODEL, "messages": YES, "max_tokens": 5, "min_tokens": 6},
        ),
        400,
        "min_tokens",
    )
    # min_p at temperature 1.5: every drawn token within T*log(min_p) of the top one
    t, min_p = 1.5, 0.2

    def gaps(**kw):
        r = sdk.completions.create(
            model=DEFAULT_MODEL,
            prompt="My favourite animal is",
            max_tokens=24,
            temperature=t,
            seed=3,
            logprobs=1,
            **kw,
        )
        lp = r.choices[0].logprobs
        return [v - max(top.values()) for v, top in zip(lp.token_logprobs, lp.top_logprobs)]

    assert min(gaps(extra_body={"min_p": min_p})) >= t * math.log(min_p) - 1e-4
    assert min(gaps()) < t * math.log(min_p)  # without it, this seed draws a rarer token


def test_mixed_batch_equals_alone(server, http):
    """Eight different requests at once (logprobs, penalties, biases, echo, seeds,
    streams) give exactly what each gives alone."""
    reqs = [
        (
            "/v1/chat/completions",
            {
                "messages": FRANCE,
                "temperature": 0,
                "max_tokens": 10,
                "logprobs": True,
                "top_logprobs": 3,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HELLO,
                "temperature": 0,
                "max_tokens": 16,
                "frequency_penalty": 1.2,
                "presence_penalty": 0.5,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HELLO,
                "temperature": 1.0,
                "seed": 11,
                "max_tokens": 12,
                "repetition_penalty": 1.3,
                "min_p": 0.05,
            },
        ),
        (
            "/v1/completions",
            {
                "prompt": "Once upon a time",
                "temperature": 0.9,
                "seed": 4,
                "max_tokens": 12,
                "logprobs": 2,
                "echo": True,
            },
        ),
        ("/v1/completions", {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 12}),
        (
            "/v1/chat/completions",
            {
                "messages": YES,
                "temperature": 0,
                "max_tokens": 16,
                "min_tokens": 10,
                "logit_bias": {"30": -5},
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": FRANCE,
                "temperature": 0.8,
                "seed": 2,
                "max_tokens": 10,
                "stream": True,
                "logprobs": True,
            },
        ),
        (
            "/v1/completions",
            {
                "prompt": "The capital of France is",
                "temperature": 0,
                "max_tokens": 8,
                "stream": True,
                "logprobs": 1,
                "echo": True,
            },
        ),
    ]

    def send(path, body):
        r = httpx.post(
            server.url + path,
            json={"model": DEFAULT_MODEL, **body},
            headers=server.headers(),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        if body.get("stream"):
            return summary(sse(r))
        return summary([r.json()])

    alone = [send(p, b) for p, b in reqs]
    together: list = [None] * len(reqs)

    def worker(i):
        together[i] = send(*reqs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for a, b in zip(alone, together):
        assert a[0] == b[0]  # the text
        assert a[1] == b[1]  # the logprob tokens
        assert np.allclose(a[2], b[2], atol=1e-3)  # their values


def summary(bodies: list[dict]) -> tuple[str, list[str], list[float]]:
    """Text, logprob tokens and values of one choice, from a body or its chunks."""
    text, tokens, values = "", [], []
    for b in bodies:
        for c in b["choices"]:
            text += c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or ""
            lp = c.get("logprobs")
            if not lp:
                continue
            if "content" in lp:
                tokens += [e["token"] for e in lp["content"]]
                values += [e["logprob"] for e in lp["content"]]
            else:
                tokens += lp["tokens"]
                values += [v for v in lp["token_logprobs"] if v is not None]
    return text, tokens, values


# --------------------------------------------------------------------------- tokenize


def test_tokenize_and_detokenize(server, http):
    card = http.get(f"/v1/models/{DEFAULT_MODEL}").json()
    a = http.post("/tokenize", json={"model": DEFAULT_MODEL, "prompt": "Hello world"}).json()
    b = http.post("/v1/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert a["tokens"] == b["tokens"] and a["count"] == len(a["tokens"]) > 0
    assert a["max_model_len"] == card["context_length"] and a["token_strs"] is None
    assert len(b["token_strs"]) == b["count"]
    back = http.post("/detokenize", json={"model": DEFAULT_MODEL, "tokens": a["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    assert http.post("/v1/detokenize", json={"tokens": a["tokens"]}).json() == back
    # a conversation: the ids chat feeds the model (its prompt_tokens), template included
    t = http.post("/tokenize", json={"messages": FRANCE, "add_generation_prompt": True}).json()
    used = chat(http, FRANCE, temperature=0, max_tokens=1)["usage"]["prompt_tokens"]
    assert t["count"] == used
    no_gen = http.post("/tokenize", json={"messages": FRANCE, "add_generation_prompt": False})
    assert no_gen.json()["count"] < t["count"]
    # bad input
    assert_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model")
    assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"prompt": "x", "messages": FRANCE}), 400)
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "x"}), 401)


# --------------------------------------------------------------------------- other fields


def test_other_request_fields(http, sdk):
    r = sdk.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[
            {"role": "developer", "content": "Answer in one word."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the capital of France?"}],
            },
        ],
        temperature=0,
        max_tokens=9,
        max_completion_tokens=3,
        user="u-1",
        metadata={"run": "a"},
        store=False,
        service_tier="auto",
        n=2,
        logprobs=True,
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 6
    for c in r.choices:
        assert len(c.logprobs.content) <= 3
        assert c.finish_reason in ("stop", "length")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = assert_error(
        http.post(
            "/v1/chat/completions",
            json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": [image]}]},
        ),
        400,
        "messages[0].content[0].type",
    )
    assert "text-only" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=DEFAULT_MODEL, prompt="def f(", suffix="return 1")
    assert info.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model=DEFAULT_MODEL, messages=FRANCE, logit_bias={"not-an-id": 3}
        )
    assert info.value.param == "logit_bias"
