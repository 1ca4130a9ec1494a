"""Model loading: real GGUFs, tiny GGUFs written like llama.cpp writes them, broken files,
safetensors folders, random models. No mocks: every model here really runs."""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.loading import (
    ModelLoadError,
    build_random_model,
    export_mlx_folder,
    load_model,
    resolve_weight_format,
)
from engine.loading import gguf_quants as gq
from engine.loading.builtin import ensure_gemma3_270m
from tests.helpers.models import (
    FRANCE,
    GEMMA,
    SMOLLM2,
    builtin_path,
    gguf_tensors_from_model,
    greedy,
    real_model,
    sequence_logits,
    tiny_gguf,
    tiny_model,
    write_gguf,
)

IDS = [1, 5, 77, 200, 3, 9, 100, 42]


# --- real models ---------------------------------------------------------------------------


def test_smollm2_loads_native():
    lm = real_model(SMOLLM2)
    assert lm.architecture == "llama"
    assert lm.name == SMOLLM2
    assert lm.context_length == 8192
    assert lm.weight_format == "q4_1+q8_0"
    assert lm.compute_dtype == "float32"
    assert lm.config["tie_word_embeddings"] is True
    assert not hasattr(lm.model, "lm_head")
    # Q4_1 matrices stay MLX 4-bit, the Q8_0 embedding 8-bit (quantized embedding, tied head)
    assert lm.quantization["bits"] == 4 and lm.quantization["group_size"] == 32
    assert lm.quantization["model.embed_tokens"]["bits"] == 8
    assert type(lm.model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert lm.has_chat_template and lm.tokenizer.eos_token_ids == {0, 2}


def test_smollm2_chat_answers_paris():
    lm = real_model(SMOLLM2)
    tok = lm.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = greedy(lm, prompt, 24, stop_at_eos=True)
    assert out[-1] in tok.eos_token_ids
    assert "Paris" in tok.decode(out)


def test_gemma_loads_and_completes_sensibly():
    lm = real_model(GEMMA)
    assert lm.architecture == "gemma3_text"
    assert lm.context_length == 32768
    assert lm.weight_format == "q4_k+q5_0+q6_k+q8_0"
    cfg = lm.config
    assert (cfg["query_pre_attn_scalar"], cfg["sliding_window"], cfg["sliding_window_pattern"]) == (
        256,
        512,
        6,
    )
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["rope_theta"] == 1e6
    assert lm.model.tie_word_embeddings  # no output.weight in the GGUF
    # llama.cpp stored the norms as 1+w; mlx-lm adds the 1 itself
    from engine.loading.gguf_reader import GGUFFile

    with GGUFFile(builtin_path(GEMMA)) as gf:
        stored = gf.raw(gf.tensors["blk.0.attn_k_norm.weight"]).view(np.float32).ravel().copy()
    got = np.array(lm.model.model.layers[0].self_attn.k_norm.weight)
    np.testing.assert_allclose(got, stored - 1.0, rtol=1e-6)
    tok = lm.tokenizer
    assert not lm.has_chat_template and tok.bos_token_id == 2
    ids = tok.encode(FRANCE)
    out = greedy(lm, ids, 12)
    text = tok.decode(out)
    assert "France" in text, text
    assert len(set(out)) > 4, text  # not "The The The"


def test_gemma_second_load_is_cached():
    path = builtin_path(GEMMA)  # assembled (and verified) once
    marker = json.loads(Path(str(path) + ".ok").read_text())
    assert marker["size"] == path.stat().st_size
    t0 = time.perf_counter()
    lm = load_model(GEMMA)
    elapsed = time.perf_counter() - t0
    assert lm.source == str(path)
    # Converting the tokenizer alone takes ~6 s and dequantizing K-quants with gguf ~150 s;
    # a cached load does neither. Generous bound: the CI box is small and busy.
    assert elapsed < 30, elapsed


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q4"])
def test_smollm2_weight_formats(fmt):
    native = real_model(SMOLLM2)
    lm = load_model(SMOLLM2, weight_format=fmt)
    assert lm.weight_format == {"q4": "mlx-q4"}.get(fmt, fmt)
    a = sequence_logits(native, IDS)
    b = sequence_logits(lm, IDS)
    if fmt == "float32":  # Q4_1/Q8_0 transcode losslessly: float32 is the same model
        np.testing.assert_allclose(a, b, atol=1e-3)
        assert lm.quantization is None
    elif fmt == "q4":
        assert lm.quantization == {"group_size": 32, "bits": 4, "mode": "affine"}
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.5
    else:
        assert lm.compute_dtype == "bfloat16"
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


def test_resolve_weight_format():
    # "auto" is decided by backend; on a Linux CPU with OpenBLAS bound it is float32
    from engine.backends.cpu.tuning import best_cpu_weight_format

    assert resolve_weight_format("auto") == best_cpu_weight_format()
    for f in ("native", "q4", "float32", "bfloat16", "float16"):
        assert resolve_weight_format(f) == f
    with pytest.raises(ModelLoadError, match="weight_format"):
        resolve_weight_format("int3")


# --- GGML block formats ------------------------------------------------------------------


# byte offsets of the fp16 fields (d, m / dmin) inside one block of each GGML type
FP16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108],
}  # fmt: skip


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda q: q.name)
def test_ggml_blocks_match_gguf_reference(qtype):
    """Random blocks (with sane fp16 scales): our numpy dequantization and, for the exact
    types, MLX's dequantization of our packing equal gguf-py's reference dequantization."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 8, 512
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        half = rng.uniform(-0.1, 0.1, size=(rows, cols // block)).astype(np.float16)
        raw[..., off : off + 2] = half[..., None].view(np.uint8)
    raw = raw.reshape(rows, -1)
    ref = gguf_dequantize(raw, qtype).reshape(rows, cols)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(gq.dequantize(raw, qtype, cols), ref, rtol=1e-6, atol=1e-7)
    if qtype in gq.EXACT_BITS:
        p = gq.transcode(raw, qtype)
        got = mx.dequantize(
            mx.array(p.weight), mx.array(p.scales), mx.array(p.biases), group_size=32, bits=p.bits
        )
        np.testing.assert_allclose(np.array(got), ref, rtol=1e-6, atol=1e-7)


# --- tiny GGUFs ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3", "qwen3_moe", "mixtral"])
def test_tiny_f32_gguf_is_the_same_model(tmp_path, model_type):
    """A GGUF written the way llama.cpp writes one loads back as the exact same model:
    architecture table, names, Q/K un-permutation (llama, mixtral), 1+w norms (Gemma),
    stacked experts (MoE)."""
    path, ref = tiny_gguf(tmp_path / "tiny.gguf", model_type)
    lm = load_model(str(path), cache_dir=tmp_path / "cache")
    assert lm.architecture == model_type
    np.testing.assert_allclose(sequence_logits(lm, IDS), sequence_logits(ref, IDS), atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_tiny_quantized_gguf_matches_dequantized(tmp_path, qtype):
    """A quantized GGUF (kept packed) runs like the F32 GGUF of gguf-py's dequantization."""
    ref = tiny_model("llama")
    tensors = gguf_tensors_from_model(ref)
    qpath = write_gguf(tmp_path / "q.gguf", ref, tensors, qtype)
    deq = {
        k: gguf_dequantize(gguf_quantize(v, qtype), qtype) if v.ndim == 2 else v
        for k, v in tensors.items()
    }
    fpath = write_gguf(tmp_path / "f.gguf", ref, deq)
    q = load_model(str(qpath), cache_dir=tmp_path / "c", weight_format="native")
    f = load_model(str(fpath), cache_dir=tmp_path / "c")
    assert q.weight_format == qtype.name.lower() and q.quantization is not None
    np.testing.assert_allclose(sequence_logits(q, IDS), sequence_logits(f, IDS), atol=1e-4)


