"""engine.model.decode_step: the fused decode step equals the plain model call, for float
and 4-bit weights, and make_decode_step keeps the CPU configuration as it was."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from engine.backends.cpu.native_step import NativeDecodeStep  # noqa: E402
from engine.backends.cpu.step import CpuDecodeStep  # noqa: E402
from engine.loading import build_random_model  # noqa: E402
from engine.model.decode_step import FusedDecodeStep, fuse_linears, make_decode_step  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from tests.helpers.models import RANDOM_LLAMA, check_step, prefilled_batch  # noqa: E402

TINY = {**RANDOM_LLAMA, "vocab_size": 97}
PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 12, 13])  # rows of different lengths: an array mask


def _batch(model, prompts=PROMPTS):
    return prefilled_batch(model, prompts)


def _check_against_model(model, step, prompts=PROMPTS, steps=3, atol=1e-4):
    """``step`` on one batch = the model's own call on an identical batch, for a few
    greedy steps. The model's modules read the fused arrays' views, as prefill does."""
    check_step(model, step, prompts, steps=steps, atol=atol)


@pytest.mark.parametrize("compile", [True, False])
def test_float_fused_step_matches_model(compile):
    model = build_random_model("llama", TINY, seed=3).model
    step = FusedDecodeStep(model, compile=compile)
    assert step.fused_groups == 2 * len(model.layers)
    _check_against_model(model, step)
    _check_against_model(model, step, prompts=(PROMPTS[0],))  # one row: no mask


@pytest.mark.parametrize("compile", [True, False])
def test_quantized_fused_step_matches_model(compile):
    """Native 4-bit (QuantizedLinear, group 32): weight, scales and biases rows
    concatenated (the GPU configuration, run here on the CPU)."""
    loaded = build_random_model("llama", TINY, seed=4, quantize_bits=4, group_size=32)
    model = loaded.model
    assert type(model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    before = model(mx.array([[3, 4, 5]]))[:, -1, :]
    step = FusedDecodeStep(model, fuse_quantized=True, compile=compile)
    assert step.fused_groups == 2 * len(model.layers)
    q = model.layers[0].self_attn.q_proj
    assert q.weight.shape[0] == TINY["hidden_size"]  # a view of its own rows
    after = model(mx.array([[3, 4, 5]]))[:, -1, :]  # the views hold the same values
    assert mx.array_equal(before, after).item()
    _check_against_model(model, step)


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("quant", [False, True])
def test_flat_step_matches_model(compile, quant):
    """The hidden state as [B, D] between attentions (the GPU's default) gives the
    model's own logits, float and 4-bit, ragged rows and one row."""
    kw = {"quantize_bits": 4, "group_size": 32} if quant else {}
    model = build_random_model("llama", {**TINY, "tie_word_embeddings": False}, seed=7, **kw).model
    step = FusedDecodeStep(model, fuse_quantized=True, compile=compile, flat=True)
    assert step.flat
    _check_against_model(model, step)
    _check_against_model(model, step, prompts=(PROMPTS[0],))


def test_flat_is_the_gpu_default_only(monkeypatch):
    model = build_random_model("llama", TINY, seed=8).model
    assert not FusedDecodeStep(model, compile=False).flat  # the CPU's configuration
    assert FusedDecodeStep(model, compile=False, gpu_plans=True).flat
    assert not FusedDecodeStep(model, compile=False, gpu_plans=True, flat=False).flat


def test_quantized_parts_with_different_settings_are_not_fused():
    a = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    b = nn.QuantizedLinear(64, 16, bias=False, group_size=32, bits=8)
    c = nn.QuantizedLinear(64, 16, bias=False, group_size=64, bits=4)
    assert fuse_linears([a, b], quantized=True) is None
    assert fuse_linears([a, c], quantized=True) is None
    assert fuse_linears([a, a], quantized=False) is None  # quantized only when asked
    with_bias = nn.Linear(64, 16, bias=True)
    assert fuse_linears([nn.Linear(64, 16, bias=False), with_bias]) is None
    mixed = [nn.Linear(64, 16, bias=False), a]
    assert fuse_linears(mixed, quantized=True) is None


def test_quantized_fuse_equals_the_parts():
    parts = [nn.QuantizedLinear(64, n, bias=False, group_size=32, bits=4) for n in (32, 16, 16)]
    x = mx.random.normal((3, 64))
    want = mx.concatenate([p(x) for p in parts], axis=-1)
    fused = fuse_linears(parts, quantized=True)
    assert fused is not None
    assert mx.array_equal(fused(x), want).item()
    assert mx.array_equal(mx.concatenate([p(x) for p in parts], axis=-1), want).item()


def test_cpu_configuration_is_unchanged():
    """On the CPU: compiled, float weights fused, quantized ones left alone (the GPU
    configuration differs)."""
    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("checks the CPU configuration")
    model = build_random_model("llama", TINY, seed=5).model
    step = make_decode_step(model)
    assert step is not None and step.compiled and step.fused_groups == 4
    qmodel = build_random_model("llama", TINY, seed=5, quantize_bits=4, group_size=32).model
    qstep = make_decode_step(qmodel)
    assert qstep is not None and qstep.compiled and qstep.fused_groups == 0


def test_runner_fused_decode_switch():
    loaded = build_random_model("llama", TINY, seed=6)
    assert ModelRunner(loaded.model, fused_decode=False).decode_step is None
    # the CPU runs the lean step (engine/backends/cpu/step.py, tests/backends/cpu/test_cpu_step.py)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    cpu_steps = (CpuDecodeStep, NativeDecodeStep)
    assert isinstance(ModelRunner(loaded.model).decode_step, (FusedDecodeStep, *cpu_steps))
    assert on_cpu == isinstance(ModelRunner(loaded.model).decode_step, cpu_steps)
    other = build_random_model(
        "qwen3", {**TINY, "head_dim": 16, "max_position_embeddings": 512, "rope_theta": 1e4}, seed=6
    )
    assert make_decode_step(other.model) is None  # not a llama TransformerBlock


@pytest.mark.parametrize(
    "float_plan,quant_plan",
    [
        ("1:xwt", "1:qmm"),
        ("1:wxt", "1:deq"),
        ("1:xwt,2:wxt", "1:qmm,2:deqwxt"),
        ("1:xwt", "1:qmmk2,2:qmmk4"),
        # the custom CUDA kernels: on a machine without CUDA they fall back to xwt/qmm
        ("1:gemv", "1:qgemv"),
        ("1:mma", "1:qmma"),  # and the fused residual/SwiGLU step's fallback
    ],
)
def test_gpu_matmul_plans_give_the_same_step(monkeypatch, float_plan, quant_plan):
    """Every formulation engine/backends/cuda/linear.py can pick (run here on the CPU) computes
    the same products: the step still equals the model's own call, float and 4-bit,
    one row and two (the plans above switch form at 2 rows)."""
    from engine.backends.cuda import linear as gpu_linear

    monkeypatch.setenv("MARKBASE_GPU_FLOAT_PLAN", float_plan)
    monkeypatch.setenv("MARKBASE_GPU_QUANT_PLAN", quant_plan)
    gpu_linear.reset_plans()  # plans are read from the environment once, then kept
    try:
        assert gpu_linear.float_plan() == gpu_linear.parse_plan(float_plan, gpu_linear.FLOAT_FORMS)
        untied = {**TINY, "tie_word_embeddings": False}
        for kw in ({}, {"quantize_bits": 4, "group_size": 32}):
            model = build_random_model("llama", untied, seed=5, **kw).model
            step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
            for fold in (True, False):  # MARKBASE_GPU_FOLD: the residual/SwiGLU folding
                step.fold = fold
                _check_against_model(model, step, atol=2e-4)
                _check_against_model(model, step, prompts=(PROMPTS[0],), atol=2e-4)
    finally:
        monkeypatch.undo()
        gpu_linear.reset_plans()


def test_gpu_matmul_plan_parsing():
    from engine.backends.cuda import linear as gpu_linear
    from engine.backends.cuda.linear import FLOAT_FORMS, parse_plan

    plan = parse_plan("8:wxt, 1:xwt", FLOAT_FORMS)
    assert [plan.form(n) for n in (1, 7, 8, 128)] == ["xwt", "xwt", "wxt", "wxt"]
    plan = parse_plan(gpu_linear.DEFAULT_QUANT_PLAN, gpu_linear.QUANT_FORMS)
    forms = [plan.form(n) for n in (1, 2, 8, 32, 33, 128)]
    assert forms == ["qstream", "qmma", "qmma", "qmma", "qgemm", "qgemm"]
    plan = parse_plan(gpu_linear.DEFAULT_FLOAT_PLAN, gpu_linear.FLOAT_FORMS)
    assert [plan.form(n) for n in (1, 2, 32, 33)] == ["xwt", "mma", "mma", "xwt"]
    gpu_linear.set_plans(float_text="1:wxt")
    try:
        assert gpu_linear.float_plan().form(5) == "wxt" and gpu_linear.uses("wxt")
    finally:
        gpu_linear.reset_plans()
    for bad in ("", "8wxt", "x:wxt", "1:fast"):
        with pytest.raises(ValueError, match="GPU matmul plan"):
            parse_plan(bad, FLOAT_FORMS)


def test_gpu_mma_m_tiles_rule():
    """A block of engine/backends/cuda/products/mma.py takes as many 16-row m-tiles (up to 4, or the cap)
    as leave at least MIN_BLOCKS blocks: 8b's gate_up 4, its o_proj/qkv/down 2, 1b's
    o_proj 1; a weight the tiles do not divide gets 1."""
    from engine.backends.cuda.products import mma as gpu_mma

    assert [gpu_mma.m_tiles(n) for n in (28672, 16384, 6144, 4096, 3072, 2048, 4112)] == [
        4, 4, 2, 2, 1, 1, 1,
    ]  # fmt: skip
    assert gpu_mma.m_tiles(28672, rows=16) == 1  # up to 16 rows: one m-tile (measured)
    assert gpu_mma.m_tiles(2048, rows=128) == 4  # 4 row chunks: 4x the blocks
    try:
        gpu_mma.set_max_m_tiles(1)
        assert gpu_mma.m_tiles(28672) == 1
        gpu_mma.set_max_m_tiles(2)
        assert gpu_mma.m_tiles(28672) == 2
    finally:
        gpu_mma.set_max_m_tiles(None)
    assert gpu_mma.m_tiles(28672) == 4


@pytest.mark.parametrize("variant", ["default", "traditional", "llama3", "linear", "mha"])
@pytest.mark.parametrize("joint", [True, False])
def test_gpu_step_rope_variants(variant, joint):
    """The GPU configuration's 2-D step (q and k through one RoPE call, or two) equals
    the model's own call for every RoPE variant mlx-lm's llama takes; run on the CPU."""
    from tests.helpers.models import ROPES

    cfg = {**TINY, **ROPES[variant]}
    model = build_random_model("llama", cfg, seed=8).model
    step = FusedDecodeStep(model, fuse_quantized=True, compile=False, gpu_plans=True)
    step.joint_rope = joint
    _check_against_model(model, step, atol=2e-4)
    _check_against_model(model, step, prompts=(PROMPTS[0],), atol=2e-4)


def test_gpu_fold_switch_routes_the_products(monkeypatch):
    """``fold`` (MARKBASE_GPU_FOLD) decides whether the 2-D step's o_proj, gate_up and
    down_proj go through ``fused`` (residual adds and SwiGLU inside the products), and
    with it qkv and gate_up get their RMSNorm handed in (the route folds it into the
    1-row kernel); every way the step equals the model (on the CPU ``fused`` computes
    with MLX ops)."""
    from engine.backends.cuda import linear as gpu_linear

    calls = []
    real = gpu_linear.GpuLinear.fused

    def counting(self, *args, **kwargs):
        calls.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gpu_linear.GpuLinear, "fused", counting)
    model = build_random_model("llama", {**TINY, "tie_word_embeddings": False}, seed=5).model
    step = FusedDecodeStep(model, compile=False, gpu_plans=True)
    layers = len(model.model.layers)
    # 3 steps: qkv, o_proj, gate_up and down_proj through fused
    for fold, want in ((False, 0), (True, 12 * layers)):
        step.fold = fold
        calls.clear()
        _check_against_model(model, step, atol=2e-4)
        assert len(calls) == want
        normed = [c for c in calls if c.get("norm") is not None]
        assert len(normed) == (6 * layers if fold else 0)  # qkv, gate_up
    assert any(c.get("glu") for c in calls) and any("residual" in c for c in calls)
    assert all(c.get("norm") is None for c in calls if "residual" in c)
