"""MLX's Linux CPU backend must run its float32 matmuls on a fast BLAS.

Each check runs in a fresh interpreter: which BLAS MLX binds to is decided when
``mlx.core`` is first loaded, so it cannot be observed from this (pytest) process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the vendored reference BLAS is a Linux issue"
)

# Conservative: the reference BLAS measured 2.7-8 GFLOP/s, OpenBLAS 27-390 GFLOP/s on
# the 2-core CI/dev box, the low end while other processes hogged both cores.
MIN_GFLOPS = 10.0


def _run(code: str, env_extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARKBASE_BLAS")}
    env.pop("LD_PRELOAD", None)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _needs_cpu_wheel():
    from engine.backends.cpu import blas as cpu_blas

    if cpu_blas.vendored_reference_blas() is None:
        pytest.skip("this MLX does not link the vendored reference BLAS (not mlx[cpu])")
    if cpu_blas._mlx_is_cuda_build():
        pytest.skip("CUDA build of MLX")


CHECK = """
    import json, sys
    {pre}
    from engine.backends.cpu import blas as cpu_blas
    setup = cpu_blas.ensure_fast_blas()
    import mlx.core as mx
    import numpy as np

    # Correctness of every path the sgemv shim takes (M == 1, both transposes,
    # alpha/beta, strided A) and of plain sgemm.
    rng = np.random.default_rng(0)
    def close(got, want):
        return bool(np.allclose(np.array(got), want, rtol=1e-4, atol=1e-3))
    A = rng.standard_normal((1, 576)).astype(np.float32)
    W = rng.standard_normal((1536, 576)).astype(np.float32)
    W2 = rng.standard_normal((576, 1536)).astype(np.float32)
    C = rng.standard_normal((1, 1536)).astype(np.float32)
    X = rng.standard_normal((8, 576)).astype(np.float32)
    At = rng.standard_normal((576, 3)).astype(np.float32)
    with mx.stream(mx.cpu):
        ok = {{
            "m1_bt": close(mx.array(A) @ mx.array(W).T, A @ W.T),
            "m1_bn": close(mx.array(A) @ mx.array(W2), A @ W2),
            "m1_addmm": close(
                mx.addmm(mx.array(C), mx.array(A), mx.array(W).T, alpha=2.0, beta=0.5),
                0.5 * C + 2.0 * (A @ W.T),
            ),
            "m1_at": close(mx.array(At)[:, 1:2].T @ mx.array(W).T, At[:, 1:2].T @ W.T),
            "m8": close(mx.array(X) @ mx.array(W).T, X @ W.T),
            "batched": close(
                mx.array(X).reshape(2, 4, 576) @ mx.array(W2), X.reshape(2, 4, 576) @ W2
            ),
        }}
    rep = cpu_blas.blas_report()
    print(json.dumps({{"rep": rep, "ok": ok}}))
"""


def test_fast_blas_active_after_ensure():
    _needs_cpu_wheel()
    out = _run(CHECK.format(pre=""))
    rep = out["rep"]
    assert rep["setup"]["method"] == "dlopen-global", rep
    assert not rep["uses_reference_blas"], rep
    assert "mlx_cpu.libs" not in (rep["sgemm_provider"] or ""), rep
    assert any("openblas" in p or "mkl" in p for p in rep["mapped"]), rep["mapped"]
    assert rep["gflops"] >= MIN_GFLOPS, rep
    assert all(out["ok"].values()), out["ok"]
    if rep["setup"]["shim"]:
        assert rep["shim_calls"]["gemv"] >= 3, rep["shim_calls"]  # the M == 1 checks used it


def test_reexec_when_mlx_already_imported():
    _needs_cpu_wheel()
    out = _run(CHECK.format(pre="import mlx.core"))
    rep = out["rep"]
    assert rep["setup"]["method"] == "ld-preload", rep
    assert not rep["uses_reference_blas"], rep
    assert rep["gflops"] >= MIN_GFLOPS, rep
    assert all(out["ok"].values()), out["ok"]


def test_plain_blas_without_shim():
    _needs_cpu_wheel()
    out = _run(CHECK.format(pre=""), {"MARKBASE_BLAS_GEMV": "0"})
    rep = out["rep"]
    assert rep["setup"]["shim"] is None and not rep["uses_reference_blas"], rep
    assert all(out["ok"].values()), out["ok"]


def test_report_detects_reference_blas():
    """With the override off, the report must see the slow vendored BLAS (what the
    server's start-up warning relies on)."""
    _needs_cpu_wheel()
    out = _run(
        """
        import json, logging
        from engine.backends.cpu import blas as cpu_blas
        cpu_blas.ensure_fast_blas()
        logging.basicConfig(level=logging.WARNING)
        rep = cpu_blas.warn_if_slow()
        print(json.dumps(rep))
        """,
        {"MARKBASE_BLAS": "off"},
    )
    assert out["uses_reference_blas"] and not out["fast"], out


def test_cpu_decode_step_matches_model():
    """engine.backends.cpu.tuning.CpuDecodeStep == model(tokens, cache)[:, -1] on a tiny llama,
    with markbase's left-padded BatchKV (rows of different lengths)."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models import llama

    from engine.backends.cpu.tuning import CpuDecodeStep
    from engine.kv import BatchKV, SequenceKV

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        vocab_size=97,
        rope_traditional=True,
    )
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    ref = llama.Model(args)
    ref.update(model.parameters())
    step = CpuDecodeStep(model)

    def batch_kv():
        caches = [BatchKV() for _ in range(2)]
        for prompt in ([5, 6, 7, 8, 9, 10], [11, 12, 13]):
            seq = [SequenceKV() for _ in range(2)]
            ref(mx.array([prompt]), cache=seq)
            for layer, c in enumerate(caches):
                c.add(*seq[layer].kv())
        return caches

    mine, theirs = batch_kv(), batch_kv()
    tokens = mx.array([[1], [2]], dtype=mx.int32)
    for _ in range(3):
        got = step(tokens, mine)
        want = ref(tokens, cache=theirs)[:, -1, :]
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-4).item()
        tokens = mx.argmax(want, axis=-1, keepdims=True).astype(mx.int32)
