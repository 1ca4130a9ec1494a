"""Process set-up for MLX's CUDA backend, done before MLX is first imported.

MLX's CUDA backend compiles its kernels with NVRTC on first use and keeps the PTX
in ``MLX_PTX_CACHE_DIR``, by default a folder under the temp dir (often lost at a
reboot, and unwritable when another user created it first). A fresh cache cost
the first 1b request 10-47 s on the H200, a kept one 0.2-1.2 s
(docs/performance.md, "First-call (JIT) times"). ``default_ptx_cache_dir`` points it
at a per-user cache folder unless the user chose one. MLX reads the variable once,
at its first kernel compile, and creates the folder itself; CPU and Metal builds
never read it, so setting it there is harmless (and creates nothing).

``default_cuda_attention`` turns MLX's cuDNN attention off unless the user chose:
cuDNN builds an execution graph per attention shape, so every prompt length not seen
before cost its request 0.1-0.6 s of time to first token on the H200, warm-up or
not (docs/performance.md); MLX's own attention has no per-shape build.

Imports nothing from MLX.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

PTX_ENV = "MLX_PTX_CACHE_DIR"
CUDNN_SDPA_ENV = "MLX_CUDA_USE_CUDNN_SDPA"


def _mlx_version() -> str:
    """The installed MLX version, without importing MLX: cached PTX is only valid
    for the kernel sources it came from (MLX's own default folder is per version)."""
    from importlib import metadata

    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


def ptx_cache_dir(env: MutableMapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/markbase/mlx-ptx/<mlx version>`` (XDG default ``~/.cache``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "markbase" / "mlx-ptx" / _mlx_version()


def default_ptx_cache_dir(env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``MLX_PTX_CACHE_DIR`` to ``ptx_cache_dir()`` if it is unset; returns the
    value now in effect (None if no home folder could be found). Call it before MLX
    is imported."""
    env = os.environ if env is None else env
    if env.get(PTX_ENV):
        return env[PTX_ENV]
    try:
        path = ptx_cache_dir(env)
    except RuntimeError:  # Path.home(): no HOME and no passwd entry
        return None
    env[PTX_ENV] = str(path)
    return env[PTX_ENV]


def default_cuda_attention(env: MutableMapping[str, str] | None = None) -> str:
    """Set ``MLX_CUDA_USE_CUDNN_SDPA=0`` if it is unset; returns the value in effect.
    MLX reads it once, at the first attention on a CUDA device; other builds never."""
    env = os.environ if env is None else env
    return env.setdefault(CUDNN_SDPA_ENV, "0")
