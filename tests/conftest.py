"""Suite-wide setup: bind MLX's CPU matmuls to a fast BLAS before any test imports MLX.

Server subprocesses started by tests do the same in ``markbase serve``.
"""

from engine.cpu_blas import ensure_fast_blas

ensure_fast_blas(allow_reexec=False)
