#!/usr/bin/env bash
# shardopt -> PyTorch -> shardopt: export a checkpoint for torch.load, continue
# in Python, compare with shardopt's own next step; import it back.
set -uo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
  echo "FAIL: Debian's python3-torch is missing (tools/setup.sh installs it)"
  exit 1
fi
set -e
timeout 120 tools/shardrun --nproc 2 -- tools/shardopt_train --model=tiny --steps=3 --lr=1e-2 \
  --ckpt-dir="$tmp/ck" >"$tmp/train.log" 2>&1
tools/shardctl consolidate "$tmp/ck" "$tmp/adam.pt" --format=torch
tests/interop_step "$tmp/ck" "$tmp/next.bin"
/usr/bin/python3 tests/torch_interop.py "$tmp/adam.pt" "$tmp/next.bin"
# Import the exported file back and take the same step: bitwise the same.
tools/shardctl import "$tmp/adam.pt" "$tmp/imported" --optimizer=adam
tests/interop_step "$tmp/imported" "$tmp/next2.bin"
cmp "$tmp/next.bin" "$tmp/next2.bin"
echo "import round trip: identical next step"
