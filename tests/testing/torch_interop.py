#!/usr/bin/python3
"""Debian's python3-torch as an independent reader: load shardopt's exported
optimizer state, load_state_dict it into torch.optim.Adam on the same
parameters, take the same step as shardopt, compare.
   torch_interop.py EXPORTED.pt SHARDOPT_NEXT_PARAMS.bin"""
import sys

import numpy as np
import torch

sd = torch.load(sys.argv[1])
names = sd["param_names"]
params = [sd["params"][n].clone().requires_grad_(True) for n in names]
group = sd["param_groups"][0]
opt = torch.optim.Adam(params, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                       weight_decay=group["weight_decay"])
opt.load_state_dict(sd)
assert len(opt.state) == len(params), "every parameter has state"
step = float(opt.state[params[0]]["step"])
loss = sum((-p.cos()).sum() for p in params) * 0.01
loss.backward()
opt.step()
ours = np.fromfile(sys.argv[2], dtype=np.float32)
theirs = np.concatenate([p.detach().numpy().ravel() for p in params])
assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
err = np.abs(ours - theirs).max()
print(f"torch {torch.__version__}: {len(params)} parameters, step {step:.0f} -> {step + 1:.0f}, "
      f"max |shardopt - torch| = {err:.3g}")
# One Adam step moves a parameter by at most ~lr; the two implementations
# differ by fp32 rounding (LibTorch/PyTorch use FMA): 1e-7 absolute is ~1e-3 of lr.
assert err <= 1e-7, err
