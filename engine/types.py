"""Data objects at the seam between the HTTP layer and the engine.

The server builds a ``GenerationRequest`` from an OpenAI request, hands it to
``EngineClient.generate`` and reads ``TokenEvent``s back. Nothing here holds an
MLX array, so the HTTP layer never imports MLX.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# tokens a block of the two-level draw (engine/sampler.py): the CUDA kernel
# (engine/backends/cuda/sampler.py) draws with the same blocks, so a row's two uniforms
# pick the same token either way
DRAW_BLOCK = 256


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # client went away or the server is shutting down
    ERROR = "error"  # this sequence failed; the rest of the batch goes on


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence decoding settings; every row of a batch may differ."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities (engine/logprobs.py): None = off; k >= 0 = each generated
    # token's logprob and the k most likely tokens at its position.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token (echo)
    # Logit adjustments (engine/penalties.py); each at its neutral value is off.
    frequency_penalty: float = 0.0  # OpenAI: minus penalty x count, generated tokens
    presence_penalty: float = 0.0  # OpenAI: minus penalty once, generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: divides (>0) / multiplies, prompt + generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens under min_p x the most likely one's probability
    min_tokens: int = 0  # end tokens (EOS, stop_token_ids) masked until this many


@dataclass(slots=True)
class TokenLogprob:
    """One position's log-probabilities (engine/logprobs.py says which ones): the
    token's own and the ``top`` most likely (token id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GrammarSpec:
    """What a sequence's output must match, enforced by a token mask
    (engine/structured). ``kind``: "json_schema" (``source`` is the schema as JSON
    text), "regex", "choice" (a JSON list of strings), "lark" (llguidance's Lark
    dialect) or "gbnf" (llama.cpp's grammar format). Equal specs share one compiled
    grammar."""

    kind: str
    source: str


@dataclass
class GenerationRequest:
    request_id: str
    model: str
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    grammar: GrammarSpec | None = None  # constrained decoding; None: free text
    # Keep special tokens in the text: tool-call markers such as Mistral's [TOOL_CALLS]
    # or Gemma 4's <|tool_call>, which the tool-call parser must see.
    skip_special_tokens: bool = True


@dataclass(slots=True)
class TokenEvent:
    """One step of one sequence: new text (stop strings already cut) and, at the
    end, why it finished. ``text`` may be empty while a possible stop string or
    an incomplete UTF-8 sequence is held back.

    Read-only by convention, not frozen: the worker makes one per row and token, and
    a frozen dataclass's ``__init__`` (``object.__setattr__`` per field) costs about
    2 us more each time."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: str | None = None  # "overloaded" | "engine_dead" | "internal" | "context_length"
    # With params.logprobs: one per token of ``token_ids``, in order.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # With params.prompt_logprobs, on the first event only: one per prompt token, the
    # first None (nothing precedes it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer may know about a served model."""

    name: str
    architecture: str
    context_length: int
    source: str
    created: int
    has_chat_template: bool


class EngineError(Exception):
    """Base of errors the engine reports to callers; each maps to one HTTP status."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None
    param: str | None = None


class UnknownModelError(EngineError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"
    param = "model"


class ContextLengthError(EngineError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "context_length_exceeded"
    param = "messages"


class GrammarError(EngineError):
    """A grammar or JSON schema the grammar engine refuses (a syntax error, an
    unsupported schema keyword); the message names what."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_grammar"


class OverloadedError(EngineError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "overloaded"


class EngineDeadError(EngineError):
    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"
