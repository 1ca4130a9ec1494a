"""Grammar specs -> compiled llguidance matchers, cached per model.

``GrammarCompiler.compile`` validates a spec against the model's vocabulary and keeps
the compiled matcher (an LRU of ``MAX_CACHED``); ``GrammarCompiler.matcher`` hands a
sequence its own copy (``LLMatcher.deep_copy``, cheap: the lexer and token trie are
shared). The HTTP layer calls ``compile`` before it queues a request (in a thread: the
first call builds the token bridge), so a bad schema is a 400 and the worker only ever
copies.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from engine.structured.bridge import build_token_bridge
from engine.types import GrammarError, GrammarSpec

MAX_CACHED = 64  # compiled grammars kept per model

# JSON output as OpenAI's structured outputs write it: no free whitespace between
# tokens (a small model otherwise pads with newlines until max_tokens), one optional
# space after ':' and ','.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) for ``spec``; GrammarError if the spec's
    text cannot be read at all (finer checks happen in ``GrammarCompiler.compile``)."""
    kind, text = spec.kind, spec.source
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict | bool):
                raise GrammarError("A JSON schema must be an object (or true/false).")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("Choices must be a non-empty list of strings.")
            lark = "start: " + " | ".join(json.dumps(c) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(text)
        if kind == "gbnf":
            return llguidance.grammar_from("gbnf", text)
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"Invalid {kind.replace('_', ' ')}: {exc}") from None
    raise GrammarError(f"Unknown grammar kind {kind!r}.")


class SequenceGrammar:
    """One sequence's place in its grammar: fed each sampled token, asked for the
    next mask (by ``MaskFiller``) and whether the output is complete."""

    __slots__ = ("matcher", "error", "_ahead", "_stopped")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None
        self._ahead: tuple[int, bool] | None = None
        self._stopped: bool | None = None  # ``done`` as of the last token fed ahead

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and ``error`` set) if the grammar refused it.
        A token already fed by ``feed_ahead`` is not fed again: its answer is returned."""
        if self._ahead is not None:
            ahead, ok = self._ahead
            self._ahead = None
            if ahead != int(token):
                raise RuntimeError(f"grammar fed token {ahead} ahead, then given {token}")
            return ok
        return self._consume(token)

    def feed_ahead(self, token: int) -> None:
        """``accept`` now, ahead of handing the token on: the pipelined step feeds the
        grammars, fills the next masks while the forward is queued, then hands the
        tokens on, whose ``accept(token)`` and ``done`` take this answer without
        touching the matcher: the hand-on runs while the next mask is being filled."""
        if self._ahead is not None:
            raise RuntimeError("grammar fed ahead twice")
        ok = self._consume(token)
        self._stopped = self.matcher.is_stopped()
        self._ahead = (int(token), ok)

    def _consume(self, token: int) -> bool:
        self._stopped = None
        if self.matcher.consume_token(int(token)):
            return True
        self.error = self.matcher.get_error() or f"token {token} is not allowed here"
        return False

    @property
    def done(self) -> bool:
        """Nothing more can follow (end of sequence is the only choice left)."""
        if self._stopped is not None:
            return self._stopped
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles and caches the grammars of one model; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, max_cached: int = MAX_CACHED) -> None:
        self._tokenizer = tokenizer
        # a model served without a real tokenizer (benchmarks) has no vocab_size
        self.vocab_size = max(int(vocab_size), int(getattr(tokenizer, "vocab_size", 0) or 0))
        self._bridge: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._max = max_cached
        self._lock = threading.Lock()
        self._bridge_lock = threading.Lock()

    @property
    def bridge(self) -> llguidance.LLTokenizer:
        if self._bridge is None:
            with self._bridge_lock:
                if self._bridge is None:
                    self._bridge = build_token_bridge(self._tokenizer, self.vocab_size)
        return self._bridge

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled matcher for ``spec`` (from the cache when seen before); raises
        GrammarError naming what llguidance refused (e.g. ``Unimplemented keys: ["not"]``)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = grammar_source(spec)
        bridge = self.bridge
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, bridge)
        if is_error:
            raise GrammarError(_first_line(messages[0] if messages else "invalid grammar"))
        matcher = llguidance.LLMatcher(bridge, grammar, log_level=0)
        # The first mask builds the lexer; errors that only show then (a regex too
        # complex for its limits) are the request's, not a later step's.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        with self._lock:
            self._cache[spec] = matcher
            self._cache.move_to_end(spec)
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: GrammarSpec) -> SequenceGrammar:
        """A fresh matcher for one sequence (compiles on a cache miss)."""
        return SequenceGrammar(self.compile(spec).deep_copy())


def _first_line(message: str) -> str:
    """llguidance's message without the grammar dump some errors carry."""
    text = message.strip()
    return text if len(text) <= 500 else text[:500] + "..."
