"""``markbase serve`` with two models configured (a GGUF llama and a qwen3_moe folder,
tiny random weights): both load, each on its own thread, both are listed and served,
and requests to both at once, streamed and not, give exactly what each gives alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.loading import export_mlx_folder
from tests.helpers.models import gguf_tensors_from_model, tiny_model, write_gguf
from tests.helpers.server import running_server

pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The capital of France is", "0123456789"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-models")
    llama = tiny_model("llama", seed=1)
    gguf = write_gguf(root / "llama.gguf", llama, gguf_tensors_from_model(llama))
    folder = export_mlx_folder(tiny_model("qwen3_moe", seed=2), root / "qwen3-moe")
    env = {"MARKBASE_CACHE_DIR": str(root / "cache")}
    with running_server([f"alpha={gguf}", f"beta={folder}"], "--max-num-seqs", "4", env=env) as srv:
        yield srv


def _complete(srv, model: str, prompt: str, stream: bool = False) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}
    r = httpx.post(srv.v1 + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        assert out["model"] == model and out["usage"]["completion_tokens"] == 12
        return out["choices"][0]["text"]
    text = ""
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            text += "".join(c["text"] for c in chunk["choices"])
    return text


def test_both_models_listed(server):
    r = httpx.get(server.v1 + "/models", headers=server.headers())
    assert r.status_code == 200, r.text
    ids = {m["id"] for m in r.json()["data"]}
    assert ids == {"alpha", "beta"}


def test_concurrent_requests_to_both_equal_each_alone(server):
    alone = {(m, p): _complete(server, m, p) for m in ("alpha", "beta") for p in PROMPTS}
    assert any(alone["alpha", p] != alone["beta", p] for p in PROMPTS)  # two different models
    jobs = [(m, p, s) for m in ("alpha", "beta") for p in PROMPTS for s in (False, True)] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _complete(server, *j), jobs))
    for (m, p, _), text in zip(jobs, got):
        assert text == alone[m, p], (m, p)


def test_unknown_model_is_404(server):
    r = httpx.post(
        server.v1 + "/completions", json={"model": "gamma", "prompt": "x", "max_tokens": 2}
    )
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "gamma" in err["message"]
