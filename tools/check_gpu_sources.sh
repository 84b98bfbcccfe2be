#!/usr/bin/env bash
# Checks that tools/gpu_check.sh (which builds the GPU targets with nvcc/g++
# alone, on machines without Bazel) names every source file those targets
# depend on according to the BUILD files. Run by tools/test.sh; exit 1 naming
# the missing files.
set -uo pipefail
cd "$(dirname "$0")/.."
targets="//tests:gpu_kernels_test //tests:gpu_nccl_test //tests:gpu_sharded_optimizer_test //tools:bench_gpu_step"
srcs=$(bazel query --noshow_progress "kind('source file', deps(set($targets)))" 2>/dev/null |
       grep -E '^//' | grep -E '\.(cc|cu)$' | sed 's|^//||; s|:|/|; s|^/||' | sort)
if [[ -z $srcs ]]; then
  echo "check_gpu_sources: bazel query returned nothing"
  exit 1
fi
missing=()
for s in $srcs; do
  grep -qF "$s" tools/gpu_check.sh || missing+=("$s")
done
if [[ ${#missing[@]} -ne 0 ]]; then
  echo "check_gpu_sources: tools/gpu_check.sh does not build ${missing[*]}, which the GPU targets depend on (see their BUILD files)"
  exit 1
fi
echo "check_gpu_sources: tools/gpu_check.sh names all $(echo "$srcs" | wc -l) sources of the GPU targets"
