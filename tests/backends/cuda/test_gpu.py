"""The GPU path: a tiny model decodes on the MLX GPU device (CUDA or Metal) through
EngineClient, and its greedy tokens are the CPU path's.

Skipped where MLX has no GPU (CI, the Linux CPU build). On the lent H200:

    source bench/gpu/env.sh && python3 -m pytest -q -p no:cacheprovider tests/backends/cuda/test_gpu.py

The CPU reference runs in a subprocess (MLX's default device is per process), from
the same numpy-drawn float32 weights. Tokens must be equal; a difference is allowed
only where the CPU's top two logits are a near tie (float32 sums in another order,
or TF32 matmuls, can flip those), and from there on nothing is compared.
``MARKBASE_GPU_TEST_ON_CPU=1`` runs the test on a CPU machine too (CPU against CPU),
to check the test itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

# MLX's CUDA backend runs float32 matmuls as TF32 unless MLX_ENABLE_TF32=0 (read once
# per process, at the first matmul): ask for full float32 so GPU and CPU agree closely.
# If something in this process already ran one, the test measures which is in effect.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=False,
)
PROMPTS = [[5, 17, 99, 3], list(range(30, 70)), [200, 3, 5, 9, 11, 13, 2], [7] * 23]
MAX_TOKENS = 24
# (logits relative error, top-2 margin below which a flip is a near tie, share of tokens
# that must be compared before a near tie ends the comparison). The logits here have a
# spread of ~4; TF32 rounding moved them by ~5e-3 relative on the H200 (2026-12-02).
STRICT = (1e-4, 1e-3, 0.9)
TF32 = (2e-2, 0.15, 0.5)


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


FORCE = os.environ.get("MARKBASE_GPU_TEST_ON_CPU") == "1"
pytestmark = [
    pytest.mark.cpu,  # its own condition: a GPU (CUDA or Metal), or forced
    pytest.mark.skipif(
        not (on_gpu() or FORCE), reason="needs an MLX GPU device (mlx[cuda13] or Metal)"
    ),
]


def tf32_in_effect() -> bool:
    """Whether float32 matmuls on the default device round like TF32 (10-bit mantissa)."""
    a = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(a))
    want = a.astype(np.float64) @ a.astype(np.float64)
    return np.abs(got - want).max() / np.abs(want).max() > 1e-5


def tolerances():
    return TF32 if tf32_in_effect() else STRICT


def build_tiny(seed: int = 0):
    """A tiny llama with float32 weights drawn by numpy, so identical on every device."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(model_type="llama", **TINY))
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            v = 1 + 0.1 * rng.standard_normal(p.shape)
        elif "embed" in name:
            v = rng.standard_normal(p.shape)
        else:  # 4/sqrt(fan_in): peaked logits, varied greedy tokens
            v = 4.0 * rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        new.append((name, mx.array(v.astype(np.float32))))
    model.load_weights(new)
    mx.eval(model.parameters())
    return model


