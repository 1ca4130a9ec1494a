"""Every custom CUDA kernel's source, as MLX would hand it to NVRTC, defines each
compile-time switch it branches on (CPU: no compiler needed).

Why: the kernels share headers and bodies (csrc/), and a switch added to a shared part
for one kernel once left the others' sources failing to compile, which only NVRTC or a
GPU would have shown. Each name in
``if constexpr (NAME)`` must be a template constant, a ``constexpr`` of the body, a
template parameter or a macro of the source."""

from __future__ import annotations

import re

import pytest

from engine.backends.cuda.kernels import nvrtc_source as build_source
from engine.backends.cuda.specs import all_specs

pytestmark = pytest.mark.cpu  # runs without a CUDA device

SWITCH = re.compile(r"if\s+constexpr\s*\(\s*!?\s*([A-Za-z_]\w*)\s*\)")


def defined(name: str, src: str) -> bool:
    pats = (
        rf"constexpr\s+(?:bool|int|unsigned|uint32_t|size_t)\s+{name}\b",
        rf"template\s*<[^>]*\b(?:bool|int)\s+{name}\b",
        rf"#define\s+{name}\b",
        rf"\b(?:bool|int)\s+{name}\s*=",
    )
    return any(re.search(p, src, re.S) for p in pats)


def test_every_switch_a_kernel_branches_on_is_defined():
    specs = all_specs()
    assert len(specs) > 50
    missing = []
    for spec in specs:
        src = build_source(spec)
        for name in sorted(set(SWITCH.findall(src))):
            if not defined(name, src):
                missing.append(f"{spec.name}: {name}")
    assert not missing, missing


def test_every_kernel_source_balances_its_brackets():
    """Braces, parentheses and brackets pair up in every kernel's whole source (comments
    and literals aside): a fragment that loses a closing brace (csrc/ files are joined
    into one body) fails here on the CPU instead of in NVRTC on a GPU."""
    unbalanced = []
    for spec in all_specs():
        code = re.sub(r"//[^\n]*", "", build_source(spec))
        code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
        code = re.sub(r"'(\\.|[^'\\])'", "''", code)
        for opening, closing in ("{}", "()", "[]"):
            depth = 0
            for ch in code:
                depth += (ch == opening) - (ch == closing)
                if depth < 0:
                    break
            if depth != 0:
                unbalanced.append(f"{spec.name}: {opening}{closing}")
    assert unbalanced == []