# --- broken files: ModelLoadError naming the file and the tensor -----------------------------


def _expect(path: Path, *needles: str, **kw) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), cache_dir=path.parent / "cache", **kw)
    msg = str(e.value)
    assert str(path) in msg, msg
    for n in needles:
        assert n in msg, msg


def test_bad_magic(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + b"\0" * 100)
    _expect(p, "not a GGUF")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _expect(p, "empty")


@pytest.mark.parametrize("cut", [3, 20, 200, 2000])
def test_truncated_header(tmp_path, cut):
    path, _ = tiny_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()[:cut]
    p = tmp_path / "cut.gguf"
    p.write_bytes(data)
    _expect(p, "truncated")


def test_truncated_data(tmp_path):
    path, _ = tiny_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    p = tmp_path / "short.gguf"
    p.write_bytes(data[:-1000])
    _expect(p, "truncated", "output.weight")


def test_corrupt_counts(tmp_path):
    path, _ = tiny_gguf(tmp_path / "t.gguf")
    data = bytearray(path.read_bytes())
    data[8:16] = struct.pack("<Q", 1 << 60)  # tensor count
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(data))
    _expect(p, "corrupt")


def test_nan_in_float_weight(tmp_path):
    def edit(t):
        t["blk.1.attn_q.weight"][3, 5] = np.nan

    path, _ = tiny_gguf(tmp_path / "nan.gguf", edit=edit)
    _expect(path, "blk.1.attn_q.weight", "NaN")


def test_inf_in_norm(tmp_path):
    def edit(t):
        t["output_norm.weight"][0] = np.inf

    path, _ = tiny_gguf(tmp_path / "inf.gguf", edit=edit)
    _expect(path, "output_norm.weight", "NaN/Inf")


