"""What the app does while it starts and stops (FastAPI's lifespan): the metrics
recorder behind ``/v1/stats`` runs, and the log says where the pages are and how long
the process took to get there."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator

from server.stats import recording

log = logging.getLogger("markbase.server")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), else None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time
    except (OSError, ValueError, IndexError):
        return None


@contextlib.asynccontextmanager
async def lifespan(app) -> AsyncIterator[None]:
    async with recording(app):
        settings = getattr(app.state, "settings", None)
        if settings is not None:
            host, port = settings.server.host, settings.server.port
            shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            base = f"http://{shown}:{port}"
            age = process_age_s()
            log.info(
                "ready%s: chat page %s/ · dashboard %s/dashboard · API %s/v1",
                f" {age:.1f} s after start" if age is not None else "",
                base,
                base,
                base,
            )
        yield
