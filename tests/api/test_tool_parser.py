"""Tool calls read out of model text, per template family, whole and streamed.

The texts are what models of each family write (Qwen 2.5 / Hermes, Llama 3.1 JSON,
Mistral's two forms, Gemma 4's call tokens as text with special tokens kept), plus the
ways answers go wrong: cut short by max_tokens, not JSON, a marker in prose, a marker
split across pieces. Every text is also fed in pieces of 1, 2, 3, 5 and 8 characters:
the streamed deltas must add up to the same content and calls as the whole text.
"""

from __future__ import annotations

import json

import llguidance
import pytest

from engine.tokenizer import Tokenizer
from server.tools.formats import ToolFormat, tool_format_for
from server.tools.grammar import closed_objects, tool_grammar
from server.tools.parser import ArgsDelta, CallStart, Content, ToolCallParser

HERMES = ToolFormat("hermes", True, "<tool_call>", "</tool_call>", True, "arguments", False)
GENERIC = ToolFormat("generic", False, "<tool_call>", "</tool_call>", True, "arguments", False)
LLAMA3 = ToolFormat("llama3", True, "<|python_tag|>", None, True, "parameters", True)
MISTRAL = ToolFormat("mistral", True, "[TOOL_CALLS]", None, False, "arguments", True)
GEMMA4 = ToolFormat("gemma4", True, "<|tool_call>", "<tool_call|>", False, "arguments", True)


def parse_whole(fmt, text):
    p = ToolCallParser(fmt)
    p.feed(text)
    p.finish()
    return p.content, [(c.name, c.arguments) for c in p.calls]


def parse_streamed(fmt, text, step):
    """Content and calls as a client rebuilds them from the streamed deltas."""
    p = ToolCallParser(fmt)
    deltas = []
    for i in range(0, len(text), step):
        deltas += p.feed(text[i : i + step])
    deltas += p.finish()
    content, calls, ids = "", [], set()
    for d in deltas:
        if isinstance(d, Content):
            content += d.text
        elif isinstance(d, CallStart):
            assert d.index == len(calls) and d.id not in ids and d.name  # fresh index, id, name
            ids.add(d.id)
            calls.append([d.name, ""])
        else:
            assert isinstance(d, ArgsDelta) and d.index == len(calls) - 1
            calls[d.index][1] += d.fragment
    if calls and not content.strip():
        content = None
    return content, [tuple(c) for c in calls]