def test_nan_in_quantized_scale(tmp_path):
    path, _ = tiny_gguf(tmp_path / "q.gguf", qtype=Q.Q8_0)
    from engine.loading.gguf_reader import GGUFFile

    with GGUFFile(path) as gf:
        t = gf.tensors["blk.0.ffn_up.weight"]
        offset = t.offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()  # first block's d
    path.write_bytes(bytes(data))
    _expect(path, "blk.0.ffn_up.weight", "NaN")


def test_missing_tensor(tmp_path):
    path, _ = tiny_gguf(tmp_path / "m.gguf", edit=lambda t: t.pop("blk.1.ffn_down.weight"))
    _expect(path, "missing", "blk.1.ffn_down.weight")


def test_unexpected_tensor(tmp_path):
    def edit(t):
        t["blk.0.mystery.weight"] = np.zeros((4, 32), np.float32)

    path, _ = tiny_gguf(tmp_path / "u.gguf", edit=edit)
    _expect(path, "unexpected", "blk.0.mystery.weight")


def test_wrong_shape(tmp_path):
    def edit(t):
        t["blk.0.attn_v.weight"] = np.zeros((16, 64), np.float32)  # should be (32, 64)

    path, _ = tiny_gguf(tmp_path / "s.gguf", edit=edit)
    _expect(path, "blk.0.attn_v.weight", "shape")


def test_missing_source(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope.gguf"))


def test_gemma_wrong_checksum(tmp_path):
    with pytest.raises(ModelLoadError, match="SHA-256"):
        ensure_gemma3_270m(tmp_path, expected_sha256="0" * 64)
    assert not (tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf").exists()


# --- safetensors folders -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory):
    return export_mlx_folder(real_model(SMOLLM2), tmp_path_factory.mktemp("export") / "smollm2-mlx")


def test_export_and_reload_folder_same_greedy(smollm2_folder):
    lm = real_model(SMOLLM2)
    out = smollm2_folder
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    )
    assert cfg["eos_token_id"] == [0, 2]
    again = load_model(str(out), weight_format="native")
    assert again.architecture == "llama" and again.name == "smollm2-mlx"
    assert again.quantization == lm.quantization
    assert again.weight_format == "mlx-q4" and again.context_length == 8192
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    assert (
        again.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
        == prompt
    )
    assert greedy(again, prompt, 10) == greedy(lm, prompt, 10)


def test_plain_hf_folder_tokenizer(smollm2_folder, tmp_path):
    """A folder without our tokenizer metadata goes through AutoTokenizer."""
    import shutil

    lm = real_model(SMOLLM2)
    folder = Path(shutil.copytree(smollm2_folder, tmp_path / "plain"))
    (folder / "markbase_tokenizer.json").unlink()
    again = load_model(str(folder))
    tok = again.tokenizer
    assert tok.eos_token_ids == {0, 2} and tok.has_chat_template
    msgs = [{"role": "user", "content": "Hello"}]
    assert tok.apply_chat_template(msgs) == lm.tokenizer.apply_chat_template(msgs)
    assert tok.encode(FRANCE) == lm.tokenizer.encode(FRANCE)


def test_exported_folder_loads_in_mlx_lm(smollm2_folder):
    """What mlx_lm.server does with --model DIR: mlx_lm.load, then generate."""
    from mlx_lm import load

    lm = real_model(SMOLLM2)
    model, tokenizer = load(str(smollm2_folder))
    msgs = [{"role": "user", "content": "Hi!"}]
    prompt = lm.tokenizer.apply_chat_template(msgs)
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == prompt
    assert set(tokenizer.eos_token_ids) >= {2}
    ref = greedy(lm, prompt, 8)
    assert greedy(dataclasses.replace(lm, model=model), prompt, 8) == ref


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "qwen3_moe"])
def test_random_folder_round_trip_quantized(tmp_path, model_type):
    cfg = _QWEN3 if model_type == "qwen3" else RANDOM_CONFIGS[model_type]
    lm = build_random_model(model_type, cfg, quantize_bits=4)
    out = export_mlx_folder(lm, tmp_path / "q")
    again = load_model(str(out), weight_format="native")
    assert again.quantization["bits"] == 4
    np.testing.assert_allclose(sequence_logits(again, IDS), sequence_logits(lm, IDS), atol=1e-5)
    f32 = load_model(str(out), weight_format="float32")
    assert f32.quantization is None
    np.testing.assert_allclose(sequence_logits(f32, IDS), sequence_logits(lm, IDS), atol=1e-3)


