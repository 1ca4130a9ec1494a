"""The grammar a tool choice puts on the answer, in llguidance's Lark dialect.

``required`` and a named function force a call from the first token: the family's
marker, then a JSON object whose ``name`` is one of the tools (or the named one) and
whose arguments follow that tool's ``parameters`` schema. ``auto`` lets the model write
free text, and only once it writes the call marker (a lazy lexeme: llguidance matches
the free text up to the marker, then holds the rest to the call's grammar) constrains
the call. ``parallel_tool_calls: false`` allows one call. ``none`` has no grammar.
"""

from __future__ import annotations

import json

from server.tools.formats import ToolFormat

# Free text, as a terminal (one lexeme: fast to match).
TEXT = "TEXT: /(.|\\n)*/"

# JSON as engine/structured/compiler.py writes it (no free whitespace, one optional
# space after ':' and ','), for the %json parts of a Lark grammar.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}


def call_schema(name: str, parameters: dict | None, args_key: str) -> dict:
    """A call object: ``{"name": <name>, <args_key>: <arguments>}``, nothing else. The
    arguments hold only the keys the parameters schema lists, unless it says otherwise
    (``additionalProperties``): a function takes the arguments it declares."""
    params = parameters if parameters else {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: closed_objects(params)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and does not set ``additionalProperties`` itself (OpenAI's strict
    mode)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(
            value, dict
        ):
            out[key] = {k: closed_objects(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties"):
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def with_style(schema: dict) -> dict:
    return {"x-guidance": JSON_STYLE, **schema}


def tool_grammar(
    fmt: ToolFormat, functions: list[tuple[str, dict | None]], mode: str, parallel: bool
) -> str | None:
    """Lark text for ``mode`` "auto", "required" or "named" (``functions`` then holds
    the one named function) over ``functions`` [(name, parameters)]; None when the
    family has no grammar for it (the answer is then only parsed)."""
    schemas = [call_schema(n, p, fmt.args_key) for n, p in functions]
    one = with_style(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    forced = mode != "auto"
    many = parallel and mode != "named"
    if fmt.name in ("hermes", "generic"):
        body = "body: %json " + json.dumps(one)
        if forced:
            start = 'start: call ("\\n" call)*' if many else "start: call"
            return "\n".join([start, 'call: "<tool_call>\\n" body "\\n</tool_call>"', body])
        lines = [
            "start: call* tail" if many else "start: tail | call",
            "tail: TEXT",
            TEXT,
            'call_head[lazy]: TEXT "<tool_call>"',
            'call: call_head "\\n" body "\\n</tool_call>"',
            body,
        ]
        return "\n".join(lines)
    if fmt.name == "llama3":
        body = "body: %json " + json.dumps(one)
        calls = 'body (";" body)*' if many else "body"
        if forced:
            return "\n".join([f"start: {calls}", body])
        return "\n".join([f"start: NOT_JSON | {calls}", "NOT_JSON: /([^{](.|\\n)*)?/", body])
    if fmt.name == "mistral":
        marker = fmt.token_id("[TOOL_CALLS]")
        if marker is None:
            return None
        items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        listing = with_style({"type": "array", "items": items, "minItems": 1})
        if not many:
            listing["maxItems"] = 1
        body = "calls: %json " + json.dumps(listing)
        if forced:
            return "\n".join([f"start: <[{marker}]> calls", body])
        return "\n".join([f"start: TEXT (<[{marker}]> calls)?", TEXT, body])
    if fmt.name == "gemma4":
        ids = [fmt.token_id(m) for m in ("<|tool_call>", "<tool_call|>", '<|"|>')]
        if None in ids:
            return None
        open_, close, quote = ids
        names = " | ".join(json.dumps(n) for n, _ in functions)
        lines = [
            f'gcall: <[{open_}]> "call:" gname "{{" gargs "}}" <[{close}]>',
            f"gname: {names}",
            'gargs: (GTEXT | gstr | "{" gargs "}")*',
            f"gstr: <[{quote}]> GSTR <[{quote}]>",
            "GTEXT: /[^<{}]+/",
            "GSTR: /[^<]*/",
        ]
        if forced:
            return "\n".join(["start: gcall+" if many else "start: gcall", *lines])
        return "\n".join(
            ["start: TEXT (gcall TEXT)*" if many else "start: TEXT gcall?", TEXT, *lines]
        )
    return None
