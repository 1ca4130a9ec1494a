"""Suite-wide setup: bind MLX's CPU matmuls to a fast BLAS before any test imports MLX.

Server subprocesses started by tests do the same in ``markbase serve``.
"""

from engine.backends.cpu.blas import ensure_fast_blas

ensure_fast_blas(allow_reexec=False)


def pytest_unconfigure(config) -> None:
    """The main thread loaded models and ran MLX ops: release its streams before
    the interpreter finalizes, or the run can end in SIGABRT after all passed."""
    import sys

    if "mlx.core" in sys.modules:
        from engine.worker import release_mlx_thread_state

        release_mlx_thread_state()
