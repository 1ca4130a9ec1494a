"""engine/backends/cuda/attention/prefill.py: the causal prompt-chunk kernel equals attention
computed in float32, for fresh prompts and chunks after a cached prefix, GQA and
MHA, both head dims, bf16 and fp16, strided queries; and a model's prefill logits do
not change when the kernel replaces MLX's attention.

The kernel tests need MLX's CUDA backend (skipped elsewhere); the support rule runs
everywhere. ``bench/gpu/nvrtc_check.py --only mb_prefill`` compiles the kernel
without a GPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.backends import cuda
from engine.backends.cuda.attention import prefill as gpu_prefill_attention
from engine.kv import SequenceKV
from engine.loading import build_random_model
from engine.model import attention


def _qkv(b, hq, hkv, lq, s, d, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((b, hq, lq, d)).astype(dtype)
    k = mx.random.normal((b, hkv, s, d)).astype(dtype)
    v = mx.random.normal((b, hkv, s, d)).astype(dtype)
    return q, k, v


def causal_attention(q, k, v, scale):
    """Causal attention in numpy (float64 in, float64 out), the last L keys being the
    queries' own (bench/gpu/prefill_attn_emulation.py checks against it too)."""
    b, hq, lq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    visible = np.arange(s)[None, :] <= (s - lq + np.arange(lq))[:, None]
    scores = np.where(visible, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def reference(q, k, v, scale):
    """``causal_attention`` of MLX arrays, in float64."""
    return causal_attention(
        *(np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v)), scale
    )


@pytest.mark.cpu
def test_support_rule():
    q, k, v = _qkv(1, 8, 2, 16, 40, 128, mx.bfloat16)
    ok = gpu_prefill_attention.shape_supported
    assert ok(q, k, v, "causal")
    assert not ok(q, k, v, None)  # not a causal chunk
    assert not ok(q, k, v, mx.ones((16, 40), dtype=mx.bool_))  # an array mask
    assert not ok(q[:, :, :1], k, v, "causal")  # one row: the decode paths
    assert not ok(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), "causal")
    assert not ok(q, k[:, :, :8], v[:, :, :8], "causal")  # fewer keys than queries
    q3, k3, v3 = _qkv(1, 6, 4, 16, 40, 64, mx.float16)
    assert not ok(q3, k3, v3, "causal")  # 6 query heads over 4 KV heads
    q4, k4, v4 = _qkv(1, 4, 2, 16, 40, 96, mx.bfloat16)
    assert not ok(q4, k4, v4, "causal")  # head dim 96
    if not mx.cuda.is_available():
        assert not gpu_prefill_attention.supported(q, k, v, "causal")


@pytest.mark.cpu
def test_switch(monkeypatch):
    monkeypatch.setenv(gpu_prefill_attention.ENV, "fast")
    with pytest.raises(ValueError, match=gpu_prefill_attention.ENV):
        gpu_prefill_attention.enabled()
    monkeypatch.setenv(gpu_prefill_attention.ENV, "kernel")
    assert gpu_prefill_attention.enabled()
    monkeypatch.setenv(gpu_prefill_attention.ENV, "mlx")
    assert not gpu_prefill_attention.enabled()


@pytest.mark.cpu
def test_stages_and_shared_memory(monkeypatch):
    monkeypatch.setenv(gpu_prefill_attention.STAGES_ENV, "3")
    with pytest.raises(ValueError, match=gpu_prefill_attention.STAGES_ENV):
        gpu_prefill_attention.stages()
    # two stages of K and V tiles at head dim 128, bf16: under an H100/H200 SM's 227 KB
    assert gpu_prefill_attention.shared_bytes(128, 2, 2) == 2 * 2 * 64 * 136 * 2 < 227 << 10


CASES = [
    # b, hq, hkv, lq, s, d
    (1, 8, 2, 2, 2, 64),
    (1, 4, 4, 17, 17, 128),
    (1, 32, 8, 200, 200, 128),
    (1, 8, 1, 64, 64, 64),
    (1, 8, 2, 100, 357, 128),  # a chunk after 257 cached positions
    (2, 4, 2, 70, 135, 64),
    (1, 16, 8, 1000, 1000, 128),
    (1, 8, 2, 129, 1153, 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", ["2-ldm", "1-ldm", "2-lds"])
def test_kernel_equals_float_attention(monkeypatch, case, dtype, form):
    monkeypatch.setenv(gpu_prefill_attention.STAGES_ENV, form[0])
    monkeypatch.setenv(gpu_prefill_attention.LDM_ENV, "1" if form.endswith("ldm") else "0")
    b, hq, hkv, lq, s, d = case
    q, k, v = _qkv(b, hq, hkv, lq, s, d, dtype, seed=lq + s)
    scale = d**-0.5
    got = gpu_prefill_attention.prefill_attention(q, k, v, scale)
    assert got.shape == q.shape and got.dtype == dtype
    got = np.array(got.astype(mx.float32))
    want = reference(q, k, v, scale)
    assert np.isfinite(got).all()
    tol = 3e-2 if dtype == mx.bfloat16 else 6e-3
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_strided_queries_and_cache_views():
    """q as mlx-lm makes it ([B, L, H, D] transposed) and K/V as views of a larger
    cache buffer (SequenceKV's slices)."""
    b, hq, hkv, lq, s, d = 1, 8, 2, 90, 150, 128
    mx.random.seed(7)
    q = mx.random.normal((b, lq, hq, d)).astype(mx.bfloat16).transpose(0, 2, 1, 3)
    kbuf = mx.random.normal((b, hkv, 512, d)).astype(mx.bfloat16)
    vbuf = mx.random.normal((b, hkv, 512, d)).astype(mx.bfloat16)
    k, v = kbuf[:, :, :s, :], vbuf[:, :, :s, :]
    got = np.array(gpu_prefill_attention.prefill_attention(q, k, v, 0.1).astype(mx.float32))
    np.testing.assert_allclose(got, reference(q, k, v, 0.1), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_model_prefill_logits_unchanged(monkeypatch, head_dim):
    heads = 4
    cfg = {
        "hidden_size": heads * head_dim,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    model = build_random_model("llama", cfg, seed=2).model
    model.set_dtype(mx.bfloat16)
    attention.install(model)
    tokens = [(7 * i + 3) % 256 for i in range(150)]

    def logits():
        kv = [SequenceKV() for _ in model.layers]
        model(mx.array([tokens[:90]], dtype=mx.int32), cache=kv)  # then a chunk after 90
        return np.array(model(mx.array([tokens[90:]], dtype=mx.int32), cache=kv).astype(mx.float32))

    monkeypatch.setenv(gpu_prefill_attention.ENV, "kernel")
    calls = []
    real = gpu_prefill_attention.prefill_attention
    # counted where engine/model/attention.py calls it: the backend's face (which keeps
    # the first function it resolved, so patching the kernel module would count only
    # in the first test to get there)
    monkeypatch.setattr(cuda, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    with_kernel = logits()
    assert len(calls) == 2 * 2  # two chunks, two layers
    monkeypatch.setenv(gpu_prefill_attention.ENV, "mlx")
    with_mlx = logits()
    assert len(calls) == 4
    np.testing.assert_allclose(with_kernel, with_mlx, atol=5e-2, rtol=5e-2)
