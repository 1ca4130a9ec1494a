"""engine/backends/cuda/linear.py's per-layer routes (runs on the CPU): a product's kernel,
template and launch geometry are worked out once per (rows, dtype, form) and reused;
changing the plans rebuilds them; the kernel receives exactly x, the weight's arrays,
then the residual or the norm's weight and epsilon. The CUDA launch is replaced by a
recorder here (the kernels themselves are tests/backends/cuda/test_gpu_mma.py's, on a GPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.backends.cuda import linear as gpu_linear
from engine.backends.cuda.products import mma as gpu_mma

pytestmark = pytest.mark.cpu  # runs without a CUDA device


@pytest.fixture
def recorded(monkeypatch):
    """Every kernel object made ([(kind, template)]) and every launch ([kwargs])."""
    made, launches = [], []

    class Recorder:
        def __call__(self, kind, template):
            made.append((kind, dict(template)))

            def launch(**kw):
                launches.append(kw)
                return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]

            return launch

    monkeypatch.setattr(gpu_mma, "_kernel", Recorder())
    monkeypatch.setattr(gpu_linear, "_float_kernel_ok", lambda *a: True)
    monkeypatch.setattr(gpu_linear.GpuQuantizedLinear, "_kernel_ok", lambda s, f, d: True)
    gpu_linear.set_plans("1:mma", "1:qmma")
    yield made, launches
    gpu_linear.reset_plans()


def test_a_route_is_built_once_and_gets_the_right_inputs(recorded):
    made, launches = recorded
    w = mx.zeros((256, 512), dtype=mx.bfloat16)
    x = mx.ones((8, 512), dtype=mx.bfloat16)
    r = mx.ones((8, 256), dtype=mx.bfloat16)
    lin = gpu_linear.GpuLinear(w)
    for _ in range(3):
        y = lin.fused(x, residual=r)
    assert y.shape == (8, 256)
    assert [m[0] for m in made] == ["float_res"]  # one kernel object for three calls
    assert made[0][1]["NT"] == 1 and made[0][1]["MT"] == 1 and made[0][1]["T"] == mx.bfloat16
    assert len(launches) == 3
    kw = launches[-1]
    assert [a is b for a, b in zip(kw["inputs"], [x, w, r])] == [True] * 3
    assert kw["grid"] == (256 // 16 * gpu_mma.WARPS * 32, 1, 1)
    assert kw["output_shapes"] == [(8, 256)] and kw["output_dtypes"] == [mx.bfloat16]

    lin.fused(x, glu=True)  # another form: its own route
    assert made[-1][0] == "float_glu" and launches[-1]["output_shapes"] == [(8, 128)]
    lin(x)  # the plain product
    assert made[-1][0] == "float" and len(made) == 3
    lin(x.astype(mx.float16))  # another dtype: another kernel, never a bf16 one
    assert made[-1][0] == "float" and made[-1][1]["T"] == mx.float16


def test_rows_pick_tiles_and_chunks(recorded):
    made, launches = recorded
    w = mx.zeros((28672, 256), dtype=mx.bfloat16)
    lin = gpu_linear.GpuLinear(w)
    for rows, nt, mt in ((1, 1, 1), (9, 2, 1), (17, 4, 4), (100, 4, 4)):
        lin(mx.zeros((rows, 256), dtype=mx.bfloat16))
        assert (made[-1][1]["NT"], made[-1][1]["MT"]) == (nt, mt)
        chunks = -(-rows // 32)
        assert launches[-1]["grid"][0] == 28672 // (16 * mt) * chunks * gpu_mma.WARPS * 32


def test_plan_changes_rebuild_the_routes(recorded):
    made, _ = recorded
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((64, 128)).astype(np.float32))
    x = mx.array(rng.standard_normal((4, 128)).astype(np.float32))
    lin = gpu_linear.GpuLinear(w)
    lin(x)
    assert len(made) == 1
    gpu_linear.set_plans("1:xwt", None)  # MLX's own product now: real numbers
    np.testing.assert_allclose(np.array(lin(x)), np.array(x @ w.T), rtol=1e-5, atol=1e-5)
    assert len(made) == 1
    r = mx.ones((4, 64))
    np.testing.assert_allclose(
        np.array(lin.fused(x, residual=r)), np.array(r + x @ w.T), rtol=1e-5, atol=1e-5
    )
    gpu_linear.set_plans("1:mma", None)
    lin(x)
    assert len(made) == 2


def test_eps_is_one_array_a_value_past_the_scalar_pool():
    """The RMSNorm's epsilon input: float32, element 0 the value, more than 8 bytes (MLX's
    CUDA allocator keeps arrays of 8 bytes or less in a managed-memory pool the host
    also touches), the same array for the same value."""
    e = gpu_mma.device_scalar(1e-6)
    assert e is gpu_mma.device_scalar(1e-6) and e is not gpu_mma.device_scalar(1e-5)
    assert e.dtype == mx.float32 and e.nbytes > 8
    assert float(e[0].item()) == pytest.approx(1e-6)
    # first asked for inside mx.compile's trace (a route built while the step traces)
    got = mx.compile(lambda x: x + gpu_mma.device_scalar(2e-6)[0])(mx.array([1.0]))
    assert got.item() == pytest.approx(1.000002)
    assert gpu_mma.device_scalar(2e-6).nbytes > 8 and gpu_mma.device_scalar(2e-6)[0].item() > 0


def test_qstream_blocks_fit_the_gpu(monkeypatch):
    """engine/backends/cuda/products/qstream.py (CPU part): the default launch shape shrinks to fit the
    SM's shared memory: 16 warps at the 8b down_proj's K on an H200, fewer on an
    sm_89-sized SM; the knobs are taken as given."""
    from engine.backends.cuda.products import qstream as gpu_qstream

    monkeypatch.setattr(gpu_qstream, "_smem", [228 << 10])
    assert gpu_qstream.shape_for("q4", 4096) == (8, 8)
    assert gpu_qstream.shape_for("q4", 14336) == (8, 16)
    assert gpu_qstream.shape_for("mma", 4096) == (4, 4)
    monkeypatch.setattr(gpu_qstream, "_smem", [100 << 10])
    stages, warps = gpu_qstream.shape_for("q4", 14336)
    assert gpu_qstream.smem_bytes("q4", 14336, 64, stages, warps) + 1024 <= 100 << 10
    assert (stages, warps) == (8, 4)
    assert gpu_qstream.shape_for("q4", 4096) == (8, 8)
    gpu_qstream.set_knobs(stages=12, warps=16)
    try:
        assert gpu_qstream.shape_for("q4", 14336) == (12, 16)
    finally:
        gpu_qstream.set_knobs()


def test_qstream_integer_form_shapes(monkeypatch):
    """The integer form (the default): two chunks a slot where a lane's chunks a row are
    even (K a multiple of 2048), else one chunk and twice the slots; its shared memory
    fits an H200's SM at the 8b down_proj's K with 16 warps; the form comes from the
    knob, else MARKBASE_GPU_QSTREAM_FORM, else the default, and a wrong name is refused."""
    from engine.backends.cuda.products import qstream as gpu_qstream

    monkeypatch.setattr(gpu_qstream, "_smem", [228 << 10])
    assert gpu_qstream.form_for(4096, False) == "q4i"
    assert gpu_qstream.cps_for("q4i", 4096) == 2 and gpu_qstream.shape_for("q4i", 4096) == (4, 8)
    assert gpu_qstream.cps_for("q4i", 3072) == 1 and gpu_qstream.shape_for("q4i", 3072) == (8, 8)
    assert gpu_qstream.shape_for("q4i", 14336) == (4, 16)
    assert gpu_qstream.cps_for("q4", 4096) == 1
    smem = gpu_qstream.smem_bytes("q4i", 14336, 64, 4, 16, 2)
    assert smem == 448 * 80 + 4 * 2 * 16 * 32 * 24 and smem + 1024 <= 228 << 10
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_FORM", "q4")
    assert gpu_qstream.form_for(4096, False) == "q4"
    gpu_qstream.set_knobs(form="mma", cps=1)
    try:
        assert gpu_qstream.form_for(4096, False) == "mma"
        assert gpu_qstream.form_for(4100, False) == "q4i"  # not whole m-tiles
        assert gpu_qstream.cps_for("q4i", 4096) == 1
    finally:
        gpu_qstream.set_knobs()
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_FORM", "q5")
    with pytest.raises(ValueError, match="MARKBASE_GPU_QSTREAM_FORM"):
        gpu_qstream.form_for(4096, False)
    with pytest.raises(ValueError, match="unknown form"):
        gpu_qstream.set_knobs(form="q5")


def test_one_row_norm_goes_into_the_stream_kernel(monkeypatch, recorded):
    """By default (MARKBASE_GPU_QSTREAM_NORM unset), at one row the RMSNorm before
    qkv/gate_up goes inside engine/backends/cuda/products/qstream.py's
    integer-form call (its weight and epsilon after the weight's arrays); at 3 rows it is
    its own op before the plain tensor-core kernel; with MARKBASE_GPU_QSTREAM_NORM=0, or a form without it, also at
    one row."""
    import mlx.nn as nn

    from engine.backends.cuda.products import qstream as gpu_qstream

    made, launches = recorded
    qmade = []

    class Recorder:
        def __call__(self, kind, template, smem=0):
            qmade.append(kind)

            def launch(**kw):
                launches.append(kw)
                return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]

            return launch

    monkeypatch.setattr(gpu_qstream, "_kernel", Recorder())
    monkeypatch.setattr(gpu_qstream, "_smem", [228 << 10])
    monkeypatch.delenv("MARKBASE_GPU_QSTREAM_NORM", raising=False)  # on by default
    gpu_linear.set_plans("1:mma", "1:qstream,2:qmma")
    wq, s, b = mx.quantize(mx.zeros((128, 1024), dtype=mx.bfloat16), group_size=64, bits=4)
    q = gpu_linear.GpuQuantizedLinear(wq, s, b, 64, 4, "affine")
    norm = nn.RMSNorm(1024, eps=1e-6)
    x = mx.ones((1, 1024), dtype=mx.bfloat16)
    assert q.fused(x, glu=True, norm=norm).shape == (1, 64)
    assert qmade[-1] == "q4i_glu_norm"
    ins = launches[-1]["inputs"]
    assert [a is c for a, c in zip(ins, [x, wq, s, b, norm.weight])] == [True] * 5
    assert ins[5] is gpu_mma.device_scalar(1e-6)
    q.fused(x, norm=norm)
    assert qmade[-1] == "q4i_norm" and len(launches[-1]["inputs"]) == 6
    x3 = mx.ones((3, 1024), dtype=mx.bfloat16)
    q.fused(x3, glu=True, norm=norm)
    assert made[-1][0] == "q4_glu" and len(launches[-1]["inputs"]) == 4  # norm(x) first
    assert launches[-1]["inputs"][0] is not x3
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_NORM", "0")
    q2 = gpu_linear.GpuQuantizedLinear(wq, s, b, 64, 4, "affine")
    q2.fused(x, glu=True, norm=norm)
    assert qmade[-1] == "q4i_glu" and len(launches[-1]["inputs"]) == 4
    monkeypatch.setenv("MARKBASE_GPU_QSTREAM_NORM", "1")
    gpu_qstream.set_knobs(form="q4")
    try:
        assert not gpu_qstream.takes_norm(128, True)
        with pytest.raises(ValueError, match="does not take the RMSNorm"):
            gpu_qstream.launcher(mx.bfloat16, 128, 1024, 64, glu=True, norm=True)
    finally:
        gpu_qstream.set_knobs()


def test_compiled_step_plumbing_on_the_cpu(monkeypatch):
    """FusedDecodeStep's whole-step compile (``_compiled_call`` -> ``_whole_step`` ->
    ``_layer``) hands the attention the whole cache buffers and a split count, retraces
    only when that count or the buffers' capacity changes, and gives what the step
    over views gives. The CUDA attention kernel is replaced here by an MLX stand-in of
    its contract (T from the views' length, or pos + start + 1 with ``nsplit``; it does
    not write the cache, so both runs read the same stale cache); the kernel itself is
    tests/backends/cuda/test_gpu_attention.py's, on a GPU."""
    from engine.backends import cuda
    from tests.helpers.models import RAGGED_PROMPTS, prefilled_batch

    seen = []
    stand_in = _append_stand_in(seen)

    # the name the step calls: the backend's face, which keeps what it first resolved
    # (patching the attention module instead would reach the step only if the face had
    # not resolved the name yet, and the face would then keep the stand-in)
    monkeypatch.setattr(cuda, "decode_attention_append", stand_in)
    model, step = _append_step(layers=2, seed=3)
    assert step.rope is not None
    traces = []

    def counted(*args):
        traces.append(args[-1])
        return step._whole_step(*args)

    views, whole = prefilled_batch(model, RAGGED_PROMPTS), prefilled_batch(model, RAGGED_PROMPTS)
    tokens = mx.array([[11], [12], [13]], dtype=mx.int32)
    compiled = mx.compile(counted)
    for _ in range(240):  # T 31 -> 270: split counts 1, 2, 3 and one growth (256 slots)
        step._whole = None  # the step over views
        want = step(tokens, views)
        step._whole = compiled
        got = step(tokens, whole)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
    assert views[0].length == whole[0].length == 30 + 240
    assert {n for n, _ in seen if n is not None} == {1, 2, 3}
    assert all(cap > 256 for n, cap in seen if n == 3)  # the whole (grown) buffer
    assert 3 <= len(traces) <= 5, traces


