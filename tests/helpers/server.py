"""Start a real ``markbase serve`` subprocess for tests and wait until it is healthy.

    with running_server("smollm2-135m-instruct", "--max-num-seqs", "4") as srv:
        httpx.get(srv.url + "/v1/models")

A module-scoped fixture in each test module wraps it (this is not conftest.py).
The server listens on a free loopback port; its output goes to a log file whose
tail is shown if it fails to start (kept after a failure, or always with
MARKBASE_TEST_KEEP_LOGS=1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from server.config import setting_env_vars

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = float(os.environ.get("MARKBASE_TEST_START_TIMEOUT", "600"))


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    api_key: str | None
    proc: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def running_server(
    model: str | list[str] = DEFAULT_MODEL,
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
    cwd: Path = REPO,
) -> Iterator[Server]:
    """``cwd``: the source tree whose ``server.cli`` runs (bench/serve/hostile.py runs an
    older commit's beside this one's)."""
    models = [model] if isinstance(model, str) else list(model)
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for m in models:
        cmd += ["--model", m]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(args)
    # The caller's settings variables would change what is tested; others stay
    # (MARKBASE_CACHE_DIR keeps converted weights and tokenizers between runs).
    ours = setting_env_vars()
    child_env = {k: v for k, v in os.environ.items() if k not in ours}
    child_env.update(env or {})
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    log_file = tempfile.NamedTemporaryFile(prefix=f"markbase-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdout=log_file, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", api_key, proc, Path(log_file.name))
    ok = False
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"markbase serve exited with {proc.returncode} before it was healthy:\n"
                    + server.log_tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"markbase serve not healthy after {timeout_s:.0f} s:\n" + server.log_tail()
                )
            time.sleep(0.25)
        yield server
        ok = True
    finally:
        _stop(proc)
        log_file.close()
        if ok and not os.environ.get("MARKBASE_TEST_KEEP_LOGS"):
            server.log_path.unlink(missing_ok=True)
