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

TINY_CONFIGS = {
    "llama": TINY_LLAMA,
    "gemma3_text": TINY_GEMMA3,
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
}

_GGUF_ARCH = {
    "llama": "llama",
    "gemma3_text": "gemma3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
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
    """float32 GGUF tensors (llama.cpp names and layout) of a float mlx-lm model."""
    from mlx.utils import tree_flatten

    arch = ARCHITECTURES[_GGUF_ARCH[loaded.architecture]]
    if loaded.architecture == "mixtral":
        from engine.loading.gguf_to_mlx import MIXTRAL_LAYER

        arch = dataclasses.replace(arch, layer_map=MIXTRAL_LAYER)
    inv_layer = {v: k for k, v in arch.layer_map.items()}
    inv_top = {v: k for k, v in arch.top_map.items()}
    cfg = loaded.config
    out = {}
    for name, value in tree_flatten(loaded.model.parameters()):
        w = np.array(value.astype(mx.float32))
        module, leaf = name.rsplit(".", 1)
        parts = module.split(".")
        if parts[:2] == ["model", "layers"]:
            suffix = inv_layer[".".join(parts[3:])]
            gname = f"blk.{parts[2]}.{suffix}.{leaf}"
        else:
            suffix = inv_top[module]
            gname = f"{suffix}.{leaf}"
        if arch.permute_qk and suffix == "attn_q":
            w = _llamacpp_permute(w, cfg["num_attention_heads"])
        elif arch.permute_qk and suffix == "attn_k":
            w = _llamacpp_permute(w, cfg["num_key_value_heads"])
        if arch.norm_offset and suffix.endswith("norm"):
            w = w + arch.norm_offset
        out[gname] = w
    return out


def write_gguf(
    path: Path,
    loaded: LoadedModel,
    tensors: dict[str, np.ndarray],
    qtype: GGMLQuantizationType | None = None,
) -> Path:
    """Write ``tensors`` (float32) as a GGUF with metadata for ``loaded``'s config; 2-D
    matrices are stored as ``qtype`` when given (e.g. Q8_0, Q4_0)."""
    cfg = loaded.config
    arch = _GGUF_ARCH[loaded.architecture]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_experts:
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
    return build_random_model(model_type, dict(TINY_CONFIGS[model_type]), seed=seed)


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
