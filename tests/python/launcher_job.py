"""A Python job for tests/e2e/slurm_test.sh, kubernetes_env_test.sh and restart_test.sh:
the same script under shardrun, srun or a Kubernetes Indexed Job's variables.
shardopt.init() finds the ranks from the launcher; every rank trains on its
own deterministic data with gradient clipping and a BatchNorm buffer, then
rank 0 writes the model's state_dict (parameters and buffers) and the
optimizer's consolidated state for a bitwise comparison between launchers."""
import argparse
import os
import time

import torch
import torch.nn as nn

import shardopt

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--out", required=True, help="rank 0 writes the final state here (torch.save)")
p.add_argument("--ckpt-dir", default=None, help="save_checkpoint here every --ckpt-every steps")
p.add_argument("--ckpt-every", type=int, default=0)
p.add_argument("--resume", default=None,
               help="load_checkpoint from here (started again by shardrun --max-restarts: "
                    "--ckpt-dir when it holds one)")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep every step")
a = p.parse_args()
torch.set_num_threads(1)
ctx = shardopt.init(timeout=60)
print(f"rank {ctx.rank} of {ctx.world_size}, launcher {ctx.launcher}, "
      f"control plane {'on' if ctx.control_plane else 'off'}, job {ctx.job_id}", flush=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
opt = shardopt.ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2,
                                max_grad_norm=0.5, module=model, timeout=60)
first = 0
if not a.resume and ctx.restart and a.ckpt_dir and os.path.exists(
        os.path.join(a.ckpt_dir, "LATEST")):
    a.resume = a.ckpt_dir
if a.resume:
    first = opt.load_checkpoint(a.resume)["step"]
    if ctx.rank == 0:
        print(f"restart {ctx.restart}: resumed at step {first}", flush=True)
for step in range(first, a.steps):
    g = torch.Generator().manual_seed(1000 * step + ctx.rank)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    opt.zero_grad()
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step(loss=loss)
    if a.ckpt_dir and a.ckpt_every and (step + 1) % a.ckpt_every == 0:
        opt.save_checkpoint(a.ckpt_dir)
    time.sleep(a.step_sleep)
state = opt.state_dict()  # every rank takes part (consolidated on each)
if ctx.rank == 0:
    torch.save({"model": model.state_dict(), "optimizer": state, "world": ctx.world_size},
               a.out)
    print(f"saved {a.out}", flush=True)
opt.finish()
print("done", flush=True)
