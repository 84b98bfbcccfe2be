#!/usr/bin/env bash
# The Python API (//python:shardopt) against PyTorch's DDP + torch.optim on
# 1-3 CPU ranks: tests/python/api_test.py. Then the PYTHONPATH-free install
# (tools/install_python.sh's .pth file) in a scratch user site.
set -uo pipefail
if ! /usr/bin/python3 -c "import torch, torchvision" 2>/dev/null; then
  echo "FAIL: Debian's python3-torch / python3-torchvision are missing (tools/setup.sh installs them)"
  exit 1
fi
root=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# .pth install: a user base of our own, the package copied from runfiles.
export PYTHONUSERBASE="$tmp/userbase"
site=$(/usr/bin/python3 -c 'import site; print(site.getusersitepackages())')
mkdir -p "$site" "$tmp/prefix"
cp -rL "$root/python/shardopt" "$tmp/prefix/shardopt"
echo "$tmp/prefix" > "$site/shardopt.pth"
(cd "$tmp" && /usr/bin/python3 -c 'import shardopt, torch; assert issubclass(shardopt.ShardedOptimizer, torch.optim.Optimizer); print("import through a .pth file: ok")') || exit 1
rm -f "$site/shardopt.pth"
export PYTHONPATH="$root/python"
cd "$tmp" && timeout 1500 /usr/bin/python3 "$root/tests/python/api_test.py"
