"""One rank of tests/python/loops/misuse_test.py: a case where a ported
script used to train silently wrong (or hang); prints `RESULT <json>` with
what happened on this rank. Launched torchrun-style at 2 ranks."""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt


class Mlp(nn.Module):
    def __init__(self, sizes=(8, 16, 4)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, l in enumerate(self.layers):
            x = l(x) if i == len(self.layers) - 1 else torch.tanh(l(x))
        return x


class BnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def data(rank, step, n=8, d=8, classes=4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def one_step(model, opt, rank, step=0):
    opt.zero_grad()
    x, y = data(rank, step)
    F.cross_entropy(model(x), y).backward()
    return opt.step()


def error_of(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # the message is what the test checks
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def case_ddp_module(rank):
    model = Mlp()
    return error_of(lambda: shardopt.ShardedOptimizer(model.named_parameters(),
                                                      module=DDP(model)))


def case_clip_on_grad(rank):
    torch.manual_seed(0)
    model = Mlp()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-3)

    def run():
        opt.zero_grad()
        x, y = data(rank, 0)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
    return error_of(run)


def case_ddp_left_on(rank):
    torch.manual_seed(0)
    model = Mlp()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-3)
    net = DDP(model)

    def run():
        opt.zero_grad()
        x, y = data(rank, 0)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return error_of(run)


def case_state_dict_one_rank(rank):
    torch.manual_seed(0)
    model = Mlp()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-3, timeout=5)
    one_step(model, opt, rank)
    if rank == 0:
        return error_of(opt.state_dict)
    time.sleep(12)  # rank 1 goes on with its loop; it never calls state_dict()
    return {"error": None}


def case_consolidate(rank):
    torch.manual_seed(0)
    model = Mlp()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3)
    one_step(model, opt, rank)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref.load_state_dict(sd)
        return {"error": None, "states": len(sd["state"]), "params": len(list(model.parameters()))}
    return error_of(opt.state_dict)


def case_hyper_mismatch(rank):
    model = Mlp()
    lr, wd = (1e-3, 0.01) if rank == 0 else (5e-2, 0.5)
    return error_of(lambda: shardopt.ShardedOptimizer(model.named_parameters(), lr=lr,
                                                      weight_decay=wd, timeout=30))


def case_hyper_edit(rank):
    torch.manual_seed(0)
    model = Mlp()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-3, timeout=30)
    one_step(model, opt, rank, 0)
    if rank == 1:
        opt.param_groups[0]["lr"] = 5e-2
    return error_of(lambda: one_step(model, opt, rank, 1))


def case_lr_float32(rank):
    model = Mlp()
    out = {"ctor": error_of(lambda: shardopt.ShardedOptimizer(model.named_parameters(), lr=1e39))}
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-3)
    opt.param_groups[0]["lr"] = 1e39
    out["edit"] = error_of(lambda: one_step(model, opt, rank))
    out["error"] = None
    return out


def case_params_set(rank):
    model = Mlp()
    return error_of(lambda: shardopt.ShardedOptimizer(set(model.parameters())))


def case_unnamed_order(rank):
    model = Mlp((8, 8, 8, 8))  # layers 1 and 2 have the same shapes
    params = list(model.parameters())
    if rank == 1:  # the two [8, 8] weights swapped, as an unordered collection may give
        params[0], params[2] = params[2], params[0]
    return error_of(lambda: shardopt.ShardedOptimizer(params, module=model, timeout=30))


