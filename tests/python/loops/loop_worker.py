"""One rank of tests/python/loops/loops_test.py: runs training-loop styles
twice in this process, once as people write them with DistributedDataParallel
+ torch.optim (the oracle) and once ported to shardopt (optimizer line
changed, DDP wrapper removed), on the same data, and compares parameters,
buffers and losses. Launched torchrun-style (RANK, WORLD_SIZE, MASTER_*), or
through torch.multiprocessing.spawn with init_process_group(init_method=...)
and no RANK/WORLD_SIZE variables (--spawn)."""
import argparse
import contextlib
import copy
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt

STEPS = 20


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class BnNet(nn.Module):
    """Convolutions with BatchNorm: running statistics are buffers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class Branchy(nn.Module):
    """A branch that only some steps (or ranks) use, and a layer no forward
    uses: torch.optim skips a parameter whose .grad is None."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.unused = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.a(torch.tanh(self.fc1(x))))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.head(h)


# Styles on Branchy: (whether step `step` on rank `rank` uses branch b,
# zeroing with set_to_none, shard_gradients).
BRANCHY = {
    "unused_param": (lambda rank, step: True, False, False),
    "branch_set_to_none": (lambda rank, step: step % 2 == 0, True, False),
    "branch_zero2": (lambda rank, step: step % 2 == 0, True, True),
    "branch_rank0": (lambda rank, step: rank == 0 and step % 3 == 0, True, False),
}


def make_model(style):
    torch.manual_seed(1234)
    if style in BRANCHY:
        return Branchy()
    return BnNet() if style == "batchnorm" else Mlp()


def batch(style, rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    if style == "batchnorm":
        x = torch.randn(8, 3, 8, 8, generator=g)
    else:
        x = torch.randn(16, 32, generator=g)
    return x, torch.randint(0, 10, (x.shape[0],), generator=g)


def groups(model, names):
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if names:  # shardopt: (name, tensor) pairs keep checkpoints readable
        decay = [(n, p) for n, p in model.named_parameters() if not n.endswith("bias")]
        no_decay = [(n, p) for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]


def build(style, model, sharded):
    """The optimizer (and scheduler) as the script builds it."""
    if style == "groups_onecycle_clip":
        if sharded:
            opt = shardopt.ShardedOptimizer(groups(model, True), torch.optim.AdamW, lr=1e-3,
                                            max_grad_norm=1.0, module=model)
        else:
            opt = torch.optim.AdamW(groups(model, False), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)
        return opt, sched
    if style == "sgd_nesterov":
        kw = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
        if sharded:
            return shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD,
                                             module=model, **kw), None
        return torch.optim.SGD(model.parameters(), **kw), None
    if style == "zero_api":
        # ZeroRedundancyOptimizer's signature: optimizer_class=, **defaults.
        if sharded:
            return shardopt.ShardedOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                             lr=2e-3, module=model), None
        return torch.optim.Adam(model.parameters(), lr=2e-3), None
    if style == "rmsprop":
        kw = dict(lr=1e-3, momentum=0.9)
        if sharded:
            return shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.RMSprop,
                                             module=model, **kw), None
        return torch.optim.RMSprop(model.parameters(), **kw), None
    if style == "adagrad_groups":
        if sharded:
            return shardopt.ShardedOptimizer(groups(model, True),
                                             optimizer_class=torch.optim.Adagrad, lr=0.05,
                                             module=model), None
        return torch.optim.Adagrad(groups(model, False), lr=0.05), None
    if style in BRANCHY:
        if sharded:
            return shardopt.ShardedOptimizer(model.named_parameters(), "adamw", lr=2e-3,
                                             module=model,
                                             shard_gradients=BRANCHY[style][2]), None
        return torch.optim.AdamW(model.parameters(), lr=2e-3), None
    if sharded:
        return shardopt.ShardedOptimizer(model.named_parameters(), "adamw", lr=2e-3,
                                         module=model), None
    return torch.optim.AdamW(model.parameters(), lr=2e-3), None


