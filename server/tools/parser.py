"""Tool calls out of generated text, incrementally: the same parser streams and not.

``ToolCallParser.feed(text)`` takes the next piece of a choice's text and returns what
can be told already, as OpenAI streams it: ``Content`` (text outside calls),
``CallStart`` (call i's id and function name, once the name is known) and ``ArgsDelta``
(the next fragment of call i's arguments, as the model writes them). ``finish()`` says
what is left at the end. A non-streamed answer feeds the whole text at once and reads
``content`` and ``calls``, so both ways give the same calls.

What is held back: a possible start of the call marker at the end of a piece (until the
next piece decides), a call until its function name is known, and trailing whitespace
(dropped when a call follows, kept otherwise). Anything that looks like a call but is not
one (no name, not JSON) is returned as content; arguments cut short (max_tokens) stay
as the fragment written so far. Nothing here raises on model output.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from server.tools.formats import ToolFormat


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    index: int
    fragment: str


Delta = Content | CallStart | ArgsDelta


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


# The head of a JSON call object up to its arguments value: name first (how every
# family writes it); other orders are read once the object is complete.
_HEAD = re.compile(
    r'\s*\{\s*"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*'
)

TEXT, HEAD, ARGS, OBJECT_TAIL, AFTER_CALL, MISTRAL_START, MISTRAL_NAME, GEMMA = range(8)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ValueScanner:
    """Finds where one JSON value ends, piece by piece (strings and nesting aware)."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth  # > 0: already inside an object or list
        self.in_str = False
        self.escape = False
        self.kind = "container" if depth else None  # container | string | scalar

    def feed(self, s: str) -> tuple[int, bool]:
        """How many characters of ``s`` belong to the value, and whether it ended."""
        for i, c in enumerate(s):
            if self.kind is None:
                if c in "{[":
                    self.kind, self.depth = "container", 1
                elif c == '"':
                    self.kind, self.in_str = "string", True
                else:
                    self.kind = "scalar"
                continue
            if self.kind == "scalar":
                if c in ",}] \t\r\n":
                    return i, True
                continue
            if self.in_str:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_str = False
                    if self.kind == "string":
                        return i + 1, True
                continue
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(s), False


def json_value_end(text: str, start: int) -> int:
    """Index just past the JSON value starting at ``text[start]`` (-1: not ended)."""
    n, done = ValueScanner().feed(text[start:])
    return start + n if done else -1


