# Source on the GPU machine after remote_setup.sh b (docs/gpu-development.md): MLX from
# /tmp/site, markbase from the repo.
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
# MLX's CUDA backend JIT-compiles kernels and keeps the PTX here; a second process on
# the same machine starts faster.
export MLX_PTX_CACHE_DIR=/tmp/mlx-ptx
# A PTX cache saved on an earlier machine (suite.sh save-ptx, copied to .gpu-cache/ptx.tgz)
# skips most JIT.
if [ -f .gpu-cache/ptx.tgz ] && [ ! -d "$MLX_PTX_CACHE_DIR" ]; then
    mkdir -p "$MLX_PTX_CACHE_DIR" && tar xzf .gpu-cache/ptx.tgz -C "$MLX_PTX_CACHE_DIR" --strip-components=1
fi
# What `markbase serve` sets (engine/backends/cuda/setup.py): MLX's own attention, not cuDNN's,
# whose per-shape graph build costs every new prompt length 0.1-0.6 s.
export MLX_CUDA_USE_CUDNN_SDPA=${MLX_CUDA_USE_CUDNN_SDPA:-0}
