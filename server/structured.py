"""Structured output: which grammar a request asks for, checked before it is queued.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's extras
(``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``: Lark or
GBNF) become one ``engine.types.GrammarSpec``. ``check_grammar`` has the engine compile
it for the model (cached there, so the worker only copies it): a schema keyword or
grammar the grammar engine cannot enforce is a 400 naming it, never a silently
unconstrained answer.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from engine.types import GrammarError, GrammarSpec
from server.errors import bad_request
from server.schemas import GuidedFields
from server.tools.grammar import closed_objects

JSON_OBJECT = GrammarSpec("json_schema", json.dumps({"type": "object"}))


def requested_grammar(body: GuidedFields) -> tuple[GrammarSpec, str] | None:
    """The request's grammar and the parameter that asked for it; None for free text.
    At most one of response_format (other than text) and the guided_* fields."""
    asked: list[tuple[GrammarSpec, str]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        asked.append((_response_format(rf.type, rf.json_schema), "response_format"))
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad_request(
                    f"Invalid 'guided_json': not JSON ({exc}).", param="guided_json"
                ) from None
        asked.append((_schema_spec(schema, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        asked.append((GrammarSpec("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        if not body.guided_choice:
            raise bad_request(
                "Invalid 'guided_choice': give at least one choice.", param="guided_choice"
            )
        asked.append((GrammarSpec("choice", json.dumps(body.guided_choice)), "guided_choice"))
    if body.guided_grammar is not None:
        asked.append((GrammarSpec("gbnf", body.guided_grammar), "guided_grammar"))
    if len(asked) > 1:
        names = ", ".join(p for _, p in asked)
        raise bad_request(
            f"Only one kind of structured output per request; got {names}.", param=asked[1][1]
        )
    return asked[0] if asked else None


def _response_format(kind: str, json_schema: dict[str, Any] | None) -> GrammarSpec:
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise bad_request(
            f"Invalid 'response_format.type': {kind!r}; supported: 'text', 'json_object', "
            "'json_schema'.",
            param="response_format.type",
            code="invalid_value",
        )
    if json_schema is None:
        raise bad_request(
            "Missing required parameter: 'response_format.json_schema'.",
            param="response_format.json_schema",
        )
    name = json_schema.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            "Missing required parameter: 'response_format.json_schema.name'.",
            param="response_format.json_schema.name",
        )
    if "schema" not in json_schema:  # OpenAI: no schema means any JSON object
        return JSON_OBJECT
    schema = json_schema["schema"]
    if json_schema.get("strict") is True:  # OpenAI's strict mode: no unlisted keys
        schema = closed_objects(schema)
    return _schema_spec(schema, "response_format.json_schema.schema")


def _schema_spec(schema: Any, param: str) -> GrammarSpec:
    if not isinstance(schema, dict):
        raise bad_request(f"Invalid '{param}': a JSON schema must be an object.", param=param)
    return GrammarSpec("json_schema", json.dumps(schema))


async def check_grammar(engine: Any, model: str, spec: GrammarSpec, param: str) -> None:
    """Compile ``spec`` for ``model`` (in a thread: the first one per model builds the
    grammar engine's view of the vocabulary); a refusal is a 400 naming ``param``."""
    try:
        await anyio.to_thread.run_sync(engine.compile_grammar, model, spec)
    except GrammarError as exc:
        what = "schema" if spec.kind == "json_schema" else spec.kind.replace("_", " ")
        raise bad_request(
            f"Invalid '{param}': the {what} cannot be enforced: {exc}",
            param=param,
            code="invalid_grammar",
        ) from None
