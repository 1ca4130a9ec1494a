"""Tool calling end to end with the default model (SmolLM2-135M-Instruct, whose ChatML
template knows nothing of tools: the tools go into a system message and calls are read
in the generic format) and Gemma 3 270M (no chat template at all).

A model this small rarely calls a tool on its own, so real calls come from
``tool_choice`` ``required`` or a named function, which the grammar forces from the
first token; ``auto`` is checked to answer well-formed either way. Parsing of other
families' text is in test_tool_parser.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, "--max-num-seqs", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


def body(**extra) -> dict:
    return {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 60, **extra}


def check_call(call, names=None) -> dict:
    """A complete call: a known function, arguments valid for its parameters."""
    fn = call["function"] if isinstance(call, dict) else call.function.model_dump()
    assert fn["name"] in (names or PARAMS), fn
    args = json.loads(fn["arguments"])
    jsonschema.validate(args, PARAMS[fn["name"]])
    return args


def sse_chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [
        json.loads(line[6:])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_named_function_call_through_the_sdk(sdk):
    r = sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = check_call(call)
    assert args["unit"] in ("celsius", "fahrenheit")


def test_required_call_streamed_as_openai_does(http):
    chunks = sse_chunks(
        http.post(
            "/v1/chat/completions",
            json=body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True),
        )
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    first = calls[0][0]
    # first delta of call 0: index, id, type, name; arguments come after, as fragments
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] in PARAMS and first["function"]["arguments"] == ""
    fragments = [c[0] for c in calls[1:]]
    assert len(fragments) > 1
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    arguments = "".join(f["function"]["arguments"] for f in fragments)
    check_call({"function": {"name": first["function"]["name"], "arguments": arguments}})
    assert not any(d.get("content") for d in deltas)  # no text around a forced call
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_and_whole_answers_agree_through_the_sdk(sdk):
    kw = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    whole = sdk.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in sdk.chat.completions.create(parallel_tool_calls=False, stream=True, **kw):
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [calls[0]] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]


def test_parallel_calls_get_their_own_index_and_id(http):
    """With parallel calls allowed this model keeps calling until max_tokens: every
    call has its own index and id, every complete one valid arguments."""
    chunks = sse_chunks(
        http.post(
            "/v1/chat/completions",
            json=body(tools=TOOLS, tool_choice="required", max_tokens=64, stream=True),
        )
    )
    calls: list[dict] = []
    for c in chunks:
        for tc in c["choices"][0]["delta"].get("tool_calls", []) if c["choices"] else []:
            if "id" in tc:
                assert tc["index"] == len(calls)
                fn = {"name": tc["function"]["name"], "arguments": ""}
                calls.append({"id": tc["id"], "function": fn})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    finish = chunks[-1]["choices"][0]["finish_reason"]
    assert len(calls) >= 2 and len({c["id"] for c in calls}) == len(calls)
    assert finish in ("tool_calls", "length")
    for call in calls if finish == "tool_calls" else calls[:-1]:
        check_call(call)


def test_auto_answers_well_formed_either_way(http):
    """With ``auto`` the model may write text or a call; both come back well formed.
    The tools are in the prompt (more prompt tokens than without them)."""
    plain = http.post("/v1/chat/completions", json=body(max_tokens=16)).json()
    r = http.post("/v1/chat/completions", json=body(tools=TOOLS, max_tokens=16)).json()
    assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50
    message, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
    if message.get("tool_calls"):
        assert finish in ("tool_calls", "length")
        if finish == "tool_calls":
            for call in message["tool_calls"]:
                check_call(call)
    else:
        assert isinstance(message["content"], str) and message["content"]
        assert finish in ("stop", "length")
    none = http.post(
        "/v1/chat/completions", json=body(tools=TOOLS, tool_choice="none", max_tokens=16)
    ).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"]["tool_calls"] is None
    assert none["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_tool_results_are_accepted_in_the_next_turn(sdk):
    """The assistant's call (the SDK's own message object) and the tool's result go
    back in; the model answers from them."""
    messages = list(ASK)
    first = sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message)
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}
    )
    second = sdk.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert second.choices[0].message.content
    plain = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=1)
    # the call and its result are in the prompt
    assert second.usage.prompt_tokens > plain.usage.prompt_tokens + 25
    # the same turns as plain dicts, streamed
    dict_turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"},
    ]
    text = ""
    for chunk in sdk.chat.completions.create(
        model=MODEL, messages=dict_turns, temperature=0, max_tokens=20, stream=True
    ):
        text += chunk.choices[0].delta.content or ""
    assert text


def test_tool_calls_beside_other_requests_in_one_batch(server, http):
    """Forced calls, a JSON-schema answer and a free answer share the batch; the free
    greedy answer is the one it gives alone."""
    free = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "temperature": 0,
        "max_tokens": 24,
    }
    alone = http.post("/v1/chat/completions", json=free).json()["choices"][0]["message"]["content"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ah:
            jobs = [
                ah.post("/v1/chat/completions", json=body(tools=TOOLS, tool_choice=NAMED)),
                ah.post(
                    "/v1/chat/completions",
                    json=body(
                        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True
                    ),
                ),
                ah.post("/v1/chat/completions", json=free),
                ah.post("/v1/chat/completions", json={**free, "stream": True}),
                ah.post("/v1/chat/completions", json=body(response_format={"type": "json_object"})),
            ]
            return await asyncio.gather(*jobs)

    named, required, free1, free2, js = asyncio.run(main())
    check_call(named.json()["choices"][0]["message"]["tool_calls"][0], names=["get_weather"])
    assert sse_chunks(required)[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert free1.json()["choices"][0]["message"]["content"] == alone
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in sse_chunks(free2) if c["choices"]
    )
    assert streamed == alone
    assert js.json()["choices"][0]["message"]["content"].startswith("{")


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"not": {}}}},
                        },
                    }
                ]
            },
            "tools",
        ),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]},
                ]
            },
            "messages[1].tool_calls[0].function",
        ),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}, *ASK]}, None),
        ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_tool_errors_are_400s_naming_the_parameter(http, extra, param):
    r = http.post("/v1/chat/completions", json=body(max_tokens=4, **extra))
    if param is None:  # an empty tool_calls list on a user message is harmless
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert http.get("/health").status_code == 200


def test_arguments_cut_by_max_tokens_do_not_break_the_answer(http, sdk):
    r = sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=21
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut short: kept as written, not an error
    chunks = sse_chunks(
        http.post(
            "/v1/chat/completions",
            json=body(tools=TOOLS, tool_choice=NAMED, max_tokens=21, stream=True),
        )
    )
    args = "".join(
        tc["function"].get("arguments", "")
        for c in chunks
        for tc in c["choices"][0]["delta"].get("tool_calls", [])
    )
    assert args == call.function.arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_gemma3_without_a_template_gets_the_generic_tool_prompt(gemma3_server):
    """Gemma 3's GGUF has no chat template: the tools are described in the system
    text of the fallback template and a forced call comes back parsed."""
    client = openai.OpenAI(base_url=gemma3_server.v1, api_key="unused", max_retries=0, timeout=300)
    plain = client.chat.completions.create(
        model="gemma3-270m", messages=ASK, temperature=0, max_tokens=4
    )
    r = client.chat.completions.create(
        model="gemma3-270m",
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=0,
        max_tokens=60,
    )
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert r.choices[0].finish_reason == "tool_calls"
    check_call(r.choices[0].message.tool_calls[0], names=["get_weather"])


@pytest.mark.parametrize("max_tokens", [1, 3, 5, 8])
def test_a_call_cut_short_never_leaks_its_marker_as_content(http, max_tokens):
    """max_tokens cutting a forced call inside its marker or before its name: the
    answer has no call and no content starting a marker, streamed or whole."""
    ask = body(tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
    whole = http.post("/v1/chat/completions", json=ask).json()["choices"][0]
    assert whole["finish_reason"] == "length"
    assert "<tool" not in (whole["message"]["content"] or "")
    content = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in sse_chunks(http.post("/v1/chat/completions", json={**ask, "stream": True}))
        if c["choices"]
    )
    assert "<tool" not in content
    assert content == (whole["message"]["content"] or "")
