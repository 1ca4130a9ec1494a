"""Tiny random-weight mlx-lm models of any architecture, for tests of the engine and server."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn

from engine.loading.loaded_model import LoadedModel
from engine.loading.materialize import materialize
from engine.loading.safetensors_folder import context_length_of, model_quantization
from engine.tokenizer import Tokenizer

_RANDOM_LOCK = threading.Lock()


def build_random_model(
    model_type: str,
    config: dict,
    *,
    seed: int = 0,
    quantize_bits: int | None = None,
    group_size: int = 32,
) -> LoadedModel:
    """A random ``mlx_lm.models.<model_type>.Model`` built from ``config`` (ModelArgs fields,
    e.g. ``{"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, ...}``), with a
    byte-level tokenizer (ids 0-255 are bytes; ``<bos>``=256, ``<eos>``=257 when vocab_size
    is at least 258, otherwise no special tokens). ``quantize_bits`` quantizes every module
    whose input size is a multiple of ``group_size``."""
    from engine.loading.loader import model_classes

    config = {"model_type": model_type, **config}
    model_cls, args_cls = model_classes(model_type)
    # MLX's random state is one per process: seeding and drawing under a lock keep a
    # seed's weights the same when several models are built on threads at once
    with _RANDOM_LOCK:
        mx.random.seed(seed)
        model = model_cls(args_cls.from_dict(config))
        if quantize_bits:

            def predicate(_path: str, m: nn.Module) -> bool:
                w = getattr(m, "weight", None)
                return (
                    hasattr(m, "to_quantized") and w is not None and w.shape[-1] % group_size == 0
                )

            nn.quantize(model, group_size=group_size, bits=quantize_bits, class_predicate=predicate)
        model.eval()
        materialize(model)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 256
    tokenizer = Tokenizer.byte_level(vocab)
    return LoadedModel(
        name=f"random-{model_type}",
        architecture=model_type,
        model=model,
        tokenizer=tokenizer,
        context_length=context_length_of(config, default=2048),
        source="random",
        weight_format=f"random-q{quantize_bits}" if quantize_bits else "random-float32",
        config=config,
        has_chat_template=False,
        compute_dtype="float32",
        quantization=model_quantization(model),
    )
