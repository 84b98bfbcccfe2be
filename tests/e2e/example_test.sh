#!/usr/bin/env bash
# The README's C++ API example (examples/train_loop.cc) as a user runs it:
# 2 ranks under shardrun with checkpoints, then a resume at another world
# size, then --device=cuda refused clearly where LibTorch has no CUDA.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run=tools/shardrun
ex=examples/train_loop

timeout 120 $run --nproc 2 -- $ex --steps=20 --ckpt-dir="$tmp/ck" >"$tmp/a.log" 2>&1
check "2 ranks train 20 steps" test $? -eq 0
check "loss printed at step 20" grep -q '^\[rank 0\] step 20 loss' "$tmp/a.log"
check "checkpoints at 10 and 20" test -f "$tmp/ck/step-10/manifest.json" -a -f "$tmp/ck/step-20/manifest.json"
check "each rank holds half the state" grep -q 'rank 1: done; optimizer state on this rank' "$tmp/a.log"

timeout 120 $run --nproc 3 -- $ex --steps=30 --ckpt-dir="$tmp/ck" >"$tmp/b.log" 2>&1
check "resume at 3 ranks" test $? -eq 0
check "resumed from step 20" grep -q 'resumed from step 20' "$tmp/b.log"
check "trains on to step 30" grep -q '^\[rank 0\] step 30 loss' "$tmp/b.log"

timeout 60 $run --nproc 1 -- $ex --device=cuda >"$tmp/c.log" 2>&1
rc=$?
if grep -q 'LibTorch sees no CUDA device' "$tmp/c.log"; then
  check "--device=cuda without CUDA fails clearly" test $rc -ne 0
else
  check "--device=cuda runs where CUDA is present" test $rc -eq 0
fi
$ex --stpes=3 >"$tmp/d.log" 2>&1
check "a misspelt flag is refused" test $? -eq 2
check "and named" grep -q "unknown argument '--stpes=3'" "$tmp/d.log"
$ex --steps=abc >"$tmp/e.log" 2>&1
check "a non-number is refused" test $? -eq 2
check "and explained" grep -q "steps must be a whole number in \[0, [0-9]*\], not 'abc'" "$tmp/e.log"
$ex --ckpt-every=0 >"$tmp/f.log" 2>&1
check "a checkpoint interval of 0 is refused" test $? -eq 2
if [[ $fails -ne 0 ]]; then
  echo "--- logs"; cat "$tmp/a.log" "$tmp/b.log" "$tmp/c.log"
fi
echo "example_test: $fails failed"
exit $((fails > 0))
