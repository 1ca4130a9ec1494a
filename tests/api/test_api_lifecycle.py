"""A real ``markbase serve`` configured from a YAML file, environment and flags
together. Its request timeout ends a stream mid-way with an error event and
``[DONE]`` and a plain request with 504; then it is stopped with SIGINT while
a stream is in flight: that stream must also end with an error event and
``[DONE]`` (not a cut connection) and the process must exit cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.server import DEFAULT_MODEL, running_server

pytestmark = pytest.mark.slow

TIMEOUT_S = 8  # the server's request timeout: room for a slow first token on CPU
AUTH = {"Authorization": "Bearer env-key"}
LONG = {  # runs until something stops it
    "model": DEFAULT_MODEL,
    "prompt": "Count from one to one thousand:",
    "max_tokens": 2000,
    "ignore_eos": True,
}


def data_lines(text: str) -> list[str]:
    return [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]


def test_config_layers_timeout_and_shutdown_mid_stream(tmp_path):
    config = tmp_path / "markbase.yaml"
    config.write_text("server:\n  max_n: 5\n  shutdown_grace_s: 30\nengine:\n  max_num_seqs: 4\n")
    env = {"MARKBASE_MAX_N": "2", "MARKBASE_API_KEY": "env-key"}
    flags = ["--config", str(config), "--shutdown-grace-s", "1"]
    flags += ["--request-timeout-s", str(TIMEOUT_S)]
    with running_server(DEFAULT_MODEL, *flags, env=env) as srv:
        url = srv.v1 + "/completions"
        # YAML said max_n 5, the environment 2: the environment wins.
        r = httpx.post(url, json={**LONG, "n": 3, "max_tokens": 1}, headers=AUTH)
        assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"]

        # The request timeout, streaming and not, both at once.
        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            plain, streamed = pool.map(
                lambda body: httpx.post(url, json=body, headers=AUTH, timeout=60),
                [LONG, {**LONG, "stream": True}],
            )
        assert time.monotonic() - t0 < TIMEOUT_S + 10
        assert plain.status_code == 504 and plain.json()["error"]["type"] == "timeout"
        lines = data_lines(streamed.text)
        assert lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["error"]["type"] == "timeout"
        assert len(lines) > 3  # tokens came before the timeout ended the stream

        # SIGINT mid-stream: grace 1 s (the flag beat the YAML's 30), then the abort.
        events: list[str] = []
        started = threading.Event()

        def read_stream() -> None:
            with httpx.stream(
                "POST", url, json={**LONG, "stream": True}, headers=AUTH, timeout=60
            ) as resp:
                for line in data_lines_iter(resp):
                    events.append(line)
                    started.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(TIMEOUT_S), "the stream never started"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after shutdown"
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]


def data_lines_iter(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]
