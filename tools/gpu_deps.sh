#!/usr/bin/env bash
# Packs what tools/gpu_check.sh needs beyond CUDA, NCCL and PyTorch (Abseil,
# GoogleTest and nlohmann/json headers and libraries, NCCL's header as a fallback) from this
# Debian machine into one folder, for a GPU machine that has no package
# manager access:  tools/gpu_deps.sh [DIR]   (default .gpu_deps)
# Then on the GPU machine:  DEPS=DIR tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu_deps}
lib=/usr/lib/x86_64-linux-gnu
for need in /usr/include/absl /usr/include/gtest $lib/libgtest.a; do
  [[ -e $need ]] || { echo "gpu_deps: $need missing (run tools/setup.sh)" >&2; exit 1; }
done
rm -rf "$dir"
mkdir -p "$dir/include" "$dir/lib" "$dir/nccl_include"
cp -r /usr/include/absl /usr/include/gtest /usr/include/nlohmann "$dir/include/"
# Plain files named by their sonames (links may not survive a copy to the
# GPU machine); gpu_check.sh links these by path.
for f in $lib/libabsl_*.so.*.*.*; do
  soname=$(objdump -p "$f" | awk '/SONAME/ {print $2}')
  cp "$f" "$dir/lib/${soname:-$(basename "$f")}"
done
cp $lib/libgtest.a $lib/libgtest_main.a "$dir/lib/"
if [[ -f /usr/local/cuda/include/nccl.h ]]; then cp /usr/local/cuda/include/nccl.h "$dir/nccl_include/"; fi
echo "gpu_deps: $(du -sh "$dir" | cut -f1) in $dir"
