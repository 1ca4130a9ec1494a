"""The package layout as an import graph (AST, no imports run): no module of engine/ or
server/ takes part in an import circle, and generic code (engine/*.py, engine/model/,
engine/loading/, server/) reaches a backend only through its public face
(``engine.backends.cpu`` / ``engine.backends.cuda``), never a backend submodule.

Imports under ``if TYPE_CHECKING:`` do not run and are left out; in-function imports
and the modules a face loads lazily count (a circle closed at call time is still a
circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACES = ("engine.backends.cpu", "engine.backends.cuda")


def modules() -> dict[str, Path]:
    out = {}
    for top in ("engine", "server"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The engine/server modules ``name`` imports (a ``from pkg import sub`` names the
    submodule), at module level or in functions."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for alias in child.names:
                    sub = f"{mod}.{alias.name}"
                    found.add(sub if sub in known else mod)
            visit(child)

    visit(ast.parse(path.read_text()))
    # a package's parents are imported before it anyway: not an edge
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def lazy_exports(name: str, path: Path, known: dict) -> set[str]:
    """The modules a face loads on first use: the values of its ``_EXPORTS`` dict
    literal ((module under the face, attribute)), a run-time import like any other."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            mods = {f"{name}.{v.elts[0].value}" for v in node.value.values}
            return {m for m in mods if m in known}
    return set()


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: imports(name, path, known) | lazy_exports(name, path, known)
        for name, path in known.items()
    }


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def generic(name: str) -> bool:
    return name.startswith("server") or (
        name.startswith("engine") and not name.startswith("engine.backends")
    )


def test_no_import_circles():
    assert circles(graph()) == []


def test_generic_code_imports_backends_only_through_their_faces():
    bad = [
        f"{name} imports {dep}"
        for name, deps in graph().items()
        if generic(name)
        for dep in sorted(deps)
        if dep.startswith("engine.backends.") and dep not in FACES
    ]
    assert bad == []


def test_every_name_a_face_exports_exists():
    """The faces load their names lazily: each must resolve to its module's attribute."""
    import importlib

    for face in FACES:
        module = importlib.import_module(face)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{face}.{name}"


def test_the_checks_see_a_circle_and_a_reach_past_a_face():
    """The graph code itself: a two-module circle and a generic module importing a
    backend submodule are both found."""
    edges = {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "engine.c": set()}
    assert circles(edges) == [["engine.a", "engine.b"]]
    known = {"engine.backends.cuda.linear": None, "engine.backends.cuda": None}
    tree = "from engine.backends.cuda.linear import GpuLinear\n"
    path = ROOT / "tests" / "engine" / "_layout_probe.py"
    path.write_text(tree)
    try:
        assert imports("engine.x", path, known) == {"engine.backends.cuda.linear"}
    finally:
        path.unlink()
