"""Structured output end to end: a real server with the default model (SmolLM2-135M-
Instruct), the ``openai`` SDK and raw httpx, streamed and not, constrained requests
batched with unconstrained ones. Every answer that ends by itself must parse and
validate against its schema (``jsonschema``); one cut by max_tokens must be a valid
start of such an answer."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from engine.structured import GrammarCompiler
from engine.tokenizer import Tokenizer
from engine.types import GrammarSpec
from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL

# A corpus of schemas: nested objects, arrays, enums, required, numbers, strings with
# patterns, $defs/$ref and anyOf. Strings and arrays are bounded so a small model's
# answers end well inside max_tokens.
SCHEMAS = {
    "person": (
        "Describe a person with a name, an age and an address (city and zip code) as JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 24},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
    ),
    "colors": (
        "List up to three primary colors as JSON.",
        {
            "type": "object",
            "properties": {
                "colors": {
                    "type": "array",
                    "items": {"enum": ["red", "green", "blue"]},
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["colors"],
        },
    ),
    "weather": (
        "Give today's weather in Paris as JSON: temperature in Celsius and whether it rains.",
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60},
                "raining": {"type": "boolean"},
                "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
            },
            "required": ["temperature", "raining", "wind_kmh"],
            "additionalProperties": False,
        },
    ),
    "ticket": (
        "Open a support ticket as JSON with a status and a code like ABC-12.",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["open", "closed", "pending"]},
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "priority": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["status", "code", "priority"],
            "additionalProperties": False,
        },
    ),
    "items": (
        "Give two inventory items as a JSON array, each with an id and at most two tags.",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 10},
                        "maxItems": 2,
                    },
                },
                "required": ["id", "tags"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    ),
    "shape": (
        "Describe a shape as JSON: a circle with a radius or a square with a side.",
        {
            "$defs": {
                "circle": {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "circle"},
                        "radius": {"type": "number", "minimum": 0, "maximum": 100},
                    },
                    "required": ["kind", "radius"],
                    "additionalProperties": False,
                },
                "square": {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "square"},
                        "side": {"type": "integer", "minimum": 0, "maximum": 100},
                    },
                    "required": ["kind", "side"],
                    "additionalProperties": False,
                },
            },
            "anyOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/square"}],
        },
    ),
}


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, "--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat_body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


def streamed(response: httpx.Response) -> tuple[str, str | None]:
    """Text and finish reason of a streamed chat answer."""
    assert response.status_code == 200, response.text
    text, finish = "", None
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


def prefix_checker(schema: dict):
    """Whether a text is a valid start of an answer to ``schema`` as the server writes
    JSON (the same grammar, over a byte-level vocabulary: one token a byte)."""
    compiler = GrammarCompiler(Tokenizer.byte_level(258), 258)
    spec = GrammarSpec("json_schema", json.dumps(schema))

    def check(text: str) -> bool:
        m = compiler.matcher(spec)
        return all(m.accept(b) for b in text.encode())

    return check


def test_schema_corpus_in_a_mixed_batch(server, http):
    """Each schema twice (SDK greedy, httpx streamed with a temperature) in one batch
    with unconstrained requests; the unconstrained greedy answer is the one it gives
    alone (masks touch only their rows)."""
    free_prompt = "Write one sentence about the sea."
    free_alone = http.post(
        "/v1/chat/completions", json=chat_body(free_prompt, temperature=0, max_tokens=24)
    ).json()["choices"][0]["message"]["content"]

    async def main():
        sdk = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ah:

            async def sdk_call(name, prompt, schema):
                r = await sdk.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    response_format=schema_format(name, schema),
                    temperature=0,
                    max_tokens=200,
                )
                return r.choices[0].message.content, r.choices[0].finish_reason

            async def stream_call(name, prompt, schema):
                body = chat_body(
                    prompt,
                    response_format=schema_format(name, schema),
                    temperature=0.8,
                    seed=5,
                    max_tokens=200,
                    stream=True,
                )
                return streamed(await ah.post("/v1/chat/completions", json=body))

            async def free_call():
                r = await ah.post(
                    "/v1/chat/completions",
                    json=chat_body(free_prompt, temperature=0, max_tokens=24),
                )
                return r.json()["choices"][0]["message"]["content"]

            jobs = []
            for name, (prompt, schema) in SCHEMAS.items():
                jobs += [sdk_call(name, prompt, schema), stream_call(name, prompt, schema)]
            jobs += [free_call(), free_call()]
            return await asyncio.gather(*jobs)

    *answers, free1, free2 = asyncio.run(main())
    assert free1 == free2 == free_alone
    for (name, (_, schema)), pair in zip(SCHEMAS.items(), zip(answers[::2], answers[1::2])):
        for text, finish in pair:
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)


def test_json_object_mode(sdk):
    r = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert prefix_checker({"type": "object"})(text)
    assert text.startswith("{")


def test_sdk_parse_with_a_pydantic_model(sdk):
    """``client.chat.completions.parse`` sends a strict json_schema from the model
    class and parses the answer back into it."""

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population_millions: int = pydantic.Field(ge=0, le=40)

    r = sdk.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)


def test_max_tokens_cut_is_a_valid_prefix(http, sdk):
    name = "person"
    prompt, schema = SCHEMAS[name]
    check = prefix_checker(schema)
    r = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format=schema_format(name, schema),
        temperature=0,
        max_tokens=9,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 9
    assert check(text) and text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)
    body = chat_body(
        prompt, response_format=schema_format(name, schema), temperature=0, max_tokens=9
    )
    s_text, s_finish = streamed(http.post("/v1/chat/completions", json={**body, "stream": True}))
    assert (s_text, s_finish) == (text, "length")


def test_vllm_guided_extras(http):
    def ask(prompt, **guided):
        r = http.post(
            "/v1/chat/completions", json=chat_body(prompt, temperature=0, max_tokens=40, **guided)
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        return choice["message"]["content"]

    assert ask("Is the sky blue?", guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert re.fullmatch(
        r"[0-9]{3}-[0-9]{4}", ask("A phone number:", guided_regex=r"[0-9]{3}-[0-9]{4}")
    )
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    jsonschema.validate(json.loads(ask("Are you ok? JSON.", guided_json=schema)), schema)
    jsonschema.validate(
        json.loads(ask("Are you ok? JSON.", guided_json=json.dumps(schema))), schema
    )
    lark = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]?/'
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", ask("What is 2 + 2?", guided_grammar=lark))
    gbnf = 'root ::= "Answer: " ("yes" | "no")'
    assert ask("Is water wet?", guided_grammar=gbnf) in ("Answer: yes", "Answer: no")


def test_text_completions_take_structured_output_too(http):
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Three primary colors:",
            "max_tokens": 30,
            "temperature": 0,
            "n": 2,
            "guided_regex": r" (red|green|blue)(, (red|green|blue)){2}\.",
        },
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch(r" (red|green|blue)(, (red|green|blue)){2}\.", choice["text"])
        assert choice["finish_reason"] == "stop"
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "A JSON object:",
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "response_format": {"type": "json_object"},
        },
    )
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in r.text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    assert text.startswith("{") and prefix_checker({"type": "object"})(text)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": schema_format(
                    "x", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
                )
            },
            "response_format",
            ['"not"', "cannot be enforced"],
        ),
        (
            {"response_format": schema_format("x", {"type": "string", "format": "credit-card"})},
            "response_format",
            ["credit-card"],
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", ["xml"]),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", []),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            [],
        ),
        ({"guided_regex": "a(b"}, "guided_regex", ["regex"]),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", ["nowhere"]),
        ({"guided_choice": []}, "guided_choice", []),
        ({"guided_json": "{not json"}, "guided_json", ["JSON"]),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            ["response_format", "guided_regex"],
        ),
    ],
)
def test_structured_output_errors_are_400s_naming_the_problem(http, extra, param, words):
    r = http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=5, **extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    assert http.get("/health").status_code == 200
