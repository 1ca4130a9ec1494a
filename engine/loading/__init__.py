"""Model loading: GGUF files and mlx-lm / Hugging Face safetensors folders.

Contract used by the rest of the engine (implemented in this package):

    load_model(source, *, name=None, weight_format="auto", cache_dir=None,
               compute_dtype=None) -> LoadedModel
    load_models([ModelConfig, ...]) -> [(LoadedModel, max_context)]   # each on its own thread
    build_random_model(model_type, config, *, seed=0, quantize_bits=None) -> LoadedModel
    export_mlx_folder(loaded, out_dir) -> Path
    resolve_weight_format(requested) -> str      # the one place that defines "auto"

``source`` is a built-in alias ("smollm2-135m-instruct", "gemma3-270m"), a path to a
``.gguf`` file, or a folder with config.json + *.safetensors + tokenizer files.
Modules: gguf_reader (strict parser), gguf_quants (GGML blocks -> MLX affine),
gguf_to_mlx (architecture table, names, layout fixes), safetensors_folder (folders, export),
formats (weight formats), validate, builtin (aliases, Gemma assembly), convert_cache.
"""

from engine.loading.concurrent import load_models
from engine.loading.formats import resolve_weight_format
from engine.loading.loaded_model import LoadedModel, ModelLoadError
from engine.loading.loader import load_model
from engine.loading.random_model import build_random_model
from engine.loading.safetensors_folder import export_mlx_folder

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "build_random_model",
    "export_mlx_folder",
    "load_model",
    "load_models",
    "resolve_weight_format",
]
