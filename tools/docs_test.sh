#!/usr/bin/env bash
# Runs the documentation's runnable blocks, so a quickstart that stops working
# fails CI: every ```sh block of README.md right after a line
# `<!-- docs-test -->` (run in order, from the repository root, with
# bazel-bin/tools on PATH as the README says, after building what it names),
# and every ```python block of docs/*.md after `<!-- docs-test-python -->`
# (run at 2 ranks under shardrun with PYTHONPATH=bazel-bin/python).
# Paths the blocks write (ckpt, /tmp/pyck, /tmp/ck, example.pt) are removed
# before and after. Exit status 0 only if every block exited 0.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tmp=$(mktemp -d)
cleanup() { rm -rf "$tmp" ckpt /tmp/pyck /tmp/ck example.pt; }
trap cleanup EXIT
cleanup
mkdir -p "$tmp"

# Blocks after a marker line, each into its own file.
extract() {  # FILE MARKER LANG OUTPREFIX
  awk -v marker="$2" -v lang="$3" -v out="$4" '
    $0 == marker { armed = 1; next }
    armed && $0 == "```" lang { inblock = 1; n++; file = out n; armed = 0; next }
    inblock && $0 == "```" { inblock = 0; close(file); next }
    inblock { print > file; next }
    NF { armed = 0 }' "$1"
}
extract README.md "<!-- docs-test -->" sh "$tmp/readme-"
for f in docs/*.md; do
  extract "$f" "<!-- docs-test-python -->" python "$tmp/$(basename "$f" .md)-py-"
done

bazel build -c opt //tools:shardrun //tools:shardopt_train //tools:shardctl 2>&1 | tail -n 1
export PATH="$root/bazel-bin/tools:$PATH"
failed=0
ran=0
for block in "$tmp"/readme-*; do
  [[ -e $block ]] || continue
  ran=$((ran + 1))
  echo "== README block $(basename "$block"):"
  sed 's/^/   $ /' "$block"
  start=$SECONDS
  if timeout 600 bash -euo pipefail "$block" >"$block.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)"
  else
    echo "   FAILED ($((SECONDS - start)) s); last lines:"
    tail -n 15 "$block.log" | sed 's/^/   | /'
    failed=$((failed + 1))
  fi
done
bazel build //python:shardopt //tools:shardrun 2>&1 | tail -n 1
for block in "$tmp"/*-py-*; do
  [[ -e $block && $block != *.log ]] || continue
  ran=$((ran + 1))
  echo "== Python block $(basename "$block") at 2 ranks:"
  start=$SECONDS
  if PYTHONPATH="$root/bazel-bin/python" timeout 600 bazel-bin/tools/shardrun --nproc 2 -- \
       /usr/bin/python3 "$block" >"$block.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s): $(grep -m1 'rank 0:' "$block.log" || true)"
  else
    echo "   FAILED ($((SECONDS - start)) s); last lines:"
    tail -n 15 "$block.log" | sed 's/^/   | /'
    failed=$((failed + 1))
  fi
done
echo "docs_test: $ran blocks, $failed failed"
[[ $ran -gt 0 && $failed -eq 0 ]]
