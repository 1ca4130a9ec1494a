"""Tiny configurations of every text architecture in ``mlx_lm.models``.

``tiny_config(family)`` is ``POOL`` (small values under every field name mlx-lm's
``ModelArgs`` classes use; ``from_dict`` takes only the fields a family has) with the
family's ``OVERRIDES`` on top: 2 layers (more where a family needs one full pattern of
sliding/global, linear/full or shared layers), hidden 64, vocab 256, 4 experts. Sliding
windows are 8 positions, shorter than the test prompts, so windows matter.
Families wrapping a text model (``text_config``) get the same values inside it.

``NOT_BUILT``: modules that cannot be built as a tiny text model on this machine, and why.
"""

from __future__ import annotations

import importlib
import pkgutil

# mlx_lm.models modules that are not model families
HELPER_MODULES = frozenset(
    {
        "activations",
        "base",
        "bitlinear_layers",
        "cache",
        "gated_delta",
        "mla",
        "pipeline",
        "rope_utils",
        "ssm",
        "switch_layers",
    }
)

POOL: dict = dict(
    hidden_size=64,
    d_model=64,
    n_embd=64,
    model_dim=64,
    num_hidden_layers=2,
    n_layers=2,
    n_layer=2,
    num_layers=2,
    num_transformer_layers=2,
    intermediate_size=128,
    ffn_hidden_size=128,
    n_inner=128,
    ff_intermediate_size=128,
    num_attention_heads=4,
    n_heads=4,
    n_head=4,
    num_heads=4,
    num_query_heads=4,
    num_key_value_heads=2,
    num_kv_heads=2,
    n_kv_heads=2,
    num_attention_groups=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    layer_norm_eps=1e-5,
    norm_eps=1e-5,
    layer_norm_epsilon=1e-5,
    layernorm_epsilon=1e-5,
    vocab_size=256,
    rope_theta=10000.0,
    max_position_embeddings=512,
    n_positions=512,
    n_ctx=512,
    block_size=512,
    model_max_length=512,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    use_bias=False,
    use_qkv_bias=False,
    conv_bias=False,
    use_conv_bias=False,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_intermediate_size=32,
    expert_ffn_hidden_size=32,
    shared_expert_intermediate_size=32,
    shared_intermediate_size=32,
    n_shared_experts=1,
    num_shared_experts=1,
    num_shared_expert=1,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    partial_rotary_factor=1.0,
    sliding_window=8,
    rope_scaling=None,
)

_LINEAR = dict(  # linear-attention (gated delta) heads of the hybrid families
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)

_MISTRAL_ROPE = dict(
    rope_theta=10000.0,
    rope_type="default",
    llama_4_scaling_beta=0.1,
    original_max_position_embeddings=512,
)

_QWEN3_NEXT = dict(
    _LINEAR, full_attention_interval=2, partial_rotary_factor=0.5, num_hidden_layers=4
)