def train(style, sharded, rank):
    model = make_model(style)
    opt, sched = build(style, model, sharded)
    net = model if sharded else DDP(model, find_unused_parameters=style in BRANCHY)
    losses = []
    for step in range(STEPS):
        if style in BRANCHY:
            uses_b, set_to_none, _ = BRANCHY[style]
            x, y = batch(style, rank, step)
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(net(x, uses_b(rank, step)), y)
            loss.backward()
            opt.step()
        elif style in ("accum_no_sync", "accum_synced"):
            # Two micro-batches; with no_sync the first only accumulates
            # locally, without it both are reduced (DDP: avg(g1) + avg(g2)).
            ctx = (opt.no_sync() if sharded else net.no_sync()) if style == "accum_no_sync" \
                else contextlib.nullcontext()
            with ctx:
                x, y = batch(style, rank, step, 0)
                (F.cross_entropy(net(x), y) / 2).backward()
            x, y = batch(style, rank, step, 1)
            loss = F.cross_entropy(net(x), y) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
        elif style == "closure":
            x, y = batch(style, rank, step)

            def closure():
                opt.zero_grad()
                out = F.cross_entropy(net(x), y)
                out.backward()
                return out
            loss = opt.step(closure)
        else:
            x, y = batch(style, rank, step)
            if style == "model_zero_grad":
                net.zero_grad()
            elif style == "model_zero_grad_none":
                net.zero_grad(set_to_none=True)
            elif style == "grad_none":
                for p in model.parameters():
                    p.grad = None
            elif style in ("set_to_none", "adagrad_groups"):
                opt.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            if style == "groups_onecycle_clip" and not sharded:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    if sharded:
        opt.wait_for_parameters()
    # Evaluation under no_grad, as scripts do after training.
    model.eval()
    with torch.no_grad():
        x, y = batch(style, rank, 999)
        eval_loss = float(F.cross_entropy(net(x), y))
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    if style in ("rmsprop", "adagrad_groups"):  # the optimizer's own state, torch's format
        state["__optimizer__"] = opt.state_dict()
    return losses, eval_loss, state


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def run(rank, world, styles, out):
    shardopt.init()  # adopts the default process group the script made
    results = {}
    for style in styles:
        ref_losses, ref_eval, ref_state = train(style, False, rank)
        got_losses, got_eval, got_state = train(style, True, rank)
        state_rel = None
        if "__optimizer__" in ref_state:
            a, b = got_state.pop("__optimizer__"), ref_state.pop("__optimizer__")
            state_rel = 0.0 if a["state"].keys() == b["state"].keys() else 1.0
            for k in b["state"]:
                for key, t in b["state"][k].items():
                    u = a["state"].get(k, {}).get(key)
                    if u is None:
                        state_rel = 1.0
                    else:
                        state_rel = max(state_rel, rel(torch.as_tensor(u), torch.as_tensor(t)))
            groups_a = [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]]
            groups_b = [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]
            if groups_a != groups_b or [g["params"] for g in a["param_groups"]] != \
                    [g["params"] for g in b["param_groups"]]:
                print(f"param_groups differ: {a['param_groups']} vs {b['param_groups']}")
                state_rel = 1.0
        diffs = {n: rel(got_state[n], ref_state[n]) for n in ref_state}
        worst = max(diffs, key=diffs.get)
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got_losses, ref_losses))
        # The same on every rank: gather each rank's parameter checksum.
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(sums, torch.tensor([sum(float(t.double().sum()) for t in
                                                got_state.values())], dtype=torch.float64))
        results[style] = {
            "worst_tensor": worst, "worst_rel": diffs[worst], "loss_rel": loss_diff,
            "eval_rel": abs(got_eval - ref_eval) / max(abs(ref_eval), 1e-12),
            "ranks_agree": len({float(s) for s in sums}) == 1,
            "losses_ddp": ref_losses, "losses_shardopt": got_losses,
        }
        if state_rel is not None:
            results[style]["state_rel"] = state_rel
        print(f"rank {rank} {style}: params/buffers {diffs[worst]:.2e} ({worst}), "
              f"losses {loss_diff:.2e}, eval {results[style]['eval_rel']:.2e}", flush=True)
        if rank == 0:
            print(f"  losses ddp      {' '.join(f'{v:.6f}' for v in ref_losses)}")
            print(f"  losses shardopt {' '.join(f'{v:.6f}' for v in got_losses)}", flush=True)
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(results, f)


def spawned(rank, world, init_method, styles, out):
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    run(rank, world, styles, out)
    dist.destroy_process_group()  # left to teardown, gloo aborts at random (pytorch#190489)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--styles", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--spawn", type=int, default=0, help="world size for mp.spawn")
    ap.add_argument("--init-method", default="")
    a = ap.parse_args()
    styles = a.styles.split(",")
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawned, args=(a.spawn, a.init_method, styles, a.out), nprocs=a.spawn)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    run(dist.get_rank(), dist.get_world_size(), styles, a.out)
    dist.destroy_process_group()  # left to teardown, gloo aborts at random (pytorch#190489)


if __name__ == "__main__":
    main()
