"""One rank of a Python API scenario (launched by tests/python/api_test.py).

Trains the same model twice from the same initial values and data: with
shardopt, and with PyTorch's DistributedDataParallel + torch.optim (same
parameter groups, clipping, schedule), then compares the parameters.
Writes a JSON result for rank 0 to --out.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import shardopt

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 ranks


def make_model(name):
    torch.manual_seed(1234)
    if name == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64),
                             nn.ReLU(), nn.Linear(64, 10))
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    raise ValueError(name)


def batch(model_name, step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    shape = (GLOBAL_BATCH, 32) if model_name == "mlp" else (GLOBAL_BATCH, 3, 32, 32)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def groups(model, named):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.dim() <= 1 else decay).append((n, p) if named else p)
    return [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]


def torch_optimizer(kind, params, lr, foreach=None):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.05, foreach=foreach)


def train(model, opt, sched, a, steps, first=0, ddp=None, accumulate=1, clip=0.0, shift=0):
    ctx = shardopt.init()
    rank, world = (ctx.rank + shift) % ctx.world_size, ctx.world_size
    loss_fn = nn.CrossEntropyLoss()
    for step in range(first, steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(a.model, step * accumulate + micro, rank, world)
            net = ddp if ddp is not None else model
            last = micro == accumulate - 1
            if ddp is not None and not last:
                with ddp.no_sync():
                    (loss_fn(net(x), y) / accumulate).backward()
            elif ddp is None and not last:
                with opt.no_sync():
                    (loss_fn(net(x), y) / accumulate).backward()
            else:
                (loss_fn(net(x), y) / accumulate).backward()
        if ddp is not None and clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()


def schedule(opt, a):
    if not a.onecycle:
        return None
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps)


def max_rel_diff(m1, m2):
    """Over the parameters, read through state_dict(): with overlapped
    all-gathers that is what must wait for them."""
    worst = 0.0
    s1, s2 = m1.state_dict(), m2.state_dict()
    for n, _ in m2.named_parameters():
        p, q = s1[n], s2[n]
        d = ((p - q).abs().max() / q.abs().max().clamp_min(1e-3)).item()
        worst = max(worst, d)
    return worst


def shardopt_model(a, grad_dtype=None):
    model = make_model(a.model)
    opt = shardopt.ShardedOptimizer(groups(model, True), optimizer=a.kind, lr=a.lr,
                                    momentum=0.9 if a.kind == "sgd" else 0.0,
                                    max_grad_norm=a.clip, bucket_cap_mb=a.bucket_mb,
                                    grad_dtype=grad_dtype,
                                    module=model if a.overlap else None,
                                    shard_gradients=a.shard_gradients)
    return model, opt


def scenario_parity(a, res):
    ref = make_model(a.model)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    ropt = torch_optimizer(a.kind, groups(ref, False), a.lr)
    train(ref, ropt, schedule(ropt, a), a, a.steps, ddp=ddp, accumulate=a.accumulate, clip=a.clip)
    model, opt = shardopt_model(a, torch.bfloat16 if a.bf16 else None)
    assert isinstance(opt, torch.optim.Optimizer)
    train(model, opt, schedule(opt, a), a, a.steps, accumulate=a.accumulate)
    res["max_rel_diff"] = max_rel_diff(model, ref)
    res["transport"] = opt.transport
    mem = opt.memory()
    res["grad_bytes"], res["param_bytes"] = mem["grad_bytes"], mem["param_bytes"]
    # With shard_gradients backward leaves no .grad behind.
    res["grads_after_backward"] = sum(p.grad is not None for p in model.parameters())
    if a.floor:
        # PyTorch against itself: the same global batches with the slices
        # assigned to the ranks in another order, so DDP sums every gradient
        # element in another order (floating-point addition is not
        # associative). On models whose training amplifies 1-ulp differences
        # (Adam normalises near-zero gradients, BatchNorm on small batches)
        # this is the noise floor of any parity at 3+ ranks.
        twin = make_model(a.model)
        tddp = torch.nn.parallel.DistributedDataParallel(twin)
        topt = torch_optimizer(a.kind, groups(twin, False), a.lr)
        train(twin, topt, schedule(topt, a), a, a.steps, ddp=tddp, accumulate=a.accumulate,
              clip=a.clip, shift=1)
        res["torch_floor"] = max_rel_diff(twin, ref)
    res["lr_now"] = [opt.param_groups[0]["lr"], ropt.param_groups[0]["lr"]]


def scenario_state_dict(a, res):
    # shardopt -> torch.optim: continue 3 steps in both, compare.
    model, opt = shardopt_model(a)
    train(model, opt, None, a, 4)
    sd = opt.state_dict()
    twin = make_model(a.model)
    twin.load_state_dict(model.state_dict())
    topt = torch_optimizer(a.kind, groups(twin, False), a.lr)
    topt.load_state_dict(sd)
    ddp = torch.nn.parallel.DistributedDataParallel(twin)
    train(twin, topt, None, a, 7, first=4, ddp=ddp)
    train(model, opt, None, a, 7, first=4)
    res["to_torch_rel_diff"] = max_rel_diff(model, twin)
    # torch.optim -> shardopt.
    ref = make_model(a.model)
    ropt = torch_optimizer(a.kind, groups(ref, False), a.lr)
    rddp = torch.nn.parallel.DistributedDataParallel(ref)
    train(ref, ropt, None, a, 4, ddp=rddp)
    m2 = make_model(a.model)
    m2.load_state_dict(ref.state_dict())
    o2 = shardopt.ShardedOptimizer(groups(m2, True), optimizer=a.kind, lr=a.lr,
                                   momentum=0.9 if a.kind == "sgd" else 0.0)
    o2.load_state_dict(ropt.state_dict())
    train(ref, ropt, None, a, 7, first=4, ddp=rddp)
    train(m2, o2, None, a, 7, first=4)
    res["from_torch_rel_diff"] = max_rel_diff(m2, ref)


def scenario_checkpoint(a, res):
    model, opt = shardopt_model(a)
    sched = schedule(opt, a)
    if a.resume:
        info = opt.load_checkpoint(a.ckpt)
        first = info["step"]
        if sched is not None:
            for _ in range(first):
                sched.step()
    else:
        train(model, opt, sched, a, a.save_at)
        opt.save_checkpoint(a.ckpt)
        first = a.save_at
    train(model, opt, sched, a, a.steps, first=first)
    if shardopt.init().rank == 0:
        sd = model.state_dict()  # waits for overlapped gathers
        torch.save({n: sd[n].clone() for n, _ in model.named_parameters()}, a.params_out)


def scenario_errors(a, res):
    model = make_model("mlp")
    named = list(model.named_parameters())
    errors = {}

    def expect(label, exc, fn):
        try:
            fn()
            errors[label] = "no error"
        except exc as e:
            errors[label] = f"ok: {e}"
        except Exception as e:  # noqa: BLE001
            errors[label] = f"wrong type {type(e).__name__}: {e}"

    expect("unknown optimizer", ValueError,
           lambda: shardopt.ShardedOptimizer(named, optimizer="adagrad"))
    expect("negative lr", ValueError, lambda: shardopt.ShardedOptimizer(named, lr=-1.0))
    expect("parameter twice", ValueError,
           lambda: shardopt.ShardedOptimizer(named + [("again", named[0][1])]))
    expect("bad group option", ValueError,
           lambda: shardopt.ShardedOptimizer([{"params": named, "momentum": 0.9}]))
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    expect("another device", ValueError,
           lambda: shardopt.ShardedOptimizer(named + [("meta", meta)]))
    res["errors"] = errors
    # A model that differs between ranks: both ranks raise, naming it.
    width = 64 if shardopt.init().rank == 0 else 65
    other = nn.Sequential(nn.Linear(32, width))
    try:
        shardopt.ShardedOptimizer(other.named_parameters())
        res["differs"] = "no error"
    except RuntimeError as e:
        res["differs"] = str(e)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True)
    p.add_argument("--model", default="mlp")
    p.add_argument("--kind", default="adamw")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--onecycle", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--floor", action="store_true")
    p.add_argument("--overlap", action="store_true", help="module=: gathers overlap the forward")
    p.add_argument("--shard-gradients", action="store_true", help="ZeRO-2")
    p.add_argument("--bucket-mb", type=float, default=0.05)  # several buckets
    p.add_argument("--ckpt")
    p.add_argument("--save-at", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--params-out")
    p.add_argument("--host-allocator", action="store_true",
                   help="shardopt.install_host_allocator() first")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.host_allocator:
        if shardopt.host_allocator_stats() != {}:
            raise SystemExit("host_allocator_stats() before install_host_allocator() is not {}")
        shardopt.install_host_allocator()
        shardopt.install_host_allocator()  # idempotent
    ctx = shardopt.init(timeout=60)
    res = {"world_size": ctx.world_size}
    globals()["scenario_" + a.scenario](a, res)
    res["host_allocator_stats"] = shardopt.host_allocator_stats()
    if ctx.rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
