"""``load_model``: built-in alias, GGUF file or model folder -> checked mlx-lm model.

Every source goes the same way::

    source -> (model config, WeightSet under mlx-lm names) -> model.sanitize
           -> apply weight_format -> quantize the model's modules to match
           -> validate (names, shapes, NaN/Inf) -> load_weights(strict=True) -> eval
"""

from __future__ import annotations

import importlib
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import tokenizers
import transformers

from engine.backends import cpu
from engine.loading import convert_cache
from engine.loading.builtin import BUILTINS, resolve_builtin
from engine.loading.formats import (
    Q4_GROUP_SIZE,
    WeightSet,
    apply_format,
    dtype_name,
    quantizable_modules,
    quantize_model_like,
    resolve_compute_dtype,
    resolve_weight_format,
)
from engine.loading.gguf_reader import GGUFFile
from engine.loading.gguf_to_mlx import describe_types, gguf_weights, select_arch
from engine.loading.loaded_model import LoadedModel, ModelLoadError
from engine.loading.materialize import materialize
from engine.loading.safetensors_folder import (
    context_length_of,
    folder_weights,
    model_quantization,
    read_config,
)
from engine.loading.validate import check_weights
from engine.progress import step
from engine.tokenizer import META_FILE, Tokenizer

log = logging.getLogger("markbase.loading")


def model_classes(model_type: str):
    """mlx-lm's Model and ModelArgs for a model_type (with mlx-lm's own remapping)."""
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except ImportError as e:
        raise ModelLoadError(f"model_type {model_type!r} is not supported by mlx-lm") from e
    return module.Model, module.ModelArgs


def build_model(config: dict, source: str) -> nn.Module:
    model_cls, args_cls = model_classes(config["model_type"])
    try:
        return model_cls(args_cls.from_dict(config))
    except (TypeError, ValueError, KeyError, AssertionError) as e:
        raise ModelLoadError(
            f"{source}: cannot build {config['model_type']} model from its config: {e}"
        ) from e


def load_model(
    source: str,
    *,
    name: str | None = None,
    weight_format: str = "auto",
    cache_dir: str | Path | None = None,
    compute_dtype: str | None = None,
) -> LoadedModel:
    """Load a model for serving.

    ``source``: a built-in alias (``smollm2-135m-instruct``, ``gemma3-270m``), a ``.gguf``
    file, or a folder with config.json + *.safetensors + tokenizer files.
    ``weight_format``: auto | native | q4 | float32 | bfloat16 | float16 (see formats.py).
    ``compute_dtype``: float32 | bfloat16 | float16 for norms/scales/activations when the
    weights stay quantized; default float32 on CPU, bfloat16 on GPU.
    Raises ``ModelLoadError`` naming the file (and tensor) for anything wrong with the source.
    """
    t0 = time.perf_counter()
    fmt = resolve_weight_format(weight_format)
    dtype = resolve_compute_dtype(fmt, compute_dtype)
    root = convert_cache.cache_root(cache_dir)
    if source in BUILTINS:
        path = resolve_builtin(source, root)
        default_name = source
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"{source}: no such file or folder, and not a built-in model ({', '.join(sorted(BUILTINS))})"
            )
        default_name = path.stem if path.is_file() else path.name
    if path.is_dir():
        loaded = _load_folder(path, fmt, dtype)
    else:
        loaded = _load_gguf(path, fmt, dtype, root)
    loaded.name = name or default_name
    loaded.load_seconds = time.perf_counter() - t0
    return loaded


def _shadow_dict(fmt: str) -> dict | None:
    """A dict to collect quantized shadows of float32 weights in, when the CPU's
    quantized decode products can use them (engine.backends.cpu.qgemm), else None."""
    return {} if fmt == "float32" and cpu.qgemm_available() is None else None


def _finish(
    model: nn.Module,
    ws: WeightSet,
    fmt: str,
    dtype: mx.Dtype,
    source: str,
    shadows: dict | None,
) -> dict:
    """``ws`` already went through ``model.sanitize`` (which may also change the model,
    e.g. gemma3_text drops its lm_head when the weights have none). Returns the
    quantized shadows of dequantized weights (see engine.backends.cpu.qgemm), maybe empty."""
    quantizable = quantizable_modules(model, Q4_GROUP_SIZE) if fmt == "q4" else set()
    apply_format(ws, fmt, dtype, quantizable, shadows)
    try:
        quantize_model_like(model, ws)
    except ValueError as e:
        raise ModelLoadError(f"{source}: cannot quantize the model as the weights are: {e}") from e
    check_weights(model, ws, source)
    model.load_weights(list(ws.arrays.items()), strict=True)
    model.eval()
    materialize(model)  # private arrays too: nothing lazy crosses to the worker thread
    return shadows or {}


