"""A sequence's life inside the engine, named explicitly.

WAITING -> PREFILLING -> RUNNING -> FINISHED. A sequence is prefilled on its own
caches chunk by chunk, then joins the running batch (engine/cache_layout.py) where it
decodes one token per step until EOS, a stop string, max_tokens, the context
window, an abort or an error ends it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampler import RowSampler
from engine.structured import SequenceGrammar
from engine.types import FinishReason, GenerationRequest, TokenLogprob


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class StopMatcher:
    """Cuts generated text at the first stop string, also across token boundaries.

    Text that could still be the start of a stop string is held back until the
    next token decides it, so a stop string is never emitted, not even in part.
    A stop string or a held tail starts with the first character of some stop
    string: text without one, and nothing held, passes at once; otherwise only the
    places of those characters in the last ``hold`` characters are tried as tails.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self._firsts = tuple(sorted({s[0] for s in self.stops}))

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string matched)."""
        stops = self.stops
        if not stops:
            return text, False
        if not self.pending:
            for c in self._firsts:
                if c in text:
                    break
            else:  # no stop string can start in it: nothing to cut, nothing to hold
                return text, False
        pending = self.pending + text
        if len(stops) == 1:
            cut = pending.find(stops[0])
        else:
            cut = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return pending[:cut], True
        # keep the longest tail (at most hold characters) that is a prefix of a stop string
        i = self._candidate(pending, max(0, len(pending) - self.hold)) if self.hold else -1
        while i >= 0:
            tail = pending[i:]
            if any(s.startswith(tail) for s in stops):
                self.pending = tail
                return pending[:i], False
            i = self._candidate(pending, i + 1)
        self.pending = ""
        return pending, False

    def _candidate(self, text: str, start: int) -> int:
        """The first place from ``start`` on where a stop string could begin, or -1."""
        firsts = self._firsts
        if len(firsts) == 1:
            return text.find(firsts[0], start)
        found = [i for i in (text.find(c, start) for c in firsts) if i >= 0]
        return min(found) if found else -1

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Sequence:
    request: GenerationRequest
    sampler: RowSampler | None  # set at admission, on the worker thread
    detokenizer: object  # engine.tokenizer.StreamingDetokenizer
    stop: StopMatcher
    eos_ids: frozenset[int]
    max_len: int  # context window: prompt + output may not pass it
    emit: object  # callable(TokenEvent), thread-safe, set by the worker
    state: SeqState = SeqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0  # output_ids already delivered in an event
    kv: object | None = None  # during prefill: engine.cache_layout.Caches (sequence forms)
    prefilled: int = 0  # prompt tokens already in kv (cached or computed)
    # Models with state layers: the prompt position whose state the prefix cache
    # keeps (the worker stops a chunk there), and that state once taken.
    state_at: int | None = None
    kept_state: tuple | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    next_token: int | None = None  # sampled, not yet fed to the model
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: FinishReason | None = None
    reserved_tokens: int = 0  # KV budget held for this sequence
    grammar: SequenceGrammar | None = None  # constrained decoding, set at admission
    # With params.logprobs: one per output_ids entry (engine/logprobs.py)
    logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs: one per prompt token computed so far (the first
    # None); sent with the first event, then dropped
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Derived once (the worker reads them for every token):
    end_ids: frozenset[int] = field(init=False)  # eos_ids and params.stop_token_ids
    output_limit: int = field(init=False)  # max output tokens: max_tokens and max_len

    def __post_init__(self) -> None:
        params = self.request.params
        self.end_ids = self.eos_ids | frozenset(params.stop_token_ids)
        self.output_limit = min(params.max_tokens, self.max_len - len(self.request.prompt_tokens))
        if params.logprobs is not None:
            self.logprobs = []
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt is prefilled from the start, alone, with every position's logits
        (engine/worker.py ``_prefill_chunk``): no cached prefix, no shared forward."""
        return self.request.params.prompt_logprobs is not None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_tokens

    @property
    def params(self):
        return self.request.params

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output_ids)
