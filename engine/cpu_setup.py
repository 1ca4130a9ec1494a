"""Install-time setup for the CPU backend (run by `make install`).

Placeholder until the fast-BLAS work lands: it only reports which backend MLX has.
"""

from __future__ import annotations


def main() -> None:
    import mlx.core as mx

    print(f"markbase: MLX {mx.__version__}, default device {mx.default_device()}")


if __name__ == "__main__":
    main()