def partial_suffix(text: str, marker: str | None) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    if not marker:
        return 0
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def call_from_object(obj, args_key: str, need_args: bool = False) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object, or None if it is not one
    (``need_args``: without an arguments key it is not, as for a bare JSON answer)."""
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function")
    if isinstance(fn, dict):  # {"function": {"name", "arguments"}} (OpenAI's own shape)
        obj = fn
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in (args_key, "arguments", "parameters"):
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # arguments already as JSON text
                return name, args
            return name, json.dumps(args, ensure_ascii=False)
    return None if need_args else (name, "{}")


class ToolCallParser:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""  # text not yet told
        self.state = TEXT
        self.calls: list[ParsedCall] = []
        self._content: list[str] = []  # every Content told, for ``content``
        self._held_ws = ""  # whitespace-only text held back
        self._at_start = True  # nothing but whitespace so far (a bare JSON call may come)
        self._head_skip = 0  # HEAD: where the JSON object starts in buf
        self._tagged = False  # the call being read began with open_tag
        self._in_list = False  # mistral: inside [TOOL_CALLS][ ... ]
        self._scan: ValueScanner | None = None
        self._string_args = ""  # arguments written as a JSON string: decoded at its end

    # -- public ------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while self._advance(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while self._advance(out, final=True):
            pass
        if self.state == GEMMA and self.buf:
            self._gemma_truncated(out)
        elif self.state in (HEAD, MISTRAL_START, MISTRAL_NAME) and self.buf:
            if self._tagged:  # a call marker, then the end: an unfinished call, not text
                self._drop_unfinished_call()
            else:
                self._say(out, self.buf)
        elif self.state == ARGS and self._scan is not None and self._scan.kind == "string":
            self._args(out, self._string_args)  # cut short: as written
        elif self.state == TEXT and self.buf:
            self._say(out, self.buf)
        self.buf = ""
        if self._held_ws and not self.calls:
            out.append(Content(self._held_ws))
            self._content.append(self._held_ws)
        self._held_ws = ""
        return out

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return None if self.calls and not text.strip() else text

    # -- telling -----------------------------------------------------------------------
    def _say(self, out: list[Delta], text: str) -> None:
        """Text outside calls; trailing whitespace waits for what follows it (dropped
        before a call, so streamed and whole answers split the same way)."""
        if not text:
            return
        text = self._held_ws + text
        told = text.rstrip()
        self._held_ws = text[len(told) :]
        if told:
            out.append(Content(told))
            self._content.append(told)

    def _start(self, out: list[Delta], name: str) -> None:
        self._held_ws = ""  # whitespace before a call is not content
        call = ParsedCall(new_call_id(), name)
        self.calls.append(call)
        out.append(CallStart(len(self.calls) - 1, call.id, name))

    def _args(self, out: list[Delta], fragment: str) -> None:
        if fragment:
            self.calls[-1].arguments += fragment
            out.append(ArgsDelta(len(self.calls) - 1, fragment))

    # -- the state machine ---------------------------------------------------------------
    def _advance(self, out: list[Delta], final: bool) -> bool:
        """One step on ``buf``; False when it needs more text (or, ``final``, is done)."""
        state = self.state
        if state == TEXT:
            return self._text(out, final)
        if state == HEAD:
            return self._head(out, final)
        if state == ARGS:
            return self._read_args(out, final)
        if state == OBJECT_TAIL:
            return self._object_tail(final)
        if state == AFTER_CALL:
            return self._after_call(out, final)
        if state == MISTRAL_START:
            return self._mistral_start(out, final)
        if state == MISTRAL_NAME:
            return self._mistral_name(out, final)
        return self._gemma(out, final)

    def _text(self, out: list[Delta], final: bool) -> bool:
        fmt, buf = self.fmt, self.buf
        if fmt.bare_json and self._at_start:
            body = buf.lstrip()
            if not body:
                return False
            self._at_start = False
            if body[0] == "{":
                self.buf, self._head_skip, self._tagged = body, 0, False
                self.state = HEAD
                return True
        j = buf.find(fmt.open_tag) if fmt.open_tag else -1
        if j >= 0:
            self._at_start = False
            self._say(out, buf[:j])
            self.buf = buf[j:]
            self._tagged = True
            if fmt.name == "mistral":
                self.buf = buf[j + len(fmt.open_tag) :]
                self.state = MISTRAL_START
            elif fmt.name == "gemma4":
                self.state = GEMMA
            else:
                self._head_skip = len(fmt.open_tag)
                self.state = HEAD
            return True
        keep = partial_suffix(buf, fmt.open_tag)
        if final and keep < 2:  # a lone "<" or "[" at the end is text
            keep = 0
        if len(buf) > keep:
            self._say(out, buf[: len(buf) - keep])
            self.buf = buf[len(buf) - keep :]
        if final and keep:  # the answer ends in the start of a marker: a call cut short
            self._drop_unfinished_call()
        return False

    def _head(self, out: list[Delta], final: bool) -> bool:
        buf, skip = self.buf, self._head_skip
        body = buf[skip:].lstrip()
        if not body:
            return False
        if body[0] != "{":  # not a JSON call after the marker: the marker is text
            self._not_a_call(out, skip)
            return True
        m = _HEAD.match(buf, skip)
        if m:
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                name = m.group(1)
            self._start(out, name)
            self.buf = buf[m.end() :]
            self._scan = ValueScanner()
            self.state = ARGS
            return True
        start = len(buf) - len(body)
        end = json_value_end(buf, start)
        if end < 0 and not final:
            return False
        if end < 0 and self._tagged:  # cut short inside a marked call, its name unread
            self._drop_unfinished_call()
            return True
        try:
            obj = json.loads(buf[start:end] if end >= 0 else buf[start:])
        except ValueError:
            obj = None
        call = call_from_object(obj, self.fmt.args_key, need_args=not self._tagged)
        if call is None:
            self._not_a_call(out, end if end >= 0 else len(buf))
            return True
        self._start(out, call[0])
        self._args(out, call[1])
        self.buf = buf[end:] if end >= 0 else ""
        self.state = AFTER_CALL
        return True

    def _drop_unfinished_call(self) -> None:
        """max_tokens cut a call before its name was complete. The marker and the
        start of its JSON are neither content nor a call: the streamed answer held
        them back, and the whole answer leaves them out the same way."""
        self._in_list = False
        self.buf = self._held_ws = ""  # as before a call, the whitespace before it too
        self.state = TEXT

    def _not_a_call(self, out: list[Delta], upto: int) -> None:
        self._in_list = False
        self._say(out, self.buf[:upto])
        self.buf = self.buf[upto:]
        self.state = TEXT

    def _read_args(self, out: list[Delta], final: bool) -> bool:
        scan = self._scan
        if scan.kind is None:
            body = self.buf.lstrip()
            if not body:
                return False
            self.buf = body
        n, done = scan.feed(self.buf)
        piece, self.buf = self.buf[:n], self.buf[n:]
        if scan.kind == "string":  # arguments as a JSON string of JSON: told decoded, whole
            self._string_args += piece
            if done:
                try:
                    decoded = json.loads(self._string_args)
                except ValueError:
                    decoded = self._string_args
                self._args(out, decoded if isinstance(decoded, str) else self._string_args)
                self._string_args = ""
        else:
            self._args(out, piece)
        if not done:
            return False
        if self.fmt.name == "mistral" and not self._in_list:  # f[ARGS]{...}: no outer object
            self.state = TEXT
        else:
            self._scan = ValueScanner(depth=1)
            self.state = OBJECT_TAIL
        return True

    def _object_tail(self, final: bool) -> bool:
        """The rest of the call object after its arguments (usually just ``}``)."""
        n, done = self._scan.feed(self.buf)
        self.buf = self.buf[n:]
        if done:
            self.state = AFTER_CALL
            return True
        return False

    def _after_call(self, out: list[Delta], final: bool) -> bool:
        fmt, buf = self.fmt, self.buf
        rest = buf.lstrip()
        if self._in_list:  # mistral list: "," next call, "]" end
            if not rest:
                return False
            if rest[0] == ",":
                self.buf, self._head_skip, self.state = rest[1:], 0, HEAD
                return True
            self._in_list = False
            self.buf = rest[1:] if rest[0] == "]" else rest
            self.state = TEXT
            return True
        if self._tagged and fmt.close_tag:
            j = buf.find(fmt.close_tag)
            if j >= 0:  # anything between the object and the close tag is dropped
                self.buf = buf[j + len(fmt.close_tag) :]
                self.state = TEXT
                return True
            if rest and not fmt.close_tag.startswith(rest[: len(fmt.close_tag)]):
                self.state = TEXT  # no close tag: what follows is text
                return True
            if final:  # cut short inside the close tag: nothing more to tell
                self.buf, self.state = "", TEXT
            return False
        if fmt.name == "llama3":  # several calls joined by ";"
            rest = rest.lstrip("; \t\r\n")
            if not rest:
                if final:
                    self.buf, self.state = "", TEXT
                return False
            if rest[0] == "{":
                self.buf, self._head_skip, self._tagged, self.state = rest, 0, False, HEAD
                return True
        self.state = TEXT
        return True

    # -- mistral -----------------------------------------------------------------------
    def _mistral_start(self, out: list[Delta], final: bool) -> bool:
        rest = self.buf.lstrip()
        if not rest:
            return False
        if rest[0] == "[":
            self._in_list = True
            self.buf, self._head_skip, self.state = rest[1:], 0, HEAD
        else:
            self.buf, self.state = rest, MISTRAL_NAME
        return True

    def _mistral_name(self, out: list[Delta], final: bool) -> bool:
        j = self.buf.find("[ARGS]")
        if j < 0:
            return False
        name = self.buf[:j].strip()
        name = re.sub(r"\[CALL_ID\].*$", "", name).strip()
        self._start(out, name)
        self.buf = self.buf[j + len("[ARGS]") :]
        self._scan = ValueScanner()
        self.state = ARGS
        return True

    # -- gemma 4 -----------------------------------------------------------------------
    def _gemma(self, out: list[Delta], final: bool) -> bool:
        fmt = self.fmt
        j = self.buf.find(fmt.close_tag, len(fmt.open_tag))
        if j < 0:
            return False
        body = self.buf[len(fmt.open_tag) : j]
        call = gemma4_call(body)
        if call is None:
            self._say(out, self.buf[: j + len(fmt.close_tag)])
        else:
            self._start(out, call[0])
            self._args(out, call[1])
        self.buf = self.buf[j + len(fmt.close_tag) :]
        self.state = TEXT
        return True

    def _gemma_truncated(self, out: list[Delta]) -> None:
        body = self.buf[len(self.fmt.open_tag) :]
        m = re.match(r"\s*call:\s*([^{\s]+)\s*", body)
        if m is None:
            self._say(out, self.buf)
            return
        self._start(out, m.group(1))
        rest = body[m.end() :]
        call = gemma4_call(body)
        self._args(out, call[1] if call else rest)


# -- Gemma 4's argument syntax -> JSON -----------------------------------------------------

GEMMA_QUOTE = '<|"|>'


def gemma4_call(body: str) -> tuple[str, str] | None:
    """``call:NAME{key:value,...}`` -> (NAME, arguments as JSON); None if unreadable."""
    m = re.match(r"\s*call:\s*([^{\s]+)\s*", body)
    if m is None:
        return None
    try:
        value, end = _gemma_value(body, m.end())
    except (ValueError, IndexError):
        return None
    if not isinstance(value, dict) or body[end:].strip():
        return None
    return m.group(1), json.dumps(value, ensure_ascii=False)


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _gemma_value(s: str, i: int):
    i = _skip_ws(s, i)
    if s.startswith(GEMMA_QUOTE, i):
        j = s.index(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
        return s[i + len(GEMMA_QUOTE) : j], j + len(GEMMA_QUOTE)
    c = s[i]
    if c == "{":
        out: dict = {}
        i = _skip_ws(s, i + 1)
        while s[i] != "}":
            if s.startswith(GEMMA_QUOTE, i):
                key, i = _gemma_value(s, i)
            elif s[i] == '"':
                end = json_value_end(s, i)
                key, i = json.loads(s[i:end]), end
            else:
                j = s.index(":", i)
                key, i = s[i:j].strip(), j
            i = _skip_ws(s, i)
            if s[i] != ":":
                raise ValueError("expected ':'")
            out[key], i = _gemma_value(s, i + 1)
            i = _skip_ws(s, i)
            if s[i] == ",":
                i = _skip_ws(s, i + 1)
        return out, i + 1
    if c == "[":
        items = []
        i = _skip_ws(s, i + 1)
        while s[i] != "]":
            item, i = _gemma_value(s, i)
            items.append(item)
            i = _skip_ws(s, i)
            if s[i] == ",":
                i = _skip_ws(s, i + 1)
        return items, i + 1
    if c == '"':
        end = json_value_end(s, i)
        return json.loads(s[i:end]), end
    m = re.compile(r"[^,}\]\s]+").match(s, i)
    if m is None:
        raise ValueError("expected a value")
    word = m.group(0)
    try:
        return json.loads(word), m.end()
    except ValueError:
        return word, m.end()  # a bare word: a string
