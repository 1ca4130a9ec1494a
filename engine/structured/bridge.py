"""The model's tokenizer as llguidance sees it, built once per model.

llguidance computes masks over token byte strings it reads from the tokenizer's
``tokenizer.json``; building its token trie costs about a second for a 49k-token
vocabulary (more for 262k), so it is made on first use and kept with the model's
``GrammarCompiler``.
"""

from __future__ import annotations

import llguidance


def build_token_bridge(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """``tokenizer`` (engine.tokenizer.Tokenizer) for llguidance. ``vocab_size`` is the
    model's logits width (at least the tokenizer's): ids the tokenizer lacks are never
    allowed. Every id that ends a turn counts as end of sequence, so a grammar may end
    on any of them."""
    n_vocab = max(int(vocab_size), int(tokenizer.vocab_size))
    eos = sorted(int(i) for i in tokenizer.eos_token_ids if 0 <= int(i) < n_vocab)
    return llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos or None
    )
