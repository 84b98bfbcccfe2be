#!/usr/bin/env bash
# Training loops people write, under DDP + torch.optim and ported to shardopt
# (tests/python/loops/loops_test.py): same parameters, buffers and losses.
set -uo pipefail
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "FAIL: Debian's python3-torch is missing (tools/setup.sh installs it)"
  exit 1
fi
root=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export PYTHONPATH="$root/python"
export SHARDCTL="$root/tools/shardctl"
cd "$tmp" && timeout 1200 /usr/bin/python3 "$root/tests/python/loops/loops_test.py"
rc=$?
timeout 900 /usr/bin/python3 "$root/tests/python/loops/misuse_test.py" || rc=1
exit $rc
