"""GET /health (engine liveness, never behind auth) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from server.deps import engine_of

router = APIRouter()


@router.api_route(
    "/health",
    methods=["GET", "HEAD"],
    responses={503: {"description": "The engine is not running"}},
)
async def health(request: Request) -> JSONResponse:
    try:
        state = engine_of(request).health()
    except Exception as exc:  # noqa: BLE001 - a failing health check is a 503, not a 500
        state = {"status": "error", "detail": f"health check failed: {exc}"}
    return JSONResponse(state, status_code=200 if state.get("status") == "ok" else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
