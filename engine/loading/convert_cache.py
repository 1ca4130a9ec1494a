"""On-disk cache for slow, deterministic conversions (assembled GGUFs, converted tokenizers).

Layout under the cache root (``$MARKBASE_CACHE_DIR`` or ``~/.cache/markbase``)::

    models/<file>.gguf            assembled built-in models (+ <file>.gguf.ok marker)
    tokenizers/<key>/             tokenizers converted from GGUF metadata (save_pretrained)

Keys hash the inputs of a conversion together with ``LOADER_VERSION``; bump it whenever a
conversion changes so stale entries are ignored. Entries are written to a temporary
directory and renamed into place, so a crash or two processes racing never leave a half
entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine import envs

LOADER_VERSION = "1"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is None:
        cache_dir = envs.MARKBASE_CACHE_DIR or Path.home() / ".cache" / "markbase"
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def digest(*parts: Any) -> str:
    h = hashlib.sha256()
    h.update(LOADER_VERSION.encode())
    for p in parts:
        h.update(b"\0")
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()[:24]


def file_stat_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def entry_dir(root: Path, kind: str, key: str) -> Path:
    return root / kind / key


def publish_dir(tmp: Path, final: Path) -> Path:
    """Move a fully written temporary directory into place (first writer wins)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process published the same entry first; keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def new_tmp_dir(root: Path, kind: str) -> Path:
    base = root / kind
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