OVERRIDES: dict[str, dict] = {
    "deepseek_v2": dict(
        num_experts_per_tok=2,
        topk_method="greedy",
        rope_scaling=dict(type="yarn", factor=1.0, original_max_position_embeddings=512),
    ),
    "exaone4": dict(sliding_window_pattern="LG"),
    "hunyuan": dict(
        use_mixed_mlp_moe=True,
        use_qk_norm=True,
        use_cla=False,
        cla_share_factor=1,
        rope_scaling=dict(alpha=1.0, factor=1.0, type="dynamic"),
    ),
    "kimi_k3": dict(
        text_config=dict(
            model_type="kimi_linear",
            linear_attn_config=dict(
                kda_layers=[1],
                full_attn_layers=[2],
                head_dim=16,
                num_heads=4,
                short_conv_kernel_size=4,
            ),
            num_key_value_heads=4,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_experts_per_token=2,
        )
    ),
    "llama4": dict(
        text_config=dict(
            model_type="llama4_text",
            num_hidden_layers=4,  # every fourth layer is global
            attention_chunk_size=8,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            use_qk_norm=True,
            num_experts_per_tok=1,
        )
    ),
    "mellum": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_theta=10000.0), full_attention=dict(rope_theta=10000.0)
        ),
    ),
    "minicpm3": dict(
        dim_model_base=64,
        scale_depth=1.4,
        scale_emb=12.0,
        rope_scaling=dict(
            original_max_position_embeddings=512, short_factor=[1.0] * 4, long_factor=[1.0] * 4
        ),
    ),
    "ministral3": dict(rope_parameters=_MISTRAL_ROPE),
    "mistral4": dict(rope_parameters=_MISTRAL_ROPE),
    "muse_spark": dict(
        text_config=dict(
            model_type="muse_spark_text",
            post_norm_eps=1e-5,
            rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
            layer_rope_theta=[10000.0, 10000.0],
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            output_multiplier=1.0,
            moe_hidden_size=64,
            num_shared_experts=0,
        )
    ),
    "nemotron-nas": dict(
        block_configs=[
            dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
            dict(attention=dict(no_op=True), ffn=dict(ffn_mult=1.0)),
        ]
    ),
    "phi3small": dict(dense_attention_every_n_layers=2, gegelu_limit=20.0),
    "spark2_5": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_theta=10000.0, rope_type="default"),
            full_attention=dict(rope_theta=10000.0, rope_type="default"),
        ),
    ),
    "afm7": dict(hidden_dim=64, num_layers=4, num_kv_reuse_layers=2),
    "afmoe": dict(
        layer_types=["sliding_attention", "full_attention"],
        num_dense_layers=1,
        mup_enabled=False,
    ),
    "apertus": dict(post_norm=False, qk_norm=True),
    "baichuan_m1": dict(sliding_window_layers=[0], conv_window=2),
    "bailing_hybrid": dict(num_hidden_layers=4, layer_group_size=2, group_norm_size=1, head_dim=16),
    "bailing_moe_linear": dict(num_hidden_layers=4, layer_group_size=2, group_norm_size=1),
    "cohere2": dict(sliding_window_pattern=2),
    "dbrx": dict(
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
    ),
    "exaone_moe": dict(
        layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True]
    ),
    "falcon_h1": dict(
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_d_conv=4,
    ),
    "gear": dict(layer_types=["sliding_attention", "full_attention"]),
    "gemma": dict(),
    "gemma3": dict(
        text_config=dict(sliding_window_pattern=2, query_pre_attn_scalar=16),
    ),
    "gemma3_text": dict(sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gemma3n": dict(
        text_config=dict(
            num_hidden_layers=4,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=256,
            hidden_size_per_layer_input=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
            altup_num_inputs=4,
            altup_coef_clip=120.0,
            altup_correct_scale=True,
            altup_active_idx=0,
            laurel_rank=8,
            rope_local_base_freq=10000.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "gemma4": dict(
        text_config=dict(
            num_hidden_layers=4,
            sliding_window_pattern=2,
            global_head_dim=32,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=256,
        ),
    ),
    "gemma4_text": dict(
        num_hidden_layers=4,
        sliding_window_pattern=2,  # sliding, full, sliding, full
        global_head_dim=32,
        num_kv_shared_layers=2,  # layers 2 and 3 reuse the K/V of layers 0 and 1
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
        enable_moe_block=True,
        top_k_experts=2,
    ),
    "glm4_moe": dict(use_qk_norm=True, head_dim=16, partial_rotary_factor=0.5),
    "glm_moe_dsa": dict(
        index_head_dim=16,
        index_n_heads=2,
        index_topk=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
    ),
    "gpt_neox": dict(rotary_emb_base=10000, rotary_pct=0.5),
    "gptj": dict(rotary_dim=8),
    "gpt_oss": dict(intermediate_size=32),
    "granite": dict(
        logits_scaling=2.0,
        attention_multiplier=0.25,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
    ),
    "granitemoe": dict(
        logits_scaling=2.0,
        attention_multiplier=0.25,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
    ),
    "granitemoehybrid": dict(
        logits_scaling=2.0,
        attention_multiplier=0.25,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
        num_local_experts=None,
    ),
    "jamba": dict(
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
    ),
    "kimi_linear": dict(
        num_hidden_layers=2,
        linear_attn_config=dict(
            kda_layers=[1], full_attn_layers=[2], head_dim=16, num_heads=4, short_conv_kernel_size=4
        ),
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts_per_token=2,
    ),
    "lfm2": dict(
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        full_attn_idxs=[1],
    ),
    "lfm2-vl": dict(
        text_config=dict(
            model_type="lfm2",
            conv_L_cache=3,
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            full_attn_idxs=[1],
        )
    ),
    "lfm2_moe": dict(use_expert_bias=True, num_dense_layers=1, conv_L_cache=3, full_attn_idxs=[1]),
    "llama4_text": dict(
        intermediate_size_mlp=128,
        no_rope_layers=[1, 0],
        use_qk_norm=True,
        tie_word_embeddings=False,
    ),
    "longcat_flash": dict(
        attention_method="MLA",
        zero_expert_type="identity",
        zero_expert_num=2,
        mla_scale_q_lora=True,
        mla_scale_kv_lora=True,
    ),
    "longcat_flash_ngram": dict(zero_expert_num=2, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mamba": dict(state_size=8, conv_kernel=4, time_step_rank=8),
    "mamba2": dict(
        num_heads=4,
        head_dim=32,
        state_size=8,
        conv_kernel=4,
        n_groups=1,
        time_step_limit=(0.0, float("inf")),
        time_step_rank=8,
    ),
    "mimo_v2_flash": dict(
        hybrid_layer_pattern=[1, 0],
        moe_layer_freq=[0, 1],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        sliding_window_size=8,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        swa_rope_theta=10000.0,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        swa_v_head_dim=16,
    ),
    "minicpm": dict(dim_model_base=64, scale_depth=1.4, scale_emb=12.0),
    "minimax": dict(rotary_dim=8),
    "mistral3": dict(text_config=dict(model_type="llama")),
    "nanochat": dict(),
    "nemotron": dict(hidden_act="relu2", partial_rotary_factor=0.5),
    "nemotron_h": dict(
        hybrid_override_pattern="M*",
        num_hidden_layers=2,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=8,
        conv_kernel=4,
        n_groups=1,
    ),
    "olmo3": dict(layer_types=["sliding_attention", "full_attention"]),
    "olmo_hybrid": dict(
        _LINEAR,
        linear_allow_neg_eigval=True,
        layer_types=["linear_attention", "full_attention"],
    ),
    "openelm": dict(
        head_dim=16,
        num_query_heads=[4, 4],
        num_kv_heads=[2, 2],
        ffn_dim_divisor=16,
        ffn_multipliers=[2.0, 2.0],
    ),
    "phixtral": dict(num_vocab=256, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8),
    "pixtral": dict(text_config=dict()),
    "plamo": dict(n_shared_head=2),
    "plamo2": dict(
        num_hidden_layers=2,
        mamba_num_heads=4,
        hidden_size_per_head=16,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_step=2,
        mamba_enabled=True,
    ),
    "qwen": dict(kv_channels=16, no_bias=True),
    "qwen2_vl": dict(text_config=dict()),
    "qwen3_5": dict(text_config=dict(_QWEN3_NEXT, model_type="qwen3_5_text")),
    "qwen3_5_moe": dict(text_config=dict(_QWEN3_NEXT, model_type="qwen3_5_moe_text")),
    "qwen3_next": dict(_QWEN3_NEXT),
    "qwen3_vl": dict(text_config=dict()),
    "qwen3_vl_moe": dict(text_config=dict()),
    "recurrent_gemma": dict(
        conv1d_width=4,
        logits_soft_cap=30.0,
        attention_window_size=8,
        block_types=["recurrent", "attention"],
        num_key_value_heads=1,
    ),
    "rwkv7": dict(
        head_dim=16,
        a_low_rank_dim=8,
        v_low_rank_dim=8,
        gate_low_rank_dim=8,
        decay_low_rank_dim=8,
    ),
    "step3p5": dict(
        moe_num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=32,
        share_expert_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    ),
    "kimi_vl": dict(text_config=dict(model_type="deepseek_v3")),
    "kimi_k25": dict(text_config=dict(model_type="deepseek_v3")),
}

NOT_BUILT: dict[str, str] = {
    "phi3small": "mlx-lm's own generate_step ends the process with a segmentation fault "
    "on MLX 0.32.4's CPU backend (no reference to compare with)",
    "olmo": "needs the ai2-olmo package (its module exits on import without it)",
    "prism_hadamard_qwen35": "its weights must be a Hadamard-rotated 2-bit pack (group 128) "
    "of a qwen3_5 model, which random weights are not; qwen3_5 itself is tested",
}


def families() -> list[str]:
    """Every module of ``mlx_lm.models`` that defines a model family, sorted."""
    import mlx_lm.models

    return sorted(
        m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in HELPER_MODULES
    )


def tiny_config(family: str) -> dict:
    """``POOL`` with ``family``'s overrides; a ``text_config`` gets the pool inside too."""
    over = dict(OVERRIDES.get(family, {}))
    cfg = dict(POOL)
    text = over.pop("text_config", None)
    if text is not None or _takes_text_config(family):
        cfg["text_config"] = {**POOL, "model_type": family, **(text or {})}
    cfg.update(over)
    return cfg


def _takes_text_config(family: str) -> bool:
    import dataclasses

    try:
        module = importlib.import_module(f"mlx_lm.models.{family}")
    except BaseException:  # olmo exits on import
        return False
    args = getattr(module, "ModelArgs", None)
    return args is not None and any(f.name == "text_config" for f in dataclasses.fields(args))
