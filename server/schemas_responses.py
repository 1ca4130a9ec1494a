"""Request shapes of OpenAI's Responses API (``POST /v1/responses``).

Kept apart from server/schemas.py (the Chat and Completions shapes) because a Responses
request is translated into a chat request (server/routes/responses.py) and answered
through the same engine path; only the edges differ. Validation is strict, as for the
other endpoints; fields OpenAI accepts that do not change what this server does
(``store``, ``metadata``, ``user``, ``truncation``, ``include``, ``reasoning``) are
accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponsesFunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedChoice(_Request):
    type: Literal["function"]
    name: str


class ResponsesTextConfig(_Request):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


class ResponseObject(BaseModel):
    """The ``response`` object (for /openapi.json; the route builds it as a dict)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
