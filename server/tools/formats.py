"""Tool-call formats: how a model family writes a call, found from its chat template.

Each family writes calls its own way, and the parser (server/tools/parser.py) and the
grammar (server/tools/grammar.py) follow it:

* ``hermes`` (Hermes, Qwen 2.5/3 and templates that mention ``<tool_call>``):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block a call.
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): ``{"name": "f", "parameters": {...}}``
  as the whole answer, optionally after ``<|python_tag|>``, several joined by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects,
  or (newer tokenizers) ``[TOOL_CALLS]f[ARGS]{...}`` per call.
* ``gemma4``: ``<|tool_call>call:f{key:<|"|>text<|"|>,n:3}<tool_call|>`` (special
  tokens; strings quoted by the ``<|"|>`` token, bare keys).
* ``generic``: templates that know nothing of tools (SmolLM2's ChatML, Gemma 3's GGUF
  without a template). The tools are described in a system message
  (server/tools/prompt.py) that asks for the ``hermes`` block; the parser also takes a
  bare ``{"name": ..., "arguments": ...}`` object as the whole answer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    native: bool  # the chat template renders the tools (else the generic system prompt)
    open_tag: str | None  # text that starts a call (or a list of calls)
    close_tag: str | None  # text that ends one (None: the JSON's own end)
    bare_json: bool  # a JSON call object as the whole answer counts too
    args_key: str  # the key the arguments go under in the JSON form
    keep_special_tokens: bool  # the markers are special tokens: keep them in the text
    special_ids: tuple[tuple[str, int], ...] = ()  # marker -> token id (for grammars)

    def token_id(self, marker: str) -> int | None:
        return dict(self.special_ids).get(marker)


def _ids(tokenizer, *markers: str) -> tuple[tuple[str, int], ...]:
    out = []
    for m in markers:
        i = tokenizer.token_to_id(m)
        if i is not None:
            out.append((m, int(i)))
    return tuple(out)


def tool_format_for(tokenizer) -> ToolFormat:
    """The tool-call format of a model, from its chat template and vocabulary."""
    template = getattr(tokenizer, "chat_template", None) or ""
    native = bool(getattr(tokenizer, "has_chat_template", False)) and "tools" in template
    vocab_has = lambda t: tokenizer.token_to_id(t) is not None  # noqa: E731
    if vocab_has("<|tool_call>") and vocab_has("<tool_call|>"):
        return ToolFormat(
            "gemma4",
            native,
            "<|tool_call>",
            "<tool_call|>",
            False,
            "arguments",
            True,
            _ids(tokenizer, "<|tool_call>", "<tool_call|>", '<|"|>'),
        )
    if vocab_has("[TOOL_CALLS]"):
        return ToolFormat(
            "mistral",
            native,
            "[TOOL_CALLS]",
            None,
            False,
            "arguments",
            True,
            _ids(tokenizer, "[TOOL_CALLS]", "[ARGS]"),
        )
    if native and "<tool_call>" in template:
        return ToolFormat("hermes", True, "<tool_call>", "</tool_call>", True, "arguments", False)
    if native and ("<|python_tag|>" in template or "<|start_header_id|>" in template):
        return ToolFormat(
            "llama3",
            True,
            "<|python_tag|>",
            None,
            True,
            "parameters",
            True,
            _ids(tokenizer, "<|python_tag|>"),
        )
    # A template that renders tools in a way not known here still gets them rendered;
    # the answer is read the generic way.
    return ToolFormat("generic", native, "<tool_call>", "</tool_call>", True, "arguments", False)
