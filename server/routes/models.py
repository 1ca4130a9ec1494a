"""GET /v1/models and GET /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from engine.types import ModelInfo, UnknownModelError
from server.deps import engine_of, responses
from server.errors import APIError
from server.schemas import ModelCard, ModelList

router = APIRouter()


def card(m: ModelInfo) -> ModelCard:
    return ModelCard(
        id=m.name, created=m.created, context_length=m.context_length, architecture=m.architecture
    )


def unknown_model(name: str) -> APIError:
    return APIError(
        404,
        f"The model '{name}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def lookup(request: Request, name: str) -> ModelInfo:
    try:
        return engine_of(request).get_model(name)
    except UnknownModelError:
        raise unknown_model(name) from None


@router.get("/v1/models", response_model=None, responses=responses(ModelList))
async def list_models(request: Request) -> dict:
    return ModelList(data=[card(m) for m in engine_of(request).models()]).model_dump()


@router.get("/v1/models/{model_id:path}", response_model=None, responses=responses(ModelCard))
async def get_model(request: Request, model_id: str) -> dict:
    return card(lookup(request, model_id)).model_dump()
