"""A Python job for tests/e2e/python_shardrun_test.sh: shardopt under shardrun,
with the script's own torch.distributed process group next to it."""
import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import shardopt

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=400)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--no-torch-group", action="store_true",
               help="no torch.distributed process group of the script's own")
p.add_argument("--state-dict-on-rank0", type=int, default=-1,
               help="after this many steps rank 0 alone calls opt.state_dict() (a script bug)")
p.add_argument("--rank0-steps", type=int, default=-1,
               help="rank 0 leaves its loop after this many steps (a script bug)")
a = p.parse_args()
torch.set_num_threads(1)
ctx = shardopt.init(timeout=30)
# The script's own process group (metrics here) on shardrun's MASTER_PORT.
if not a.no_torch_group:
    dist.init_process_group("gloo")
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    if ctx.rank == 0:
        print(f"torch.distributed all_reduce: {t.item():g}", flush=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = shardopt.ShardedOptimizer(model.named_parameters(), optimizer="adam", lr=1e-3, timeout=30,
                                batch_size=8)
last_lr = opt.param_groups[0]["lr"]
steps = a.rank0_steps if ctx.rank == 0 and a.rank0_steps >= 0 else a.steps
for step in range(steps):
    opt.zero_grad()
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    loss.backward()
    opt.step(loss=loss)
    lr = opt.param_groups[0]["lr"]
    if lr != last_lr:
        print(f"param_groups lr {lr:g} at step {step + 1}", flush=True)
        last_lr = lr
    time.sleep(a.step_sleep)
    if ctx.rank == 0 and step + 1 == a.state_dict_on_rank0:
        t0 = time.time()
        try:
            opt.state_dict()
        except RuntimeError as e:
            print(f"state_dict on rank 0 alone failed after {time.time() - t0:.1f} s: {e}",
                  flush=True)
            sys.exit(3)
opt.finish()
if not a.no_torch_group:
    dist.destroy_process_group()  # left to teardown, gloo aborts at random (pytorch#190489)
print("done", flush=True)
