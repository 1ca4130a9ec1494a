"""Which backend MLX runs on here, and what the GPU is: the one place that asks.

Generic code asks ``backend()`` (``"cpu"``, ``"cuda"`` or ``"metal"``) or ``on_gpu()``;
the CUDA kernels ask ``sm_count()``, ``compute_capability()`` and ``shared_memory_per_sm()``
for launch geometry. The backend follows MLX's default device at each call (tests move
between devices in one process); what the GPU is gets read once.

MLX is imported on first call, not at import: server/cli.py imports this module's
package before it sets MLX's environment.
"""

from __future__ import annotations

from functools import lru_cache

# SMs by device name: MLX's device_info has no SM count; launch grids that must not
# exceed one block an SM need it (an H100/H200 has 132)
SM_COUNTS = {"H200": 132, "H100 80GB HBM3": 132, "H100 SXM": 132, "GH200": 132, "H100 PCIe": 114}


def backend() -> str:
    """``"cpu"``, ``"cuda"`` or ``"metal"``: where MLX's default device computes."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return "cuda" if cuda_available() else "metal"


def on_gpu() -> bool:
    """Whether MLX's default device is a GPU (CUDA or Metal)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def on_cuda() -> bool:
    """Whether MLX's default device is a CUDA GPU: where markbase's CUDA kernels run."""
    return on_gpu() and cuda_available()


def on_cpu() -> bool:
    return not on_gpu()


@lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether this MLX build has a CUDA device (whatever the default device is now)."""
    try:
        import mlx.core as mx

        return bool(mx.cuda.is_available())
    except (ImportError, AttributeError):
        return False


@lru_cache(maxsize=1)
def device_info() -> dict:
    """MLX's ``device_info()`` of the CUDA GPU, or {} without one."""
    if not cuda_available():
        return {}
    try:
        import mlx.core as mx

        return dict(mx.device_info())
    except Exception:  # an MLX without it: nothing known
        return {}


def device_name() -> str:
    return str(device_info().get("device_name", ""))


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the CUDA GPU, None when unknown or no GPU."""
    info = device_info()
    try:
        return int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    except (KeyError, TypeError, ValueError):
        return None


def sm_count() -> int | None:
    """This GPU's SMs from its name (``SM_COUNTS``), None when unknown or no GPU."""
    name = device_name()
    return next((n for key, n in SM_COUNTS.items() if key in name), None) if name else None
