"""Gemma 3 270M (the built-in GGUF) served on the CPU's fast paths: the C decode step
(engine/backends/cpu/native_step.py) and quantized decode products for its Q4_K, Q5_0,
Q6_K and Q8_0 matrices (engine/backends/cpu/qgemm.py). Greedy text from the real server, alone and
with other requests in the batch, must be what mlx-lm's own gemma3_text model gives for
the same weights (its own KV caches: a rotating 512-token window for the sliding
layers), including a prompt longer than that window."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

mx = pytest.importorskip("mlx.core")

from engine.backends.cpu import qgemm as cpu_qgemm  # noqa: E402
from tests.helpers.models import FRANCE, GEMMA, greedy, real_model  # noqa: E402
from tests.helpers.server import running_server  # noqa: E402

pytestmark = pytest.mark.skipif(
    cpu_qgemm.available() is not None,
    reason=f"quantized CPU products unavailable: {cpu_qgemm.available()}",
)

N = 16
# Gemma 3 270M's matrices: 18 layers x 7, and the tied embedding, every one with a
# quantized copy (the 9 Q6_K down projections with a scale per 16 weights)
SHADOWED = 18 * 7 + 1


@pytest.fixture(scope="module")
def reference():
    """float32 Gemma 3 270M (exact dequantization of the GGUF) and its greedy tokens by
    mlx-lm's own model call and caches, per prompt."""
    lm = real_model(GEMMA, "float32")
    tok = lm.tokenizer
    long_text = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(80))
    prompts = [
        tok.encode(FRANCE),
        tok.encode("Water boils at a temperature of"),
        tok.encode("A short list of prime numbers: 2, 3, 5,"),
        tok.encode(long_text + " The shelf of item 79 is"),
    ]
    assert len(prompts[-1]) > 600  # past the 512-token sliding window
    return lm, [(p, greedy(lm, p, N, stop_at_eos=True)) for p in prompts]


@pytest.fixture(scope="module")
def server(gemma3_server):
    return gemma3_server


def _complete(server, prompt: list[int]) -> dict:
    r = httpx.post(
        server.v1 + "/completions",
        json={"model": GEMMA, "prompt": prompt, "max_tokens": N, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_fast_paths_serve_gemma3(server, reference):
    """The server took the C step and quantized products for Gemma's layers."""
    _complete(server, reference[1][0][0])  # the log is written by now
    log = server.log_path.read_text(errors="replace")
    assert "lean CPU decode step not used" not in log, server.log_tail()
    assert "C decode step not used" not in log, server.log_tail()
    assert "C decode step: 18 gemma3 layers" in log, server.log_tail()
    counts = [int(n) for n in re.findall(r"quantized CPU decode matmuls: (\d+) weight", log)]
    assert counts and counts[-1] >= SHADOWED, server.log_tail()


def test_gemma3_greedy_alone_and_batched_is_mlx_lms(server, reference):
    lm, cases = reference
    want = [lm.tokenizer.decode(out) for _, out in cases]
    assert want[0].startswith(" the capital of the country of France")
    alone = [_complete(server, p)["text"] for p, _ in cases]
    assert alone == want
    with ThreadPoolExecutor(len(cases)) as pool:  # all four in the running batch
        together = list(pool.map(lambda c: _complete(server, c[0])["text"], cases))
    assert together == want


@pytest.mark.skipif(
    not cpu_qgemm._lib().markbase_qw_has_int8(), reason="no int8 products on this CPU"
)
def test_int8_inputs_load_and_answer():
    """``MARKBASE_QGEMM_INT8=1`` (llama.cpp's int8 inputs, other numerics): the load
    check still compares the caches with exact products, so Gemma 3 loads (with int8
    inputs in the check it was refused: "a prefilled prompt's logits differ"), and it
    answers through its 8-bit matrices' int8 kernel. Its text is not pinned: int8
    inputs have llama.cpp's numerics, not the model's own, and may take the other side
    of a near tie (docs/performance.md)."""
    with running_server(GEMMA, env={"MARKBASE_QGEMM_INT8": "1"}) as srv:
        r = httpx.post(
            srv.v1 + "/completions",
            json={"model": GEMMA, "prompt": FRANCE, "max_tokens": 8, "temperature": 0},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"].strip() and r.json()["usage"]["completion_tokens"] > 0
