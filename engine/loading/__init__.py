"""Model loading: GGUF files and mlx-lm / Hugging Face safetensors folders.

Contract used by the rest of the engine (implemented in this package):

    load_model(source, *, name=None, weight_format="auto", cache_dir=None) -> LoadedModel

``source`` is a built-in alias ("smollm2-135m-instruct", "gemma3-270m"), a path to a
``.gguf`` file, or a folder with config.json + *.safetensors + tokenizer files.
"""

from engine.loading.loaded_model import LoadedModel, ModelLoadError  # noqa: F401
