"""Shared helpers for the loading / tokenizer / reference tests (not a conftest: import it).

Real models are loaded once per test process (``functools.cache``), so every test module
that needs SmolLM2 or Gemma shares one copy. The cache directory is the default one
(``$MARKBASE_CACHE_DIR`` or ``~/.cache/markbase``): the first run fills it (Gemma's
assembly and tokenizer conversion), later runs reuse it.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from engine.loading import LoadedModel, build_random_model, load_model
from engine.loading.builtin import resolve_builtin
from engine.loading.convert_cache import cache_root
from engine.loading.gguf_to_mlx import ARCHITECTURES

SMOLLM2 = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
FRANCE = "The capital of France is"


@functools.cache
def builtin_path(alias: str) -> Path:
    return resolve_builtin(alias, cache_root())


@functools.cache
def real_model(alias: str, weight_format: str = "native") -> LoadedModel:
    return load_model(alias, weight_format=weight_format)


def greedy(loaded: LoadedModel, prompt: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    """Greedy decoding with mlx-lm's KV cache, one token per step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        if stop_at_eos and tok in loaded.tokenizer.eos_token_ids:
            break
        logits = loaded.model(mx.array([[tok]]), cache=cache)
    return out


def sequence_logits(loaded: LoadedModel, ids: list[int]) -> np.ndarray:
    """float32 logits (len(ids), vocab) of one forward pass over ``ids``."""
    logits = loaded.model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits)


# The config of the random-weight llama that engine tests build (build_random_model).
def prefilled_batch(model, prompts) -> list:
    """A ``BatchKV`` per layer holding ``prompts`` prefilled by the model itself, one
    row each (left-padded: rows of different lengths need an array mask)."""
    from engine.kv import BatchKV, SequenceKV

    n = len(model.layers)
    caches = [BatchKV() for _ in range(n)]
    for prompt in prompts:
        seq = [SequenceKV() for _ in range(n)]
        model(mx.array([prompt]), cache=seq)
        for layer, c in enumerate(caches):
            c.add(*seq[layer].kv())
    return caches


def check_step(model, step, prompts, steps: int = 4, atol: float | None = None) -> None:
    """A decode ``step`` against the model's own call on identical batch caches, a
    few greedy steps: logits to float32 rounding (or within ``atol``), and the keys and
    values it wrote."""
    mine, theirs = prefilled_batch(model, prompts), prefilled_batch(model, prompts)
    tokens = mx.array([[1]] * len(prompts), dtype=mx.int32)
    for _ in range(steps):
        got = step(tokens, mine)
        want = model(tokens, cache=theirs)[:, -1, :]
        assert got.shape == want.shape
        err = mx.abs(got - want).max().item()
        assert err < (atol or 1e-4 * max(1.0, mx.abs(want).max().item())), err
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
    for a, b in zip(mine, theirs):
        assert a.length == b.length and a.pad == b.pad
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert mx.allclose(x[:, :, : a.length], y[:, :, : b.length], atol=atol or 1e-5).item()


RANDOM_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
)


# --- tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them -------

TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

# 6 layers: mlx-lm's gemma3_text needs at least one full sliding-window pattern, and
# llama.cpp (hence our GGUF loader) fixes the pattern at 6.
TINY_GEMMA3 = dict(
    hidden_size=64,
    num_hidden_layers=6,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    rms_norm_eps=1e-6,
    vocab_size=256,
    query_pre_attn_scalar=32,
    sliding_window=512,
    sliding_window_pattern=6,
    rope_local_base_freq=10000.0,
    rope_theta=1000000.0,
    max_position_embeddings=512,
)

TINY_QWEN3 = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=256,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

# gemma2's attention keeps a group's query heads on their own axis; soft-capped logits
TINY_GEMMA2 = {
    **{k: v for k, v in TINY_QWEN3.items() if k != "tie_word_embeddings"},
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}

# qwen2 (Qwen2.5): biases on the Q/K/V projections, no head_dim setting
TINY_QWEN2 = {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}

TINY_CONFIGS = {
    "llama": TINY_LLAMA,
    "qwen2": TINY_QWEN2,
    "gemma3_text": TINY_GEMMA3,
    "gemma2": TINY_GEMMA2,
    "qwen3": TINY_QWEN3,
    "qwen3_moe": dict(
        TINY_QWEN3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(TINY_LLAMA, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    # MoE block beside the dense MLP, per-layer inputs, sliding + full layers (proportional
    # RoPE on a quarter of the full layers' dimensions)
    "gemma4_text": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
        head_dim=32, global_head_dim=32, num_key_value_heads=1, vocab_size=256,
        vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, num_kv_shared_layers=0,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=512, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    ),
    "gemma3n": {"text_config": dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
        head_dim=32, rms_norm_eps=1e-6, vocab_size=256, num_key_value_heads=1,
        num_kv_shared_layers=2, vocab_size_per_layer_input=256, sliding_window=16,
        max_position_embeddings=512, rope_local_base_freq=10000.0, rope_theta=1000000.0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], hidden_size_per_layer_input=16,
        altup_num_inputs=4, altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
        laurel_rank=8,
    )},
}  # fmt: skip

