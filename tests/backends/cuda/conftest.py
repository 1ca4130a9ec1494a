"""Every test in this folder needs a CUDA device unless it is marked ``cpu``: the
folder marks the others ``cuda`` and skips them where MLX has no CUDA device.

The ``cpu`` tests (plans and routes as plain Python, the kernels' sources and their
numpy emulations, NVRTC-side checks) run everywhere, CI's CPU machine included."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import platform

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (MLX's CUDA backend)")
    cuda = platform.cuda_available()
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        if item.get_closest_marker("cpu") is not None:
            continue
        item.add_marker(pytest.mark.cuda)
        if not cuda:
            item.add_marker(skip)
