#!/usr/bin/env bash
# Builds everything and runs every test with Bazel, then prints one summary
# line "N passed, N failed" (GPU tests that find no device count as passed
# and report SKIPPED in their logs). Exit status: 0 only if all tests passed
# and at least one ran.
set -uo pipefail
cd "$(dirname "$0")/.."

log=$(mktemp)
trap 'rm -f "$log"' EXIT

bazel build //... 2>&1 | tail -n 20
build_rc=${PIPESTATUS[0]}
if [[ $build_rc -ne 0 ]]; then
  echo "build failed (bazel exit $build_rc)"
  echo "0 passed, 1 failed"
  exit 1
fi

bazel test --nocache_test_results //... "$@" 2>&1 | tee "$log"
test_rc=${PIPESTATUS[0]}

# tools/gpu_check.sh builds the GPU targets without Bazel: its source lists
# must match the BUILD files (checked with bazel query). Counted as a test.
if tools/check_gpu_sources.sh; then
  echo "//tools:check_gpu_sources   PASSED" >>"$log"
else
  echo "//tools:check_gpu_sources   FAILED" >>"$log"
fi

# The README's quickstarts and the docs' runnable examples, run as written
# (tools/docs_test.sh), so a quickstart that stops working fails CI.
if tools/docs_test.sh; then
  echo "//tools:docs_test   PASSED" >>"$log"
else
  echo "//tools:docs_test   FAILED" >>"$log"
fi

# One line per test target: "//pkg:target   PASSED in 1.2s" (or FAILED, TIMEOUT, ...).
passed=$(grep -Ec '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -Ec '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE|FAILED TO BUILD)' "$log")
if [[ $test_rc -ne 0 && $failed -eq 0 ]]; then
  failed=1  # bazel failed without a per-target line (e.g. analysis error)
fi
echo "$passed passed, $failed failed"
if [[ $failed -ne 0 || $passed -eq 0 ]]; then
  exit 1
fi
exit 0
