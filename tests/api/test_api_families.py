"""Gemma 4, Gemma 3n, Gemma 2 and a MoE served over HTTP: tiny random-weight models saved as mlx-lm
folders (config.json + safetensors + tokenizer), served by one real ``markbase serve``
subprocess, spoken to with the ``openai`` SDK.

- gemma4_text: a MoE block and per-layer inputs in every layer, sliding and global
  layers, the last two layers reusing the first two's keys and values;
- gemma3n: per-layer inputs, AltUp, KV-shared layers, sliding and global layers;
- gemma2: attention computed inline with grouped heads on their own axis (the batch's
  mask reshaped for it: engine/model/attention.py), logit soft-capping;
- qwen3_moe: a 4-expert MoE.

For each: a chat completion and the same request streamed give the same text, and
requests sent together (batched, prefilled together, joining a running batch) give
each the text it gets alone. A family the engine cannot serve stops ``markbase serve``
at start with a message naming it.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine.loading import build_random_model, export_mlx_folder
from tests.helpers.families import tiny_config
from tests.helpers.server import REPO, free_port, running_server

pytestmark = pytest.mark.slow

FAMILIES = ("gemma4_text", "gemma3n", "gemma2", "qwen3_moe")
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea, please, with a title and an explanation of it.",
    "hi",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        loaded = build_random_model(family, tiny_config(family), seed=11)
        out[family] = str(export_mlx_folder(loaded, root / f"tiny-{family}"))
    return out


@pytest.fixture(scope="module")
def client(folders):
    # chunks of 16 tokens: the longer prompts are prefilled in several chunks
    args = ("--max-num-seqs", "8", "--prefill-chunk-tokens", "16")
    with running_server(list(folders.values()), *args) as srv:
        yield openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def chat(client, model: str, question: str) -> tuple[str, str, int]:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = r.choices[0]
    return choice.message.content, choice.finish_reason, r.usage.completion_tokens


def chat_stream(client, model: str, question: str) -> str:
    parts = []
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_stream_and_batched_equal_alone(client, family) -> None:
    model = f"tiny-{family}"
    assert model in {m.id for m in client.models.list().data}
    alone = []
    for q in QUESTIONS:
        text, finish, n = chat(client, model, q)
        assert finish == "length" and n == MAX_TOKENS, (q, finish, n)
        alone.append(text)
    assert len(set(alone)) > 1, "different questions, one answer: the prompt is not read"
    assert chat_stream(client, model, QUESTIONS[2]) == alone[2]
    # together: every request in flight at once, streamed and not
    with ThreadPoolExecutor(len(QUESTIONS) * 2) as pool:
        plain = [pool.submit(chat, client, model, q) for q in QUESTIONS]
        streamed = [pool.submit(chat_stream, client, model, q) for q in QUESTIONS]
        assert [f.result()[0] for f in plain] == alone
        assert [f.result() for f in streamed] == alone


def test_all_families_at_once(client) -> None:
    """Requests for the three models interleaved: each model's batch is its own."""
    jobs = [(f"tiny-{f}", q) for f in FAMILIES for q in QUESTIONS[:2]]
    alone = [chat(client, m, q)[0] for m, q in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = [f.result()[0] for f in [pool.submit(chat, client, m, q) for m, q in jobs]]
    assert together == alone


def test_unsupported_family_is_refused_at_start(tmp_path) -> None:
    """llama4's chunked attention keeps a cache the engine has no batched form for: the
    engine refuses it when it loads, naming the family, instead of answering wrongly."""
    loaded = build_random_model("llama4", tiny_config("llama4"), seed=1)
    folder = export_mlx_folder(loaded, tmp_path / "tiny-llama4")
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(folder)]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port())]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "cannot load model: model family 'llama4' is not supported" in proc.stderr
