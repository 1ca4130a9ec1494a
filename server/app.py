"""``create_app(engine_client, settings)``: the FastAPI app over a started engine.

Middleware, outermost first: request context (x-request-id, metrics, access
log), CORS when configured, API-key auth. All are pure ASGI so streams are not
buffered. The engine is started and shut down by the caller (server.cli).
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.middleware.cors import CORSMiddleware

from server.auth import AuthMiddleware
from server.config import Settings
from server.deps import DOCUMENTED_BODIES
from server.errors import install_handlers
from server.generation import Engine
from server.lifespan import lifespan
from server.middleware import RequestContextMiddleware
from server.openapi_served import describe_server
from server.prompt_guard import PromptGuard
from server.routes import chat, completions, health, models, responses, stats, tokenize, ui


def create_app(engine_client: Engine, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(
        title="markbase",
        description="OpenAI-compatible inference server on MLX",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,  # /v1/stats sampling; logs where the pages are
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.state.engine = engine_client
    app.state.settings = settings
    app.state.prompt_guard = PromptGuard(
        settings.server.large_prompt_bytes, settings.server.max_large_tokenizations
    )
    for module in (models, completions, chat, responses, tokenize, health, stats, ui):
        app.include_router(module.router)
    ui.mount_static(app)
    install_handlers(app)

    s = settings.server
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(AuthMiddleware, api_keys=s.api_keys, protect_metrics=s.metrics_require_auth)
    if s.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=s.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID"],
        )
    app.add_middleware(RequestContextMiddleware, log_requests=s.log_requests)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies the routes read themselves
    (server.deps.json_body), as components, and what this server serves and allows
    (server.openapi_served)."""
    if app.openapi_schema is None:
        with warnings.catch_warnings():  # /health is GET and HEAD: one id, two operations
            warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
        _, defs = models_json_schema(
            [(m, "validation") for m in DOCUMENTED_BODIES],
            ref_template="#/components/schemas/{model}",
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        engine = app.state.engine
        try:
            served = list(engine.models())
            tokenizers = {m.name: engine.tokenizer(m.name) for m in served}
        except Exception:  # noqa: BLE001 - a stand-in engine (tests) that serves nothing
            served, tokenizers = [], {}
        describe_server(schema, served, app.state.settings.server, tokenizers)
        app.openapi_schema = schema
    return app.openapi_schema
