"""Suite-wide setup: bind MLX's CPU matmuls to a fast BLAS before any test imports MLX.

Server subprocesses started by tests do the same in ``markbase serve``.
"""

import pytest

from engine.backends.cpu.blas import ensure_fast_blas

ensure_fast_blas(allow_reexec=False)


@pytest.fixture(scope="session")
def gemma3_server():
    """One Gemma 3 270M server (4 slots) shared by the tests that only send it requests:
    starting one (GGUF conversion, load check, warm-up) takes 15-40 s on 2 cores."""
    from tests.helpers.server import running_server

    with running_server("gemma3-270m", "--max-num-seqs", "4") as srv:
        yield srv


def pytest_unconfigure(config) -> None:
    """The main thread loaded models and ran MLX ops: release its streams before
    the interpreter finalizes, or the run can end in SIGABRT after all passed."""
    import sys

    if "mlx.core" in sys.modules:
        from engine.worker import release_mlx_thread_state

        release_mlx_thread_state()