# Gemma 4 26B-A4B's attention: K is V on full layers (no v_proj), fewer KV heads there
TINY_CONFIGS["gemma4_text_kv"] = dict(
    TINY_CONFIGS["gemma4_text"],
    attention_k_eq_v=True,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    num_attention_heads=4,
    hidden_size_per_layer_input=0,
)

_GGUF_ARCH = {
    "llama": "llama",
    "gemma3_text": "gemma3",
    "gemma2": "gemma2",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "gemma4_text": "gemma4",
    "gemma3n": "gemma3n",
}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def gguf_tensors_from_model(loaded: LoadedModel) -> dict[str, np.ndarray]:
    """float32 GGUF tensors (llama.cpp names and layout) of a float mlx-lm model: Q/K rows
    permuted (llama), norms stored as 1 + w (Gemma 3), Gemma 4's expert gate and up rows
    in one tensor, Gemma 3n's AltUp projections stacked, parameters without a
    ``.weight`` leaf under their llama.cpp names."""
    import re

    from mlx.utils import tree_flatten

    arch = ARCHITECTURES[_GGUF_ARCH[loaded.architecture]]
    if loaded.architecture == "mixtral":
        from engine.loading.gguf_to_mlx import MIXTRAL_LAYER

        arch = dataclasses.replace(arch, layer_map=MIXTRAL_LAYER)
    inv_layer = {v: k for k, v in arch.layer_map.items()}
    inv_param = {v: k for k, v in arch.param_map.items()}
    inv_split = {mod: (k, i) for k, pair in arch.splits.items() for i, mod in enumerate(pair)}
    inv_top = {v: k for k, v in arch.top_map.items()}
    stacks = {
        re.compile(re.escape(pat).replace(re.escape("{i}"), r"(\d+)") + "$"): base
        for base, pat in arch.unstack.items()
    }
    layer_re = re.compile(rf"^{re.escape(arch.layer_prefix)}\.(\d+)\.(.+)$")
    cfg = loaded.config.get("text_config") or loaded.config
    out: dict[str, np.ndarray] = {}
    parts_of: dict[str, dict[int, np.ndarray]] = {}  # split or stacked: index -> part
    for name, value in tree_flatten(loaded.model.parameters()):
        w = np.array(value.astype(mx.float32))
        if (m := layer_re.match(name)) and m.group(2) in inv_param:
            out[f"blk.{m.group(1)}.{inv_param[m.group(2)]}"] = w
            continue
        module, leaf = name.rsplit(".", 1)
        if m := layer_re.match(module):
            rest = m.group(2)
            if rest in inv_split:
                suffix, i = inv_split[rest]
                parts_of.setdefault(f"blk.{m.group(1)}.{suffix}.{leaf}", {})[i] = w
                continue
            suffix = inv_layer[rest]
            gname = f"blk.{m.group(1)}.{suffix}.{leaf}"
        else:
            stacked = [
                (base, int(mm.group(1))) for rx, base in stacks.items() if (mm := rx.match(module))
            ]
            if stacked:
                base, i = stacked[0]
                parts_of.setdefault(f"{base}.{leaf}", {})[i] = w
                continue
            suffix = inv_top[module]
            gname = f"{suffix}.{leaf}"
        if arch.permute_qk and suffix == "attn_q":
            w = _llamacpp_permute(w, cfg["num_attention_heads"])
        elif arch.permute_qk and suffix == "attn_k":
            w = _llamacpp_permute(w, cfg["num_key_value_heads"])
        if arch.norm_offset and suffix.endswith("norm"):
            w = w + arch.norm_offset
        out[gname] = w
    for gname, parts in parts_of.items():
        ordered = [parts[i] for i in sorted(parts)]
        stacked_top = not gname.startswith("blk.")
        out[gname] = np.stack(ordered) if stacked_top else np.concatenate(ordered, axis=-2)
    if loaded.architecture == "gemma4_text":
        # what llama.cpp's converter adds: 1.0 for each rotated frequency of a full-attention
        # layer, 1e30 for the rest (proportional RoPE)
        full = cfg["rope_parameters"]["full_attention"]
        half = cfg["global_head_dim"] // 2
        rotated = int(cfg["global_head_dim"] * full.get("partial_rotary_factor", 1.0) / 2)
        out["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (half - rotated), np.float32)
    return out


def _write_gemma_metadata(w, loaded: LoadedModel) -> None:
    """The keys llama.cpp's Gemma 4 / Gemma 3n converters write beyond the common ones."""
    from statistics import NormalDist

    cfg = loaded.config.get("text_config") or loaded.config
    layers = cfg["num_hidden_layers"]
    types = cfg["layer_types"]
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_shared_kv_layers(cfg.get("num_kv_shared_layers", 0))
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if loaded.architecture == "gemma3n":
        w.add_rope_freq_base(cfg["rope_theta"])
        w.add_rope_freq_base_swa(cfg["rope_local_base_freq"])
        w.add_altup_active_idx(cfg["altup_active_idx"])
        w.add_altup_num_inputs(cfg["altup_num_inputs"])
        w.add_activation_sparsity_scale(
            [
                NormalDist().inv_cdf(p) if p > 0 else float("-inf")
                for p in cfg["activation_sparsity_pattern"]
            ]
        )
        return
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_key_length(cfg["global_head_dim"])
    w.add_value_length(cfg["global_head_dim"])
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    kv_full = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    kv_full = kv_full or cfg["num_key_value_heads"]
    w.add_head_count_kv(
        [kv_full if t == "full_attention" else cfg["num_key_value_heads"] for t in types]
    )
    first_shared = layers - cfg.get("num_kv_shared_layers", 0)
    double = cfg.get("use_double_wide_mlp") and first_shared < layers
    ff = cfg["intermediate_size"]
    w.add_feed_forward_length(
        [ff * 2 if double and i >= first_shared else ff for i in range(layers)]
    )
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def write_gguf(
    path: Path,
    loaded: LoadedModel,
    tensors: dict[str, np.ndarray],
    qtype: GGMLQuantizationType | None = None,
) -> Path:
    """Write ``tensors`` (float32) as a GGUF with metadata for ``loaded``'s config; 2-D
    matrices are stored as ``qtype`` when given (e.g. Q8_0, Q4_0)."""
    cfg = loaded.config.get("text_config") or loaded.config
    arch = _GGUF_ARCH[loaded.architecture]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch in ("gemma4", "gemma3n"):
        if arch == "gemma3n":
            w.add_feed_forward_length(cfg["intermediate_size"])
            w.add_head_count_kv(cfg["num_key_value_heads"])
            w.add_key_length(cfg["head_dim"])
            w.add_value_length(cfg["head_dim"])
        _write_gemma_metadata(w, loaded)
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        if arch != "gemma2":
            w.add_rope_freq_base(cfg["rope_theta"])
    if "head_dim" in cfg and arch not in ("gemma4", "gemma3n"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":  # llama.cpp's Gemma2Model converter; no RoPE base (its default)
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(4096)
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_experts and arch != "gemma4":
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_byte_tokens())
    w.add_token_scores([0.0] * 256)
    w.add_token_types([1] * 256)
    w.add_eos_token_id(0)
    for name, t in tensors.items():
        if qtype is not None and t.ndim == 2 and t.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf_quantize(t.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(model_type: str = "llama", seed: int = 0) -> LoadedModel:
    """A random tiny model of ``TINY_CONFIGS[model_type]`` (a key may name a variant:
    ``gemma4_text_kv`` is a gemma4_text)."""
    family = "gemma4_text" if model_type.startswith("gemma4_text") else model_type
    return build_random_model(family, dict(TINY_CONFIGS[model_type]), seed=seed)


def tiny_gguf(
    path: Path, model_type: str = "llama", qtype=None, edit=None
) -> tuple[Path, LoadedModel]:
    """A random tiny model and its GGUF; ``edit(tensors)`` may change the tensors first."""
    loaded = tiny_model(model_type)
    tensors = gguf_tensors_from_model(loaded)
    if edit is not None:
        edit(tensors)
    return write_gguf(path, loaded, tensors, qtype), loaded


# A llama with head_dim 64 (the GPU attention kernel takes multiples of 32) and three
# ragged prompts, for the GPU decode-step tests (tests/backends/cuda/test_gpu_attention.py,
# tests/backends/cuda/test_gpu_gemv.py).
LLAMA_HD64 = dict(
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=320,
    tie_word_embeddings=False,
)
RAGGED_PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 8]]


# RoPE variants mlx-lm's llama takes (config keys over TINY-like configs): the decode
# steps and the attention kernel are checked against the model for each
ROPES = {
    "default": {},
    "traditional": {"rope_traditional": True, "rope_theta": 100000.0},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 1024,
    },
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "untied": {"tie_word_embeddings": False},
    "mha": {"num_key_value_heads": 4},
}
