"""Data-parallel training with shardopt from Python: a torchvision model (or an
MLP) on synthetic data, sharded AdamW with the usual parameter groups (no
weight decay on biases and norms), gradient clipping, a OneCycle schedule,
checkpoints and resume.

    bazel build //python:shardopt //tools:shardrun
    PYTHONPATH=bazel-bin/python bazel-bin/tools/shardrun --nproc 2 -- \\
        /usr/bin/python3 examples/train.py --model=resnet101 --steps=20 --ckpt-dir=/tmp/ck

Run it again with --resume=/tmp/ck to continue where it stopped (any number
of ranks). Under shardrun, `shardctl status|layout|memory|set-lr|checkpoint`
reach this job. A torchrun-style launcher works too (no control plane then).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn

import shardopt


def build_model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    import torchvision
    if not hasattr(torchvision.models, name):
        raise SystemExit(f"train.py: unknown model '{name}' (mlp, or a torchvision model such as "
                         "resnet18, resnet101)")
    return getattr(torchvision.models, name)(num_classes=10)


def batch(model: str, step: int, rank: int, size: int):
    """This rank's part of step `step`'s global batch (the same data at any
    world size for a given global batch)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    if model == "mlp":
        x = torch.randn(size, 1024, generator=g)
        return x, x.roll(1, dims=1)
    return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet101", help="mlp or a torchvision model name")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint here (and for shardctl checkpoint)")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default=None, help="checkpoint directory, root or consolidated file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shard-gradients", action="store_true",
                   help="ZeRO-2: keep only this rank's slices of the reduced gradients")
    a = p.parse_args()
    if a.steps < 1 or a.batch < 1 or not a.lr > 0:
        p.error("--steps, --batch and --lr must be positive")
    torch.set_num_threads(a.threads)
    ctx = shardopt.init()
    torch.manual_seed(0)
    model = build_model(a.model)
    decay = [(n, q) for n, q in model.named_parameters() if q.dim() > 1]
    no_decay = [(n, q) for n, q in model.named_parameters() if q.dim() <= 1]
    opt = shardopt.ShardedOptimizer(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        optimizer="adamw", lr=a.lr, max_grad_norm=1.0, checkpoint_dir=a.ckpt_dir,
        shard_gradients=a.shard_gradients,
        module=model,           # BatchNorm buffers as DDP keeps them; gathers overlap forward
        batch_size=a.batch)     # samples/s in shardctl status and /metrics
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps)
    first = 0
    if not a.resume and ctx.restart and a.ckpt_dir and os.path.exists(
            os.path.join(a.ckpt_dir, "LATEST")):
        a.resume = a.ckpt_dir  # started again by shardrun --max-restarts
    if a.resume:
        info = opt.load_checkpoint(a.resume)
        first = info["step"]
        for _ in range(first):
            sched.step()
        if ctx.rank == 0:
            print(f"resumed from {info['path']} at step {first}")
    if ctx.rank == 0:
        mem = opt.memory()
        print(f"train.py: {a.model}, {ctx.world_size} ranks ({ctx.launcher}), "
              f"{sum(q.numel() for q in model.parameters()) / 1e6:.1f}M parameters; this rank "
              f"holds {mem['state_bytes'] / 2**20:.1f} MiB of optimizer state")
    loss_fn = nn.MSELoss() if a.model == "mlp" else nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for step in range(first, a.steps):
        opt.zero_grad()
        x, y = batch(a.model, step, ctx.rank, a.batch)
        loss = loss_fn(model(x), y)
        loss.backward()
        stats = opt.step(loss=loss)
        sched.step()
        if a.ckpt_dir and a.ckpt_every and (step + 1) % a.ckpt_every == 0:
            path = opt.save_checkpoint(a.ckpt_dir)
            if ctx.rank == 0:
                print(f"checkpoint {path}")
        if ctx.rank == 0 and ((step + 1) % max(1, a.steps // 10) == 0 or step + 1 == a.steps):
            rate = (step + 1 - first) * a.batch / (time.perf_counter() - t0)
            print(f"step {step + 1}/{a.steps}  loss {loss.item():.4f}  grad-norm "
                  f"{stats.grad_norm:.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{rate:.1f} samples/s/rank", flush=True)
    if a.ckpt_dir:
        path = opt.save_checkpoint(a.ckpt_dir)
        if ctx.rank == 0:
            print(f"checkpoint {path}")
    opt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
