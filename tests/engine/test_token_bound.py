"""``Tokenizer.max_input_bytes_per_token``: the bound the server uses to refuse a
prompt by its length without tokenizing it (server.prompt_guard) must never
undercount, for the real tokenizers and for texts built to pack many bytes into
few tokens; and tokenizers for which no bound is safe must give None.
``encode_unlocked`` gives the same ids as ``encode``."""

from __future__ import annotations

import functools
import math
import random
import threading
import time

import pytest
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.loading.convert_cache import cache_root
from engine.loading.gguf_reader import GGUFFile
from engine.loading.loader import gguf_tokenizer
from engine.tokenizer import Tokenizer, input_bytes_bound
from tests.helpers.models import GEMMA, SMOLLM2, builtin_path


@functools.cache
def tok(alias: str) -> Tokenizer:
    with GGUFFile(builtin_path(alias)) as gf:
        return gguf_tokenizer(gf, cache_root())


def dense_texts(t: Tokenizer) -> list[str]:
    """Texts made of the vocabulary's longest tokens (the fewest tokens per byte),
    runs of whitespace and symbols, special tokens, and random Unicode."""
    vocab = t.backend.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=lambda s: len(s.encode()), reverse=True)[:50]
    pieces = [t.decode([vocab[s]], skip_special_tokens=False) for s in longest]
    rng = random.Random(0)
    texts = [
        "".join(pieces) * 20,
        " " * 5000,
        "\n" * 5000,
        "\t" * 3000,
        "#" * 4000,
        "=" * 4000 + "-" * 4000,
        "▁" * 3000,  # SentencePiece's space mark typed in by a user: 3 bytes each
        "<|im_start|><|im_end|>" * 500,
        "".join(chr(rng.randint(32, 0x2FFFF)) for _ in range(3000))
        .encode("utf-8", "replace")
        .decode("utf-8", "replace"),
        "The quick brown fox jumps over the lazy dog. " * 200,
    ]
    return texts + ["".join(rng.choice(pieces) for _ in range(300)) for _ in range(5)]


@pytest.mark.parametrize("alias, bound", [(SMOLLM2, 81), (GEMMA, 93)])
def test_the_bound_never_undercounts_real_tokenizers(alias, bound):
    t = tok(alias)
    assert t.max_input_bytes_per_token() == bound
    for text in dense_texts(t):
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        for special in (True, False):
            assert len(t.encode(text, add_special_tokens=special)) >= math.ceil(nbytes / bound)


def test_byte_tokenizer_bound():
    t = Tokenizer.byte_level(258)
    assert t.max_input_bytes_per_token() == len("<bos>")  # its longest token
    text = "héllo <bos> wörld" * 10
    assert len(t.encode(text)) >= math.ceil(len(text.encode()) / 5)


def _bpe(**kw) -> BackendTokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    return BackendTokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>", **kw))


def test_no_bound_where_none_is_safe():
    wordpiece = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert input_bytes_bound(wordpiece) is None  # a whole unknown word is one token
    merged_unknowns = _bpe(fuse_unk=True)
    assert input_bytes_bound(merged_unknowns) is None
    nfkc = _bpe()
    nfkc.normalizer = normalizers.NFKC()  # "Ａ" (3 bytes) becomes "A" (1)
    assert input_bytes_bound(nfkc) is None
    dropping = _bpe()
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces are dropped
    assert input_bytes_bound(dropping) is None
    stripping = _bpe()
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # eats spaces before it
    assert input_bytes_bound(stripping) is None


def test_a_growing_normalizer_keeps_the_bound():
    t = _bpe()
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert input_bytes_bound(t) == 5  # "<unk>": unknown characters are one token each


@pytest.mark.parametrize("alias", [SMOLLM2, GEMMA])
def test_encode_unlocked_gives_the_same_ids(alias):
    t = tok(alias)
    for text in dense_texts(t)[:6] + ["", "The capital of France is"]:
        for special in (True, False):
            assert t.encode_unlocked(text, special) == t.encode(text, special)


def _longest_stall(work) -> float:
    """The longest another Python thread waited for a 1 ms sleep while ``work`` ran."""
    worst = [0.0]
    done = threading.Event()

    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last)
            last = now

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.05)
    work()
    done.set()
    t.join()
    return worst[0]


def test_encode_unlocked_lets_other_threads_run():
    """What keeps the event loop and the engine thread going while a long prompt is
    tokenized: ``encode`` holds the GIL throughout, ``encode_unlocked`` does not."""
    t = tok(SMOLLM2)
    text = "The quick brown fox jumps over the lazy dog. " * 11_000  # ~500 kB
    locked = _longest_stall(lambda: t.encode(text))
    unlocked = _longest_stall(lambda: t.encode_unlocked(text))
    assert unlocked < min(0.25, locked / 3), (locked, unlocked)
