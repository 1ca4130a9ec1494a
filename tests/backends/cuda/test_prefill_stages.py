"""engine/backends/cuda/prefill_stages.py (stages forced on; on the CPU, and on a GPU by
``bench/gpu/suite.sh stage-check``): a staged prompt chunk queues its
forward at the marked layers and gives the same logits and KV as an unstaged one;
the marks are gone afterwards."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.backends.cuda import prefill_stages
from engine.loading import build_random_model
from engine.runner import ModelRunner

pytestmark = pytest.mark.cpu  # runs without a CUDA device

CFG = dict(hidden_size=64, num_hidden_layers=7, intermediate_size=128, num_attention_heads=4,
           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128)  # fmt: skip


def test_stage_layers():
    assert prefill_stages.stage_layers(16, 4) == [1, 5, 9, 13]
    assert prefill_stages.stage_layers(32, 4) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert prefill_stages.stage_layers(16, 0) == []
    assert prefill_stages.stage_layers(2, 4) == []  # nothing to overlap


def test_staged_prefill_equals_unstaged(monkeypatch):
    model = build_random_model("llama", CFG, seed=5).model
    runner = ModelRunner(model)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 128, size=160)]
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(len(a)), real(*a)))

    def prefill(prompt, every, kv=None):
        runner.stage_every = every
        kv = runner.new_sequence_kv() if kv is None else kv
        return np.array(runner.prefill(kv, prompt, want_logits=True))

    plain_kv = runner.new_sequence_kv()
    plain = prefill(tokens, 0, plain_kv)
    assert queued == []

    staged_kv = runner.new_sequence_kv()
    staged = prefill(tokens, 2, staged_kv)
    assert len(queued) == len(prefill_stages.stage_layers(7, 2)) == 3
    np.testing.assert_array_equal(staged, plain)
    for a, b in zip(staged_kv, plain_kv):
        np.testing.assert_array_equal(np.array(a.kv()[0]), np.array(b.kv()[0]))
    assert not any(c.stage for c in staged_kv)

    queued.clear()  # a short chunk is not staged
    prefill(tokens[:16], 2)
    assert queued == []

    queued.clear()  # several prompts in one forward (200 rows) are staged too
    kvs = [runner.new_sequence_kv() for _ in range(2)]
    together = np.array(runner.prefill_together(kvs, [tokens[:100], tokens[:90]]))
    assert len(queued) == 3
    # (on a GPU MLX's float32 matmuls run in TF32 by default, and a 2-row forward takes
    # other kernels than a 1-row one: 7e-4 apart on an H100; the staged
    # and unstaged forwards above are still bit-equal there)
    atol = 3e-3 if mx.default_device() == mx.gpu else 1e-5
    np.testing.assert_allclose(together[0], prefill(tokens[:100], 0), atol=atol)