class _Detok:
    def add_token(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""


class TinyTokenizer:
    eos_token_ids = frozenset({0})
    has_chat_template = False

    def detokenizer(self):
        return _Detok()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def engine_tokens(model) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted at once (one batch), via EngineClient."""
    import dataclasses

    from engine.client import EngineClient
    from engine.config import EngineConfig
    from engine.loading.loaded_model import LoadedModel
    from engine.types import GenerationRequest, SamplingParams

    fields = {f.name for f in dataclasses.fields(LoadedModel)}
    kw = dict(
        name="tiny",
        architecture="llama",
        model=model,
        tokenizer=TinyTokenizer(),
        context_length=512,
        source="random",
        weight_format="float32",
        config=TINY,
    )
    loaded = LoadedModel(**{k: v for k, v in kw.items() if k in fields})
    client = EngineClient.from_loaded(
        [(loaded, None)], EngineConfig(max_num_seqs=8, prefill_chunk_tokens=16)
    )

    async def one(i, prompt):
        req = GenerationRequest(
            request_id=f"g{i}",
            model="tiny",
            prompt_tokens=prompt,
            params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        )
        out = []
        async for ev in client.generate(req):
            out.extend(ev.token_ids)
        return out

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        return asyncio.run(main())
    finally:
        # not shutdown(): that also destroys this thread's MLX streams, and the
        # callers go on using MLX here (the process releases them at its end)
        client.stop_workers()


def reference() -> dict:
    """Run on the CPU: engine tokens, prompt logits, and top-2 margins along those tokens."""
    model = build_tiny()
    tokens = engine_tokens(model)
    last_logits, margins = [], []
    for prompt, toks in zip(PROMPTS, tokens):
        full = mx.array([prompt + toks[:-1]])
        logits = model(full)[0].astype(mx.float32)  # teacher-forced, no cache
        gen = logits[len(prompt) - 1 :]
        top2 = mx.sort(gen, axis=-1)[:, -2:]
        margins.append((top2[:, 1] - top2[:, 0]).tolist())
        last_logits.append(logits[len(prompt) - 1].tolist())
    return dict(
        tokens=tokens, prompt_logits=last_logits, margins=margins, device=str(mx.default_device())
    )


def cpu_reference() -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    code = (
        "import json, mlx.core as mx; mx.set_default_device(mx.cpu); "
        "import tests.backends.cuda.test_gpu as t; print('REF' + json.dumps(t.reference()), flush=True); "
        "from engine.worker import release_mlx_thread_state; release_mlx_thread_state()"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("REF"))
    return json.loads(line[3:])


@pytest.fixture(scope="module")
def ref():
    r = cpu_reference()
    assert r["device"].startswith("Device(cpu")
    return r


def test_default_device_is_gpu():
    assert on_gpu() or FORCE
    a = mx.array(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32))
    got = np.array(a @ a)
    want = np.array(a, dtype=np.float64) @ np.array(a, dtype=np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3


def test_prompt_logits_match_cpu(ref):
    model = build_tiny()
    from engine.runner import ModelRunner

    runner = ModelRunner(model)
    rtol = tolerances()[0]
    for prompt, want in zip(PROMPTS, ref["prompt_logits"]):
        kv = runner.new_sequence_kv()
        got = np.array(runner.prefill(kv, prompt, want_logits=True).astype(mx.float32))
        want = np.array(want)
        err = np.abs(got - want).max() / np.abs(want).max()
        print(f"prompt {prompt[:3]}...: logits rel err {err:.2e} (limit {rtol:.0e})")
        assert err < rtol, (prompt[:5], err, "TF32" if rtol == TF32[0] else "float32")


def test_engine_greedy_tokens_match_cpu(ref):
    model = build_tiny()
    got = engine_tokens(model)
    _, near_tie, share = tolerances()
    compared = 0
    for i, (g, want, margin) in enumerate(zip(got, ref["tokens"], ref["margins"])):
        assert len(g) == len(want) == MAX_TOKENS
        diff = next((j for j, (a, b) in enumerate(zip(g, want)) if a != b), None)
        if diff is None:
            compared += len(g)
            continue
        # only a near tie may flip, and then the rest of the sequence legitimately differs
        assert margin[diff] < near_tie, (
            f"prompt {i}: token {diff} is {g[diff]} on the GPU, {want[diff]} on the CPU, "
            f"with a CPU top-2 margin of {margin[diff]:.3g} (not a near tie)"
        )
        compared += diff
    print(
        f"greedy tokens compared before any near tie: {compared} of {MAX_TOKENS * len(PROMPTS)}; "
        f"TF32 in effect: {tf32_in_effect()}"
    )
    assert compared >= share * MAX_TOKENS * len(PROMPTS), (compared, got, ref["tokens"])


if __name__ == "__main__":
    print(json.dumps(reference())[:400])
