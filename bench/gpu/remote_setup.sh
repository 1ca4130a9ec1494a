#!/usr/bin/env bash
# Run on an offline GPU machine, from the repo root, after fetch_wheels.sh's two folders
# were copied there one at a time (docs/gpu-development.md):
#
#   bash bench/gpu/remote_setup.sh a   # with .whl-a present: stash half A of mlx-cuda-13 in /tmp
#   bash bench/gpu/remote_setup.sh b   # with .whl-b present: join, verify, install, link, smoke test
#
# Everything goes to /tmp (the repo copy may be replaced between the two parts). Once
# installed, a shell only needs
#   export PYTHONPATH=/tmp/site:$PWD
# (source bench/gpu/env.sh does that and a little more).
set -euo pipefail
STASH=/tmp/mb-wheels
SITE=/tmp/site
# where the machine's CUDA 13 libraries (the nvidia-* wheels of a PyTorch install) live
NVIDIA=${NVIDIA_LIBS:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia}
part=${1:?usage: remote_setup.sh a|b}
SECONDS=0

case "$part" in
a)
    mkdir -p "$STASH"
    cp .whl-a/part-aa .whl-a/SHA256SUMS "$STASH/"
    echo "setup a: half A stashed in $STASH ($(du -sb "$STASH" | cut -f1) bytes)"
    ;;
b)
    if [ -f "$SITE/.markbase-ok" ]; then
        echo "setup b: already installed in $SITE"
    else
        if [ ! -f "$STASH/part-aa" ]; then
            echo "setup b: half A is missing from $STASH: run part a again" >&2
            exit 3
        fi
        cp .whl-b/* "$STASH/"
        (
            cd "$STASH"
            cuda_whl=$(grep -o 'mlx_cuda_13-[^ ]*\.whl' SHA256SUMS)
            cat part-aa part-ab >"$cuda_whl"
            sha256sum -c SHA256SUMS
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target "$SITE" ./*.whl
        )
        # libmlx.so looks for the CUDA libraries in $ORIGIN/../../nvidia/cu13/lib.
        ln -sfn "$NVIDIA" "$SITE/nvidia"
        touch "$SITE/.markbase-ok"
        echo "setup b: installed into $SITE"
    fi
    PYTHONPATH="$SITE" python3 - <<'PY'
import time

import mlx.core as mx

print("mlx", mx.__version__, "default device:", mx.default_device(),
      "cuda available:", mx.cuda.is_available())
n = 8192
a = mx.random.normal((n, n)).astype(mx.bfloat16)
b = mx.random.normal((n, n)).astype(mx.bfloat16)
mx.eval(a, b)
t = time.perf_counter()
mx.eval(a @ b)
print(f"first matmul (init + JIT): {time.perf_counter() - t:.2f} s")
reps = 10
t = time.perf_counter()
for _ in range(reps):
    c = a @ b
    mx.eval(c)
dt = (time.perf_counter() - t) / reps
print(f"bf16 {n}^3 matmul: {2 * n**3 / dt / 1e12:.0f} TFLOP/s ({dt * 1e3:.2f} ms each, eval per product)")
PY
    ;;
*)
    echo "usage: remote_setup.sh a|b" >&2
    exit 2
    ;;
esac
echo "setup $part took ${SECONDS} s"