CASES = [
    # Qwen 2.5 (Hermes template): text, then two calls
    (
        HERMES,
        'I\'ll check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n</tool_call>',
        "I'll check both cities.",
        [
            ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
            ("get_weather", '{"city": "Tokyo", "unit": "celsius"}'),
        ],
    ),
    # nested arguments with braces and escapes inside strings
    (
        HERMES,
        '<tool_call>\n{"name": "run", "arguments": {"code": "if x: {\\"a\\": [1, 2]}", "opts": {"n": [1, {"m": "}"}]}}}\n</tool_call>',
        None,
        [("run", '{"code": "if x: {\\"a\\": [1, 2]}", "opts": {"n": [1, {"m": "}"}]}}')],
    ),
    # a plain answer: content exactly as written, trailing newline kept
    (HERMES, "The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    # the marker in prose is text; an unfinished marker at the very end is a call cut
    # short by max_tokens: left out, as the stream held it back
    (GENERIC, "Use <tool_call> tags. a <tool_ca", "Use <tool_call> tags. a", []),
    # bare JSON call as the whole answer (generic fallback)
    (GENERIC, '{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    # JSON that is not a call is content
    (GENERIC, '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    # name after the arguments: read when the object is complete
    (
        GENERIC,
        '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    # arguments written as a JSON string of JSON
    (
        GENERIC,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    # cut short by max_tokens inside the arguments: the fragment so far, never an error
    (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        None,
        [("get_weather", '{"city": "Par')],
    ),
    # cut short after the marker, before the call's name is complete: the unfinished
    # call is left out (never leaked as content), the text before it stays
    (HERMES, 'Let me check.\n<tool_call>\n{"na', "Let me check.", []),
    (HERMES, "Let me check.<tool_call>\n", "Let me check.", []),
    (HERMES, "Let me check. <tool_", "Let me check.", []),
    (HERMES, "<tool_", "", []),
    (HERMES, "if a <", "if a <", []),  # one character is not a marker yet
    (MISTRAL, 'Sure. [TOOL_CALLS] [{"name": "get_wea', "Sure.", []),
    # cut short inside the close tag
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool', None, [("f", "{}")]),
    # broken JSON after the marker: the text comes back as content
    (
        HERMES,
        "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
        "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
        [],
    ),
    # Llama 3.1 JSON tool calling, two calls joined by ';'
    (
        LLAMA3,
        '{"name": "get_weather", "parameters": {"city": "San Francisco"}}; {"name": "get_time", "parameters": {"tz": "PST"}}',
        None,
        [("get_weather", '{"city": "San Francisco"}'), ("get_time", '{"tz": "PST"}')],
    ),
    (
        LLAMA3,
        '<|python_tag|>{"name": "search", "parameters": {"q": "mlx"}}',
        None,
        [("search", '{"q": "mlx"}')],
    ),
    (LLAMA3, "Hello! How can I help?", "Hello! How can I help?", []),
    # Mistral v3: a JSON list after [TOOL_CALLS]
    (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]',
        None,
        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')],
    ),
    # Mistral v11+: [TOOL_CALLS]name[ARGS]{...} per call
    (
        MISTRAL,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')],
    ),
    # Gemma 4: its own argument syntax, converted to JSON
    (
        GEMMA4,
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,hourly:false,opts:{units:<|"|>metric<|"|>},tags:[<|"|>a<|"|>,<|"|>b<|"|>]}<tool_call|>',
        "Checking.",
        [
            (
                "get_weather",
                '{"city": "Paris, FR", "days": 3, "hourly": false, "opts": {"units": "metric"}, "tags": ["a", "b"]}',
            )
        ],
    ),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_calls_are_parsed_whole_and_streamed_alike(fmt, text, content, calls):
    assert parse_whole(fmt, text) == (content, calls)
    for step in (1, 2, 3, 5, 8):
        assert parse_streamed(fmt, text, step) == (content, calls), step


def test_complete_arguments_are_json_and_fragments_stream_early():
    p = ToolCallParser(HERMES)
    head = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(d) for d in head] == [CallStart, ArgsDelta]  # name told before the end
    assert head[1].fragment == '{"ci'
    p.feed('ty": "Oslo"}}\n</tool_call>')
    p.finish()
    assert json.loads(p.calls[0].arguments) == {"city": "Oslo"}


def test_a_partial_marker_is_held_back_until_it_resolves():
    p = ToolCallParser(HERMES)
    assert p.feed("Sure <tool") == [Content("Sure")]  # "<tool" held; trailing space too
    assert p.feed("box> is text") == [Content(" <toolbox> is text")]


def _tokenizer_with(specials: list[str], template: str) -> Tokenizer:
    tok = Tokenizer.byte_level(258)
    tok.backend.add_special_tokens(specials)
    return Tokenizer(
        tok.backend,
        special_tokens={"eos_token": "<eos>"},
        eos_token_ids={257},
        bos_token_id=None,
        chat_template=template,
        has_chat_template=True,
    )


def test_formats_are_found_from_template_and_vocabulary():
    assert tool_format_for(Tokenizer.byte_level(258)).name == "generic"
    assert not tool_format_for(Tokenizer.byte_level(258)).native
    hermes = _tokenizer_with([], "{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>")
    assert tool_format_for(hermes).name == "hermes"
    llama = _tokenizer_with(["<|python_tag|>"], "<|start_header_id|>{% if tools %}{% endif %}")
    assert tool_format_for(llama).name == "llama3"
    mistral = _tokenizer_with(
        ["[TOOL_CALLS]", "[ARGS]"], "{% if tools %}[AVAILABLE_TOOLS]{% endif %}"
    )
    assert tool_format_for(mistral).name == "mistral"
    assert tool_format_for(mistral).token_id("[TOOL_CALLS]") == 258
    gemma = _tokenizer_with(["<|tool_call>", "<tool_call|>", '<|"|>'], "{% if tools %}{% endif %}")
    assert tool_format_for(gemma).name == "gemma4"


FUNCTIONS = [
    (
        "get_weather",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    ),
    ("add", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}),
]


@pytest.mark.parametrize(
    "fmt, specials, good, bad",
    [
        (
            GENERIC,
            [],
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>',
        ),
        (
            LLAMA3,
            [],
            '{"name": "get_weather", "parameters": {"city": "Rome"}}',
            '{"name": "get_weather", "parameters": {"town": "Rome"}}',
        ),
        (
            MISTRAL,
            ["[TOOL_CALLS]"],
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]',
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": "one"}}]',
        ),
        (
            GEMMA4,
            ["<|tool_call>", "<tool_call|>", '<|"|>'],
            '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>',
            "<|tool_call>call:get_time{}<tool_call|>",
        ),
    ],
)
def test_required_grammars_take_real_calls_and_refuse_others(fmt, specials, good, bad):
    """The ``required`` grammar of each family accepts a well-formed call (tokenized as
    the model would write it, markers as special tokens) and refuses a call to a
    function that is not offered or with arguments off its schema."""
    tok = _tokenizer_with(specials, "")
    ids = tuple((m, tok.token_to_id(m)) for m in specials)
    fmt = ToolFormat(
        fmt.name, True, fmt.open_tag, fmt.close_tag, fmt.bare_json, fmt.args_key, True, ids
    )
    lark = tool_grammar(fmt, FUNCTIONS, "required", parallel=True)
    bridge = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=257)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, bridge) == ""

    def accepts(text):
        m = llguidance.LLMatcher(bridge, grammar, log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        return m.consume_tokens(ids) and m.is_accepting()

    assert accepts(good)
    assert not accepts(bad)


def test_closed_objects_only_close_what_lists_properties():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "m": {"type": "object"},
        },
        "$defs": {"D": {"type": "object", "properties": {"x": {}}, "additionalProperties": True}},
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["m"]  # a free-form map stays free
    assert out["$defs"]["D"]["additionalProperties"] is True  # stated: kept
