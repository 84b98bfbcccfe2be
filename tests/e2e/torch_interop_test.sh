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
/usr/bin/python3 tests/testing/torch_interop.py "$tmp/adam.pt" "$tmp/next.bin"
# Import the exported file back and take the same step: bitwise the same.
tools/shardctl import "$tmp/adam.pt" "$tmp/imported" --optimizer=adam
tests/interop_step "$tmp/imported" "$tmp/next2.bin"
cmp "$tmp/next.bin" "$tmp/next2.bin"
echo "import round trip: identical next step"

# Resume from the two consolidated formats at 1, 2 and 3 ranks: exactly as
# from the sharded checkpoint they came from (the final checkpoints, each
# consolidated, are byte-identical), with the saved step and lr.
tools/shardctl consolidate "$tmp/ck" "$tmp/whole.safetensors"
for n in 1 2 3; do
  for src in ck whole.safetensors adam.pt; do
    out="$tmp/resumed-$n-${src%%.*}"
    timeout 120 tools/shardrun --nproc "$n" -- tools/shardopt_train --model=tiny --steps=5 \
      --resume="$tmp/$src" --ckpt-dir="$out" >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
    grep -q "at step 3, lr 0.01 as saved" "$out.log" || { echo "FAIL: $src did not restore step/lr"; cat "$out.log"; exit 1; }
    tools/shardctl consolidate "$out" "$out.safetensors" 2>/dev/null
  done
  cmp "$tmp/resumed-$n-ck.safetensors" "$tmp/resumed-$n-whole.safetensors"
  cmp "$tmp/resumed-$n-ck.safetensors" "$tmp/resumed-$n-adam.safetensors"
  echo "$n ranks: resumed from the sharded checkpoint, whole.safetensors and adam.pt: identical"
done
# An explicit --lr wins over the saved one, and says so.
timeout 120 tools/shardrun --nproc 1 -- tools/shardopt_train --model=tiny --steps=4 --lr=0.5 \
  --resume="$tmp/whole.safetensors" >"$tmp/lr.log" 2>&1
grep -q "lr 0.5 from --lr (the checkpoint saved 0.01)" "$tmp/lr.log" || { cat "$tmp/lr.log"; exit 1; }

# Real PyTorch files (written here by python3-torch) into shardopt and back.
/usr/bin/python3 tests/testing/torch_import.py tools/shardctl "$tmp/import"

# The advisor reads a model's state_dict saved by torch.save: float tensors
# are parameters, batch-norm statistics buffers.
/usr/bin/python3 -c "
import torch
m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
torch.save({'model': m.state_dict()}, '$tmp/advise.pt')"
tools/shardctl plan --model="$tmp/advise.pt" --world=2 --forward-ms=1 --backward-ms=2 --json \
  >"$tmp/plan.json" || { echo "shardctl plan failed on a torch.save file"; exit 1; }
/usr/bin/python3 -c "
import json, sys
r = json.load(open('$tmp/plan.json'))[0]
assert r['parameters'] == 44 and r['tensors'] == 4, r
print('shardctl plan read the torch.save state_dict: 44 parameters in 4 tensors')"
