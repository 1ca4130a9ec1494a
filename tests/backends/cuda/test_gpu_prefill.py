"""engine/backends/cuda/prefill.py: the dequantize-then-matmul route for many-row quantized
products gives quantized_matmul's results (runs on any device; on a GPU the runner
installs it by default)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.backends.cuda import prefill as gpu_prefill
from engine.kv import SequenceKV
from engine.loading import build_random_model

# float32 products on a CUDA GPU may round their inputs to TF32 (10-bit mantissa):
# measured on an H100, the routes differ by up to 6e-4 there (1e-6 on the CPU)
TOL = 3e-3 if mx.default_device().type == mx.DeviceType.gpu else 1e-4

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.mark.cpu
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_route_equals_quantized_matmul_above_and_only_above_the_threshold(bits, group_size):
    mx.random.seed(3)
    layer = nn.QuantizedLinear(128, 96, bias=True, group_size=group_size, bits=bits)
    layer.bias = mx.random.normal((96,))
    reference = nn.QuantizedLinear(128, 96, bias=True, group_size=group_size, bits=bits)
    reference.update(layer.parameters())
    assert gpu_prefill.install(layer, min_rows=8) == 1
    assert isinstance(layer, gpu_prefill.DequantPrefillLinear)
    calls = []
    original = mx.dequantize
    try:
        mx.dequantize = lambda *a, **k: calls.append(1) or original(*a, **k)
        for rows in (1, 7, 8, 40):
            x = mx.random.normal((1, rows, 128))
            got, want = np.array(layer(x)), np.array(reference(x))
            np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
            assert len(calls) == (rows >= 8), rows
            calls.clear()
    finally:
        mx.dequantize = original


@pytest.mark.cpu
def test_prefill_logits_unchanged_by_the_route():
    loaded = build_random_model("llama", TINY, seed=5, quantize_bits=4)
    model = loaded.model
    tokens = mx.array([list(range(3, 43))], dtype=mx.int32)
    want = np.array(model(tokens, cache=[SequenceKV() for _ in model.layers]))
    assert gpu_prefill.install(model, min_rows=16) == 7 * 2 + 1  # q,k,v,o,gate,up,down + lm_head
    got = np.array(model(tokens, cache=[SequenceKV() for _ in model.layers]))
    np.testing.assert_allclose(got, want, rtol=10 * TOL, atol=10 * TOL)


@pytest.mark.cpu
def test_threshold_from_the_environment():
    assert gpu_prefill.min_rows_from_env({}) == gpu_prefill.DEFAULT_MIN_ROWS
    assert gpu_prefill.min_rows_from_env({gpu_prefill.ROWS_ENV: "0"}) == 0
    assert gpu_prefill.install(nn.QuantizedLinear(64, 64), min_rows=0) == 0
    with pytest.raises(ValueError, match=gpu_prefill.ROWS_ENV):
        gpu_prefill.min_rows_from_env({gpu_prefill.ROWS_ENV: "many"})


@pytest.mark.cpu
def test_the_decode_step_still_fuses_and_replans_the_routes_modules():
    """A second runner on one model (the benchmarks build one per variant) meets the
    first one's routed modules: the decode step must still fuse and plan them, else
    every decode product falls back to quantized_matmul (measured: 3x slower)."""
    from engine.backends.cuda import linear as gpu_linear
    from engine.model.decode_step import fuse_linears

    model = build_random_model("llama", TINY, seed=6, quantize_bits=4).model
    assert gpu_prefill.install(model, min_rows=16) > 0
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.q_proj, gpu_prefill.DequantPrefillLinear)
    assert fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj], quantized=True) is not None
    assert fuse_linears([mlp.gate_proj, mlp.up_proj], quantized=True, gpu_plans=True) is not None
    assert isinstance(gpu_linear.for_module(mlp.down_proj), gpu_linear.GpuQuantizedLinear)
    assert not gpu_prefill.is_plain_quantized(nn.Linear(8, 8))


@pytest.mark.cpu
def test_small_route_switch(monkeypatch):
    """MARKBASE_GPU_PREFILL_SMALL: qmma (default) or mlx, checked; on the CPU the qmma
    route does not apply (the result is quantized_matmul's either way)."""
    monkeypatch.delenv(gpu_prefill.SMALL_ENV, raising=False)
    assert gpu_prefill.small_route() == "qmma"
    monkeypatch.setenv(gpu_prefill.SMALL_ENV, "fast")
    with pytest.raises(ValueError, match="want mlx or qmma"):
        gpu_prefill.small_route()


@pytest.mark.parametrize("rows", [2, 8, 12, 33, 100, 255])
def test_small_chunks_on_the_mma_kernel_equal_quantized_matmul(rows, monkeypatch):
    """With MARKBASE_GPU_PREFILL_SMALL=qmma, chunks of 2-255 rows run on gpu_mma's
    kernel (spied) and give quantized_matmul's product (bf16, with a bias); 256 rows
    still take the dequantize route."""
    from engine.backends.cuda.products import mma as gpu_mma

    monkeypatch.setenv(gpu_prefill.SMALL_ENV, "qmma")
    calls = []
    real = gpu_mma.quantized_matmul
    monkeypatch.setattr(
        gpu_mma, "quantized_matmul", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    mx.random.seed(rows)
    layer = nn.QuantizedLinear(512, 384, bias=True, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    layer.bias = (mx.random.normal((384,)) * 0.1).astype(mx.bfloat16)
    reference = nn.QuantizedLinear(512, 384, bias=True, group_size=64, bits=4)
    reference.update(layer.parameters())
    assert gpu_prefill.install(layer) == 1
    x = mx.random.normal((1, rows, 512)).astype(mx.bfloat16)
    got, want = layer(x).astype(mx.float32), reference(x).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2)
    assert calls == [1]
    layer(mx.random.normal((1, 256, 512)).astype(mx.bfloat16))
    assert calls == [1]


def test_prompt_logits_with_small_chunks_on_the_mma_kernel(monkeypatch):
    """A 4-bit bf16 model's logits over a 40-token prompt (every product below the
    dequantize route) are the same within bf16 rounding on either small-chunk route."""
    loaded = build_random_model("llama", {**TINY, "hidden_size": 128}, seed=5, quantize_bits=4)
    model = loaded.model
    model.set_dtype(mx.bfloat16)
    gpu_prefill.install(model)
    tokens = mx.array([list(range(3, 43))], dtype=mx.int32)
    out = {}
    for route in ("mlx", "qmma"):
        monkeypatch.setenv(gpu_prefill.SMALL_ENV, route)
        logits = model(tokens, cache=[SequenceKV() for _ in model.layers])
        out[route] = np.array(logits.astype(mx.float32))
    np.testing.assert_allclose(out["qmma"], out["mlx"], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("lengths", [(40, 7, 23), (300, 120, 64)], ids=["small", "dequantized"])
def test_prompts_prefilled_together_on_the_gpu_routes(lengths):
    """A 4-bit bf16 model on the GPU's prefill routes (gpu_mma's kernel below 256 rows,
    dequantized above, the prefill attention kernel over a batch of rows): prompts
    prefilled together give each one's own last logits, within bf16 rounding."""
    from engine.runner import ModelRunner

    loaded = build_random_model(
        "llama", {**TINY, "hidden_size": 128, "vocab_size": 512}, seed=9, quantize_bits=4
    )
    loaded.model.set_dtype(mx.bfloat16)
    runner = ModelRunner(loaded.model, fused_decode=False)
    prompts = [[(i * 37 + j * 11) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    together = runner.prefill_together([runner.new_sequence_kv() for _ in prompts], prompts)
    together = np.array(together.astype(mx.float32))
    for i, prompt in enumerate(prompts):
        alone = runner.prefill(runner.new_sequence_kv(), prompt, True)
        np.testing.assert_allclose(
            together[i], np.array(alone.astype(mx.float32)), rtol=5e-2, atol=5e-2
        )
