"""engine/backends/cuda/rope_offsets.py (CPU, conversion forced on): an int RoPE offset handed to the
pass-through RoPE classes as a device array gives the same result; other classes and
array offsets are left alone; a model's layers share one array per offset."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from engine.backends.cuda import rope_offsets
from engine.loading import build_random_model

pytestmark = pytest.mark.cpu  # runs without a CUDA device

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192, rope_type="llama3")  # fmt: skip


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(rope_offsets, "force_on_cpu", True)
    monkeypatch.setattr(rope_offsets._local, "made", {}, raising=False)


def test_patched_rope_equals_the_original(forced):
    cfg = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=256, rope_scaling=LLAMA3)  # fmt: skip
    model = build_random_model("llama", cfg, seed=3).model
    ropes = [layer.self_attn.rope for layer in model.model.layers]
    assert all(type(r) is Llama3RoPE for r in ropes)
    x = mx.random.normal((1, 4, 5, 32), key=mx.random.key(1))
    before = [np.array(r(x, offset=37)) for r in ropes]
    rope_offsets.install(model)
    assert type(ropes[0]) is Llama3RoPE  # the class is patched, not the module replaced
    after = [np.array(r(x, offset=37)) for r in ropes]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    made = rope_offsets._local.made
    assert list(made) == [37] and made[37].shape == (1,) and made[37].dtype == mx.int32
    plain = nn.RoPE(32)
    rope_offsets.install(nn.Sequential(plain))
    want = mx.fast.rope(x, 32, traditional=False, base=10000.0, scale=1.0, offset=9)
    np.testing.assert_array_equal(np.array(plain(x, offset=9)), np.array(want))
    arr = mx.array([9], dtype=mx.int32)  # an array offset passes through unchanged
    np.testing.assert_array_equal(np.array(plain(x, offset=arr)), np.array(want))
    assert 9 in made and len(made) == 2


def test_only_pass_through_classes_are_patched(forced):
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.r = DynamicNTKScalingRoPE(32, 2048, False, 10000.0, 2.0)

    before = DynamicNTKScalingRoPE.__call__
    assert rope_offsets.install(Holder()) == 0
    assert DynamicNTKScalingRoPE.__call__ is before
