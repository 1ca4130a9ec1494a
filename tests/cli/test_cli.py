"""``markbase`` subcommands run as a user runs them (``python -m cli ...`` from the
repository root, as the ``markbase`` script does): chat through a stdin pipe against
a running server and against a model started in-process, models, bench with its
plot, quantize into a folder that ``markbase serve`` then serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import REPO, free_port, running_server

MODEL = "smollm2-135m-instruct"


def markbase(
    *args: str, stdin: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        env=env,
    )


def greedy(url: str, model: str, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL) as srv:
        yield srv


def test_help_lists_every_command():
    out = markbase("--help")
    assert out.returncode == 0
    for command in ("serve", "chat", "models", "bench", "quantize"):
        assert command in out.stdout
    serve = markbase("serve", "--help")
    assert serve.returncode == 0 and "--max-num-seqs" in serve.stdout
    assert markbase("nonsense").returncode == 2


def test_chat_streams_answers_and_keeps_the_conversation(server):
    q1, q2 = "What is the capital of France?", "And of Germany?"
    out = markbase(
        "chat",
        "--url",
        server.url,
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        stdin=f"{q1}\n{q2}\n/exit\nnot sent\n",
    )
    assert out.returncode == 0, out.stderr
    a1 = greedy(server.url, MODEL, [{"role": "user", "content": q1}], 24)
    history = [
        {"role": "user", "content": q1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": q2},
    ]
    a2 = greedy(server.url, MODEL, history, 24)
    assert out.stdout == f"{a1}\n{a2}\n"
    stats = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2 and all("tok/s" in s and "TTFT" in s for s in stats), out.stderr


def test_chat_commands_and_errors(server):
    out = markbase(
        "chat",
        "--url",
        server.url,
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        stdin="/system Answer in one word.\n/help\n/reset\nHi\n",
    )
    assert out.returncode == 0, out.stderr
    assert "system prompt set" in out.stdout and "/reset" in out.stdout
    expected = greedy(
        server.url,
        MODEL,
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"}],
        12,
    )
    assert out.stdout.endswith(expected + "\n")
    # A request the server refuses: its message, and the chat goes on.
    bad = markbase("chat", "--url", server.url, "--max-tokens", "100000", stdin="Hi\n")
    assert bad.returncode == 0
    assert "error: HTTP 400" in bad.stderr and "maximum context length" in bad.stderr
    unknown = markbase("chat", "--url", server.url, "--model", "nope", stdin="Hi\n")
    assert unknown.returncode == 1 and "does not serve 'nope'" in unknown.stderr
    down = markbase("chat", "--url", f"http://127.0.0.1:{free_port()}", stdin="Hi\n")
    assert down.returncode == 1 and "cannot reach" in down.stderr


def test_models_lists_packaged_configured_and_cached(tmp_path):
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 1000)
    cfg = tmp_path / "models.yaml"
    cfg.write_text(
        f"engine:\n  models:\n    - source: {MODEL}\n    - source: {gguf}\n      name: mine\n"
    )
    out = markbase("models", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    smol = next(r for r in data["packaged"] if r["alias"] == MODEL)
    assert smol["installed"] is True and smol["size"] == Path(smol["path"]).stat().st_size
    assert [(r["name"], r["kind"]) for r in data["configured"]] == [
        (MODEL, "built-in alias"),
        ("mine", "GGUF file"),
    ]
    assert data["configured"][1]["size"] == 1004
    assert Path(data["cache_dir"]).is_dir()
    text = markbase("models")
    assert text.returncode == 0
    for heading in ("Packaged", "Configured", "Cached"):
        assert heading in text.stdout


def test_quantize_writes_a_folder_that_serve_and_chat_load(tmp_path):
    from engine.loading import export_mlx_folder, load_model
    from tests.helpers.models import tiny_model

    src = export_mlx_folder(tiny_model("llama"), tmp_path / "src")
    dst = tmp_path / "q4"
    out = markbase("quantize", str(src), str(dst), "--bits", "4", "--group-size", "64")
    assert out.returncode == 0, out.stderr
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    loaded = load_model(str(dst), weight_format="native")  # "auto" dequantizes on a CPU
    assert loaded.quantization["bits"] == 4 and loaded.quantization["group_size"] == 64
    assert (dst / "model.safetensors").stat().st_size < (
        src / "model.safetensors"
    ).stat().st_size / 3
    from mlx_lm.utils import load_model as mlx_lm_load

    mlx_lm_load(dst)  # an mlx-lm folder: mlx-lm itself loads it
    again = markbase("quantize", str(src), str(dst))
    assert again.returncode == 2 and "not an empty folder" in again.stderr

    # `markbase serve` serves it; `markbase chat --model DST` (in-process) answers the same.
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--model", str(dst), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "markbase serve exited"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "markbase serve did not become healthy"
            time.sleep(0.25)
        expected = greedy(url, "q4", [{"role": "user", "content": "hello"}], 8)
    finally:
        proc.terminate()
        proc.wait(30)
    chat = markbase(
        "chat", "--model", str(dst), "--temperature", "0", "--max-tokens", "8", stdin="hello\n"
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == expected + "\n"
    assert "ready in" in chat.stderr


def test_bench_prints_the_table_and_plots_it(tmp_path):
    png = tmp_path / "bench.png"
    out = markbase(
        "bench",
        "--servers",
        "markbase",
        "--concurrency",
        "1,2",
        "--requests",
        "2",
        "--max-tokens",
        "8",
        "--out",
        str(tmp_path),
        "--plot",
        str(png),
        "--",
        "--warmup",
        "1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| markbase | 1 |" in out.stdout and "| markbase | 2 |" in out.stdout
    assert f"plot: {png}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert list(tmp_path.glob("serve-*-cli-*.json"))
