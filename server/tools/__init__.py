"""Tool calling: tools into the prompt, a grammar for the tool choice, calls out of the text.

``plan_tools`` reads a chat request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` against the model's tool-call format (``formats``) into a
``ToolPlan``: how the prompt gets the tools (``prompt``), which grammar holds the answer
(``grammar``: from the first token for ``required`` and a named function, from the call
marker on for ``auto``), and a parser per choice (``parser``) that turns the text into
``message.tool_calls`` and streamed ``tool_calls`` deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.types import GrammarSpec
from server.errors import bad_request
from server.tools.formats import ToolFormat, tool_format_for
from server.tools.grammar import tool_grammar
from server.tools.parser import ArgsDelta, CallStart, Content, ToolCallParser

__all__ = ["ToolPlan", "check_tools", "plan_tools", "tool_format_for", "delta_of"]


@dataclass
class ToolPlan:
    fmt: ToolFormat
    tools: list  # server.schemas.ChatTool, as sent
    mode: str  # "auto" | "required" | "named" | "none"
    parallel: bool
    grammar: GrammarSpec | None

    @property
    def calls_possible(self) -> bool:
        """Tools are in the prompt and the answer is read for calls."""
        return self.mode != "none"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt)


def check_tools(tools, tool_choice) -> tuple[str, list[tuple[str, dict | None]]] | None:
    """The request's tool choice checked on its own (no model needed): None without
    tools, else the mode ("auto", "required", "named" or "none") and the functions a
    call may name [(name, parameters)]. ``tool_choice``: "none", "auto", "required", a
    server.schemas.NamedToolChoice, or None (OpenAI's default: "auto" with tools)."""
    named = None if tool_choice is None or isinstance(tool_choice, str) else tool_choice
    if not tools:
        if tool_choice == "required" or named is not None:
            raise bad_request(
                "Invalid 'tool_choice': it asks for a tool call but 'tools' is empty or absent.",
                param="tool_choice",
            )
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(
            f"Invalid 'tools': the function name '{dup}' is used twice.", param="tools"
        )
    for i, t in enumerate(tools):
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise bad_request(
                f"Invalid 'tools[{i}].function.parameters': a function's parameters must be "
                "a JSON schema of type 'object'.",
                param=f"tools[{i}].function.parameters",
            )
    functions = [(t.function.name, t.function.parameters) for t in tools]
    if named is None:
        return tool_choice or "auto", functions
    if named.function.name not in names:
        raise bad_request(
            f"Invalid 'tool_choice': no function named '{named.function.name}' in 'tools' "
            f"(have: {', '.join(names)}).",
            param="tool_choice",
        )
    return "named", [f for f in functions if f[0] == named.function.name]


def plan_tools(tools, tool_choice, parallel: bool | None, tokenizer) -> ToolPlan | None:
    """The plan for a request's tools on a model (None: no tools); see ``check_tools``."""
    checked = check_tools(tools, tool_choice)
    if checked is None:
        return None
    mode, functions = checked
    fmt = tool_format_for(tokenizer)
    parallel = True if parallel is None else parallel
    grammar = None
    if mode != "none":
        lark = tool_grammar(fmt, functions, mode, parallel)
        grammar = GrammarSpec("lark", lark) if lark else None
    return ToolPlan(fmt, list(tools), mode, parallel, grammar)


def delta_of(d) -> dict:
    """A parser delta as the ``delta`` of a chat.completion.chunk."""
    if isinstance(d, Content):
        return {"content": d.text}
    if isinstance(d, CallStart):
        call = {"index": d.index, "id": d.id, "type": "function"}
        call["function"] = {"name": d.name, "arguments": ""}
        return {"tool_calls": [call]}
    assert isinstance(d, ArgsDelta)
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.fragment}}]}
