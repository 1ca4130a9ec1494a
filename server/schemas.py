"""OpenAI request and response shapes, in one module.

Requests are validated from the raw JSON body in strict mode (``"5"`` is not an
integer, as with OpenAI) and unknown fields are ignored. Parameters OpenAI
accepts but markbase does not implement are accepted at their neutral value
and rejected otherwise by ``unsupported()``, so nothing is silently ignored.
Responses are plain pydantic models dumped with every key, ``null`` included,
because the ``openai`` SDK and other clients expect OpenAI's exact keys. Stream
chunks are built as dicts by the routes (chat.ChatFormat, completions.
CompletionFormat); error bodies by server.errors.error_body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_SEQUENCES = 4  # OpenAI's limit


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}: server.structured


class GuidedFields(_Request):
    """Structured output: OpenAI's ``response_format`` and vLLM's ``guided_*`` extras
    (at most one of them a request; server/structured.py turns it into a grammar)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


StopParam = Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)]


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | StopParam | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # int64, as OpenAI
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # token id (as a string, OpenAI's form) -> added to its logit; ids checked against
    # the model's vocabulary by the route (server.sampling_extras.logit_bias)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None  # accepted and ignored
    # Extensions most OpenAI-compatible servers accept (vLLM, llama-server).
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)


# --------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields, GuidedFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "best_of is not supported; omit it or set it equal to n."
        if self.suffix:
            return (
                "suffix",
                "suffix (text after the completion, fill-in-the-middle) is not supported; "
                "send null or omit it.",
            )
        return None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids (may be empty)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- chat


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, GuidedFields):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # accepted and ignored (OpenAI's bookkeeping fields; nothing is stored here)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return (
                "top_logprobs",
                "top_logprobs needs logprobs: send 'logprobs': true with it, or omit it.",
            )
        if self.functions:
            return "functions", "The deprecated 'functions' is not supported; send 'tools'."
        if self.function_call is not None and self.function_call not in ("none", "auto"):
            return (
                "function_call",
                "The deprecated 'function_call' is not supported; send 'tool_choice'.",
            )
        return None

    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# --------------------------------------------------------------------------- tokenize


class TokenizeRequest(_Request):
    """vLLM's /tokenize body: text (``prompt``) or a conversation (``messages``, through
    the chat template), not both."""

    model: str | None = None  # None: the only served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # prompt: default true (BOS); messages: false
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """The legacy completions' logprobs: parallel lists, one entry a token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text as the model wrote it (may be cut short by max_tokens)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "markbase"
    # Extensions (the openai SDK keeps unknown keys): what a client may want to know.
    context_length: int | None = None
    architecture: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body (see server.errors); only for /openapi.json."""

    error: ErrorDetail