def _append_stand_in(seen: list):
    """An MLX stand-in of gpu_attention.decode_attention_append's contract for one
    token a row, without RoPE and without writing the cache: attention over the
    cache's slots [start, pos + start) (views or whole buffers alike) and the new
    position from ``qkv``; records (nsplit, buffer length) of each call in ``seen``."""

    def attention(qkv, keys, values, start, pos, rope, scale, n_heads, slot=0, shape=None,
                  nsplit=None):  # fmt: skip
        b, hkv, cap, d = keys.shape
        seen.append((nsplit, cap))
        idx = mx.arange(cap)[None]
        valid = (idx >= start[:, None]) & (idx < (pos + start)[:, None])
        q = qkv[:, : n_heads * d].reshape(b, hkv, n_heads // hkv, d)
        k_new = qkv[:, n_heads * d : (n_heads + hkv) * d].reshape(b, hkv, 1, d)
        v_new = qkv[:, (n_heads + hkv) * d :].reshape(b, hkv, 1, d)
        s = mx.where(valid[:, None, None, :], (q @ keys.swapaxes(2, 3)) * scale, -mx.inf)
        p = mx.softmax(mx.concatenate([s, (q @ k_new.swapaxes(2, 3)) * scale], -1), -1)
        return (p[..., :cap] @ values + p[..., cap:] @ v_new).reshape(b, n_heads, 1, d)

    return attention


def _append_step(layers: int, seed: int):
    """A small 4-bit llama and its GPU-plan decode step on this CPU, set to take the
    append-form attention route (what a CUDA GPU gives it)."""
    from engine.loading import build_random_model
    from engine.model.decode_step import FusedDecodeStep, rope_for_kernel

    cfg = dict(hidden_size=128, num_hidden_layers=layers, intermediate_size=256,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=300, tie_word_embeddings=False)  # fmt: skip
    model = build_random_model("llama", cfg, seed=seed, quantize_bits=4, group_size=32).model
    step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
    step.attention_kernel, step.rope = True, rope_for_kernel(model.model.layers)
    return model, step
