"""GET /v1/stats: the last minutes of the engine's metrics as JSON time series.

The dashboard (``/dashboard``) draws these; ``server.stats`` says how they are made.
Under ``/v1``, so it needs the API key when the server has keys.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from server.deps import settings_of
from server.stats import StatsRecorder, series

router = APIRouter()


def recorder_of(request: Request) -> StatsRecorder:
    """The app's recorder (started by its lifespan), or one made now: an app run
    without its lifespan still answers, with the history since this first call."""
    state = request.app.state
    if getattr(state, "stats_recorder", None) is None:
        state.stats_recorder = StatsRecorder()
    return state.stats_recorder


@router.get("/v1/stats", summary="Recent engine metrics as time series, per model")
async def stats(
    request: Request,
    seconds: float = Query(300.0, gt=0, le=3600, description="how far back, in seconds"),
) -> JSONResponse:
    recorder = recorder_of(request)
    engine = settings_of(request).engine
    body = {
        "object": "stats",
        "interval_s": recorder.interval_s,
        "window_s": min(seconds, recorder.window_s),
        "limits": {
            "max_num_seqs": engine.max_num_seqs,
            "max_queued_requests": engine.max_queued_requests,
            "max_kv_tokens": engine.max_kv_tokens,
        },
        "models": series(recorder.recent(min(seconds, recorder.window_s))),
    }
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