def case_clip_accuracy(rank):
    """Step-1 global norm against float64, and against clip_grad_norm_."""
    sizes = (256, 2048, 2048, 256)
    torch.manual_seed(5)
    ref = Mlp(sizes)
    torch.manual_seed(5)
    model = Mlp(sizes)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 256, (32,), generator=g)
    ddp = DDP(ref)
    F.cross_entropy(ddp(x), y).backward()
    grads = [p.grad for p in ref.parameters()]
    exact = float(torch.sqrt(sum((t.double() ** 2).sum() for t in grads)))
    torch_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-3, max_grad_norm=1e9)
    F.cross_entropy(model(x), y).backward()
    ours = opt.step().grad_norm
    return {"error": None, "exact": exact, "torch": torch_norm, "shardopt": ours,
            "torch_rel": abs(torch_norm - exact) / exact, "shardopt_rel": abs(ours - exact) / exact}


def case_buffers_checkpoint(rank, root):
    torch.manual_seed(0)
    model = BnNet()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), lr=1e-2, module=model)
    for step in range(3):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.wait_for_parameters()
    # The buffers every rank has at the next forward: rank 0's.
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, 6, 6))
    saved = {n: b.clone() for n, b in model.named_buffers()}
    opt.save_checkpoint(root)
    torch.manual_seed(1)
    fresh = BnNet()
    opt2 = shardopt.ShardedOptimizer(fresh.named_parameters(), lr=1e-2, module=fresh)
    opt2.load_checkpoint(root)
    diff = max(float((saved[n].double() - b.double()).abs().max())
               for n, b in fresh.named_buffers())
    nonzero = float(saved["bn.running_mean"].abs().sum())
    return {"error": None, "max_diff": diff, "running_mean_abs_sum": nonzero}


def case_pt_shape(rank, root):
    torch.manual_seed(0)
    model = Mlp((8, 16, 8))  # layers.0.weight [16, 8], layers.1.weight [8, 16]
    path = os.path.join(root, "transposed.pt")
    if rank == 0:
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        sd["layers.0.weight"] = sd["layers.0.weight"].t().contiguous()  # [8, 16]
        sd["layers.1.weight"] = sd["layers.1.weight"].t().contiguous()  # [16, 8]
        ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.save({"model": sd, "optimizer": ref.state_dict()}, path)
    dist.barrier()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3)
    return error_of(lambda: opt.load_checkpoint(path))


def case_pt_with_scheduler(rank, root):
    """{'model', 'optimizer', 'scheduler', 'epoch'} in one torch.save file (the
    scheduler's state pickles a bound method): read for what shardopt needs,
    the rest skipped; training continues as torch.optim does from the file."""
    torch.manual_seed(0)
    model = Mlp()
    ref_model = Mlp()
    path = os.path.join(root, "ck.pt")
    x, y = data(0, 0)  # the same batch on every rank: the averaged gradient is the local one
    if rank == 0:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "epoch": 3}, path)
    dist.barrier()
    ck = torch.load(path)
    ref_model.load_state_dict(ck["model"])
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    ref.load_state_dict(ck["optimizer"])
    torch.manual_seed(7)
    ours_model = Mlp()
    ours = shardopt.ShardedOptimizer(ours_model.named_parameters(), torch.optim.AdamW, lr=1e-3)
    info = ours.load_checkpoint(path)
    for m, o in ((ref_model, ref), (ours_model, ours)):
        for _ in range(2):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    ours.wait_for_parameters()
    diff = max(float((a - b).abs().max()) for a, b in zip(ours_model.parameters(),
                                                          ref_model.parameters()))
    # Two param groups in the file, one in this optimizer: refused (as
    # torch.optim's load_state_dict refuses it), never applied to the wrong ones.
    two = os.path.join(root, "two.pt")
    if rank == 0:
        w = [p for n, p in model.named_parameters() if n.endswith("weight")]
        b = [p for n, p in model.named_parameters() if n.endswith("bias")]
        o2 = torch.optim.AdamW([{"params": w}, {"params": b, "weight_decay": 0.0}], lr=1e-3)
        torch.save({"model": model.state_dict(), "optimizer": o2.state_dict()}, two)
    dist.barrier()
    groups_refusal = error_of(lambda: ours.load_checkpoint(two))["error"]
    bad = os.path.join(root, "bad.pt")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": torch.optim.AdamW}, bad)
    dist.barrier()
    refusal = error_of(lambda: ours.load_checkpoint(bad))
    return {"error": None, "max_diff": diff, "step": info.get("step"), "refusal": refusal["error"],
            "groups_refusal": groups_refusal}


