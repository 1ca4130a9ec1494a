"""POST /v1/responses through the ``openai`` SDK's ``client.responses`` and raw httpx,
against a real server with the default model: text input and message items,
instructions, function tools (forced), text.format json_schema, the typed stream
events, and the stateless errors."""

from __future__ import annotations

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
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, "--max-num-seqs", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def test_text_in_text_out(sdk, http):
    r = sdk.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert "Paris" in r.output_text
    assert (
        r.usage.output_tokens > 0
        and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    )
    # the same question as chat gives the same greedy text
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    ).json()
    assert r.output_text == chat["choices"][0]["message"]["content"]


def test_max_output_tokens_makes_it_incomplete(sdk):
    r = sdk.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=5, temperature=0
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_message_items_and_instructions(sdk):
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
        {"type": "message", "role": "user", "content": "Another one?"},
    ]
    r = sdk.responses.create(
        model=MODEL, input=items, instructions="You are terse.", max_output_tokens=10, temperature=0
    )
    assert r.instructions == "You are terse."
    assert r.output_text
    assert r.usage.input_tokens > 20


def test_streamed_events_in_order(sdk):
    events = list(
        sdk.responses.create(
            model=MODEL, input="Name a color.", max_output_tokens=12, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        types[-1],
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas and done.text == deltas == events[-1].response.output_text
    whole = sdk.responses.create(
        model=MODEL, input="Name a color.", max_output_tokens=12, temperature=0
    )
    assert whole.output_text == deltas


def test_function_call_then_its_output(sdk):
    r = sdk.responses.create(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = r.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    )
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # next turn: the call and its output go back as items
    follow = sdk.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C and snowing"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
    )
    assert follow.output[0].type == "message" and follow.output_text


def test_function_call_streamed(sdk):
    events = list(
        sdk.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(fragments) > 1 and "".join(fragments) == done.arguments
    json.loads(done.arguments)
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output[0].arguments == done.arguments


def test_text_format_json_schema(sdk):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    r = sdk.responses.create(
        model=MODEL,
        input="Is it sunny in Madrid? Answer as JSON.",
        text={
            "format": {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}
        },
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_errors_are_400s_naming_the_parameter(http, extra, param):
    r = http.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param == "previous_response_id":
        assert "keeps no responses" in err["message"]


def test_store_is_accepted_and_nothing_is_kept(http):
    r = http.post(
        "/v1/responses",
        json={
            "model": MODEL,
            "input": "hi",
            "max_output_tokens": 3,
            "store": True,
            "metadata": {"k": "v"},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False and r.json()["metadata"] == {"k": "v"}
