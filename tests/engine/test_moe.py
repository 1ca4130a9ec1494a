"""Grouped expert products (engine/model/moe.py) on the CPU: every family that runs its
experts through mlx-lm's ``SwitchGLU`` gives exactly mlx-lm's logits with the pairs
grouped per expert, float and 4-bit, below and above mlx-lm's own sorting threshold
(64 pairs); and the engine decodes the same greedy tokens with and without it."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from engine.loading import build_random_model
from engine.model import moe
from tests.helpers.models import TINY_CONFIGS

_BASE = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, max_position_embeddings=512,
    rope_theta=10000.0,
)  # fmt: skip

MOE_CONFIGS = {
    "qwen3_moe": TINY_CONFIGS["qwen3_moe"],
    "mixtral": TINY_CONFIGS["mixtral"],
    "olmoe": dict(_BASE, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, head_dim=16,
                  tie_word_embeddings=False),
    "granitemoe": dict(_BASE, num_local_experts=4, num_experts_per_tok=2, logits_scaling=1.0,
                       attention_multiplier=0.25, embedding_multiplier=1.0,
                       residual_multiplier=1.0, tie_word_embeddings=True, attention_bias=False),
    "gpt_oss": dict(_BASE, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    rope_scaling=None, swiglu_limit=7.0),
    "gemma4_text": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        head_dim=32, global_head_dim=32, num_key_value_heads=1, vocab_size=256,
        vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, num_kv_shared_layers=0,
        sliding_window=16, sliding_window_pattern=2, max_position_embeddings=512,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    ),
}  # fmt: skip


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_grouped_equals_mlx_lm_forward(family, bits):
    lm = build_random_model(family, MOE_CONFIGS[family], seed=2, quantize_bits=bits)
    model = lm.model
    rng = np.random.default_rng(0)
    for length in (1, 7, 40):  # 40 tokens x 2 experts: above mlx-lm's sorting threshold
        ids = mx.array([rng.integers(0, 256, length).tolist()])
        want = model(ids)
        assert moe.install(model) == 2  # one MoE block a layer
        try:
            got = model(ids)
        finally:
            assert moe.uninstall(model) == 2
        mx.eval(want, got)
        assert mx.array_equal(want, got), (family, bits, length)


def test_routes_on_the_cpu():
    lm = build_random_model("qwen3_moe", MOE_CONFIGS["qwen3_moe"], quantize_bits=4)
    moe.install(lm.model)
    glu = lm.model.model.layers[0].mlp.switch_mlp
    assert isinstance(glu, moe.GroupedSwitchGLU)
    assert glu.route(mx.zeros((3, 64)), 6) == "mlx"
    assert glu.route(mx.zeros((40, 64)), 80) == "sorted"


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_sorted_route_equals_mlx_lm_for_4bit_experts(tokens):
    """The sorted route itself (the GPU's route for what the kernels do not take),
    also below 64 pairs: 4-bit products round the same whatever the row layout."""
    lm = build_random_model("qwen3_moe", MOE_CONFIGS["qwen3_moe"], quantize_bits=4)
    glu = lm.model.model.layers[1].mlp.switch_mlp
    rng = np.random.default_rng(tokens)
    x = mx.array(rng.standard_normal((tokens, 64)).astype(np.float32))
    idx = mx.array(
        np.stack([rng.choice(4, 2, replace=False) for _ in range(tokens)]).astype(np.uint32)
    )
    want = glu(x, idx)
    glu.__class__ = moe.GroupedSwitchGLU
    got = glu._sorted(x, idx.reshape(-1), 2, dense=False).reshape(tokens, 2, 64)
    assert mx.array_equal(want, got)


def test_activation_kinds():
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.gemma4_text import GeGLU
    from mlx_lm.models.switch_layers import SwiGLU

    assert moe.activation_kind(SwiGLU()) == "silu"
    assert moe.activation_kind(GeGLU()) == "gelu_tanh"
    assert moe.activation_kind(SwigluOAI()) is None  # gpt_oss: the sorted route


def test_install_off_switch(monkeypatch):
    lm = build_random_model("mixtral", MOE_CONFIGS["mixtral"])
    monkeypatch.setenv("MARKBASE_MOE", "mlx")
    assert moe.install(lm.model) == 0
    monkeypatch.setenv("MARKBASE_MOE", "bogus")
    with pytest.raises(ValueError, match="MARKBASE_MOE"):
        moe.install(lm.model)


def _engine_greedy(lm, prompts, monkeypatch, mode):
    from engine.client import EngineClient
    from engine.config import EngineConfig
    from engine.types import GenerationRequest, SamplingParams

    monkeypatch.setenv("MARKBASE_MOE", mode)
    moe.uninstall(lm.model)
    engine = EngineClient.from_loaded([(lm, None)], EngineConfig(warmup=False))

    async def one(i, p):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out = []
        async for ev in engine.generate(GenerationRequest(f"r{i}", lm.name, p, params)):
            out.extend(ev.token_ids)
        return out

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4_text"])
def test_engine_greedy_same_with_grouped_experts(family, monkeypatch):
    """Batched rows through the real engine: grouped == mlx-lm's SwitchGLU."""
    lm = build_random_model(family, MOE_CONFIGS[family], seed=5, quantize_bits=4)
    prompts = [[5, 17, 99, 3], list(range(30, 70)), [200, 3, 5, 9, 11, 13, 2]]
    base = _engine_greedy(lm, prompts, monkeypatch, "mlx")
    grouped = _engine_greedy(lm, prompts, monkeypatch, "grouped")
    assert grouped == base
    assert all(len(t) == 12 for t in grouped)