def case_scheduler_resume(rank, root):
    """A scheduler resumed with last_epoch (torch's convention) needs the
    param_groups' initial_lr: load_state_dict brings it (as torch.optim's
    does), and so does load_checkpoint, with the script's own keys; the run
    then goes on bit for bit as the one that never stopped, at torch's lr. A
    group option the fused kernels lack (amsgrad=True) is refused, never
    ignored: in a group at construction, by a param_groups edit, in a
    state_dict."""
    x, y = data(0, 0)

    def f(s):
        return 1.0 / (1.0 + 0.1 * s)

    def steps(m, o, s, n):
        for _ in range(n):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            s.step()

    torch.manual_seed(0)
    ref_model = Mlp()
    torch.manual_seed(0)
    model = Mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = shardopt.ShardedOptimizer(model.named_parameters(), "adamw", lr=1e-2, timeout=30)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, f)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    steps(ref_model, ref, ref_sched, 3)
    steps(model, opt, sched, 3)
    opt.param_groups[0]["tag"] = "mine"  # a key of the script's own
    saved_sd = opt.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = opt.save_checkpoint(root)
    steps(ref_model, ref, ref_sched, 3)
    steps(model, opt, sched, 3)
    out = {"error": None}
    for how in ("load_state_dict", "load_checkpoint"):
        torch.manual_seed(5)
        m = Mlp()
        o = shardopt.ShardedOptimizer(m.named_parameters(), "adamw", lr=1e-2, timeout=30)
        if how == "load_state_dict":
            m.load_state_dict(saved_model)
            o.load_state_dict(saved_sd)
        else:
            o.load_checkpoint(ckpt)

        def resume():
            s = torch.optim.lr_scheduler.LambdaLR(o, f, last_epoch=2)
            steps(m, o, s, 3)
        out[how] = error_of(resume)
        o.wait_for_parameters()
        out[how]["max_diff"] = max(float((a - b).abs().max())
                                   for a, b in zip(m.parameters(), model.parameters()))
        out[how]["lr"] = o.param_groups[0]["lr"]
        out[how]["tag"] = o.param_groups[0].get("tag")
    out["torch_lr"] = ref.param_groups[0]["lr"]
    out["lr"] = opt.param_groups[0]["lr"]
    m = Mlp()
    out["ctor"] = error_of(lambda: shardopt.ShardedOptimizer(
        [{"params": list(m.parameters()), "amsgrad": True}], "adam"))
    opt.param_groups[0]["amsgrad"] = True
    out["edit"] = error_of(lambda: one_step(model, opt, rank))
    opt.param_groups[0]["amsgrad"] = False
    saved_sd["param_groups"][0]["maximize"] = True
    out["state_dict"] = error_of(lambda: opt.load_state_dict(saved_sd))
    return out


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--dir", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    fn = CASES[a.case]
    try:
        result = fn(rank, a.dir) if a.case in ("buffers_checkpoint", "pt_shape", "pt_with_scheduler",
                                                "scheduler_resume") else fn(rank)
    except Exception:
        result = {"crash": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)
    # Rank 0 serves the store: it leaves last (a bounded wait, no collective).
    from torch.distributed import distributed_c10d as c10d
    store = c10d._get_default_store()
    store.set(f"misuse-done/{rank}", "1")
    if rank == 0:
        try:
            store.wait([f"misuse-done/{r}" for r in range(dist.get_world_size())],
                       datetime.timedelta(seconds=30))
        except RuntimeError:
            pass
    os._exit(0)  # a case may leave the communicator aborted on purpose


if __name__ == "__main__":
    main()
