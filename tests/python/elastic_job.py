"""An elastic Python job for tests/e2e/python_resize_test.sh: a model with a
BatchNorm buffer, gradient clipping, AdamW and a per-step LambdaLR schedule
(resumed with last_epoch, torch's convention) under shardrun, whose ranks
change while it trains (ShardedOptimizer(elastic=True)). Each step's global
batch (24 samples, drawn from the step number) is split over the ranks of
that step; on_resize rebuilds the split. A rank that shardrun starts to grow
the job runs this same script: its optimizer takes the job's state and step.
At the end rank 0 writes the model's state_dict and the consolidated
optimizer state (compare_states.py compares two such files bit for bit);
--resume/--save-at-end make the checkpoint-and-resume reference runs."""
import argparse
import os
import signal
import sys
import time

import torch
import torch.nn as nn

import shardopt

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--out", default=None, help="rank 0 writes the final state here (torch.save)")
p.add_argument("--resume", default=None, help="load_checkpoint from here first")
p.add_argument("--save-at-end", default=None, help="save_checkpoint under this root at the end")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep every step")
p.add_argument("--ckpt-dir", default=None, help="save_checkpoint here every --ckpt-every steps; "
               "started again by shardrun --max-restarts, resume from it")
p.add_argument("--ckpt-every", type=int, default=0)
p.add_argument("--drain-on-sigterm", action="store_true",
               help="a SIGTERM drains this rank (opt.drain()) instead of ending the process")
a = p.parse_args()
torch.set_num_threads(1)
ctx = shardopt.init(timeout=60)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
opt = shardopt.ShardedOptimizer(model.named_parameters(), "adamw", lr=1e-2, max_grad_norm=0.5,
                                module=model, timeout=60, elastic=True)


class Sampler:
    """This rank's share of each step's global batch."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def batch(self, step):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 16, generator=g), torch.randn(24, 4, generator=g)
        n = 24 // self.world
        return x[self.rank * n:(self.rank + 1) * n], y[self.rank * n:(self.rank + 1) * n]


sampler = Sampler(opt.rank, opt.world_size)


def rebuild(o, event):
    global sampler
    sampler = Sampler(o.rank, o.world_size)
    print(f"on_resize: rank {event.previous_rank} -> {o.rank} of {o.world_size} after step "
          f"{event.step} (epoch {event.epoch})", flush=True)


opt.on_resize(rebuild)
if a.drain_on_sigterm:
    signal.signal(signal.SIGTERM, lambda *_: opt.drain() or sys.exit(143))
if ctx.restart and a.ckpt_dir and os.path.exists(os.path.join(a.ckpt_dir, "LATEST")):
    a.resume = a.ckpt_dir
if a.resume:
    opt.load_checkpoint(a.resume)
    if ctx.restart and opt.rank == 0:
        print(f"restart {ctx.restart}: resumed at step {opt.step_count} with {opt.world_size} "
              "ranks", flush=True)
if opt.last_resize is not None:
    print(f"rank {opt.rank} of {opt.world_size} starts at step {opt.step_count}", flush=True)
# The schedule resumed as torch's convention has it: a rank that joined took
# rank 0's initial_lr with the job's state, as load_checkpoint restores it.
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.002 * s),
                                          last_epoch=opt.step_count - 1 if opt.step_count else -1)
step = opt.step_count
while step < a.steps:
    x, y = sampler.batch(step)
    opt.zero_grad()
    loss = (model(x) - y).square().mean()
    loss.backward()
    stats = opt.step(loss=loss)
    sched.step()
    step = stats.step
    if stats.resize is not None:
        assert (opt.rank, opt.world_size) == (stats.resize.rank, stats.resize.to_world)
    if a.ckpt_dir and a.ckpt_every and step % a.ckpt_every == 0:
        opt.save_checkpoint(a.ckpt_dir)
    time.sleep(a.step_sleep)
if a.save_at_end:
    opt.save_checkpoint(a.save_at_end)
state = opt.state_dict()  # every rank takes part
if opt.rank == 0 and a.out:
    torch.save({"model": model.state_dict(), "optimizer": state, "world": opt.world_size}, a.out)
    print(f"saved {a.out} at step {step}", flush=True)
opt.finish()
