"""Exit 0 when two files written by launcher_job.py hold bitwise the same
parameters, buffers and optimizer state; else name the first difference."""
import sys

import torch


def flatten(prefix, obj, out):
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            flatten(f"{prefix}/{k}", obj[k], out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(f"{prefix}/{i}", v, out)
    else:
        out[prefix] = obj


a, b = ({}, {})
flatten("", torch.load(sys.argv[1]), a)
flatten("", torch.load(sys.argv[2]), b)
if a.keys() != b.keys():
    print(f"different entries: {sorted(set(a) ^ set(b))[:5]}")
    sys.exit(1)
for k in a:
    x, y = a[k], b[k]
    same = (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)) \
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
    if not same:
        print(f"{k} differs: {x!r} vs {y!r}"[:300])
        sys.exit(1)
print(f"bitwise equal: {sum(isinstance(v, torch.Tensor) for v in a.values())} tensors, "
      f"{len(a)} entries")
