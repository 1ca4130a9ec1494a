"""GGUF (llama.cpp naming and layout) -> mlx-lm model config and weights.

One ``GGUFArch`` per ``general.architecture`` says which mlx-lm module builds the model, how
to make its config from the metadata, how llama.cpp renamed the tensors, and which of
llama.cpp's layout changes to undo:

* llama-family Q/K rows are permuted for llama.cpp's RoPE (``permute`` in
  convert_hf_to_gguf.py); we permute them back, so the model is in Hugging Face layout and
  runs with mlx-lm's default (non-traditional) RoPE, and exported folders load in mlx-lm.
  Row permutations commute with row-wise quantization, so packed rows, scales and biases
  are permuted alike and nothing is dequantized.
* Gemma norms are stored as ``1 + w``; mlx-lm's Gemma RMSNorm adds the 1 itself.

To add a family: write a config builder and an entry in ``ARCHITECTURES``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from engine.backends import cpu
from engine.loading import gguf_quants as gq
from engine.loading.formats import WeightSet
from engine.loading.gguf_reader import GGUFFile, GGUFTensor
from engine.loading.loaded_model import ModelLoadError

log = logging.getLogger("markbase.loading")

_REQUIRED = object()

TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (qwen3_moe / qwen2_moe style): router + stacked experts for SwitchGLU
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}

MIXTRAL_LAYER = {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("ffn_") or k == "ffn_norm"},
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
}

GEMMA3_LAYER = {
    **LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class Meta:
    """``metadata["<arch>.<key>"]`` with defaults and a clear error when a key is missing."""

    def __init__(self, gf: GGUFFile):
        self.gf = gf
        self.arch = gf.architecture
        self.md = gf.metadata

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.md:
            v = self.md[full]
            if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv); need uniform
                if len(set(v)) != 1:
                    raise ModelLoadError(f"{self.gf.path}: per-layer {full} = {v} is not supported")
                v = v[0]
            return v
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.gf.path}: GGUF metadata has no {full}")
        return default

    def tensor(self, name: str) -> GGUFTensor | None:
        return self.gf.tensors.get(name)

    @property
    def vocab_size(self) -> int:
        t = self.tensor("token_embd.weight")
        if t is None:
            raise ModelLoadError(f"{self.gf.path}: missing tensor token_embd.weight")
        return t.ne[1]


def _rope_scaling(m: Meta) -> dict | None:
    kind = m("rope.scaling.type", None)
    factor = m("rope.scaling.factor", None)
    if not kind or kind == "none" or not factor:
        return None
    scaling = {"type": kind, "rope_type": kind, "factor": float(factor)}
    if orig := m("rope.scaling.original_context_length", None):
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _base_config(m: Meta, model_type: str) -> dict:
    heads = int(m("attention.head_count"))
    cfg = {
        "model_type": model_type,
        "hidden_size": int(m("embedding_length")),
        "num_hidden_layers": int(m("block_count")),
        "intermediate_size": int(m("feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": m.vocab_size,
        "max_position_embeddings": int(m("context_length", 4096)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "tie_word_embeddings": m.tensor("output.weight") is None,
    }
    head_dim = m("attention.key_length", None)
    cfg["head_dim"] = int(head_dim) if head_dim else cfg["hidden_size"] // heads
    if scaling := _rope_scaling(m):
        cfg["rope_scaling"] = scaling
    return cfg


def llama_config(m: Meta) -> dict:
    cfg = _base_config(m, "llama")
    n_experts = int(m("expert_count", 0))
    if n_experts:  # llama.cpp writes Mixtral as llama + expert tensors
        cfg.update(
            model_type="mixtral",
            num_local_experts=n_experts,
            num_experts_per_tok=int(m("expert_used_count")),
        )
    return cfg


def qwen2_config(m: Meta) -> dict:
    cfg = _base_config(m, "qwen2")
    cfg.pop("head_dim")
    return cfg


def qwen3_config(m: Meta) -> dict:
    return _base_config(m, "qwen3")


def qwen3moe_config(m: Meta) -> dict:
    cfg = _base_config(m, "qwen3_moe")
    cfg.update(
        num_experts=int(m("expert_count")),
        num_experts_per_tok=int(m("expert_used_count")),
        moe_intermediate_size=int(m("expert_feed_forward_length")),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=bool(m("expert_weights_norm", True)),
    )
    if not cfg["intermediate_size"]:
        cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    return cfg


# Gemma 3 settings llama.cpp hard-codes instead of writing them to the GGUF (llama-model.cpp,
# LLM_ARCH_GEMMA3): every 6th layer global, local RoPE base 10k, attention scaled by
# 1/sqrt(head_dim) -- except the 27B (62 layers), scaled by 1/sqrt(hidden/heads).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE = 10000.0
GEMMA3_DEFAULT_SLIDING_WINDOW = 512


def gemma3_config(m: Meta) -> dict:
    cfg = _base_config(m, "gemma3_text")
    cfg.pop("tie_word_embeddings")  # gemma3_text ties when lm_head.weight is absent
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cfg.update(
        query_pre_attn_scalar=(hidden // heads) if layers == 62 else cfg["head_dim"],
        rope_local_base_freq=GEMMA3_ROPE_LOCAL_BASE,
        sliding_window=int(m("attention.sliding_window", GEMMA3_DEFAULT_SLIDING_WINDOW)),
        sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
    )
    return cfg


@dataclass(frozen=True)
class GGUFArch:
    make_config: Callable[[Meta], dict]
    layer_map: dict[str, str]
    top_map: dict[str, str] = field(default_factory=lambda: dict(TOP_LEVEL))
    permute_qk: bool = False  # undo llama.cpp's Q/K row permutation
    norm_offset: float = 0.0  # llama.cpp stored every *norm.weight as w + norm_offset
    # rope_freqs: Llama 3.x RoPE scaling factors precomputed by llama.cpp. Not applied yet
    # (mlx-lm wants the llama3 rope_scaling parameters instead): a warning is logged; output
    # is close within the original context but not exact.
    ignore: frozenset[str] = frozenset({"rope_freqs.weight"})


ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch(llama_config, LLAMA_LAYER, permute_qk=True),
    "gemma3": GGUFArch(gemma3_config, GEMMA3_LAYER, norm_offset=1.0),
    "qwen2": GGUFArch(qwen2_config, LLAMA_LAYER),
    "qwen3": GGUFArch(qwen3_config, LLAMA_LAYER),
    "qwen3moe": GGUFArch(qwen3moe_config, LLAMA_LAYER),
}

# GGML types with no exact MLX form: bits of the MLX affine format "native" requantizes them to.
NATIVE_REQUANT_BITS = {T.Q6_K: 8}
NATIVE_REQUANT_DEFAULT_BITS = 4

_BLK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def select_arch(gf: GGUFFile) -> tuple[GGUFArch, dict]:
    name = gf.architecture
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ModelLoadError(
            f"{gf.path}: GGUF architecture {name!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    config = arch.make_config(Meta(gf))
    if config["model_type"] == "mixtral":
        arch = GGUFArch(llama_config, MIXTRAL_LAYER, permute_qk=True)
    return arch, config


def map_name(arch: GGUFArch, name: str) -> str | None:
    if m := _BLK.match(name):
        layer, suffix, leaf = m.groups()
        target = arch.layer_map.get(suffix)
        return f"model.layers.{layer}.{target}.{leaf}" if target else None
    if m := _TOP.match(name):
        base, leaf = m.groups()
        target = arch.top_map.get(base)
        return f"{target}.{leaf}" if target else None
    return None


def _inverse_hint(arch: GGUFArch) -> Callable[[str], str | None]:
    inv_layer = {v: k for k, v in arch.layer_map.items()}
    inv_top = {v: k for k, v in arch.top_map.items()}

    def hint(param: str) -> str | None:
        module, leaf = param.rsplit(".", 1)
        leaf = "weight" if leaf in ("scales", "biases") else leaf
        if m := re.match(r"^model\.layers\.(\d+)\.(.+)$", module):
            if m.group(2) in inv_layer:
                return f"blk.{m.group(1)}.{inv_layer[m.group(2)]}.{leaf}"
        elif module in inv_top:
            return f"{inv_top[module]}.{leaf}"
        return None

    return hint


def _unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows [head, dim/2, 2] -> [head, 2, dim/2]."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {n_head} heads")
    rest = a.shape[1:]
    return np.ascontiguousarray(
        a.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(a.shape)
    )


def _target_bits(gtype: T, weight_format: str) -> int | None:
    """MLX bits a quantized GGML tensor becomes in ``weight_format`` (None: float)."""
    if weight_format == "native":
        return gq.EXACT_BITS.get(gtype) or NATIVE_REQUANT_BITS.get(
            gtype, NATIVE_REQUANT_DEFAULT_BITS
        )
    if weight_format == "q4":
        return 4
    return None


def gguf_weights(
    gf: GGUFFile,
    arch: GGUFArch,
    config: dict,
    weight_format: str,
    shadows: dict | None = None,
) -> WeightSet:
    """All tensors of ``gf`` under mlx-lm names, already in ``weight_format``'s layout:
    quantized GGML matrices become MLX affine group-32 (losslessly when ``gq.EXACT_BITS``
    allows, else dequantized and requantized), or float32 for the float formats. Float
    tensors in the file stay float32 (the caller casts to the compute dtype).

    With ``shadows`` (a dict) and a float format, every matrix dequantized from a type
    that transcodes losslessly also leaves its MLX-quantized form there, by module path
    (``engine.backends.cpu.qgemm.QuantShadow``: the CPU's decode products read it)."""
    ws = WeightSet(arrays={}, hint=_inverse_hint(arch))
    src = str(gf.path)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    for name, t in gf.tensors.items():
        if name in arch.ignore:
            log.warning("%s: ignoring tensor %s (not supported yet)", src, name)
            continue
        target = map_name(arch, name)
        if target is None:
            raise ModelLoadError(
                f"{src}: unexpected tensor {name!r} ({t.type_name} {list(t.shape)})"
            )
        module, leaf = target.rsplit(".", 1)
        shape = t.shape
        heads = None
        if arch.permute_qk and ".attn_q." in name:
            heads = n_head
        elif arch.permute_qk and ".attn_k." in name:
            heads = n_kv

        def fix(a: np.ndarray, heads: int | None = heads) -> np.ndarray:
            return _unpermute_rows(a, heads) if heads else a

        origin = f"{name!r} [{t.type_name}]"
        raw = gf.raw(t)
        is_float = t.ggml_type in gq.FLOAT_TYPES or t.ggml_type == T.BF16
        bits = None if is_float or len(shape) < 2 else _target_bits(t.ggml_type, weight_format)
        if bits is not None and gq.EXACT_BITS.get(t.ggml_type) == bits:
            p = gq.transcode(raw, t.ggml_type)
            lead = shape[:-1]
            ws.arrays[target] = mx.array(fix(p.weight).reshape(*lead, -1))
            ws.arrays[f"{module}.scales"] = mx.array(fix(p.scales).reshape(*lead, -1))
            ws.arrays[f"{module}.biases"] = mx.array(fix(p.biases).reshape(*lead, -1))
            ws.quant[module] = {"group_size": p.group_size, "bits": p.bits, "mode": "affine"}
            for n in (target, f"{module}.scales", f"{module}.biases"):
                ws.origin[n] = origin
            continue
        if (
            shadows is not None
            and bits is None
            and not is_float
            and len(shape) == 2
            and gq.EXACT_BITS.get(t.ggml_type)
        ):
            p = gq.transcode(raw, t.ggml_type)
            shadow = cpu.shadow_of(fix(p.weight), fix(p.scales), fix(p.biases), p.bits, p.group_size)
            if shadow is not None:
                shadows[module] = shadow
        a = gq.dequantize(raw, t.ggml_type, t.ne[0]).reshape(shape)
        if arch.norm_offset and leaf == "weight" and name.rsplit(".", 2)[-2].endswith("norm"):
            a = a - np.float32(arch.norm_offset)
        a = mx.array(fix(a))
        ws.origin[target] = origin
        if bits is not None:
            ws.set_quantized(module, a, gq.GROUP, bits)
            for n in (f"{module}.scales", f"{module}.biases"):
                ws.origin[n] = origin
        else:
            ws.arrays[target] = a
    return ws


def describe_types(gf: GGUFFile) -> str:
    """e.g. "q4_1+q8_0": the quantized GGML types of the file's tensors."""
    types = sorted(
        {t.type_name.lower() for t in gf.tensors.values() if t.type_name not in ("F32",)}
    )
    return "+".join(types) or "f32"
