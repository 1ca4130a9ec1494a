"""Weights are validated at load for every family, from GGUF files and from mlx-lm
folders alike: NaN/Inf, missing, unexpected, mis-shaped and mistyped tensors each fail
the load with a ``ModelLoadError`` naming the file and the tensor (in the source's own
naming: llama.cpp's for a GGUF, the safetensors name for a folder)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.loading import ModelLoadError, export_mlx_folder, load_model
from tests.helpers.models import gguf_tensors_from_model, tiny_model, write_gguf

# family -> (a parameter of layer 1 in mlx-lm's naming, the GGUF tensor it comes from)
TARGETS = {
    "llama": ("model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"),
    "gemma3_text": ("model.layers.1.mlp.gate_proj.weight", "blk.1.ffn_gate.weight"),
    "qwen3_moe": ("model.layers.1.mlp.switch_mlp.up_proj.weight", "blk.1.ffn_up_exps.weight"),
    "mixtral": (
        "model.layers.1.block_sparse_moe.switch_mlp.down_proj.weight",
        "blk.1.ffn_down_exps.weight",
    ),
    "gemma4_text": (
        "model.layers.1.experts.switch_glu.gate_proj.weight",
        "blk.1.ffn_gate_up_exps.weight",
    ),
    "gemma3n": (
        "model.language_model.layers.1.laurel.linear_left.weight",
        "blk.1.laurel_l.weight",
    ),
}
FAMILIES = sorted(TARGETS)


def _expect(path, *needles):
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), cache_dir=path.parent / "cache")
    msg = str(e.value)
    assert str(path) in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def _corrupt_folder(folder, edit):
    st = folder / "model.safetensors"
    w = dict(mx.load(str(st)))
    edit(w)
    mx.save_safetensors(str(st), w)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fault", ["nan", "inf", "missing", "unexpected", "shape", "dtype"])
def test_folder_faults_name_file_and_tensor(tmp_path, family, fault):
    param, _ = TARGETS[family]
    folder = export_mlx_folder(tiny_model(family), tmp_path / family)

    def edit(w):
        if fault in ("nan", "inf"):
            a = np.array(w[param])
            a.flat[7] = np.nan if fault == "nan" else -np.inf
            w[param] = mx.array(a)
        elif fault == "missing":
            w.pop(param)
        elif fault == "unexpected":
            w[param.replace("weight", "mystery")] = mx.zeros((4, 4))
        elif fault == "shape":
            w[param] = w[param][..., :-1]
        else:
            w[param] = w[param].astype(mx.uint32)

    _corrupt_folder(folder, edit)
    needle = {"nan": "NaN", "inf": "NaN/Inf", "missing": "missing", "unexpected": "unexpected",
              "shape": "shape", "dtype": "floating-point"}[fault]  # fmt: skip
    name = param.replace("weight", "mystery") if fault == "unexpected" else param
    _expect(folder, needle, name, *(["model.safetensors"] if fault != "missing" else []))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fault", ["nan", "missing", "unexpected", "shape"])
def test_gguf_faults_name_file_and_tensor(tmp_path, family, fault):
    _, tensor = TARGETS[family]
    ref = tiny_model(family)
    tensors = gguf_tensors_from_model(ref)
    if fault == "nan":
        tensors[tensor].flat[3] = np.nan
    elif fault == "missing":
        tensors.pop(tensor)
    elif fault == "unexpected":
        tensors["blk.1.mystery.weight"] = np.zeros((4, 32), np.float32)
    else:
        tensors[tensor] = tensors[tensor][..., :-32]
    path = write_gguf(tmp_path / f"{family}.gguf", ref, tensors)
    needle = {"nan": "NaN", "missing": "missing", "unexpected": "unexpected", "shape": "shape"}[
        fault
    ]
    _expect(path, needle, "blk.1.mystery.weight" if fault == "unexpected" else tensor)
