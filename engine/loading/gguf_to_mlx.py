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

* Gemma 4 keeps an expert's gate and up rows in one tensor (``ffn_gate_up_exps``), split
  here by rows into mlx-lm's ``switch_glu.gate_proj`` / ``up_proj`` (packed rows split
  like float rows); Gemma 3n stacks its AltUp projections into one 3-D tensor, unstacked
  here. Some parameters have no ``.weight`` leaf in mlx-lm (``router.scale``,
  ``layer_scalar``, ``altup.correct_output_scale``): ``param_map`` names them whole.

To add a family: write a config builder and an entry in ``ARCHITECTURES``.
"""

from __future__ import annotations

import logging
import math
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
from engine.progress import bar

log = logging.getLogger("markbase.loading")

_REQUIRED = object()

TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# the attention block's names, the same in every family llama.cpp maps here
ATTENTION_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

LLAMA_LAYER = {
    **ATTENTION_LAYER,
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

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        """``metadata["<arch>.<key>"]`` as stored: per-layer arrays stay lists."""
        full = f"{self.arch}.{key}"
        if full in self.md:
            return self.md[full]
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.gf.path}: GGUF metadata has no {full}")
        return default

    def per_layer(self, key: str, layers: int, default: Any = _REQUIRED) -> list:
        """A per-layer value as a list of ``layers`` (a scalar repeated)."""
        v = self.raw(key, default)
        if isinstance(v, list):
            if len(v) != layers:
                raise ModelLoadError(
                    f"{self.gf.path}: {self.arch}.{key} has {len(v)} entries for {layers} layers"
                )
            return list(v)
        return [v] * layers

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


# Gemma 2 settings llama.cpp hard-codes (llama-model.cpp, LLM_ARCH_GEMMA2): attention
# scaled by 1/sqrt(head_dim), except the 27B (46 layers): 1/sqrt(hidden/heads).
def gemma2_config(m: Meta) -> dict:
    cfg = _base_config(m, "gemma2")
    cfg.pop("tie_word_embeddings")  # gemma2 always reads its output from the embedding
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cfg.update(
        query_pre_attn_scalar=(hidden // heads) if layers == 46 else cfg["head_dim"],
        attn_logit_softcapping=float(m("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(m("final_logit_softcapping", 30.0)),
    )
    return cfg


GEMMA4_LAYER = {
    **ATTENTION_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE block (26B-A4B)
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    # per-layer inputs (E2B / E4B)
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
GEMMA4_PARAMS = {
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale.weight": "layer_scalar",
}
GEMMA4_SPLITS = {
    "ffn_gate_up_exps": ("experts.switch_glu.gate_proj", "experts.switch_glu.up_proj"),
}
GEMMA4_TOP = {
    **TOP_LEVEL,
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}

GEMMA3N_LAYER = {
    **{
        k: v
        for k, v in GEMMA4_LAYER.items()
        if not k.startswith(("pre_ffw_norm_2", "post_ffw_norm_", "ffn_gate_inp", "ffn_down_exps"))
    },
    "altup_correct_coef": "altup.correction_coefs",
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
}
GEMMA3N_PARAMS = {"altup_correct_scale.weight": "altup.correct_output_scale"}
GEMMA3N_TOP = {
    "token_embd": "model.language_model.embed_tokens",
    "output_norm": "model.language_model.norm",
    "per_layer_token_embd": "model.language_model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.language_model.per_layer_model_projection",
    "per_layer_proj_norm": "model.language_model.per_layer_projection_norm",
}
# stacked [n, ...] tensors written as n modules ({i} = 0..n-1)
GEMMA3N_UNSTACK = {
    "altup_proj": "model.language_model.altup_projections.{i}",
    "altup_unembd_proj": "model.language_model.altup_unembed_projections.{i}",
}


def _layer_types(m: Meta, layers: int) -> list[str]:
    swa = m.raw("attention.sliding_window_pattern")
    if not isinstance(swa, list) or len(swa) != layers:
        raise ModelLoadError(
            f"{m.gf.path}: {m.arch}.attention.sliding_window_pattern should list every layer"
        )
    return ["sliding_attention" if s else "full_attention" for s in swa]


def gemma4_config(m: Meta) -> dict:
    layers = int(m("block_count"))
    types = _layer_types(m, layers)
    kv = m.per_layer("attention.head_count_kv", layers)
    ff = m.per_layer("feed_forward_length", layers)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    head_dim = int(m("attention.key_length_swa", m("attention.key_length")))
    global_head_dim = int(m("attention.key_length"))
    shared = int(m("attention.shared_kv_layers", 0))
    # attention_k_eq_v: the full-attention layers' V is their K (no attn_v written)
    k_eq_v = bool(full) and all(m.tensor(f"blk.{i}.attn_v.weight") is None for i in full)
    rope_full = {"rope_theta": float(m("rope.freq_base", 1000000.0)), "rope_type": "proportional"}
    if (freqs := m.tensor("rope_freqs.weight")) is not None:
        # llama.cpp writes 1.0 for each rotated frequency of a full layer, 1e30 for the rest
        rotated = int((m.gf.raw(freqs).view(np.float32) < 2.0).sum())
        rope_full["partial_rotary_factor"] = 2 * rotated / global_head_dim
    rope_sliding = {"rope_theta": float(m("rope.freq_base_swa", 10000.0)), "rope_type": "default"}
    pl = int(m("embedding_length_per_layer_input", 0) or 0)
    pl_embd = m.tensor("per_layer_token_embd.weight")
    experts = int(m("expert_count", 0))
    cfg = {
        "model_type": "gemma4_text",
        "hidden_size": int(m("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(ff[0]),
        "use_double_wide_mlp": shared > 0 and int(ff[-1]) == 2 * int(ff[0]),
        "num_attention_heads": int(m("attention.head_count")),
        "num_key_value_heads": int(kv[sliding[0]] if sliding else kv[0]),
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": pl,
        "vocab_size": m.vocab_size,
        "vocab_size_per_layer_input": pl_embd.ne[1] if pl_embd is not None else m.vocab_size,
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(m("attention.sliding_window", 512)),
        "layer_types": types,
        "max_position_embeddings": int(m("context_length", 131072)),
        "rope_parameters": {"full_attention": rope_full, "sliding_attention": rope_sliding},
        "final_logit_softcapping": m("final_logit_softcapping", None),
        "attention_k_eq_v": k_eq_v,
        "tie_word_embeddings": m.tensor("output.weight") is None,
        "enable_moe_block": experts > 0,
    }
    if k_eq_v and full:
        cfg["num_global_key_value_heads"] = int(kv[full[0]])
    if experts:
        cfg.update(
            num_experts=experts,
            top_k_experts=int(m("expert_used_count")),
            moe_intermediate_size=int(m("expert_feed_forward_length")),
        )
    return cfg


def gemma3n_config(m: Meta) -> dict:
    layers = int(m("block_count"))
    ff = m.per_layer("feed_forward_length", layers)
    scales = m.raw("activation_sparsity_scale", [0.0] * layers)
    # llama.cpp stores the normal quantile of each layer's sparsity; mlx-lm wants the
    # sparsity itself (0: none; llama.cpp wrote -inf for it)
    sparsity = [
        0.0 if not np.isfinite(s) or s < -30 else 0.5 * (1.0 + math.erf(s / math.sqrt(2.0)))
        for s in scales
    ]
    laurel = m.tensor("blk.0.laurel_l.weight")
    pl_embd = m.tensor("per_layer_token_embd.weight")
    heads = int(m("attention.head_count"))
    text = {
        "model_type": "gemma3n_text",
        "hidden_size": int(m("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": [int(v) for v in ff] if len(set(ff)) > 1 else int(ff[0]),
        "num_attention_heads": heads,
        "head_dim": int(m("attention.key_length")),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": m.vocab_size,
        "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "num_kv_shared_layers": int(m("attention.shared_kv_layers", 0)),
        "vocab_size_per_layer_input": pl_embd.ne[1] if pl_embd is not None else m.vocab_size,
        "sliding_window": int(m("attention.sliding_window", 512)),
        "max_position_embeddings": int(m("context_length", 32768)),
        "rope_local_base_freq": float(m("rope.freq_base_swa", 10000.0)),
        "rope_theta": float(m("rope.freq_base", 1000000.0)),
        "final_logit_softcapping": m("final_logit_softcapping", None),
        "layer_types": _layer_types(m, layers),
        "activation_sparsity_pattern": sparsity,
        "hidden_size_per_layer_input": int(m("embedding_length_per_layer_input")),
        "altup_num_inputs": int(m("altup.num_inputs", 4)),
        # not in the GGUF (llama.cpp does not clip): Hugging Face's default and the
        # released models' value
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": int(m("altup.active_idx", 0)),
        "laurel_rank": laurel.ne[1] if laurel is not None else 64,
    }
    return {
        "model_type": "gemma3n",
        "text_config": text,
        "max_position_embeddings": text["max_position_embeddings"],
        "vocab_size": text["vocab_size"],
    }


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
    # read into the config by make_config (no parameter of the model)
    consumed: frozenset[str] = frozenset()
    layer_prefix: str = "model.layers"
    # "<suffix>.<leaf>" of a layer tensor -> the parameter's path under the layer, for
    # parameters without a ".weight"/".bias" leaf of their own in mlx-lm
    param_map: dict[str, str] = field(default_factory=dict)
    # layer tensor suffix -> two module paths taking its first and second half of rows
    splits: dict[str, tuple[str, str]] = field(default_factory=dict)
    # top-level tensor -> module path pattern ({i}) for each slice of its first axis
    unstack: dict[str, str] = field(default_factory=dict)


ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch(llama_config, LLAMA_LAYER, permute_qk=True),
    "gemma3": GGUFArch(gemma3_config, GEMMA3_LAYER, norm_offset=1.0),
    "gemma2": GGUFArch(gemma2_config, GEMMA3_LAYER, norm_offset=1.0),
    "qwen2": GGUFArch(qwen2_config, LLAMA_LAYER),
    "qwen3": GGUFArch(qwen3_config, LLAMA_LAYER),
    "qwen3moe": GGUFArch(qwen3moe_config, LLAMA_LAYER),
    "gemma4": GGUFArch(
        gemma4_config,
        GEMMA4_LAYER,
        top_map=GEMMA4_TOP,
        ignore=frozenset(),
        consumed=frozenset({"rope_freqs.weight"}),
        param_map=GEMMA4_PARAMS,
        splits=GEMMA4_SPLITS,
    ),
    "gemma3n": GGUFArch(
        gemma3n_config,
        GEMMA3N_LAYER,
        top_map=GEMMA3N_TOP,
        layer_prefix="model.language_model.layers",
        param_map=GEMMA3N_PARAMS,
        unstack=GEMMA3N_UNSTACK,
    ),
}

# GGML types with no exact MLX form: bits of the MLX affine format "native" requantizes them to.
NATIVE_REQUANT_BITS = {T.Q6_K: 8}
NATIVE_REQUANT_DEFAULT_BITS = 4

_BLK = re.compile(r"^blk\.(\d+)\.(.+)\.(\w+)$")
_TOP = re.compile(r"^([a-z_0-9]+)\.(weight|bias)$")


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
    """The mlx-lm parameter a GGUF tensor becomes (None: unknown); split and stacked
    tensors are handled by ``gguf_weights``."""
    if m := _BLK.match(name):
        layer, suffix, leaf = m.groups()
        if whole := arch.param_map.get(f"{suffix}.{leaf}"):
            return f"{arch.layer_prefix}.{layer}.{whole}"
        if leaf not in ("weight", "bias"):
            return None
        target = arch.layer_map.get(suffix)
        return f"{arch.layer_prefix}.{layer}.{target}.{leaf}" if target else None
    if m := _TOP.match(name):
        base, leaf = m.groups()
        target = arch.top_map.get(base)
        return f"{target}.{leaf}" if target else None
    return None


def _inverse_hint(arch: GGUFArch) -> Callable[[str], str | None]:
    inv_layer = {v: k for k, v in arch.layer_map.items()}
    inv_layer.update({v: k for k, pair in arch.splits.items() for v in pair})
    inv_param = {v: k for k, v in arch.param_map.items()}
    inv_top = {v: k for k, v in arch.top_map.items()}
    layer_re = re.compile(rf"^{re.escape(arch.layer_prefix)}\.(\d+)\.(.+)$")

    def hint(param: str) -> str | None:
        if (m := layer_re.match(param)) and m.group(2) in inv_param:
            return f"blk.{m.group(1)}.{inv_param[m.group(2)]}"
        module, leaf = param.rsplit(".", 1)
        leaf = "weight" if leaf in ("scales", "biases") else leaf
        if m := layer_re.match(module):
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


def destinations(arch: GGUFArch, name: str, t: GGUFTensor) -> list[tuple[str, tuple | None]]:
    """(mlx-lm parameter, part) for each parameter a GGUF tensor feeds: part None (the
    whole tensor), ("rows", i, n) (the i-th of n equal row blocks, axis -2) or
    ("stack", i) (slice i of axis 0). Empty: the tensor is unknown."""
    if m := _BLK.match(name):
        layer, suffix, leaf = m.groups()
        base = f"{arch.layer_prefix}.{layer}"
        if whole := arch.param_map.get(f"{suffix}.{leaf}"):
            return [(f"{base}.{whole}", None)]
        if leaf in ("weight", "bias") and suffix in arch.splits:
            halves = arch.splits[suffix]
            return [
                (f"{base}.{mod}.{leaf}", ("rows", i, len(halves))) for i, mod in enumerate(halves)
            ]
    elif (m := _TOP.match(name)) and m.group(1) in arch.unstack:
        base, leaf = m.groups()
        pattern = arch.unstack[base]
        return [(f"{pattern.format(i=i)}.{leaf}", ("stack", i)) for i in range(t.shape[0])]
    target = map_name(arch, name)
    return [(target, None)] if target else []


def _part(a, part: tuple | None):
    """The slice of ``a`` (numpy, packed or float) that ``part`` names."""
    if part is None:
        return a
    if part[0] == "stack":
        return a[part[1]]
    _, i, n = part
    rows = a.shape[-2] // n
    return a[..., i * rows : (i + 1) * rows, :]


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
    n_head, n_kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    tensors = bar(
        gf.tensors.items(), desc=f"converting {gf.path.name}", total=len(gf.tensors), unit="tensor"
    )
    for name, t in tensors:
        if name in arch.consumed:
            continue
        if name in arch.ignore:
            log.warning("%s: ignoring tensor %s (not supported yet)", src, name)
            continue
        dests = destinations(arch, name, t)
        if not dests:
            raise ModelLoadError(
                f"{src}: unexpected tensor {name!r} ({t.type_name} {list(t.shape)})"
            )
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
            packed = [fix(v).reshape(*lead, -1) for v in (p.weight, p.scales, p.biases)]
            for target, part in dests:
                module = target.rsplit(".", 1)[0]
                names = (target, f"{module}.scales", f"{module}.biases")
                for n, v in zip(names, packed):
                    ws.arrays[n] = mx.array(np.ascontiguousarray(_part(v, part)))
                    ws.origin[n] = origin
                ws.quant[module] = {"group_size": p.group_size, "bits": p.bits, "mode": "affine"}
            continue
        # one float matrix of its own from a type whose codes the CPU's products read
        shadowed = (
            shadows is not None
            and bits is None
            and not is_float
            and len(shape) == 2
            and len(dests) == 1
            and dests[0][1] is None
        )
        shadow = None
        if shadowed and gq.EXACT_BITS.get(t.ggml_type):
            # decoded once: the codes give both the shadow and the float32 values
            q, scale, bias, qbits = gq.decode(raw, t.ggml_type)
            shadow = cpu.shadow_of_codes(fix(q), fix(scale), fix(bias), qbits, gq.GROUP)
            a = gq.expand(q, scale, bias).reshape(shape)
        elif shadowed and t.ggml_type == T.Q6_K:
            # an 8-bit shadow with a scale per 16 weights (the float32 values are the
            # products the kernel's fma rounds to)
            q, scale = gq.decode_q6_k(raw)
            shadow = cpu.shadow_of_codes(fix(q), fix(scale), fix(-32.0 * scale), 6, gq.Q6_K_GROUP)
            a = gq.expand_q6_k(q, scale).reshape(shape)
        else:
            a = gq.dequantize(raw, t.ggml_type, t.ne[0]).reshape(shape)
        if shadow is not None:
            shadows[dests[0][0].rsplit(".", 1)[0]] = shadow
        if (
            arch.norm_offset
            and name.endswith(".weight")
            and name.rsplit(".", 2)[-2].endswith("norm")
        ):
            a = a - np.float32(arch.norm_offset)
        a = fix(a)
        for target, part in dests:
            module = target.rsplit(".", 1)[0]
            v = mx.array(np.ascontiguousarray(_part(a, part)))
            ws.origin[target] = origin
            if bits is not None:
                ws.set_quantized(module, v, gq.GROUP, bits)
                for n in (f"{module}.scales", f"{module}.biases"):
                    ws.origin[n] = origin
            else:
                ws.arrays[target] = v
    return ws


def describe_types(gf: GGUFFile) -> str:
    """e.g. "q4_1+q8_0": the quantized GGML types of the file's tensors."""
    types = sorted(
        {t.type_name.lower() for t in gf.tensors.values() if t.type_name not in ("F32",)}
    )
    return "+".join(types) or "f32"
