"""Tokenizers built from GGUF metadata, chat templates, streaming detokenization."""

from __future__ import annotations

import functools
import random
import time

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from engine.loading.convert_cache import cache_root
from engine.loading.gguf_reader import GGUFFile
from engine.loading.loader import gguf_tokenizer
from engine.tokenizer import StreamingDetokenizer, Tokenizer, decoder_is_context_free
from tests.helpers.models import GEMMA, SMOLLM2, builtin_path

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


# --- the detokenizer's fast path (plain pieces, no decode) -------------------------------

# Streamed text must equal the full decode: spaces (leading, repeated, trailing), tabs,
# newlines, accents (precomposed and combining), CJK, RTL scripts, emoji (multi-byte,
# skin tones, flags, ZWJ sequences) between letters and at the start, symbols, code.
CORPUS = STREAM_TEXTS + [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "  two leading spaces, three   inside, and trailing   ",
    "line one\nline two\r\n\n\ttab\t\tdouble tab\n\n\n",
    "👍🏽 🇫🇷 👨‍💻 ❤️ 🙂🙂🙂 a🙂b🙂c",
    "🙂 at the start",
    "日本語のテキスト、한국어 텍스트, 中文文本。",
    "combining: e\u0301 a\u0308 n\u0303; RTL: مرحبا بالعالم שלום",
    "∑ x² ≤ √y — ½ € £ ¥ © ™ «»“”‘’…",
    "zero\u200bwidth\u00a0nbsp and ======== rules\n    indented {code: [1, 2]}",
    '```python\nfor i in range(10):\n    print(f"{i:>3} ✓")\n```\n',
]


def stream(det: StreamingDetokenizer, ids: list[int]) -> list[str]:
    return [det.add_token(i) for i in ids] + [det.flush()]


def assert_same_as_slow_path(t: Tokenizer, ids, context=(), skip=True) -> list[str]:
    """The fast detokenizer gives the same piece and state as the decoding one, token
    by token."""
    fast = StreamingDetokenizer(t, context=context, skip_special_tokens=skip)
    slow = StreamingDetokenizer(t, context=context, skip_special_tokens=skip, fast=False)
    out = []
    for i in ids:
        a, b = fast.add_token(i), slow.add_token(i)
        assert a == b, (ids, i)
        assert (fast._ids, fast._prefix, fast._read) == (slow._ids, slow._prefix, slow._read)
        out.append(a)
    out.append(fast.flush())
    assert out[-1] == slow.flush() and fast.text_emitted == slow.text_emitted
    return out


@pytest.mark.parametrize("alias", [SMOLLM2, GEMMA])
def test_fast_detokenizer_streams_the_full_decode(alias):
    t = tok(alias)
    assert t.plain_pieces() is not None  # both decoders take the fast path
    prompt = t.apply_chat_template([{"role": "user", "content": "Hi"}])
    for text in CORPUS:
        ids = t.encode(text, add_special_tokens=False)
        for context in ((), prompt[-4:]):  # the worker passes the prompt's last 4 ids
            pieces = assert_same_as_slow_path(t, ids, context)
            assert "".join(pieces) == t.decode(ids) == text
            assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("alias", [SMOLLM2, GEMMA])
def test_fast_detokenizer_decodes_only_what_is_not_plain(alias):
    t = tok(alias)
    calls = []
    real = t.decode

    def counting(ids, skip_special_tokens=True):
        calls.append(list(ids))
        return real(ids, skip_special_tokens=skip_special_tokens)

    ids = t.encode("The capital of France is Paris, of course.", add_special_tokens=False)
    det = StreamingDetokenizer(t)
    t.decode = counting
    try:
        text = "".join(det.add_token(i) for i in ids)
    finally:
        del t.decode
    assert text == "The capital of France is Paris, of course."
    assert len(calls) == 2  # the first token only; every later one is a plain piece


def test_plain_pieces():
    s, g = tok(SMOLLM2).plain_pieces(), tok(GEMMA).plain_pieces()
    assert s[3575] == " capital" and s[504] == "The"  # byte-level BPE's Ġ is a space
    assert s[2] is None and s[0] is None  # special tokens
    assert s[tok(SMOLLM2).encode("🙂")[0]] is None  # part of a character
    assert s[10**7] is None and s[-1] is None  # not in the vocabulary
    gt = tok(GEMMA)
    paris = gt.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1 and g[paris[0]] == " Paris"  # SentencePiece's ▁ is a space
    assert g[gt.token_to_id("<0x41>")] is None  # byte fallback
    assert g[1] is None and g[106] is None  # <eos>, <end_of_turn>


def random_ids(rng: random.Random, t: Tokenizer, extra: list[int], n: int) -> list[int]:
    """Token soup: any id, special and added tokens, byte-fallback tokens, ids past the
    vocabulary, and runs of a real text's tokens (so the fast path gets its turns)."""
    text = t.encode(CORPUS[0] + CORPUS[3], add_special_tokens=False)
    added = sorted(t._added_ids)
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.1:
            out.append(rng.choice(added))
        elif r < 0.3 and extra:
            out.append(rng.choice(extra))
        elif r < 0.35:
            out.append(t.vocab_size + rng.randrange(8))
        elif r < 0.7:
            start = rng.randrange(len(text))
            out.extend(text[start : start + rng.randint(1, 6)])
        else:
            out.append(rng.randrange(t.vocab_size))
    return out


