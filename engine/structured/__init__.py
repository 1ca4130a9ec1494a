"""Constrained decoding: a sequence's output held to a grammar by a token mask.

A request may carry an ``engine.types.GrammarSpec`` (a JSON schema, a regex, a list of
choices, a Lark or GBNF grammar; the HTTP layer builds tool-call grammars as Lark).
Its life in the engine:

* ``compiler.GrammarCompiler`` (one per model) turns the spec into an llguidance
  grammar, validates it against the model's vocabulary (``bridge``: the tokenizer
  handed to llguidance once per model) and keeps the compiled matcher in an LRU cache;
  each sequence gets a cheap copy (``SequenceGrammar``) at admission.
* Each step, ``masks.MaskFiller`` fills one bitmask row (a bit per token, int32 words,
  llguidance's parallel fill with the GIL released) per constrained row, in a thread of
  its own while the worker thread waits for the model's forward.
* On a GPU's pipelined decode, ``step_order.StepOrder`` picks by timing whether the
  forward is queued before the previous tokens are read back or after the fill starts.
* ``masks.apply_token_masks`` sets the logits of disallowed tokens to -inf in the
  constrained rows only, right before the sampler's draw; unconstrained rows of the
  same batch are not touched.
* The sampled token is fed back to the row's matcher (``SequenceGrammar.accept``);
  when the grammar can take nothing more the sequence finishes with ``stop``.
"""

from engine.structured.compiler import GrammarCompiler, SequenceGrammar
from engine.structured.masks import MaskFiller, TokenMasks, apply_token_masks
from engine.structured.step_order import FORWARD_FIRST, READ_FIRST, StepOrder

__all__ = [
    "FORWARD_FIRST",
    "READ_FIRST",
    "StepOrder",
    "GrammarCompiler",
    "MaskFiller",
    "SequenceGrammar",
    "TokenMasks",
    "apply_token_masks",
]
