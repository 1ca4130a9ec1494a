"""Tools and tool turns in the prompt.

A chat template that renders tools gets them (``tools=``) and the conversation's tool
turns in the shape templates expect (an assistant message's ``tool_calls`` with the
arguments as an object; ``tool`` messages with ``tool_call_id`` and the function's
name). A template that knows nothing of tools gets them described in a system message
(``TOOLS_PROMPT``) that asks for the Hermes-style ``<tool_call>`` block, and its tool
turns written as text: the assistant's calls as those blocks, a tool's result as a user
turn in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_PROMPT = """You can call these tools (functions) to help answer; each is described by a JSON schema:
<tools>
{tools}
</tools>
To call a tool, answer with one block per call, a JSON object with the tool's name and its arguments:
<tool_call>
{{"name": "<tool name>", "arguments": {{<arguments>}}}}
</tool_call>
A tool's result comes back in <tool_response></tool_response> tags. If no tool is needed, answer in plain text."""


def tool_list(tools) -> list[dict]:
    """The request's tools (server.schemas.ChatTool) as plain dicts for a template."""
    return [t.model_dump(exclude_none=True) for t in tools]


def tools_system_text(tools) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_list(tools))
    return TOOLS_PROMPT.format(tools=lines)


def with_tools_prompt(messages: list[dict], tools) -> list[dict]:
    """``messages`` with the tools described in the system message (added if none)."""
    text = tools_system_text(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + text).strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def arguments_value(arguments: Any) -> Any:
    """A call's arguments for a template: the object when they are JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_block(name: str, arguments: Any) -> str:
    body = {"name": name, "arguments": arguments_value(arguments)}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def assistant_turn(content: str, calls: list[dict], native: bool) -> dict:
    """An assistant message with tool calls (OpenAI's shape, checked by the caller)."""
    if native:
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": arguments_value(c["function"].get("arguments", "{}")),
                    },
                }
                for c in calls
            ],
        }
    blocks = [
        call_block(c["function"]["name"], c["function"].get("arguments", "{}")) for c in calls
    ]
    return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}


def tool_turn(content: str, call_id: str | None, name: str | None, native: bool) -> dict:
    if native:
        turn = {"role": "tool", "content": content, "tool_call_id": call_id}
        if name:
            turn["name"] = name
        return turn
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
