"""tests/helpers/trace.py, bench/gpu/worker_timeline.py's reading of a profiler trace:
the GPU's idle stretches inside a step are charged to the host phase running at their
midpoint (the innermost one), busy time is the union of kernel intervals, and steps
without every row decoding are not counted. Synthetic traces."""

from __future__ import annotations

import pytest

from tests.helpers.trace import analyse

pytestmark = pytest.mark.cpu  # runs without a CUDA device


def _range(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": "mb:" + name, "ts": ts, "dur": dur, "cat": "user_annotation"}


def _kernel(ts: float, dur: float) -> dict:
    return {"ph": "X", "name": "custom_kernel_mb_x", "ts": ts, "dur": dur, "cat": "kernel"}


def test_idle_gaps_are_charged_to_the_host_phase_running_then():
    events = [
        _range("step", 0, 1000),
        _range("decode_step", 0, 600),
        _range("decode_build", 0, 200),
        _range("deliver", 400, 200),
        _range("accept", 550, 50),
        _range("flush", 600, 100),
        _kernel(100, 200),  # 100-300
        _kernel(250, 100),  # 250-350: overlaps the first
        _kernel(650, 250),  # 650-900
        _kernel(1100, 50),  # after the step: not counted in it
        _range("step_partial", 2000, 500),  # rows still joining: not a full step
        _kernel(2100, 300),
        {"ph": "X", "name": "cudaGraphLaunch", "ts": 500, "dur": 5, "cat": "cuda_runtime"},
    ]
    r = analyse(events)
    assert r["steps"] == 1
    assert r["wall_us_median"] == 1000
    assert r["busy_us_median"] == 250 + 250  # 100-350 and 650-900
    # idle: 0-100 (decode_build), 350-650 (mid 500: deliver, not its caller decode_step),
    # 900-1000 (outside every phase)
    assert r["idle_us_per_step_by_host_phase"] == {"decode_build": 100, "deliver": 300, "step": 100}
    assert r["idle_us_median"] == 500
    assert r["phases_us_median"]["decode_step"] == 600
    assert r["api_calls_per_step"] == {"cudaGraphLaunch": 1}


def test_no_full_step_is_no_numbers():
    assert analyse([_range("step_partial", 0, 10)]) == {"steps": 0}
