"""The engine's per-token log-probabilities in OpenAI's two response shapes.

Chat (``logprobs: true``, ``top_logprobs`` 0-20): ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``,
``top_logprobs`` exactly the asked count (fewer only past the vocabulary).

Completions (``logprobs`` 0-5): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, parallel lists; each ``top_logprobs`` entry maps token text to logprob
for the asked count of most likely tokens plus the sampled one (so up to logprobs + 1
keys, as OpenAI documents); ``text_offset`` is each token's character offset in the
choice's text (echoed prompt included). With ``echo`` the prompt's tokens come first,
the first of them with ``null`` logprob and top list (nothing precedes it).

A token's text is its bytes (engine/tokenizer.py ``token_bytes``) as UTF-8; a token
that is not whole UTF-8 on its own (part of a character) is written ``bytes:\\xNN...``
as OpenAI writes it, and ``bytes`` always carries the exact bytes. What the numbers
are (raw model logprobs, before penalties and temperature) is engine/logprobs.py's.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from engine.types import TokenLogprob


class TokenTexts:
    """Token id -> (text, bytes as a list of ints) for one tokenizer, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._tok.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._cache[token_id] = (text, list(raw))
        return found


def chat_content(
    texts: TokenTexts, ids: Sequence[int], lps: Sequence[TokenLogprob], top_n: int
) -> list[dict]:
    """``logprobs.content`` entries for tokens ``ids`` with their logprobs ``lps``."""
    out = []
    for token_id, lp in zip(ids, lps):
        text, raw = texts(token_id)
        top = []
        for tid, value in lp.top[:top_n]:
            t_text, t_raw = texts(tid)
            top.append({"token": t_text, "logprob": value, "bytes": t_raw})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def chat_logprobs(content: list[dict]) -> dict:
    return {"content": content, "refusal": None}


class CompletionLogprobsBuilder:
    """Builds one choice's legacy logprobs, chunk by chunk: ``add`` returns the lists
    for the tokens it was given. ``text_offset`` runs on across chunks and counts the
    characters the tokens' bytes decode to (a character split over two tokens counts
    at the token that completes it), so it matches the text where every token's text
    is shown (not inside a cut stop string)."""

    def __init__(self, texts: TokenTexts, top_n: int) -> None:
        self.texts = texts
        self.top_n = top_n
        self.offset = 0  # characters of the choice's text before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Sequence[int], lps: Sequence[TokenLogprob | None]) -> dict:
        """The lists for tokens ``ids`` (``lps[i]`` None: no logprob, the prompt's first
        token)."""
        tokens, values, tops, offsets = [], [], [], []
        for token_id, lp in zip(ids, lps):
            text, raw = self.texts(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(self._utf8.decode(bytes(raw)))
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(lp.logprob)
            top = {self.texts(tid)[0]: value for tid, value in lp.top[: self.top_n]}
            top.setdefault(text, lp.logprob)  # the sampled token is always there
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def merge_completion(parts: list[dict]) -> dict:
    """Lists of several ``CompletionLogprobsBuilder.add`` results joined, in order."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for p in parts:
        for key in out:
            out[key].extend(p[key])
    return out