@pytest.mark.parametrize("alias", [SMOLLM2, GEMMA])
def test_fast_detokenizer_equals_slow_on_random_ids(alias):
    t = tok(alias)
    rng = random.Random(alias)
    if alias == GEMMA:  # byte-fallback tokens, e.g. the bytes of é and 🙂
        extra = [t.token_to_id(f"<0x{b:02X}>") for b in b"A\xc3\xa9\xf0\x9f\x99\x82\x80\xff"]
    else:  # the byte-level tokens of é and 🙂's bytes, one by one
        extra = [t.token_to_id(c) for c in ("Ã", "©", "ð", "Ł", "Ļ", "Ĥ")]
    assert None not in extra
    for _ in range(400):
        ids = random_ids(rng, t, extra, rng.randint(1, 24))
        context = [rng.randrange(t.vocab_size) for _ in range(rng.randint(0, 4))]
        assert_same_as_slow_path(t, ids, context, skip=rng.random() < 0.7)


def sentencepiece_like(decoder) -> Tokenizer:
    """A small SentencePiece-style vocabulary (▁ words, byte fallback, special and added
    tokens) with the given decoder, to check each decoder form."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁▁", "▁▁▁", "▁the", "▁cat", "s", "at", "▁Paris", "é", "東京", "\n", "▁\n"]
    pieces += ["a", "▁a", "ab", "🙂", ".", ",", "▁▁x"]
    backend = BackendTokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)},
            merges=[],
            byte_fallback=True,
            unk_token="<unk>",
        )
    )
    backend.add_special_tokens(["<s>", "</s>"])
    backend.add_tokens(["<tool>"])  # added, not special
    backend.decoder = decoder
    return Tokenizer(
        backend,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
        eos_token_ids={2},
        bos_token_id=1,
        chat_template=None,
        has_chat_template=False,
    )


def _sp_steps(*tail):
    return [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail]


DECODERS = {
    "gemma": (decoders.Sequence(_sp_steps()), True),
    "llama": (decoders.Sequence(_sp_steps(decoders.Strip(" ", 1, 0))), True),
    "metaspace-always": (decoders.Metaspace(prepend_scheme="always"), True),
    "metaspace-first": (decoders.Metaspace(prepend_scheme="first"), True),
    "metaspace-never": (decoders.Metaspace(prepend_scheme="never"), True),
    "strip-each-token": (decoders.Sequence([decoders.Strip(" ", 1, 0), decoders.Fuse()]), True),
    "strip-2": (decoders.Sequence(_sp_steps(decoders.Strip(" ", 2, 0))), False),
    "replace-after-fuse": (decoders.Sequence([decoders.Fuse(), decoders.Replace("▁", " ")]), False),
    "wordpiece": (decoders.WordPiece(), False),
    "bpe-suffix": (decoders.BPEDecoder(), False),
    "ctc": (decoders.CTC(), False),
}


@pytest.mark.parametrize("name", list(DECODERS))
def test_fast_detokenizer_equals_slow_for_each_decoder(name):
    decoder, fast = DECODERS[name]
    assert decoder_is_context_free(decoder) is fast
    t = sentencepiece_like(decoder)
    assert (t.plain_pieces() is not None) is fast
    rng = random.Random(name)
    vocab = t.vocab_size
    words = [t.token_to_id(p) for p in ("▁the", "▁cat", "s", "▁Paris", "▁", "▁▁", "\n", "é")]
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 20)):
            r = rng.random()
            ids.append(rng.choice(words) if r < 0.6 else rng.randrange(vocab + 2))
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        assert_same_as_slow_path(t, ids, context, skip=rng.random() < 0.7)
    if fast:  # and it does take the fast path
        ids = [t.token_to_id(p) for p in ("▁the", "▁cat", "s", "▁Paris", "\n", "▁the")]
        det = StreamingDetokenizer(t)
        pieces = [det.add_token(i) for i in ids]
        assert det._synced  # the fast path's state after each of them
        assert "".join(pieces) + det.flush() == t.decode(ids)


def test_decoders_not_taken_for_context_free():
    # Strip at the end of the whole text (tokenizers 0.23 panics decoding some of these)
    assert not decoder_is_context_free(decoders.Sequence(_sp_steps(decoders.Strip(" ", 0, 1))))
    assert not decoder_is_context_free(None)  # tokens joined with spaces
    assert decoder_is_context_free(tok(SMOLLM2).backend.decoder)
    assert decoder_is_context_free(tok(GEMMA).backend.decoder)


def test_detokenizer_without_plain_pieces():
    """A tokenizer-like object with only ``decode`` (as some tests pass) streams through
    the decoding path."""

    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("a🙂 é".encode())
    det = StreamingDetokenizer(Bytes())
    assert det._pieces is None
    assert "".join(stream(det, ids)) == "a🙂 é"