def test_tied_gemma_gguf_to_folder_and_back(tmp_path):
    """Tied Gemma (no output.weight, like the real one): GGUF -> folder -> folder load."""
    path, _ = tiny_gguf(tmp_path / "g.gguf", "gemma3_text", edit=lambda t: t.pop("output.weight"))
    lm = load_model(str(path), cache_dir=tmp_path / "c")
    assert lm.model.tie_word_embeddings
    again = load_model(str(export_mlx_folder(lm, tmp_path / "f")))
    assert again.model.tie_word_embeddings
    np.testing.assert_allclose(sequence_logits(again, IDS), sequence_logits(lm, IDS), atol=1e-6)


def test_truncated_safetensors(tmp_path):
    lm = tiny_model("llama")
    out = export_mlx_folder(lm, tmp_path / "f")
    st = out / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load_model(str(out))
    assert "model.safetensors" in str(e.value)


def test_nan_in_folder_weight(tmp_path):
    lm = tiny_model("llama")
    out = export_mlx_folder(lm, tmp_path / "f")
    st = out / "model.safetensors"
    w = mx.load(str(st))
    bad = np.array(w["model.layers.1.mlp.up_proj.weight"])
    bad[0, 0] = np.nan
    w["model.layers.1.mlp.up_proj.weight"] = mx.array(bad)
    mx.save_safetensors(str(st), w)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(out))


def test_folder_missing_tensor(tmp_path):
    lm = tiny_model("llama")
    out = export_mlx_folder(lm, tmp_path / "f")
    st = out / "model.safetensors"
    w = mx.load(str(st))
    w.pop("model.layers.0.self_attn.k_proj.weight")
    mx.save_safetensors(str(st), w)
    with pytest.raises(
        ModelLoadError, match=r"missing.*model\.layers\.0\.self_attn\.k_proj\.weight"
    ):
        load_model(str(out))


# --- random models -------------------------------------------------------------------------

_QWEN3 = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=256,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

RANDOM_CONFIGS = {
    "llama": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=300, sliding_window=16,
        sliding_window_pattern=6, query_pre_attn_scalar=32,
    ),
    "qwen3_moe": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6,
        vocab_size=256, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=512, norm_topk_prob=True,
    ),
    "mixtral": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
    ),
    "gemma4_text": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
        head_dim=32, global_head_dim=32, num_key_value_heads=1, vocab_size=256,
        vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, num_kv_shared_layers=0,
        sliding_window=16, sliding_window_pattern=2, max_position_embeddings=512,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(RANDOM_CONFIGS))
def test_random_models_decode(model_type):
    lm = build_random_model(model_type, RANDOM_CONFIGS[model_type], seed=1)
    assert lm.architecture == model_type
    prompt = lm.tokenizer.encode("hello")
    assert prompt == list(b"hello")
    out = greedy(lm, prompt, 5)
    assert len(out) == 5 and all(0 <= t < lm.config["vocab_size"] for t in out)
    again = build_random_model(model_type, RANDOM_CONFIGS[model_type], seed=1)
    assert greedy(again, prompt, 5) == out  # seeded


def test_random_model_quantized_and_per_layer_inputs():
    lm = build_random_model("gemma4_text", RANDOM_CONFIGS["gemma4_text"], quantize_bits=4)
    assert lm.quantization is not None
    assert hasattr(lm.model.model, "embed_tokens_per_layer")  # per-layer embeddings
    assert len(greedy(lm, [1, 2, 3], 3)) == 3


# --- GGUF of every family llama.cpp defines = the same weights as an mlx-lm folder -------

GGUF_FAMILIES = [
    "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gemma4_text",
    "gemma4_text_kv", "gemma3n",
]  # fmt: skip


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_greedy_equals_folder(tmp_path, family):
    """A tiny random model written as a GGUF the way llama.cpp's converter writes it
    (names, metadata, layout changes: Gemma 4's fused expert gate/up and proportional
    RoPE table, Gemma 3n's stacked AltUp projections and activation-sparsity quantiles)
    loads back as the model the same weights give as an mlx-lm folder: same config
    where it matters, same logits, same greedy tokens."""
    ref = tiny_model(family)
    gpath = write_gguf(tmp_path / "m.gguf", ref, gguf_tensors_from_model(ref))
    folder = export_mlx_folder(ref, tmp_path / "folder")
    from_gguf = load_model(str(gpath), cache_dir=tmp_path / "cache")
    from_folder = load_model(str(folder))
    assert from_gguf.architecture == from_folder.architecture == ref.architecture
    prompt = [3, 17, 99, 5, 250, 42, 7]
    np.testing.assert_allclose(
        sequence_logits(from_gguf, prompt), sequence_logits(from_folder, prompt), atol=1e-4
    )
    want = greedy(from_folder, prompt, 12)
    assert greedy(from_gguf, prompt, 12) == want
    assert greedy(ref, prompt, 12) == want
