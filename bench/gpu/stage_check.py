"""Are staged prompt chunks (engine/backends/cuda/prefill_stages.py) exact on the GPU?

Prints, for random llama models of a few shapes and dtypes, the largest difference
between two unstaged prefills of the same prompt (is the GPU path itself
deterministic?) and between a staged and an unstaged one (logits, and every layer's
keys and values). On an H100 (2026-12-06) every difference was 0; MLX's TF32 float32
matmuls put a two-prompt forward 7e-4 from a one-prompt one, which is why
tests/backends/cuda/test_prefill_stages.py compares those with a TF32 tolerance on a GPU.

    python3 bench/gpu/stage_check.py
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.loading import build_random_model
from engine.runner import ModelRunner

SHAPES = {
    "test": dict(hidden_size=64, num_hidden_layers=7, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2),
    "hd64": dict(hidden_size=512, num_hidden_layers=6, intermediate_size=1024,
                 num_attention_heads=8, num_key_value_heads=2),
}  # fmt: skip


def prefill(runner: ModelRunner, tokens: list[int], every: int):
    runner.stage_every = every
    kv = runner.new_sequence_kv()
    logits = np.array(runner.prefill(kv, tokens, want_logits=True).astype(mx.float32))
    keys = [np.array(c.kv()[0].astype(mx.float32)) for c in kv]
    values = [np.array(c.kv()[1].astype(mx.float32)) for c in kv]
    return logits, keys, values


def diff(a, b) -> float:
    return float(np.max(np.abs(a - b)))


def main() -> None:
    print(f"device {mx.default_device()}")
    for name, shape in SHAPES.items():
        for dtype in (mx.float32, mx.bfloat16):
            cfg = dict(shape, rms_norm_eps=1e-5, vocab_size=128)
            model = build_random_model("llama", cfg, seed=5).model
            model.set_dtype(dtype)
            runner = ModelRunner(model)
            tokens = [int(t) for t in np.random.default_rng(0).integers(0, 128, size=160)]
            p1, k1, v1 = prefill(runner, tokens, 0)
            p2, k2, v2 = prefill(runner, tokens, 0)
            s, ks, vs = prefill(runner, tokens, 2)
            row = (
                f"{name} {dtype}: |logits| max {np.max(np.abs(p1)):.3g}; "
                f"unstaged twice: logits {diff(p1, p2):.3g} keys "
                f"{max(diff(a, b) for a, b in zip(k1, k2)):.3g} values "
                f"{max(diff(a, b) for a, b in zip(v1, v2)):.3g}; "
                f"staged vs unstaged: logits {diff(s, p1):.3g} keys "
                f"{[round(diff(a, b), 6) for a, b in zip(ks, k1)]} values "
                f"{max(diff(a, b) for a, b in zip(vs, v1)):.3g}"
            )
            print(row, flush=True)


if __name__ == "__main__":
    main()
