"""Model shapes shared by the MLX benchmark and the PyTorch reference (no imports)."""

from __future__ import annotations

_COMMON = dict(rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)

CONFIGS = {
    # random llama ~1B: the shapes of the GPU table's 1b rows
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        **_COMMON,
    ),
    # random llama ~8B (Llama-3-8B shapes)
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        **_COMMON,
    ),
    # for CPU smoke runs of the scripts
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        **_COMMON,
    ),
}


def kv_bytes_per_token(cfg: dict, itemsize: int = 2) -> int:
    """K and V of one token position over all layers."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize
