"""What a loader hands to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the file and tensor at fault."""


@dataclass
class LoadedModel:
    name: str
    architecture: str  # mlx-lm model_type, e.g. "llama", "gemma3_text"
    model: Any  # mlx.nn.Module from mlx_lm.models.<arch>.Model, weights loaded and checked
    tokenizer: Any  # engine.tokenizer.Tokenizer
    context_length: int
    source: str  # file or folder it came from
    weight_format: str  # e.g. "q4_1+q8_0", "mlx-q4", "float32"
    config: dict = field(default_factory=dict)  # mlx-lm config (ModelArgs fields); exportable
    # Added by the loader (all have defaults so older call sites keep working):
    has_chat_template: bool = False  # False: tokenizer.chat_template is a fallback
    compute_dtype: str = "float32"  # dtype of activations / norms / quantization scales
    quantization: dict | None = None  # mlx-lm "quantization" entry (None: unquantized)
    load_seconds: float = 0.0
    # Quantized forms of dequantized float32 weights, by module path: CPU decode
    # products read them (engine.backends.cpu.qgemm). Empty when not used.
    cpu_shadows: dict = field(default_factory=dict, repr=False)
