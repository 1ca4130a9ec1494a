"""Model folders in mlx-lm / Hugging Face layout: config.json + *.safetensors + tokenizer files.

Quantized mlx-lm folders are honoured: ``quantization`` in config.json gives the default and
per-module overrides; modules without an override take bits and group size from the shapes
of their packed weight and scales (as mlx-lm does). ``export_mlx_folder`` writes the same
layout, so mlx-lm (``mlx_lm.server --model DIR``) and this loader read it back.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.loading.formats import WeightSet
from engine.loading.loaded_model import LoadedModel, ModelLoadError

_ST_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder}: no config.json (not a model folder)") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable config: {e}") from e
    if "model_type" not in config:
        raise ModelLoadError(f"{path}: config has no model_type")
    gen = folder / "generation_config.json"
    if gen.exists():
        try:
            if (eos := json.loads(gen.read_text()).get("eos_token_id")) is not None:
                config["eos_token_id"] = eos
        except (OSError, ValueError):
            pass
    return config


def check_safetensors_file(path: Path) -> list[str]:
    """Validate the header and that every tensor's bytes lie inside the file (before mx.load)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelLoadError(
                    f"{path}: truncated safetensors header ({n} bytes declared, file {size})"
                )
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header: {e}") from e
    data = size - 8 - n
    names = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            item = _ST_DTYPES[info["dtype"]]
            count = 1
            for d in info["shape"]:
                count *= d
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: tensor {name!r} has a corrupt header entry") from None
        if not 0 <= start <= end <= data:
            raise ModelLoadError(
                f"{path}: truncated: tensor {name!r} lies past the end of the file"
            )
        if end - start != count * item:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has {end - start} bytes for shape {info['shape']}"
            )
        names.append(name)
    return names


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    return files


def folder_weights(folder: Path, model: nn.Module, config: dict) -> WeightSet:
    arrays: dict[str, mx.array] = {}
    origin: dict[str, str] = {}
    for f in weight_files(folder):
        for name in check_safetensors_file(f):
            origin[name] = f"{name!r} in {f.name}"
        try:
            arrays.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read weights: {e}") from e
    if hasattr(model, "sanitize"):
        arrays = model.sanitize(arrays)
    ws = WeightSet(arrays=arrays, origin=origin)
    ws.quant = infer_quantization(model, arrays, config, folder)
    return ws


def infer_quantization(
    model: nn.Module, arrays: dict, config: dict, folder: Path
) -> dict[str, dict]:
    quant_cfg = config.get("quantization")
    if quant_cfg is None and (qc := config.get("quantization_config")):
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method is not None and any(k.endswith(".scales") for k in arrays):
            raise ModelLoadError(
                f"{folder}: quantization_config quant_method={method!r} is not supported; "
                "convert with mlx_lm.convert first"
            )
        quant_cfg = qc if isinstance(qc, dict) and "bits" in qc else None
    quant_cfg = quant_cfg or {}
    default_mode = quant_cfg.get("mode", "affine")
    out = {}
    for path, m in model.named_modules():
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in arrays:
            continue
        override = quant_cfg.get(path)
        if override is False:
            continue
        if isinstance(override, dict):
            out[path] = {"mode": default_mode, **override}
            continue
        in_dims = m.weight.shape[-1]
        scales = arrays[f"{path}.scales"]
        packed = arrays.get(f"{path}.weight")
        if packed is None or scales.shape[-1] == 0:
            raise ModelLoadError(f"{folder}: quantized module {path} has no packed weight")
        out[path] = {
            "group_size": in_dims // scales.shape[-1],
            "bits": packed.shape[-1] * 32 // in_dims,
            "mode": default_mode,
        }
    return out


def context_length_of(config: dict, default: int = 4096) -> int:
    for c in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if isinstance(c.get(key), int):
                return c[key]
    return default


def model_quantization(model: nn.Module) -> dict | None:
    """The mlx-lm ``quantization`` entry describing a loaded model's quantized modules."""
    per: dict[str, dict] = {}
    for path, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "group_size") and hasattr(m, "scales"):
            per[path] = {
                "group_size": m.group_size,
                "bits": m.bits,
                "mode": getattr(m, "mode", "affine"),
            }
    if not per:
        return None
    counts: dict[tuple, int] = {}
    for q in per.values():
        counts[(q["group_size"], q["bits"], q["mode"])] = (
            counts.get((q["group_size"], q["bits"], q["mode"]), 0) + 1
        )
    g, b, mode = max(counts, key=counts.get)
    summary: dict = {"group_size": g, "bits": b, "mode": mode}
    for path, q in sorted(per.items()):
        if (q["group_size"], q["bits"], q["mode"]) != (g, b, mode):
            summary[path] = q
    return summary


def export_mlx_folder(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write ``loaded`` as an mlx-lm model folder: config.json, model.safetensors, tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = dict(loaded.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if q := model_quantization(loaded.model):
        config["quantization"] = q
        config["quantization_config"] = q
    eos = sorted(loaded.tokenizer.eos_token_ids)
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2))
    loaded.tokenizer.save(out)
    return out
