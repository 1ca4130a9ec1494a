"""The browser pages: the chat page at ``/``, the dashboard at ``/dashboard``, and
their scripts and styles under ``/static/``. Plain files from ``server/static/``:
no build step, nothing fetched from elsewhere. Public even when the server has API
keys: the pages ask for the key and send it with their own API calls."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"
NO_CACHE = {"Cache-Control": "no-cache"}  # revalidate: a new version shows on reload

router = APIRouter(include_in_schema=False)


@router.get("/")
async def chat_page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=NO_CACHE)


@router.get("/dashboard")
async def dashboard_page() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", headers=NO_CACHE)


def mount_static(app) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