def _load_gguf(path: Path, fmt: str, dtype: mx.Dtype, root: Path) -> LoadedModel:
    clock = _Clock(path.name)
    with GGUFFile(path) as gf, ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        clock("parse header")
        arch, config = select_arch(gf)
        # The tokenizer (seconds for a large vocabulary) loads while the weights convert;
        # both spend most of their time outside the GIL.
        tokenizer_future = pool.submit(gguf_tokenizer, gf, root)
        model = build_model(config, str(path))
        shadows = _shadow_dict(fmt)
        log.info("%s: converting %d tensors to %s ...", path.name, len(gf.tensors), fmt)
        ws = gguf_weights(gf, arch, config, fmt, shadows)
        if hasattr(model, "sanitize"):
            ws.arrays = model.sanitize(ws.arrays)
        clock("convert tensors")
        types = describe_types(gf)
        tokenizer = tokenizer_future.result()
        clock("tokenizer (rest)")
    shadows = _finish(model, ws, fmt, dtype, str(path), shadows)
    clock("format, validate, load")
    clock.summary()
    return LoadedModel(
        name=path.stem,
        architecture=config["model_type"],
        model=model,
        tokenizer=tokenizer,
        context_length=int(config["max_position_embeddings"]),
        source=str(path),
        weight_format={"native": types, "q4": "mlx-q4"}.get(fmt, fmt),
        config=config,
        has_chat_template=tokenizer.has_chat_template,
        compute_dtype=dtype_name(dtype),
        quantization=model_quantization(model),
        cpu_shadows=shadows,
    )


class _Clock:
    """Where load time goes: ``clock(step)`` ends a step, ``summary()`` logs them all
    on one line (logger ``markbase.loading``)."""

    def __init__(self, what: str):
        self.what = what
        self.t = time.perf_counter()
        self.steps: list[tuple[str, float]] = []

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.steps.append((step, now - self.t))
        self.t = now

    def summary(self) -> None:
        log.info(
            "%s: %s",
            self.what,
            ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.steps),
        )


def _load_folder(folder: Path, fmt: str, dtype: mx.Dtype) -> LoadedModel:
    config = read_config(folder)
    model = build_model(config, str(folder))
    ws = folder_weights(folder, model, config)
    shadows = _finish(model, ws, fmt, dtype, str(folder), _shadow_dict(fmt))
    eos = config.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    try:
        tokenizer = Tokenizer.load(folder, extra_eos_ids=eos)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer: {e}") from e
    quant = model_quantization(model)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return LoadedModel(
        name=folder.name,
        architecture=config["model_type"],
        model=model,
        tokenizer=tokenizer,
        context_length=context_length_of(config),
        source=str(folder),
        weight_format={"native": f"mlx-q{quant['bits']}" if quant else "float", "q4": "mlx-q4"}.get(
            fmt, fmt
        ),
        config=config,
        has_chat_template=tokenizer.has_chat_template,
        compute_dtype=dtype_name(dtype),
        quantization=quant,
        cpu_shadows=shadows,
    )


def gguf_tokenizer(gf: GGUFFile, root: Path) -> Tokenizer:
    """The GGUF's tokenizer, converted once and cached by a hash of the file's metadata."""
    header_hash = convert_cache.digest(
        gf.header_sha256(), transformers.__version__, tokenizers.__version__
    )
    entry = convert_cache.entry_dir(root, "tokenizers", header_hash)
    if (entry / META_FILE).exists():
        try:
            return Tokenizer.load(entry)
        except (OSError, ValueError, KeyError):
            pass  # damaged entry: rebuild below
    try:
        with step(
            log, f"building the tokenizer of {gf.path.name} from its metadata (once; cached)"
        ):
            tok = Tokenizer.from_gguf_metadata(gf.metadata, gf.architecture)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(
            f"{gf.path}: cannot build the tokenizer from GGUF metadata: {e}"
        ) from e
    if entry.exists():
        shutil.rmtree(entry, ignore_errors=True)
    tmp = convert_cache.new_tmp_dir(root, "tokenizers")
    tok.save(tmp)
    convert_cache.publish_dir(tmp, entry)
    return tok
