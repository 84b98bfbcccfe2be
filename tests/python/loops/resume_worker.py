"""One rank of loops_test.py's checkpoint case: AdamW in two groups +
OneCycleLR + clipping on a model with BatchNorm, trained at 2 ranks and saved
as scripts do (rank 0 torch.save of {"model", "optimizer", "scheduler",
"epoch"}), then resumed at 3 ranks from that file; under DDP + torch.optim or
ported to shardopt (consolidate_state_dict(to=0) before the save;
load_checkpoint(file) to resume)."""
import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt
from loop_worker import groups

TOTAL = 12


class BnMlp(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm (as resnets do): its gradient would be
        # rounding noise that Adam scales to +-lr.
        self.fc1 = nn.Linear(32, 64, bias=False)
        self.bn = nn.BatchNorm1d(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.fc1(x))))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(12, 32, generator=g), torch.randint(0, 10, (12,), generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "shardopt"], required=True)
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--sharded-dir", default="",
                    help="shardopt: save_checkpoint()/load_checkpoint() of this directory for the "
                         "optimizer (the rest still in --file)")
    ap.add_argument("--optim", choices=["adamw", "rmsprop"], default="adamw",
                    help="rmsprop: a class without fused kernels (its own step on owned tensors)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(99)
    model = BnMlp()
    sharded = a.mode == "shardopt"
    cls, kw = ((torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9)) if a.optim == "rmsprop"
               else (torch.optim.AdamW, dict(lr=1e-3)))
    if sharded:
        opt = shardopt.ShardedOptimizer(groups(model, True), cls, max_grad_norm=1.0, module=model,
                                        **kw)
        net = model
    else:
        opt = cls(groups(model, False), **kw)
        net = DDP(model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=TOTAL)
    first = 0
    if a.phase == "resume":
        ck = torch.load(a.file)
        if sharded and a.sharded_dir:
            opt.load_checkpoint(a.sharded_dir)
            model.load_state_dict(ck["model"])  # buffers (the same parameters again)
        elif sharded and a.optim == "rmsprop":
            model.load_state_dict(ck["model"])  # before the optimizer reads parameters
            opt.load_state_dict(ck["optimizer"])
        elif sharded:
            opt.load_checkpoint(a.file)  # parameters, state, groups' hyper-parameters
            model.load_state_dict(ck["model"])  # buffers (the same parameters again)
        else:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        first = ck["epoch"]
    losses = []
    for step in range(first, first + a.steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if not sharded:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
    if sharded and a.sharded_dir and a.phase == "save":
        opt.save_checkpoint(a.sharded_dir)
    elif sharded:
        opt.wait_for_parameters()
        opt.consolidate_state_dict(to=0)
    if rank == 0:
        if a.phase == "save":
            saved = {"model": model.state_dict(), "scheduler": sched.state_dict(),
                     "epoch": first + a.steps}
            if not (sharded and a.sharded_dir):
                saved["optimizer"] = opt.state_dict()
            torch.save(saved, a.file)
        else:
            torch.save({"state": model.state_dict(), "losses": losses}, a.out)
    dist.barrier()
    dist.destroy_process_group()  # left to teardown, gloo aborts at random (pytorch#190489)


if __name__ == "__main__":
    main()
