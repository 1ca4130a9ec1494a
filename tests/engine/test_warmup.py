"""The engine's warm-up at start, its setting, and the PTX cache default."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from engine.backends.cuda.setup import (
    CUDNN_SDPA_ENV,
    PTX_ENV,
    default_cuda_attention,
    default_ptx_cache_dir,
)
from engine.client import EngineClient
from engine.config import EngineConfig, warmup_batch_sizes, warmup_prefill_rows
from engine.loading import build_random_model
from engine.types import GenerationRequest, SamplingParams
from server.cli import build_parser, overrides_from_args
from server.config import load_settings
from tests.helpers.models import RANDOM_LLAMA

TINY = RANDOM_LLAMA
PROMPTS = [list(range(1, 6)), [7] * 40, list(range(30, 90))]
COUNTERS = (
    "markbase_prompt_tokens_total",
    "markbase_generation_tokens_total",
    "markbase_prefix_cache_queries_total",
    "markbase_prefix_cache_hits_total",
)


def _engine(name: str, warmup: bool) -> EngineClient:
    loaded = build_random_model("llama", TINY, seed=7)
    loaded.name = name
    config = EngineConfig(max_num_seqs=4, prefill_chunk_tokens=16, warmup=warmup)
    return EngineClient.from_loaded([(loaded, None)], config)


async def _generate(client, model, i, prompt, **params):
    req = GenerationRequest(
        request_id=f"{model}-{i}",
        model=model,
        prompt_tokens=list(prompt),
        params=SamplingParams(max_tokens=12, ignore_eos=True, **params),
    )
    tokens = []
    async for ev in client.generate(req):
        tokens.extend(ev.token_ids)
    return tokens


def _run_all(client, model):
    async def main():
        jobs = [_generate(client, model, i, p, temperature=0) for i, p in enumerate(PROMPTS)]
        jobs.append(_generate(client, model, 9, PROMPTS[2], temperature=1.0, top_p=0.9, seed=5))
        return await asyncio.gather(*jobs)

    return asyncio.run(main())


def test_warmup_leaves_no_state_and_same_tokens():
    on, off = _engine("warm-on", True), _engine("warm-off", False)
    try:
        w_on, w_off = on.worker("warm-on"), off.worker("warm-off")
        assert w_on.warmup_s is not None and w_on.warmup_s > 0
        assert w_off.warmup_s is None
        for w in (w_on, w_off):
            assert w.kv_reserved == 0 and w.steps == 0
            assert w.prefix_cache.tokens_held == 0
            assert not (w.running or w.prefilling or w.waiting)
            assert all(layer.keys is None and layer.batch_size == 0 for layer in w.batch)
            for counter in COUNTERS:
                got = REGISTRY.get_sample_value(counter, {"model": w.name})
                assert got in (None, 0.0), (counter, got)
            assert not REGISTRY.get_sample_value(
                "markbase_decode_batch_size_count", {"model": w.name}
            )
        assert _run_all(on, "warm-on") == _run_all(off, "warm-off")
        for w in (w_on, w_off):  # the names above are the real ones: now they count
            tokens = REGISTRY.get_sample_value(COUNTERS[1], {"model": w.name})
            assert tokens == 12 * (len(PROMPTS) + 1)
    finally:
        on.shutdown()
        off.shutdown()


def test_warmup_prefills_a_chunk_in_each_band_of_rows(monkeypatch):
    """Besides its main chunk, the warm-up prefills prompts of 12, 24, 48, 96 and 192
    rows where a chunk can have them: MLX's quantized product JIT-compiles one kernel
    per tile size (16, 32, 64 rows on an H100), 23-28 s each at a first request."""
    assert warmup_prefill_rows(16, 4096) == [12]
    assert warmup_prefill_rows(2048, 4096) == [12, 24, 48, 96, 192]
    assert warmup_prefill_rows(2048, 40) == [12, 24]
    from engine.runner import ModelRunner

    seen = []
    real = ModelRunner.prefill

    def spy(self, kv, tokens, want_logits):
        seen.append(len(tokens))
        return real(self, kv, tokens, want_logits)

    monkeypatch.setattr(ModelRunner, "prefill", spy)
    loaded = build_random_model("llama", TINY, seed=7)
    loaded.name = "warm-rows"
    config = EngineConfig(max_num_seqs=2, prefill_chunk_tokens=64, warmup=True)
    client = EngineClient.from_loaded([(loaded, None)], config)
    try:
        assert {12, 24, 48} <= set(seen), seen
    finally:
        client.shutdown()


def test_warmup_batch_sizes():
    assert warmup_batch_sizes(1) == [1]
    assert warmup_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert warmup_batch_sizes(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize(
    "argv, env, want",
    [
        ([], {}, None),
        (["--warmup"], {}, True),
        (["--no-warmup"], {"MARKBASE_WARMUP": "1"}, False),
        ([], {"MARKBASE_WARMUP": "0"}, False),
        ([], {"MARKBASE_WARMUP": "on"}, True),
    ],
)
def test_warmup_setting_layers(argv, env, want):
    args = build_parser().parse_args(["serve", *argv])
    s = load_settings(None, env=env, overrides=overrides_from_args(args))
    assert s.engine.warmup is want


def test_ptx_cache_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    env: dict[str, str] = {}
    got = default_ptx_cache_dir(env)
    assert got == env[PTX_ENV]
    assert got.startswith(str(tmp_path / ".cache" / "markbase" / "mlx-ptx"))
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert default_ptx_cache_dir(env).startswith(str(tmp_path / "xdg" / "markbase" / "mlx-ptx"))
    env = {"XDG_CACHE_HOME": "relative/ignored"}  # XDG: relative paths are invalid
    assert default_ptx_cache_dir(env).startswith(str(tmp_path / ".cache"))
    env = {PTX_ENV: "/somewhere/else"}
    assert default_ptx_cache_dir(env) == "/somewhere/else" and env[PTX_ENV] == "/somewhere/else"


def test_cuda_attention_default():
    env: dict[str, str] = {}
    assert default_cuda_attention(env) == "0" and env[CUDNN_SDPA_ENV] == "0"
    env = {CUDNN_SDPA_ENV: "1"}  # the user's choice stays
    assert default_cuda_attention(env) == "1"
