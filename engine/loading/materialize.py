"""Evaluate every array a model holds, its private ones included, before it leaves the
thread that loaded it.

Why: MLX 0.32 keeps a stream per thread, and an array still waiting to be computed
belongs to the stream of the thread that made it. Evaluating it from another thread
fails with ``There is no Stream(cpu, 0) in current thread`` (or ``gpu``). Loading
evaluates the parameters, but some mlx-lm modules also hold arrays that are not
parameters: ``ProportionalRoPE._freqs`` (gemma4_text's full-attention layers), the
GELU-top-k multipliers of gemma3n's MLPs (``MLP._std_multiplier``). Left lazy, the
first prefill on the engine's worker thread failed for those families; and with
several models loading on threads of their own, no array of one load may wait on a
stream of another.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def held_arrays(model: nn.Module) -> list[mx.array]:
    """Every ``mx.array`` reachable from ``model``'s modules: parameters, private
    entries (keys starting with ``_``) and plain attributes, inside lists, tuples
    and dicts too."""
    out: list[mx.array] = []
    seen: set[int] = set()

    def visit(value, depth: int = 0) -> None:
        if isinstance(value, mx.array):
            if id(value) not in seen:
                seen.add(id(value))
                out.append(value)
        elif isinstance(value, nn.Module):
            return  # reached through named_modules
        elif depth < 4 and isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth + 1)
        elif depth < 4 and isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)

    for _, module in model.named_modules():
        for value in module.values():
            visit(value)
        for value in vars(module).values():
            visit(value)
    return out


def materialize(model: nn.Module) -> int:
    """``fix_families``, then ``mx.eval`` of every array ``model`` holds; returns how
    many arrays there were."""
    fix_families(model)
    arrays = held_arrays(model)
    mx.eval(arrays)
    return len(arrays)


class _FixedCoefs(nn.Linear):
    """Gemma 3n's AltUp coefficients, cast to float32 and clipped once at load.

    mlx-lm's ``Gemma3nAltUp.predict``/``correct`` assign
    ``coefs.weight = clip(coefs.weight.astype(float32))`` on every forward pass: a new
    lazy array in the model after each call, made on the calling thread's stream. The
    next call from another thread (a second engine thread, a test) then fails with
    ``There is no Stream(cpu, N) in current thread``. The values after the first call
    never change (clipping is idempotent), so they are computed here once and the
    per-call assignment is dropped."""

    def __setattr__(self, key, value):
        if key == "weight" and "weight" in self:
            return  # already float32 and clipped
        super().__setattr__(key, value)


def fix_families(model: nn.Module) -> int:
    """Load-time fixes of mlx-lm modules that change their own parameters while they
    run (see ``_FixedCoefs``); returns how many modules were fixed."""
    n = 0
    for _, module in model.named_modules():
        if type(module).__name__ != "Gemma3nAltUp":
            continue
        clip = module.config.altup_coef_clip
        for coefs in (module.prediction_coefs, module.correction_coefs):
            w = coefs.weight.astype(mx.float32)
            if clip is not None:
                w = mx.clip(w, -clip, clip)
            coefs.update({"weight": w})
            coefs.__class__ = _FixedCoefs
            n += 1
    return n
