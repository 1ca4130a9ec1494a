"""A markbase server inside this process, on a free loopback port, for ``markbase chat
--model SRC``: the same app and engine as ``markbase serve``, so the terminal chat
goes through exactly the HTTP path every other client uses."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("markbase.cli")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(models: list[str], overrides: dict | None = None) -> Iterator[str]:
    """Load ``models`` (aliases, .gguf files or folders), serve them on 127.0.0.1 and
    yield the base URL; stops the server and the engine on exit."""
    import uvicorn

    from cli.main import prepare_mlx
    from server.config import load_settings, parse_model_arg

    prepare_mlx()
    from engine.client import EngineClient
    from engine.worker import release_mlx_thread_state
    from server.app import create_app

    port = free_port()
    settings = load_settings(
        None,
        overrides={
            **(overrides or {}),
            "models": [parse_model_arg(m) for m in models],
            "host": "127.0.0.1",
            "port": port,
        },
    )
    engine = EngineClient.start(settings.engine)
    try:
        app = create_app(engine, settings)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="markbase-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process HTTP server did not start")
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    finally:
        engine.shutdown()
        release_mlx_thread_state()
