"""The load check: the engine's cache forms give the model's own logits.

Run once when a model is loaded (``ModelRunner``), on two short prompts, before any
request can reach it. mlx-lm's own caches (``make_prompt_cache``) give the reference:
each prompt's last logits and the logits of one more token. The engine must give
the same through its forms: a prompt prefilled in two chunks, both prompts decoding
one token as rows of one batch, and (where it would be used) both prompts prefilled
together, right-padded.

Why at load: a family whose layers reach into their cache in a way the engine's forms
do not serve should be refused with a message naming it, not fail (or, worse, answer
wrongly) in the middle of a request. What the check decides:

- the single prompt or the batch differs or raises: the model is refused
  (``ModelLoadError``);
- only the output-layer cut (``LastPositions``) differs: it is dropped, and logits
  come from the whole model;
- only prompts prefilled together differ: that is turned off for this model.

It also measures what a sequence holds per leaf (``CacheLayout.measure``), for the
KV budget. Cost: about seven forwards of at most seven tokens.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from engine.loading.loaded_model import ModelLoadError

log = logging.getLogger("markbase.engine")

PROMPTS = ([1, 2, 3, 4, 5, 6, 7], [8, 9])  # different lengths: padding, ragged rows
NEXT = [5, 6]  # the token each row decodes next
# Tolerance, relative to the largest logit: the engine's forms compute what mlx-lm's
# caches do, in other shapes (batched, padded), so kernels differ only in rounding.
RTOL = {mx.float32: 1e-3}
RTOL_HALF = 2e-2  # bfloat16 / float16 logits


def _close(got: mx.array, want: mx.array) -> bool:
    a = np.array(got.astype(mx.float32))
    b = np.array(want.astype(mx.float32))
    if a.shape != b.shape or not np.all(np.isfinite(a)):
        return False
    rtol = RTOL.get(want.dtype, RTOL_HALF)
    return float(np.abs(a - b).max()) <= rtol * float(np.abs(b).max()) + 1e-6


def _reference(model) -> list[tuple[mx.array, mx.array]]:
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for prompt, nxt in zip(PROMPTS, NEXT):
        cache = make_prompt_cache(model)
        first = model(mx.array([prompt], dtype=mx.int32), cache=cache)[0, -1]
        second = model(mx.array([[nxt]], dtype=mx.int32), cache=cache)[0, -1]
        mx.eval(first, second)
        out.append((first, second))
    return out


def _single(runner, prompt: list[int]):
    kv = runner.new_sequence_kv()
    split = len(prompt) // 2
    runner.prefill(kv, prompt[:split], want_logits=False)
    logits = runner.prefill(kv, prompt[split:], want_logits=True)
    mx.eval(logits, kv.arrays())
    return kv, logits


def _decodes(runner, seqs: list, want: list) -> bool:
    """The prefilled ``seqs`` as rows of one batch decode ``NEXT`` as the reference does."""
    batch = runner.new_batch_kv()
    for kv in seqs:
        batch.add(kv.rows())
    logits = runner.decode(batch, NEXT)
    mx.eval(logits)
    return all(_close(logits[i], w[1]) for i, w in enumerate(want))


def load_check(runner) -> None:
    family = runner.family
    refused = f"model family '{family}' is not supported by the engine's caches ({runner.layout.describe()})"
    try:
        want = _reference(runner.model)
    except Exception as exc:  # the model cannot run here at all (e.g. a Metal-only kernel)
        raise ModelLoadError(f"model family '{family}' cannot run on this device: {exc!r}") from exc
    try:
        seqs = [_single(runner, p) for p in PROMPTS]
        if runner.cut is not None and not all(
            _close(logits, w[0]) for (_, logits), w in zip(seqs, want)
        ):
            log.info("%s: the output-layer cut differs from the model's own; not used", family)
            runner.cut = None
            seqs = [_single(runner, p) for p in PROMPTS]
        for (_, logits), w in zip(seqs, want):
            if not _close(logits, w[0]):
                raise ModelLoadError(
                    f"{refused}: a prefilled prompt's logits differ from the model's own"
                )
        runner.layout.measure(seqs[0][0])
        if not _decodes(runner, [kv for kv, _ in seqs], want):
            raise ModelLoadError(f"{refused}: a batched decode step differs from the model's own")
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{refused}: {exc!r}") from exc
    if runner.can_prefill_together():
        try:
            kvs = [runner.new_sequence_kv() for _ in PROMPTS]
            together = runner.prefill_together(kvs, [list(p) for p in PROMPTS])
            mx.eval(together)
            ok = all(_close(together[i], w[0]) for i, w in enumerate(want))
            ok = ok and _decodes(runner, kvs, want)  # the padded rows' caches go on right
        except Exception:
            log.exception("%s: prompts prefilled together failed", family)
            ok = False
        if not ok:
            log.info("%s: prompts prefilled together differ; prefilled one by one", family)
            runner.together_ok = False
