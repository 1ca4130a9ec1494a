"""Several models loading at once in one process, each on its own thread (as
``markbase serve`` with several ``--model`` does): every model gives the greedy tokens
it gives when loaded alone, and a bad file fails its own load with its own error
while the others load."""

from __future__ import annotations

import threading

import pytest

from engine.config import ModelConfig
from engine.loading import ModelLoadError, build_random_model, export_mlx_folder, load_models
from tests.helpers.models import (
    TINY_CONFIGS,
    gguf_tensors_from_model,
    greedy,
    tiny_model,
    write_gguf,
)

PROMPT = [3, 17, 99, 5, 250, 42, 7]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Four tiny models of different families, as GGUF files and mlx-lm folders."""
    root = tmp_path_factory.mktemp("concurrent")
    out = {}
    for family, kind in (
        ("llama", "gguf"), ("gemma4_text", "gguf"), ("qwen3_moe", "folder"), ("gemma3n", "folder"),
    ):  # fmt: skip
        ref = tiny_model(family, seed=len(out) + 1)
        if kind == "gguf":
            path = write_gguf(root / f"{family}.gguf", ref, gguf_tensors_from_model(ref))
        else:
            path = export_mlx_folder(ref, root / family)
        out[family] = str(path)
    return out


def test_concurrent_loads_equal_loads_alone(sources, tmp_path):
    cache = tmp_path / "cache"
    alone = {}
    for family, src in sources.items():
        ((lm, _),) = load_models([ModelConfig(source=src, name=family)], cache_dir=cache)
        alone[family] = greedy(lm, PROMPT, 10)
    configs = [ModelConfig(source=src, name=family) for family, src in sources.items()]
    for _ in range(2):  # loads overlap differently each time
        loaded = load_models(configs, cache_dir=cache)
        assert [lm.name for lm, _ in loaded] == list(sources)
        for lm, _ in loaded:
            assert greedy(lm, PROMPT, 10) == alone[lm.name], lm.name


def test_models_loaded_on_threads_decode_on_other_threads(sources, tmp_path):
    """Arrays of a load on one thread are complete: another thread (an engine worker)
    runs the model without touching the loading thread's MLX streams."""
    loaded = load_models(
        [ModelConfig(source=s, name=f) for f, s in sources.items()], cache_dir=tmp_path / "c"
    )
    got: dict[str, list[int]] = {}

    def decode(lm):
        got[lm.name] = greedy(lm, PROMPT, 6)

    threads = [threading.Thread(target=decode, args=(lm,)) for lm, _ in loaded]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(sources)
    for lm, _ in loaded:
        assert got[lm.name] == greedy(lm, PROMPT, 6)


def test_a_bad_file_fails_alone(sources, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 16)
    configs = [ModelConfig(source=sources["llama"], name="llama"), ModelConfig(source=str(bad))]
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_models(configs, cache_dir=tmp_path / "c")


def test_random_models_built_on_threads_are_seeded():
    """build_random_model draws from MLX's one random state: built on threads at
    once, each seed still gives its own weights."""
    cfg = TINY_CONFIGS["llama"]
    want = {s: greedy(build_random_model("llama", dict(cfg), seed=s), PROMPT, 6) for s in (1, 2, 3)}
    got = {}

    def build(s):
        got[s] = build_random_model("llama", dict(cfg), seed=s)

    threads = [threading.Thread(target=build, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {s: greedy(lm, PROMPT, 6) for s, lm in got.items()} == want
