"""engine.backends.cpu.fast_math: exp and SwiGLU built from multiplies and adds equal MLX's own to
float32 precision (they replace them on the CPU, in prefill and in decode)."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from engine.backends.cpu import fast_math  # noqa: E402


def test_exp_matches_over_the_float32_range():
    x = mx.linspace(-87.0, 88.0, 200_001)
    got = mx.compile(fast_math.exp)(x)
    want = mx.exp(x)
    assert (mx.abs(got - want) / want).max().item() < 4e-6
    assert fast_math.exp(mx.array([0.0, -1e4, -mx.inf])).tolist()[0] == 1.0
    tiny = fast_math.exp(mx.array([-1e4, -mx.inf])).tolist()
    assert all(0.0 <= t < 1e-37 for t in tiny)  # clipped, never NaN


@pytest.mark.parametrize("shape", [(1, 62, 1536), (16, 1536), (3, 7)])
def test_swiglu_matches_mlx(shape):
    g = mx.random.normal(shape, key=mx.random.key(1)) * 6
    u = mx.random.normal(shape, key=mx.random.key(2))
    want = nn.silu(g) * u
    got = fast_math.swiglu(g, u)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5 * max(1.0, mx.abs(want).max().item())
    half = fast_math.swiglu(g.astype(mx.float16), u.astype(mx.float16))
    assert half.dtype == mx.float16  # other dtypes: MLX's own ops


def test_install_reroutes_llama_prefill_only_on_cpu():
    from mlx_lm.models import llama

    from engine.loading import build_random_model

    model = build_random_model(
        "llama",
        {
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": 97,
        },
        seed=1,
    ).model
    x = mx.array([[1, 2, 3, 4]])
    before = model(x)
    assert fast_math.install(model) == (mx.default_device() == mx.cpu)
    if mx.default_device() == mx.cpu:
        assert llama.swiglu is fast_math.swiglu
    assert mx.allclose(model(x), before, atol=1e-5).item()


@pytest.mark.parametrize("shape", [(1, 62, 2048), (16, 2048), (3, 7)])
def test_gelu_tanh_mul_matches_mlx(shape):
    g = mx.random.normal(shape, key=mx.random.key(3)) * 6
    u = mx.random.normal(shape, key=mx.random.key(4))
    want = nn.gelu_approx(g) * u
    got = mx.compile(fast_math.gelu_tanh_mul)(g, u)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5 * max(1.0, mx.abs(want).max().item())
    x = mx.linspace(-20.0, 20.0, 100_001)
    err = mx.abs(fast_math.gelu_tanh_mul(x, mx.ones_like(x)) - nn.gelu_approx(x))
    assert err.max().item() < 1e-6


def test_install_reroutes_gemma3_mlp_prefill():
    from engine.loading import build_random_model

    model = build_random_model(
        "gemma3_text",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": 97,
            "sliding_window": 4,
            "sliding_window_pattern": 2,
        },
        seed=1,
    ).model
    x = mx.array([[1, 2, 3, 4, 5, 6]])
    before = model(x)
    on_cpu = mx.default_device() == mx.cpu
    assert fast_math.install(model) == on_cpu
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(
        type(m).__call__ is (fast_math._gelu_mlp_call if on_cpu else type(m).__call__) for m in mlps
    )
    assert mx.allclose(model(x), before, atol=1e-5).item()
