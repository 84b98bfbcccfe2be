#!/usr/bin/env bash
# Builds everything with clang's thread-safety analysis as errors
# (`bazel build --config=tsa //...`, see .bazelrc): every mutex-guarded member
# is annotated (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED), and an access
# without its lock fails the build. Runs in an output base of its own
# ($SHARDOPT_TSA_OUTPUT_BASE, default one under ~/.cache/shardopt-tsa per checkout) so that switching
# compilers does not invalidate the normal (gcc) build; the disk cache of
# .bazelrc is shared, so a second run only recompiles what changed. Counted as
# a test by tools/test.sh. Exit status: bazel's.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang >/dev/null; then
  echo "tsa_check: clang is not installed (tools/setup.sh installs it)"
  exit 1
fi
# One output base per checkout (a Bazel output base belongs to one workspace).
base=${SHARDOPT_TSA_OUTPUT_BASE:-$HOME/.cache/shardopt-tsa/$(pwd -P | md5sum | cut -c1-12)}
start=$(date +%s)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# //... spelled out folder by folder: the normal build's convenience symlinks
# (bazel-bin, bazel-<checkout>, ...) point into another output base, which
# this build would otherwise walk into. This build makes none of its own
# (--symlink_prefix=/), so bazel-bin stays the normal build's.
patterns=()
[[ -f BUILD || -f BUILD.bazel ]] && patterns+=("//:all")
for d in */; do
  d=${d%/}
  [[ -L $d || $d == bazel-* ]] && continue
  patterns+=("//$d/...")
done
bazel --output_base="$base" build --config=tsa --symlink_prefix=/ "$@" -- "${patterns[@]}" \
  >"$log" 2>&1
rc=$?
# The analysis' findings first (each names the file, line and mutex), then
# how the build ended.
grep -E "(error|warning): .*(mutex|lock|thread-safety|GUARDED|guarded)" "$log" | sort -u | head -n 100
grep -E "^(ERROR|FAILED|INFO: Build completed)" "$log" | tail -n 10
echo "tsa_check: bazel build --config=tsa //... exit $rc ($(($(date +%s) - start)) s)"
exit "$rc"
