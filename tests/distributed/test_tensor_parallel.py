"""``markbase serve --tensor-parallel 2`` on the CPU: two ranks over MLX's ring backend
on 127.0.0.1, through the real HTTP server. Greedy output of the sharded model equals
the single-rank server's token for token (dense and MoE), batched and alone; a
cancelled stream leaves the ranks in step; a rank killed mid-request fails that request
with a clear error and turns /health to 503 instead of hanging."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from engine.loading.safetensors_folder import export_mlx_folder
from tests.helpers.models import tiny_model
from tests.helpers.server import running_server

PROMPTS = ["ab", "The quick brown fox jumps over", "0123456789" * 3, "xyz"]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def tiny_folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    export_mlx_folder(tiny_model(request.param), out)
    return f"tiny={out}"


def _complete(url: str, prompt: str, max_tokens: int = 16) -> str:
    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _batched(url: str) -> list[str]:
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _complete(url, p), PROMPTS))


def _followers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _running(url: str) -> int:
    models = httpx.get(url + "/health", timeout=10).json()["models"]
    return sum(m["running"] + m["prefilling"] for m in models.values())


def _scored(url: str) -> dict:
    """An echoed prompt with logprobs: the prompt's every position's logits (its own
    forward, engine/worker.py ``_prefill_scoring``) and sampled tokens' logprobs."""
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "echo": True, "logprobs": 2, "repetition_penalty": 1.3}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_sharded_greedy_equals_single_rank(tiny_folder):
    with running_server(tiny_folder) as one:
        alone = [_complete(one.url, p) for p in PROMPTS]
        scored = _scored(one.url)
    with running_server(tiny_folder, "--tensor-parallel", "2") as tp:
        assert len(_followers(tp.proc.pid)) == 1
        assert _batched(tp.url) == alone  # batched, with rows joining as they come
        assert [_complete(tp.url, p) for p in PROMPTS] == alone
        sharded = _scored(tp.url)
        assert sharded["text"] == scored["text"]
        assert sharded["logprobs"]["tokens"] == scored["logprobs"]["tokens"]
        a, b = sharded["logprobs"]["token_logprobs"], scored["logprobs"]["token_logprobs"]
        assert a[0] is None and b[0] is None
        assert max(abs(x - y) for x, y in zip(a[1:], b[1:])) < 1e-3

        # a stream cancelled mid-way: the rank 0 drops the row, the follower follows
        with httpx.stream(
            "POST",
            tp.url + "/v1/completions",
            json={"model": "tiny", "prompt": "ab", "max_tokens": 400, "stream": True,
                  "temperature": 0, "ignore_eos": True},
            timeout=120,
        ) as r:  # fmt: skip
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
        deadline = time.monotonic() + 20
        while _running(tp.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(tp.url) == 0
        assert _batched(tp.url) == alone


def test_rank_killed_mid_request_fails_cleanly(tmp_path):
    folder = tmp_path / "tiny"
    export_mlx_folder(tiny_model("llama"), folder)
    with running_server(f"tiny={folder}", "--tensor-parallel", "2") as tp:
        (follower,) = _followers(tp.proc.pid)
        events, t0 = [], time.monotonic()
        with httpx.stream(
            "POST",
            tp.url + "/v1/completions",
            json={"model": "tiny", "prompt": "ab", "max_tokens": 480, "stream": True,
                  "temperature": 0, "ignore_eos": True},
            timeout=60,
        ) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5:
                    os.kill(follower, signal.SIGKILL)
        assert time.monotonic() - t0 < 30, "the stream hung after a rank died"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "rank" in error["message"] or "peer" in error["message"], error
        deadline = time.monotonic() + 10
        while httpx.get(tp.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "health stayed 200 after a rank died"
            time.sleep(0.1)
        assert "rank 1" in httpx.get(tp.url + "/health", timeout=5).text
        r = httpx.post(
            tp.url + "/v1/completions",
            json={"model": "tiny", "prompt": "ab", "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 503, r.text
        assert tp.proc.poll() is None  # the server itself stays up, answering 503


def test_tensor_parallel_refuses_what_it_cannot_split(tmp_path):
    folder = tmp_path / "tiny"
    export_mlx_folder(tiny_model("llama"), folder)  # 2 KV heads: 3 ranks cannot split them
    with pytest.raises(RuntimeError, match="divisible by 3"):
        with running_server(f"tiny={folder}", "--tensor-parallel", "3", timeout_s=120):
            pass
