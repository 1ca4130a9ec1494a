"""engine/envs.py: every MARKBASE_* switch in one registry. The committed
docs/configuration.md is what the registry generates; no module of engine/ or server/
reads a MARKBASE_* variable from os.environ itself; the settings' names and defaults
agree with server/config.py's dataclasses; values are checked; `markbase serve` warns
about a MARKBASE_* variable nothing reads."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine import envs

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_configuration_doc_is_current():
    assert (ROOT / "docs" / "configuration.md").read_text() == envs.markdown(), (
        "run: python -m engine.envs --markdown"
    )


def _markbase_names(tree: ast.AST) -> dict[str, str]:
    """Module-level NAME = "MARKBASE_..." constants."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str) and node.value.value.startswith("MARKBASE_"):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def _environ_reads(path: Path) -> list[str]:
    """``os.environ.get(X)``, ``os.environ[X]``, ``os.getenv(X)``, ``X in os.environ``
    where X is a MARKBASE_* string (a literal, an f-string or a constant naming one)."""
    tree = ast.parse(path.read_text())
    names = _markbase_names(tree)

    def markbase(node) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("MARKBASE_")
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            return isinstance(first, ast.Constant) and str(first.value).startswith("MARKBASE_")
        return isinstance(node, ast.Name) and node.id in names

    def environ(node) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "environ"
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in ("get", "pop", "setdefault") and environ(f.value)) or (
                f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"
            ):
                if node.args and markbase(node.args[0]):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        elif isinstance(node, ast.Subscript) and environ(node.value) and markbase(node.slice):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            if markbase(node.left):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return bad


def test_no_module_reads_markbase_variables_from_os_environ():
    paths = [p for top in ("engine", "server") for p in sorted((ROOT / top).rglob("*.py"))]
    bad = [hit for p in paths if p.name != "envs.py" for hit in _environ_reads(p)]
    assert bad == []


def test_the_check_finds_each_form_of_read(tmp_path):
    probe = ROOT / "engine" / "_envs_probe.py"
    probe.write_text(
        "import os\nA = 'MARKBASE_X'\n"
        "os.environ.get('MARKBASE_X')\nos.environ[A]\nos.getenv(f'MARKBASE_{A}')\n"
        "'MARKBASE_Y' in os.environ\nos.environ.get('HOME')\n"
    )
    try:
        assert len(_environ_reads(probe)) == 4
    finally:
        probe.unlink()


def test_every_markbase_name_in_the_code_is_registered():
    """A MARKBASE_* name written in engine/ or server/ (the C shim too) is a switch."""
    import re

    names = set()
    for top in ("engine", "server"):
        for p in (ROOT / top).rglob("*"):
            if p.suffix in (".py", ".c", ".cu", ".cuh") and p.name != "envs.py":
                names |= set(re.findall(r"MARKBASE_[A-Z0-9_]*[A-Z0-9]", p.read_text()))
    names.discard("MARKBASE_GPU_ATTN")  # the loop shape's prefix (MARKBASE_GPU_ATTN_{n})
    assert sorted(names - set(envs.SWITCHES)) == []


def test_settings_match_server_config():
    from engine.config import EngineConfig
    from server.config import ServerSettings, setting_env_vars

    assert setting_env_vars() == set(envs.SETTINGS)
    for cls in (ServerSettings, EngineConfig):
        for f in dataclasses.fields(cls):
            if f.name == "models":
                continue
            s = envs.switch("MARKBASE_" + f.name.upper())
            if (
                f.default is not dataclasses.MISSING
                and f.default is not None
                and s.default is not None
            ):
                assert s.default == f.default, f.name


def test_kernel_defaults_agree_with_their_modules():
    from engine.backends.cuda import linear, prefetch

    assert envs.value("MARKBASE_GPU_FLOAT_PLAN", {}) == linear.DEFAULT_FLOAT_PLAN
    assert envs.value("MARKBASE_GPU_QUANT_PLAN", {}) == linear.DEFAULT_QUANT_PLAN
    assert envs.value("MARKBASE_GPU_L2_PREFETCH_MB", {}) == prefetch.DEFAULT_MB


def test_values_are_typed_and_checked():
    assert envs.value("MARKBASE_GPU_FOLD", {}) is True
    assert envs.value("MARKBASE_GPU_FOLD", {"MARKBASE_GPU_FOLD": "0"}) is False
    assert envs.value("MARKBASE_GPU_PREFILL_STAGES", {"MARKBASE_GPU_PREFILL_STAGES": "8"}) == 8
    assert envs.value("MARKBASE_PREFILL_ASYNC", {}) is None  # by backend
    with pytest.raises(ValueError, match="MARKBASE_GPU_FOLD='yes': want 0 or 1"):
        envs.value("MARKBASE_GPU_FOLD", {"MARKBASE_GPU_FOLD": "yes"})
    with pytest.raises(ValueError, match="MARKBASE_GPU_WGMMA='2': want auto, 0 or 1"):
        envs.value("MARKBASE_GPU_WGMMA", {"MARKBASE_GPU_WGMMA": "2"})
    with pytest.raises(ValueError, match="want an integer"):
        envs.value("MARKBASE_QGEMM_THREADS", {"MARKBASE_QGEMM_THREADS": "two"})
    with pytest.raises(KeyError, match="registry"):
        envs.value("MARKBASE_NOT_A_SWITCH")
    env = {"MARKBASE_GPU_FOLDD": "1", "MARKBASE_PORT": "8000", "MARKBASE_GPU_DEQUANT": "x"}
    assert envs.unknown(env) == ["MARKBASE_GPU_FOLDD (did you mean MARKBASE_GPU_FOLD?)"]
    assert envs.invalid(env) == ["MARKBASE_GPU_DEQUANT='x': want 0 or 1"]


def test_serve_warns_about_an_unknown_variable_and_stops_on_a_bad_value(tmp_path):
    """`markbase serve` itself: an unknown MARKBASE_* variable is a warning on stderr
    (the server still starts: here it then fails on a model that does not exist); a
    switch with a value it cannot read stops it at once with the reason, exit 2."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MARKBASE_")}
    env.update(MARKBASE_GPU_FOLDD="1", MARKBASE_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "none.gguf"),
           "--port", "1"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "unknown environment variable MARKBASE_GPU_FOLDD" in run.stderr
    assert "did you mean MARKBASE_GPU_FOLD?" in run.stderr
    env["MARKBASE_GPU_DEQUANT"] = "yes"
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "MARKBASE_GPU_DEQUANT='yes': want 0 or 1" in run.stderr
