"""Tokenizer and streaming detokenizer used by the engine.

``Tokenizer`` wraps a Hugging Face fast tokenizer (built from GGUF metadata with
transformers' converter, no torch; or loaded from a model folder). It encodes and decodes on
the ``tokenizers`` backend directly, renders chat templates with transformers' jinja sandbox,
and builds the ``PreTrainedTokenizerFast`` (``.hf``) only when something asks for it. On top
it keeps what serving needs: every token id that ends a turn (``eos_token_ids``), the chat
template (or a documented fallback when the model ships none), and save/load of all of it.

``StreamingDetokenizer`` turns a token stream into text pieces, holding back incomplete
UTF-8 / byte-fallback sequences. It decodes only a small window of recent tokens per step.

Fallback chat templates (used when the model has no ``chat_template``; ``has_chat_template``
is then False):

* ``GEMMA_FALLBACK_TEMPLATE`` when the vocabulary has ``<start_of_turn>``/``<end_of_turn>``:
  Gemma's own turn format (system text is put in front of the first user turn).
* ``GENERIC_FALLBACK_TEMPLATE`` otherwise: a plain transcript ``System: ...``, ``User: ...``,
  ``Assistant: ...``, one turn per paragraph, ending with ``Assistant:`` when a generation
  prompt is asked for. Base models tend to continue with ``User:``; ``fallback_stop_strings``
  lists what to stop on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

META_FILE = "markbase_tokenizer.json"

# Tokens that end a turn or a document in common chat formats. Any of them present in the
# vocabulary (as a special/control token) stops generation.
END_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<turn|>",
    "</s>",
    "<eos>",
    "<|return|>",
)

# Text is only ever written from {{ ... }} so jinja's whitespace rules cannot eat it.
GEMMA_FALLBACK_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] | trim) + '\\n\\n' %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<start_of_turn>model\\n' + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% else %}"
    "{{ '<start_of_turn>user\\n' + ns.system + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

GENERIC_FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ ('System: ' if message['role'] == 'system' else 'Assistant: ' if message['role'] == 'assistant' else 'User: ')"
    " + (message['content'] | trim) + '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
GENERIC_FALLBACK_STOPS = ("\n\nUser:", "\nUser:")
BOS_PREFIX = "{{ bos_token }}"  # put in front of a fallback template when the model wants BOS


def fallback_chat_template(has_gemma_turns: bool, add_bos: bool) -> str:
    base = GEMMA_FALLBACK_TEMPLATE if has_gemma_turns else GENERIC_FALLBACK_TEMPLATE
    return (BOS_PREFIX if add_bos else "") + base


class Tokenizer:
    """The engine's tokenizer. Build with ``from_gguf_metadata``, ``load`` or ``byte_level``.

    Encoding and decoding run on the ``tokenizers`` backend directly; the
    ``PreTrainedTokenizerFast`` wrapper (``.hf``) is built on first use, because building
    it for a 262k-token vocabulary costs seconds at every start.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: dict[str, str | None],
        eos_token_ids: Iterable[int],
        bos_token_id: int | None,
        chat_template: str | None,
        has_chat_template: bool,
        add_bos: bool = False,
        hf: PreTrainedTokenizerFast | None = None,
    ):
        self._backend = backend
        self._hf = hf
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.has_chat_template = has_chat_template
        self._vocab = backend.get_vocab(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        self._plain_pieces: PlainPieces | None = None
        self._plain_checked = False
        self._input_bytes_bound: int | None = None
        self._bound_checked = False
        self._token_bytes: dict[int, bytes] = {}
        self._byte_decoder: dict[str, int] | None = None  # {} once known not byte-level
        if chat_template is None:
            gemma_turns = "<start_of_turn>" in self._vocab and "<end_of_turn>" in self._vocab
            chat_template = fallback_chat_template(gemma_turns, add_bos)
        self.chat_template = chat_template
        self.fallback_stop_strings: tuple[str, ...] = (
            GENERIC_FALLBACK_STOPS if chat_template.endswith(GENERIC_FALLBACK_TEMPLATE) else ()
        )
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_token_ids) | frozenset(
            self._template_end_tokens()
        )
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # --- encoding ---------------------------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """A transformers tokenizer over the same backend (built lazily)."""
        if self._hf is None:
            self._hf = PreTrainedTokenizerFast(
                tokenizer_object=self._backend, **self.special_tokens
            )
            self._hf.chat_template = self.chat_template
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` for long texts, called from a worker thread: the tokenizers
        library releases the GIL in ``encode_batch`` but not in ``encode``, so with
        this the event loop and the engine thread keep running while it works. Measured
        on 1 MB of English with SmolLM2's tokenizer (2 vCPUs): a thread calling
        ``encode`` stalls every other Python thread for the whole 1.6 s; one calling
        ``encode_batch`` for 0.1 s at most. Same ids as ``encode``."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def max_input_bytes_per_token(self) -> int | None:
        """The most bytes of UTF-8 input one token can stand for, or None where this
        tokenizer offers no safe bound. ``ceil(len(text.encode()) / bound)`` is then a
        lower bound on the tokens of ``text``: the server rejects a prompt that cannot
        fit the context window from its length alone, without tokenizing it. Worked
        out once (see ``input_bytes_bound``)."""
        if not self._bound_checked:
            self._input_bytes_bound = input_bytes_bound(self._backend, self._vocab)
            self._bound_checked = True
        return self._input_bytes_bound

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The conversation as text, through the chat template (transformers' jinja sandbox)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        context = {**self.special_tokens, **kwargs}
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
        return rendered[0]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation. Templates write BOS themselves."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self, context: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for one sequence (``context``: last prompt ids)."""
        return StreamingDetokenizer(self, context=context, skip_special_tokens=skip_special_tokens)

    def plain_pieces(self) -> PlainPieces | None:
        """The text of every token that always adds the same text, whatever comes before
        it (see ``PlainPieces``); None when the decoder is not one we can reason about.
        Built once per tokenizer, filled lazily."""
        if not self._plain_checked:
            if decoder_is_context_free(self._backend.decoder):
                try:
                    self._plain_pieces = PlainPieces(self)
                except ValueError:  # no token to read pieces after: no fast path
                    pass
            self._plain_checked = True
        return self._plain_pieces

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, on its own (logprobs' ``bytes``): byte-level
        BPE maps its characters back to bytes, a ``<0xXX>`` byte-fallback token is that
        byte, an added/special token its own text, any other token the text it adds
        after other text (SentencePiece's ``▁`` is a space). Cached per token."""
        cache = self._token_bytes
        found = cache.get(token_id)
        if found is None:
            found = cache[token_id] = self._token_bytes_uncached(int(token_id))
        return found

    def _token_bytes_uncached(self, token_id: int) -> bytes:
        try:
            piece = self._backend.id_to_token(token_id)
        except (OverflowError, ValueError):
            piece = None
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_decoder is None:
            self._byte_decoder = _byte_decoder(self._backend.decoder)
        if self._byte_decoder:
            try:
                return bytes(self._byte_decoder[c] for c in piece)
            except KeyError:
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        pieces = self.plain_pieces()
        text = pieces[token_id] if pieces is not None else None
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=False)
        return text.encode()

    def id_to_piece(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _template_end_tokens(self) -> set[int]:
        out = set()
        for t in END_TOKENS:
            # A known end token stops generation if it is a special token of this vocabulary
            # or the chat template writes it.
            i = self._vocab.get(t)
            if i is not None and (i in self._special_ids or t in self.chat_template):
                out.add(i)
        return out

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, architecture: str) -> Tokenizer:
        """Build from llama.cpp tokenizer metadata, via transformers' GGUF converter (no torch)."""
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        td = {
            name: metadata[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in metadata
        }
        backend, _ = convert_gguf_tokenizer(architecture, td)
        tokens = td["tokens"]

        def tok(key: str) -> tuple[str | None, int | None]:
            i = metadata.get(f"tokenizer.ggml.{key}")
            if i is None or not 0 <= int(i) < len(tokens):
                return None, None
            return tokens[int(i)], int(i)

        bos, bos_id = tok("bos_token_id")
        eos, eos_id = tok("eos_token_id")
        unk, _ = tok("unknown_token_id")
        pad, _ = tok("padding_token_id")
        model = metadata.get("tokenizer.ggml.model")
        add_bos = bos is not None and bool(
            metadata.get("tokenizer.ggml.add_bos_token", model == "llama")
        )
        add_eos = eos is not None and bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(
            backend, bos if add_bos else None, bos_id, eos if add_eos else None, eos_id
        )
        eos_ids = {eos_id} if eos_id is not None else set()
        for key in ("eot_token_id", "eom_token_id"):
            if (i := metadata.get(f"tokenizer.ggml.{key}")) is not None:
                eos_ids.add(int(i))
        template = metadata.get("tokenizer.chat_template")
        return cls(
            backend,
            special_tokens={"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad},
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            chat_template=template,
            has_chat_template=bool(template),
            add_bos=add_bos,
        )

    @classmethod
    def byte_level(cls, vocab_size: int = 256) -> Tokenizer:
        """A trivial byte tokenizer: ids 0..255 are bytes; <bos>=256, <eos>=257 if they fit."""
        byte_chars = _bytes_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        bos = eos = None
        if vocab_size >= 258:
            backend.add_special_tokens(["<bos>", "<eos>"])
            bos, eos = "<bos>", "<eos>"
        return cls(
            backend,
            special_tokens={"bos_token": bos, "eos_token": eos},
            eos_token_ids={257} if eos else set(),
            bos_token_id=256 if bos else None,
            chat_template=None,
            has_chat_template=False,
        )

    def save(self, directory: str | Path) -> None:
        """save_pretrained plus our metadata. The chat template in use (real or fallback) goes
        into the saved tokenizer, so mlx-lm / transformers pick it up."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf.chat_template = self.chat_template
        self.hf.save_pretrained(str(directory))
        meta = {
            "eos_token_ids": sorted(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
            "add_bos": self.add_bos,
            "has_chat_template": self.has_chat_template,
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens,
        }
        (directory / META_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """From a folder written by ``save`` (fast path: tokenizer.json + our metadata), or
        any Hugging Face / mlx-lm model folder (through AutoTokenizer)."""
        directory = Path(directory)
        meta_path = directory / META_FILE
        if meta_path.exists() and (directory / "tokenizer.json").exists():
            meta = json.loads(meta_path.read_text())
            backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
            return cls(
                backend,
                special_tokens=meta.get("special_tokens", {}),
                eos_token_ids=set(meta["eos_token_ids"]) | set(extra_eos_ids),
                bos_token_id=meta["bos_token_id"],
                chat_template=meta["chat_template"],
                has_chat_template=meta["has_chat_template"],
                add_bos=meta["add_bos"],
            )
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(directory))
        if not hasattr(hf, "backend_tokenizer"):
            raise ValueError(f"{directory}: only fast (tokenizer.json) tokenizers are supported")
        template = getattr(hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: take the default one
            template = template.get("default") or next(iter(template.values()), None)
        eos = set(extra_eos_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        probe = hf.encode("a", add_special_tokens=True)
        special = {k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
        return cls(
            hf.backend_tokenizer,
            special_tokens=special,
            eos_token_ids=eos,
            bos_token_id=hf.bos_token_id,
            chat_template=template,
            has_chat_template=bool(template),
            add_bos=hf.bos_token_id is not None and bool(probe) and probe[0] == hf.bos_token_id,
            hf=hf,
        )


# Normalizers that never make text shorter in bytes: a token then stands for at most as
# many input bytes as its own (normalized) text has. Replace counts only where its
# replacement is at least as long as what it replaces (checked below).
_GROWING_NORMALIZERS = frozenset({"Prepend", "Replace"})
# Pre-tokenizers that drop no text (Whitespace, WhitespaceSplit, BertPreTokenizer and
# CharDelimiterSplit drop the characters they split on; Split and Punctuation can too).
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
)


def input_bytes_bound(backend: BackendTokenizer, vocab: Iterable[str] | None = None) -> int | None:
    """The most UTF-8 bytes of input text any one token of ``backend`` covers, or None.

    Safe only where every input byte ends up in some token and no token covers more
    input than its own text: a BPE model (byte-level, or with byte fallback, or with
    unknown characters as one token each), a normalizer that only makes text longer
    (none, Prepend, Replace with a replacement at least as long), pre-tokenizers that
    keep every character, and added tokens that strip no whitespace around them.
    Anything else (WordPiece's whole-word [UNK], NFKC, lowercasing, accent stripping,
    a Whitespace pre-tokenizer that drops spaces, merged unknowns) gives None.

    A token's text is its normalized input: byte-level BPE writes one character per
    byte (so its length in characters is its bytes), other models their UTF-8 text.
    """
    model = backend.model
    if not isinstance(model, models.BPE):
        return None
    normalizer = backend.normalizer
    if normalizer is not None:
        try:
            spec = json.loads(normalizer.__getstate__())
        except Exception:
            return None
        norm_steps = spec.get("normalizers", [spec]) if spec.get("type") == "Sequence" else [spec]
        for step in norm_steps:
            kind = step.get("type")
            if kind not in _GROWING_NORMALIZERS:
                return None
            if kind == "Replace":
                pattern = step.get("pattern", {})
                if "String" not in pattern:
                    return None  # a regex may match more than it writes
                if len(str(step.get("content", "")).encode()) < len(pattern["String"].encode()):
                    return None
    byte_level = False
    pre = backend.pre_tokenizer
    if pre is not None:
        try:
            spec = json.loads(pre.__getstate__())
        except Exception:
            return None
        pre_steps = spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]
        for step in pre_steps:
            kind = step.get("type")
            if kind not in _KEEPING_PRE_TOKENIZERS:
                return None
            if str(step.get("behavior", "")).lower() == "removed":
                return None
            byte_level |= kind == "ByteLevel"
    if not byte_level and not model.byte_fallback and model.unk_token and model.fuse_unk:
        return None  # a run of unknown characters is one token
    added = backend.get_added_tokens_decoder()
    if any(t.lstrip or t.rstrip for t in added.values()):
        return None  # such a token also covers the whitespace next to it
    if vocab is None:
        vocab = backend.get_vocab(with_added_tokens=True)
    # A ``<0xNN>`` byte-fallback token counts as its 6 characters (it stands for 1
    # byte): a looser bound, still safe.
    size = len if byte_level else (lambda token: len(token.encode()))
    most = max(map(size, vocab), default=0)
    most = max([most, *(len(t.content.encode()) for t in added.values())])
    return max(most, 4)  # an unknown character (one token each) is up to 4 bytes


def _set_post_processor(backend, bos, bos_id, eos, eos_id) -> None:
    """BOS/EOS on ``encode(..., add_special_tokens=True)`` exactly as the GGUF says."""
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + (["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = ([(bos, bos_id)] if bos else []) + ([(eos, eos_id)] if eos and eos != bos else [])
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _byte_decoder(decoder) -> dict[str, int]:
    """Byte-level BPE's character -> byte table when ``decoder`` is (or holds) a
    ByteLevel decoder, else {}."""
    try:
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except Exception:
        return {}
    steps = spec.get("decoders") if spec.get("type") == "Sequence" else [spec]
    if not any(isinstance(st, dict) and st.get("type") == "ByteLevel" for st in steps or []):
        return {}
    return {c: b for b, c in _bytes_to_unicode().items()}


def _bytes_to_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


# Decoder steps that map each token's text on its own (before ``Fuse``), so a token adds
# the same text whatever precedes it: Replace and Strip act on each token, ByteFallback
# turns only ``<0xXX>`` tokens into bytes, Metaspace drops the space of the first token
# of a decode only. After ``Fuse`` the steps see the whole text at once; only a Strip
# of at most one leading character keeps that property there (given some text before).
_PER_TOKEN_STEPS = frozenset({"Replace", "Strip", "ByteFallback", "Metaspace"})


def decoder_is_context_free(decoder) -> bool:
    """Whether ``decode(W + [t]) == decode(W) + piece(t)`` for every token ``t`` outside
    the added vocabulary (and not a ``<0xXX>`` byte token) whose piece is complete
    UTF-8, whenever ``W`` holds at least one token with text and ends on a complete
    character: true of byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) and of the
    SentencePiece decoders (Gemma, Llama 2, Mistral, T5). Other decoders (WordPiece's
    cleanup, BPEDecoder's end-of-word suffix, CTC, none at all) are not assumed to be."""
    if decoder is None:
        return False
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:
        return False
    steps = spec.get("decoders") if spec.get("type") == "Sequence" else [spec]
    if not isinstance(steps, list) or not steps:
        return False
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        return True
    fused = False
    for step in steps:
        kind = step.get("type")
        if kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused:
            if step.get("stop") != 0 or step.get("start", 0) > 1:
                return False
        elif kind not in _PER_TOKEN_STEPS or fused:
            return False
    return True


class PlainPieces(dict):
    """token id -> the text the token adds after any text (its "piece"), or None.

    A token is plain when it is in the model's vocabulary (not an added or special
    token), not a byte-fallback ``<0xXX>`` token, and its text is complete UTF-8 with
    no U+FFFD: e.g. byte-level BPE's ``Ġcapital`` -> " capital", SentencePiece's
    ``▁Paris`` -> " Paris". Its piece is what it adds after a probe token, read from
    the tokenizer's own decoder. Filled lazily, one decode per distinct token; only
    built for decoders ``decoder_is_context_free`` accepts.
    """

    def __init__(self, tokenizer: Tokenizer):
        super().__init__()
        backend = tokenizer.backend
        self._backend = backend
        self._added = tokenizer._added_ids
        self._byte_fallback = b'"ByteFallback"' in backend.decoder.__getstate__()
        # what a piece follows: one plain token with text (its decode is checked below)
        self._probe = backend.encode("a", add_special_tokens=False).ids
        self._probe_text = backend.decode(self._probe, skip_special_tokens=False)
        if (
            len(self._probe) != 1
            or self._probe[0] in self._added
            or not self._probe_text
            or "\ufffd" in self._probe_text
        ):
            raise ValueError("no probe token")

    def __missing__(self, token_id):
        piece = self._piece(token_id) if type(token_id) is int else None
        if type(token_id) is int:
            self[token_id] = piece
        return piece

    def _piece(self, token_id: int) -> str | None:
        if token_id in self._added:
            return None
        try:
            token = self._backend.id_to_token(token_id)
        except (OverflowError, ValueError):
            return None
        if token is None:
            return None
        if self._byte_fallback and len(token) == 6 and token[:3] == "<0x" and token[5] == ">":
            return None
        text = self._backend.decode([*self._probe, token_id], skip_special_tokens=False)
        if not text.startswith(self._probe_text):
            return None
        piece = text[len(self._probe_text) :]
        if not piece or "\ufffd" in piece:
            return None
        return piece


class StreamingDetokenizer:
    """Incremental detokenization for one sequence.

    Keeps two offsets into the token list (the vLLM / TGI scheme): ``prefix`` marks the
    start of a short window already emitted as text, ``read`` its end. For each new token it
    decodes the window with and without the new tokens and emits the difference, so work per
    token is bounded by the window, not the output length. While the text ends in U+FFFD
    (an incomplete UTF-8 / byte-fallback sequence) nothing is emitted and the window grows.

    Fast path: right after a token was emitted (nothing held back, so the window's text
    ends on a complete character), a plain token (``PlainPieces``: most tokens of most
    text) adds exactly its piece: the two decodes would give ``W`` and ``W + piece``.
    It then emits the piece and moves the offsets as the decodes would, without
    decoding. Output and state are the same as with ``fast=False`` token by token (the
    tests compare them).

    ``context`` can hold the last prompt token(s) so tokenizers that strip a leading space
    when decoding (sentencepiece with a dummy prefix) keep the space of the first new token.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        context: Sequence[int] = (),
        skip_special_tokens: bool = True,
        fast: bool = True,
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context)[-4:]
        self._prefix = 0
        self._read = len(self._ids)
        self.text_emitted = 0  # characters emitted so far
        plain = getattr(tokenizer, "plain_pieces", None) if fast else None
        self._pieces: PlainPieces | None = plain() if plain is not None else None
        # True right after add_token emitted text: the window ends on a complete
        # character and holds a token with text (the fast path's precondition)
        self._synced = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> str:
        token_id = int(token_id)
        if self._synced:
            piece = self._pieces[token_id]
            if piece is not None:
                ids = self._ids
                ids.append(token_id)
                self._prefix = self._read
                self._read = len(ids)
                if self._prefix > 64:
                    self._trim()
                self.text_emitted += len(piece)
                return piece
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            self._synced = False
            return ""  # incomplete character, or a token with no text (e.g. skipped special)
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 64:
            self._trim()
        self.text_emitted += len(delta)
        self._synced = self._pieces is not None
        return delta

    def _trim(self) -> None:
        """Drop what no window needs any more."""
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0

    def flush(self) -> str:
        """Whatever is still held back (e.g. an unfinished character at the end)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        self._synced = False
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.text_emitted += len(delta)
        return delta
