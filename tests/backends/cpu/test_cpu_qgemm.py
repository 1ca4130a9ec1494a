"""Quantized decode products behind float32 weights (engine/backends/cpu/qgemm.py + the shim).

Real MLX matmuls through MLX's CPU backend: the shim must serve them from the
quantized copy (hit counter), agree with a float64 product of the float32 weights,
and give a row the same bits whatever else is in the batch."""

import numpy as np
import pytest

from engine.backends.cpu import qgemm as cpu_qgemm

mx = pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(
    cpu_qgemm.available() is not None,
    reason=f"quantized CPU products unavailable: {cpu_qgemm.available()}",
)


def _weight(bits, gs, n, k):
    w = mx.random.normal((n, k), key=mx.random.key(bits * 1000 + n))
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    wf = mx.dequantize(q, s, b, group_size=gs, bits=bits).astype(mx.float32)
    mx.eval(wf)
    return wf, cpu_qgemm.shadow_of(q, s, b, bits, gs)


def _q8_1(x: np.ndarray) -> np.ndarray:
    """``x`` as llama.cpp's Q8_1 inputs hold it (float64): each 32-element block rounded
    (half to even) to int8 steps of max|x| / 127. With int8 inputs the product must be
    exactly this times the weights: the weights' affine bias meets the block sum of
    the rounded values, not of the exact ones (that left the rounding error against
    uncentred 4-bit codes: 2.5x the error, 94% top-1 agreement with the float
    products over a decode instead of 98%)."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    steps = np.rint(xb * inv)
    return (steps * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_shadow_from_codes_equals_shadow_from_mlx_packing(bits):
    """A GGUF's decoded codes (one uint8 a weight) make the same shadow as MLX's packed
    bit stream of them, and the widened forms are the codes themselves."""
    w = mx.random.normal((64, 256), key=mx.random.key(bits))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    mx.eval(q, s, b)
    stream = np.unpackbits(np.array(q).view(np.uint8), axis=-1, bitorder="little")
    codes = (stream.reshape(64, 256, bits).astype(np.uint16) << np.arange(bits)).sum(-1)
    packed = cpu_qgemm.shadow_of(q, s, b, bits, 32)
    decoded = cpu_qgemm.shadow_of_codes(codes.astype(np.uint8), np.array(s), np.array(b), bits, 32)
    assert packed.bits == decoded.bits == (4 if bits == 4 else 8)
    for x, y in (
        (packed.q, decoded.q),
        (packed.scales, decoded.scales),
        (packed.biases, decoded.biases),
    ):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    if bits != 4:
        assert np.array_equal(decoded.q, codes)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize(
    "bits,gs,n,k",
    # 5/6/3-bit: widened to 8-bit shadows (Gemma 3 270M's Q5_0 projections)
    [(4, 32, 1536, 576), (8, 32, 576, 1536), (4, 64, 100, 128), (5, 32, 256, 640),
     (6, 32, 64, 128), (3, 64, 64, 128)],
)  # fmt: skip
def test_products_match_float_and_are_batch_invariant(int8, bits, gs, n, k):
    lib = cpu_qgemm._lib()
    if int8 and not lib.markbase_qw_has_int8():
        pytest.skip("no int8 products on this CPU (AVX2 or AVX512-VNNI)")
    lib.markbase_qw_set_int8(int(int8))
    try:
        wf, shadow = _weight(bits, gs, n, k)
        assert shadow.bits == (4 if bits == 4 else 8)
        reg = cpu_qgemm.Registration()
        assert reg.add(wf, [shadow])
        for m in (1, 3, 9, 16):
            x = mx.random.normal((m, k), key=mx.random.key(m)) + 0.3
            mx.eval(x)
            before = cpu_qgemm.hits()
            y = x @ wf.T
            mx.eval(y)
            assert cpu_qgemm.hits() == before + 1, "the product did not take the quantized route"
            xr = _q8_1(np.asarray(x)) if int8 else np.asarray(x, dtype=np.float64)
            ref = xr @ np.asarray(wf, dtype=np.float64).T
            err = np.abs(np.asarray(y) - ref).max() / np.abs(ref).max()
            assert err < (1e-4 if int8 else 1e-5), (m, err)
            for i in sorted({0, m - 1}):  # the first tile of rows and the last (a tail)
                alone = x[i : i + 1] @ wf.T
                mx.eval(alone)
                assert np.array_equal(np.asarray(alone)[0], np.asarray(y)[i]), (m, i)
        reg.close()
        before = cpu_qgemm.hits()
        mx.eval(x @ wf.T)
        assert cpu_qgemm.hits() == before, "a closed registration still served a product"
    finally:
        lib.markbase_qw_set_int8(0)


@pytest.mark.parametrize("int8", [False, True])
def test_groups_of_16_match_float_and_are_batch_invariant(int8):
    """8-bit rows with a scale per 16 weights (llama.cpp's Q6_K sub-blocks, widened):
    the kernels' values are the float32 weights (one fma each), every batch size gives
    a row its own bits, and int8 inputs (blocks of 32) leave such rows on float inputs."""
    lib = cpu_qgemm._lib()
    if int8 and not lib.markbase_qw_has_int8():
        pytest.skip("no int8 products on this CPU (AVX2 or AVX512-VNNI)")
    rng = np.random.default_rng(16)
    n, k = 80, 256
    q = rng.integers(0, 64, size=(n, k), dtype=np.uint8)
    scale = (rng.standard_normal((n, k // 16)) * 0.01).astype(np.float32)
    wf = mx.array((q.astype(np.float32) - 32.0).reshape(n, -1, 16) * scale[..., None]).reshape(n, k)
    shadow = cpu_qgemm.shadow_of_codes(q, scale, -32.0 * scale, 6, 16)
    assert shadow is not None and shadow.bits == 8 and shadow.group_size == 16
    lib.markbase_qw_set_int8(int(int8))
    reg = cpu_qgemm.Registration()
    try:
        mx.eval(wf)
        assert reg.add(wf, [shadow])
        for m in (1, 3, 9, 16):
            x = mx.random.normal((m, k), key=mx.random.key(m))
            mx.eval(x)
            before = cpu_qgemm.hits()
            y = x @ wf.T
            mx.eval(y)
            assert cpu_qgemm.hits() == before + 1, "the product did not take the quantized route"
            ref = np.asarray(x, dtype=np.float64) @ np.asarray(wf, dtype=np.float64).T
            assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5
            for i in sorted({0, m - 1}):
                alone = x[i : i + 1] @ wf.T
                mx.eval(alone)
                assert np.array_equal(np.asarray(alone)[0], np.asarray(y)[i]), (m, i)
    finally:
        reg.close()
        lib.markbase_qw_set_int8(0)


def test_fused_run_is_found_by_address():
    """Q/K/V concatenated into one buffer (what the fused decode step does): the
    fused product is served too, with each part's own quantized rows."""
    parts = [_weight(4, 32, n, 64) for n in (96, 32, 32)]
    fused = mx.concatenate([w for w, _ in parts], axis=0)
    mx.eval(fused)

    class Lin:
        def __init__(self, w):
            self.weight = w

    class Model:
        def __init__(self):
            self.mods = {
                f"l{i}": Lin(fused[a:b])
                for i, (a, b) in enumerate([(0, 96), (96, 128), (128, 160)])
            }

        def named_modules(self):
            return list(self.mods.items())

    model = Model()
    for m in model.mods.values():
        mx.eval(m.weight)
    reg = cpu_qgemm.register_model(model, {f"l{i}": s for i, (_, s) in enumerate(parts)})
    assert reg is not None and reg.count >= 4  # 3 parts + the fused run(s)
    x = mx.random.normal((2, 64))
    before = cpu_qgemm.hits()
    y = x @ fused.T
    mx.eval(y)
    assert cpu_qgemm.hits() == before + 1
    ref = np.asarray(x, dtype=np.float64) @ np.asarray(fused, dtype=np.float64).T
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 4e-2
    reg.close()


def test_default_model_decodes_through_quantized_products():
    """The default model in float32 on the CPU: its weights are registered and a
    greedy decode through the engine uses them and still says Paris."""
    from engine.client import EngineClient
    from engine.config import EngineConfig, ModelConfig

    before = cpu_qgemm.hits()
    cfg = EngineConfig(
        models=[ModelConfig(source="smollm2-135m-instruct", weight_format="float32")]
    )
    client = EngineClient.start(cfg)
    try:
        worker = next(iter(client._workers.values()))
        assert worker.runner.qgemm is not None and worker.runner.qgemm.count > 200
        tok = worker.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        import asyncio

        from engine.types import GenerationRequest, SamplingParams

        async def run():
            req = GenerationRequest(
                request_id="q1",
                model=worker.name,
                prompt_tokens=prompt,
                params=SamplingParams(max_tokens=12, temperature=0.0),
            )
            return "".join([e.text async for e in client.generate(req) if e.text])

        text = asyncio.run(run())
        assert "Paris" in text, text
        assert cpu_qgemm.hits() > before + 500  # ~120 products per decode step
    finally:
        client.shutdown()


def test_timing_counts_only_the_quantized_route_while_on():
    """bench/cpu/step_bench.py's breakdown: the shim's timer grows with quantized
    products while on (and starts from zero), not with float products, not while off."""
    lib = cpu_qgemm._lib()
    wf, shadow = _weight(4, 32, 1536, 576)
    other = mx.random.normal((1536, 576))
    x = mx.random.normal((4, 576))
    mx.eval(other, x)
    reg = cpu_qgemm.Registration()
    assert reg.add(wf, [shadow])
    try:
        lib.markbase_qw_timing(1)
        assert lib.markbase_qw_time_us() == 0.0
        mx.eval(x @ other.T)  # no quantized copy: float32 OpenBLAS
        assert lib.markbase_qw_time_us() == 0.0
        for _ in range(5):
            mx.eval(x @ wf.T)
        on = lib.markbase_qw_time_us()
        assert 0.0 < on < 5e6
        lib.markbase_qw_timing(0)
        mx.eval(x @ wf.T)
        assert lib.markbase_qw_time_us() == on
    finally:
        lib.markbase_qw_timing(0)
        reg.close()
