#!/usr/bin/env bash
# Run on a machine with network access, from anywhere in the repo.
#
# Downloads the wheels MLX needs on an offline GPU machine (one with Python 3.12 and the
# CUDA 13 libraries, but no MLX) and cuts them into two folders of under 64 MiB each, for
# transfers limited to that size (docs/gpu-development.md):
#
#   .whl-a/  part-aa (first 50,000,000 bytes of mlx-cuda-13) + SHA256SUMS
#   .whl-b/  part-ab (the rest) + mlx + mlx-lm wheels + SHA256SUMS
#
# The folders are ignored through .git/info/exclude (not .gitignore), so a copy of the
# working tree includes them only when asked to.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

DL=.gpu-wheels   # full downloads (never carried)
A=.whl-a
B=.whl-b
PKGS=(mlx==0.32.4 mlx-lm==0.32.2 mlx-cuda-13==0.32.4)
# markbase needs these and the GPU image lacks them (pure Python): they ride in half B
EXTRA=(gguf==0.19.0)

mkdir -p .git/info
touch .git/info/exclude
for d in "/$DL/" "/$A/" "/$B/" "/.gpu-cache/"; do
    grep -qxF "$d" .git/info/exclude || echo "$d" >>.git/info/exclude
done

mkdir -p "$DL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 -d "$DL" "${PKGS[@]}" "${EXTRA[@]}"

CUDA_WHL=$(cd "$DL" && ls mlx_cuda_13-0.32.4-*.whl)
rm -rf "$A" "$B"
mkdir -p "$A" "$B"
EXTRA_WHL=$(cd "$DL" && ls gguf-0.19.0-*.whl)
(cd "$DL" && sha256sum mlx-0.32.4-*.whl mlx_lm-0.32.2-*.whl $EXTRA_WHL "$CUDA_WHL") >"$A/SHA256SUMS"
cp "$A/SHA256SUMS" "$B/SHA256SUMS"
split -b 50000000 "$DL/$CUDA_WHL" "$A/part-"
mv "$A/part-ab" "$B/part-ab"
[ ! -e "$A/part-ac" ] || { echo "unexpected third part: the wheel grew" >&2; exit 1; }
cp "$DL"/mlx-0.32.4-*.whl "$DL"/mlx_lm-0.32.2-*.whl "$DL/$EXTRA_WHL" "$B/"

# Check that the two halves join back into the recorded wheel.
want=$(grep "$CUDA_WHL" "$A/SHA256SUMS" | cut -d' ' -f1)
got=$(cat "$A/part-aa" "$B/part-ab" | sha256sum | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "join check failed" >&2; exit 1; }

tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
echo "ok: $CUDA_WHL split and verified ($want)"
du -sb "$A" "$B"
echo "working tree: $tree_bytes bytes (+ one wheel folder; 64 MiB is 67108864)"
