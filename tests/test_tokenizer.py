"""Tokenizers built from GGUF metadata, chat templates, streaming detokenization."""

from __future__ import annotations

import functools
import time

import pytest
from conftest_loading import GEMMA, SMOLLM2, builtin_path

from engine.loading.convert_cache import cache_root
from engine.loading.gguf_reader import GGUFFile
from engine.loading.loader import gguf_tokenizer
from engine.tokenizer import StreamingDetokenizer, Tokenizer

# Token ids llama.cpp (llama-cpp-python 0.3.36, vocab_only, add_bos=True, special=True) gives
# for the same GGUF files.
LLAMACPP = {
    SMOLLM2: {
        "The capital of France is": [504, 3575, 282, 4649, 314],
        "Hello,  world!\n\nNew   paragraph\twith tab.": [19556, 28, 216, 905, 17, 198, 198, 5529, 256, 8510, 197, 3659, 10147, 30],
        "Café naïve 東京 🙂 ok": [51, 1939, 2756, 15486, 46494, 17097, 247, 126, 16736, 122, 47526, 10907],
        "  leading spaces": [216, 2899, 5600],
        "x<|im_end|>y": [104, 2, 105],
    },
    GEMMA: {
        "The capital of France is": [2, 818, 5279, 529, 7001, 563],
        "Hello,  world!\n\nNew   paragraph\twith tab.": [2, 9259, 236764, 138, 12392, 236888, 108, 4199, 139, 35781, 255968, 4060, 6937, 236761],
        "Café naïve 東京 🙂 ok": [2, 160319, 236859, 120362, 86459, 57235, 7546],
        "  leading spaces": [2, 138, 26016, 9952],
        "x<|im_end|>y": [2, 236781, 236820, 236909, 548, 236779, 643, 111038, 236762],
    },
}  # fmt: skip

STREAM_TEXTS = [
    "Café naïve 東京 🙂 ok — «quotes» and emoji 👩‍👩‍👧 done.",
    "def f(x):\n    return x ** 2  # comment\n\n\tTabbed  spaces   here",
    "Ünïcödé at the start, then plain ASCII text for a while.",
]


@functools.cache
def tok(alias: str) -> Tokenizer:
    with GGUFFile(builtin_path(alias)) as gf:
        return gguf_tokenizer(gf, cache_root())


@pytest.mark.parametrize("alias", [SMOLLM2, GEMMA])
def test_encoding_matches_llamacpp(alias):
    t = tok(alias)
    for text, ids in LLAMACPP[alias].items():
        assert t.encode(text) == ids, text
        skip = ids[1:] if alias == GEMMA else ids
        assert t.decode(skip, skip_special_tokens=False) == text


def test_smollm2_tokenizer_facts():
    t = tok(SMOLLM2)
    assert t.vocab_size == 49152
    assert t.bos_token_id == 1 and not t.add_bos
    assert t.eos_token_ids == {0, 2}  # <|endoftext|> and <|im_end|> (the GGUF's eos)
    assert t.has_chat_template and t.fallback_stop_strings == ()
    assert t.id_to_piece(2) == "<|im_end|>"
    assert t.convert_ids_to_tokens([504, 3575]) == ["The", "Ġcapital"]
    assert t.is_special(2) and not t.is_special(504)
    assert t.decode([504, 3575, 2]) == "The capital"
    assert t.decode([504, 3575, 2], skip_special_tokens=False) == "The capital<|im_end|>"


def test_smollm2_chat_template():
    t = tok(SMOLLM2)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = t.render_chat(msgs)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = t.apply_chat_template(msgs)
    assert ids[0] == 1 and ids.count(2) == 2 and ids[-4:] == t.encode("<|im_start|>assistant\n")
    no_prompt = t.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt


def test_gemma_tokenizer_and_fallback_template():
    t = tok(GEMMA)
    assert t.vocab_size == 262144
    assert t.bos_token_id == 2 and t.add_bos
    assert t.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
    assert not t.has_chat_template  # the GGUF (base model) ships none
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert t.render_chat(msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = t.apply_chat_template(msgs)
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # exactly one BOS
    assert t.fallback_stop_strings == ()


def test_generic_fallback_template():
    t = Tokenizer.byte_level(300)
    assert not t.has_chat_template
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": " hi "}]
    assert t.render_chat(msgs) == "System: S\n\nUser: hi\n\nAssistant:"
    assert t.fallback_stop_strings
    assert t.apply_chat_template(msgs) == list(b"System: S\n\nUser: hi\n\nAssistant:")


@pytest.mark.parametrize("alias", [SMOLLM2, GEMMA])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_detokenizer_matches_decode(alias, text):
    t = tok(alias)
    ids = t.encode(text, add_special_tokens=False)
    det = t.detokenizer()
    pieces = [det.add_token(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == t.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_streaming_holds_back_partial_utf8():
    t = tok(SMOLLM2)
    ids = t.encode("🙂")  # byte-level BPE splits the emoji's 4 bytes over tokens
    assert len(ids) > 1
    det = t.detokenizer()
    out = [det.add_token(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🙂"
    assert det.flush() == ""


def test_streaming_detokenizer_flush_of_unfinished_char():
    t = tok(SMOLLM2)
    ids = t.encode("a🙂")
    det = t.detokenizer()
    text = "".join(det.add_token(i) for i in ids[:-1])
    assert text == "a"
    assert det.flush() == t.decode(ids[:-1])[1:]  # the broken bytes come out at the end


def test_streaming_detokenizer_keeps_window_small():
    t = tok(GEMMA)
    ids = t.encode("the quick brown fox jumps over the lazy dog. " * 300, add_special_tokens=False)
    det = StreamingDetokenizer(t)
    start = time.perf_counter()
    n = 0
    for i in ids[:200]:
        n += len(det.add_token(i))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for i in ids[-200:]:
        n += len(det.add_token(i))
    last = time.perf_counter() - start
    assert len(det._ids) < 100  # bounded window, not the whole output
    assert last < first * 5 + 0.05  # per-token cost does not grow with the output


def test_streaming_with_prompt_context():
    t = tok(GEMMA)
    prompt = t.encode("The capital of France is")
    out = t.encode(" Paris, of course.", add_special_tokens=False)
    det = t.detokenizer(context=prompt)
    assert "".join(det.add_token(i) for i in out) + det.flush() == " Paris, of course."


def test_skip_special_tokens_in_stream():
    t = tok(SMOLLM2)
    det = t.detokenizer()
    ids = t.encode("Hi there") + [2]
    assert "".join(det.add_token(i) for i in ids) + det.flush() == "Hi there"


def test_tokenizer_cache_round_trip(tmp_path):
    with GGUFFile(builtin_path(SMOLLM2)) as gf:
        built = gguf_tokenizer(gf, tmp_path)  # converts and saves
        entries = list((tmp_path / "tokenizers").iterdir())
        assert len(entries) == 1 and (entries[0] / "tokenizer.json").exists()
        cached = gguf_tokenizer(gf, tmp_path)  # loads the saved one
    for text in LLAMACPP[SMOLLM2]:
        assert cached.encode(text) == built.encode(text)
    assert cached.eos_token_ids == built.eos_token_ids
    assert cached.chat_template == built.chat_template and cached.has_chat_template


def test_byte_level_save_load(tmp_path):
    t = Tokenizer.byte_level(258)
    assert t.encode("héllo") == list("héllo".encode())
    assert t.eos_token_ids == {257} and t.bos_token_id == 256
    t.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.encode("héllo") == t.encode("héllo")
    assert again.decode(t.encode("héllo")) == "héllo"
    assert again.eos_token_ids == {257}
    # and through transformers, as mlx-lm would load it
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode("héllo", add_special_tokens=False) == t.encode("héllo")
