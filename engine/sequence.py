"""A sequence's life inside the engine, named explicitly.

WAITING -> PREFILLING -> RUNNING -> FINISHED. A sequence is prefilled on its own
``SequenceKV`` chunk by chunk, then joins the running batch (``BatchKV``) where it
decodes one token per step until EOS, a stop string, max_tokens, the context
window, an abort or an error ends it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.kv import SequenceKV
from engine.sampler import RowSampler
from engine.types import FinishReason, GenerationRequest


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class StopMatcher:
    """Cuts generated text at the first stop string, also across token boundaries.

    Text that could still be the start of a stop string is held back until the
    next token decides it, so a stop string is never emitted, not even in part.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string matched)."""
        if not self.stops:
            return text, False
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        if self.hold == 0:
            out, self.pending = self.pending, ""
            return out, False
        # keep only the tail that is a prefix of some stop string
        keep = 0
        for k in range(min(self.hold, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

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
    kv: SequenceKV | None = None  # during prefill
    prefilled: int = 0  # prompt tokens already in kv (cached or computed)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    next_token: int | None = None  # sampled, not yet fed to the model
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: FinishReason | None = None
    reserved_tokens: int = 0  # KV budget held for this sequence
    # Derived once (the worker reads them for every token):
    end_ids: frozenset[int] = field(init=False)  # eos_ids and params.stop_token_ids
    output_limit: int = field(init=False)  # max output tokens: max_tokens and max_len

    def __post_init__(self) -> None:
        params = self.request.params
        self.end_ids = self.eos_ids | frozenset(params.stop_token_ids)
        self.output_limit = min(params.max_tokens, self.max_len - len(self.request.prompt_tokens))

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
