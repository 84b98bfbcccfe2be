"""The same Python training loop with the optimizer swapped: PyTorch's DDP +
torch.optim.Adam, DDP + ZeroRedundancyOptimizer(Adam), and shardopt (also with
gradient sharding, shard_gradients=True: the row shardopt_zero2; without
DDP's buffer broadcast, broadcast_buffers=False: the row shardopt_nobuf, which
prices shardopt's default of broadcasting module buffers before each forward).

    bazel build //python:shardopt
    PYTHONPATH=bazel-bin/python /usr/bin/python3 tools/bench/bench_python.py [--json out.json]
        [--rows=ddp,ddp_zero,shardopt,shardopt_zero2,compute_only,shardopt@gloo] [--ref=ROW]
        [--allocator=glibc|shardopt]

2 ranks on this machine over gloo (torchrun's environment contract), one
thread per rank, the allocator tuned identically for every row (glibc
tunables: no mmap for large blocks, no trimming, one arena, as shardopt's
--malloc=tuned). Every (row, round) runs in fresh processes, so peak RSS is
the row's own. Rows are interleaved (row order rotates every round) so the
machine's drift hits them alike. Reports samples/s/rank (median of rounds,
with min-max), its ratio to DDP and to ZeRO, peak RSS, optimizer-state
bytes per rank, and where a step's time goes (forward; backward, which for
DDP includes the all-reduce it cannot overlap; optimizer step, which for
ZeRO includes the parameter broadcast and for shardopt the exposed
reduce-scatter/all-gather waits, reported separately).

shardopt rows use shardopt's default transport (auto: shared memory, since
every rank is on this host); shardopt@gloo and shardopt_zero2@gloo run them
over Gloo/TCP as DDP and ZeRO do (shardopt@shm forces shared memory).

A/B of two builds of shardopt in one run (a refactor's "behaviour unchanged"):
--ab=DIR runs every shardopt row a second time with PYTHONPATH=DIR (another
build's bazel-bin/python, e.g. a clean clone of the old commit), as the row
ROW#ab, interleaved in the same rounds, and prints each round's paired ratio
of ROW over ROW#ab (median [lowest, highest]).
"""
import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROWS = ("ddp", "ddp_zero", "shardopt", "shardopt_zero2", "compute_only", "shardopt_nobuf")
DEFAULT_ROWS = ROWS[:4]  # compute_only (forward + backward alone: the ceiling) on request
TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824:glibc.malloc.arena_max=1"


def build_model(name):
    import torch.nn as nn
    if name == "mlp":  # 1024-4096-4096-4096-1024
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    import torchvision
    return torchvision.models.resnet101()  # 1000 classes, 44.5M parameters, as bench_oss


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    torch.set_num_threads(1)
    a.row = a.row.removesuffix("#ab")  # the same row, from the --ab build (PYTHONPATH)
    if a.allocator == "shardopt":  # every row alike, before anything large is allocated
        import shardopt
        shardopt.install_host_allocator()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_model(a.model)
    batch = 64 if a.model == "mlp" else 32
    g = torch.Generator().manual_seed(rank)
    if a.model == "mlp":
        x = torch.randn(batch, 1024, generator=g)
        y = torch.randn(batch, 1024, generator=g)
        loss_fn = nn.MSELoss()
    else:
        x = torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.randint(0, 1000, (batch,), generator=g)
        loss_fn = nn.CrossEntropyLoss()
    net = model
    row, _, transport = a.row.partition("@")
    sharded = row.startswith("shardopt")
    if row == "compute_only":
        # No communication, no optimizer: what forward + backward cost alone.
        class NoStep:
            def zero_grad(self):
                model.zero_grad(set_to_none=False)

            def step(self):
                return None
        opt = NoStep()
    elif sharded:
        import shardopt
        shardopt.init(transport=transport or None)
        # module=: the all-gathers overlap the next forward (per-layer waits).
        opt = shardopt.ShardedOptimizer(model.named_parameters(), optimizer="adam", lr=1e-4,
                                        module=model,
                                        shard_gradients=row == "shardopt_zero2",
                                        broadcast_buffers=row != "shardopt_nobuf")
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        if row == "ddp":
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                          lr=1e-4)
    fwd = bwd = stp = exposed = 0.0
    t_start = None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            dist.barrier()
            t_start = time.perf_counter()
            fwd = bwd = stp = exposed = 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        r = opt.step()
        t3 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
        stp += t3 - t2
        if sharded:
            exposed += r.comm_wait_seconds
    elapsed = time.perf_counter() - t_start
    if sharded:
        state = opt.memory()["state_bytes"]
        grads = opt.memory()["grad_bytes"]
    elif row == "compute_only":
        state = 0
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
    else:
        # .grad of every parameter (DDP's own bucket copies come on top).
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
        local = opt.optim if a.row == "ddp_zero" else opt
        state = sum(t.numel() * t.element_size() for s in local.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    out = {
        "samples_per_s": a.steps * batch / elapsed,
        "forward_s": fwd / a.steps, "backward_s": bwd / a.steps, "step_s": stp / a.steps,
        "exposed_comm_s": exposed / a.steps if sharded else None,
        "state_bytes": state,
        "grad_bytes": grads,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, out)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    if sharded:
        opt.finish()
    # Not dist.destroy_process_group() nor the interpreter's teardown: with
    # DDP over gloo either can hang for minutes after the work is done (seen
    # with resnet101 on torch 1.13); the results are written.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, model, row, world):
    out = tempfile.mktemp(suffix=".json")
    port = str(free_port())
    procs, logs = [], []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   GLIBC_TUNABLES=TUNABLES)
        env.pop("SHARDOPT_COORDINATOR", None)
        if row.endswith("#ab"):
            env["PYTHONPATH"] = a.ab
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--model", model, "--row", row,
             "--steps", str(a.steps), "--warmup", str(a.warmup), "--out", out,
             "--allocator", a.allocator],
            env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    # Poll every rank: one that fails ends the others at once (they would wait
    # in a collective for gloo's 30-minute timeout), and its log is shown.
    deadline = time.time() + a.launch_timeout
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.time() > deadline:
            for p in procs:
                p.kill()
            break
        time.sleep(0.2)
    texts = []
    for p, log in zip(procs, logs):
        p.wait()
        log.seek(0)
        texts.append(log.read())
    if any(p.returncode != 0 for p in procs):
        if time.time() > deadline and not any(p.returncode not in (0, -9) for p in procs):
            return None  # timed out: the caller retries (and says so)
        raise SystemExit(f"bench_python: {model}/{row} failed:\n" + "\n---\n".join(texts))
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def summarize(per_round):
    """Per row: medians over rounds of the per-rank mean."""
    def mean_over_ranks(res, key):
        vals = [r[key] for r in res if r[key] is not None]
        return sum(vals) / len(vals) if vals else None
    s = {}
    for key in ("samples_per_s", "forward_s", "backward_s", "step_s", "exposed_comm_s"):
        vals = [mean_over_ranks(res, key) for res in per_round]
        vals = [v for v in vals if v is not None]
        s[key] = statistics.median(vals) if vals else None
        if key == "samples_per_s":
            s["samples_per_s_min"], s["samples_per_s_max"] = min(vals), max(vals)
    s["peak_rss_bytes"] = statistics.median(max(r["peak_rss_bytes"] for r in res)
                                            for res in per_round)
    s["state_bytes"] = per_round[0][0]["state_bytes"]
    s["grad_bytes"] = max(r["grad_bytes"] for res in per_round for r in res)
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,resnet101")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help="of " + ",".join(ROWS) + "; compute_only runs forward and backward "
                   "alone and every row is printed as a fraction of it (the ceiling)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=6,
                   help="untimed steps first (6, as bench_oss: the mlp's heap takes that long to "
                        "settle there; with 3, shardopt_zero2 measured 14%% slower in one run)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--launch-timeout", type=float, default=300.0,
                   help="seconds one (row, round) may take before it is killed and retried")
    p.add_argument("--allocator", choices=("glibc", "shardopt"), default="glibc",
                   help="glibc: glibc's heap with the tuned tunables (every row); shardopt: "
                        "also shardopt.install_host_allocator() in every row's processes, DDP's "
                        "included (large CPU tensors in their own mappings, reused best-fit)")
    p.add_argument("--ref", default=None,
                   help="add paired ratios against this row: each round's samples/s over the "
                        "row's in the same round (rows of a round run back to back), then their "
                        "median with the lowest and highest")
    p.add_argument("--ab", default=None, metavar="DIR",
                   help="also run every shardopt row from the build whose Python package is "
                        "in DIR (PYTHONPATH=DIR) as ROW#ab, interleaved, and print the paired "
                        "ratios ROW / ROW#ab")
    p.add_argument("--json", default=None, help="write the results here")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    rows = a.rows.split(",")
    for r in rows:
        base, at, transport = r.partition("@")
        if base not in ROWS:
            p.error(f"unknown row {r!r} (rows: {', '.join(ROWS)})")
        if at and (not base.startswith("shardopt") or transport not in ("gloo", "shm")):
            p.error(f"row {r!r}: only shardopt rows take @gloo or @shm")
    if a.ref is not None and a.ref not in rows:
        p.error(f"--ref={a.ref} is not one of --rows")
    if a.ab is not None:
        if not os.path.isdir(os.path.join(a.ab, "shardopt")):
            p.error(f"--ab={a.ab}: no shardopt package there (want a bazel-bin/python)")
        a.ab = os.path.abspath(a.ab)
        rows += [r + "#ab" for r in rows if r.startswith("shardopt")]
    report = {"world_size": a.world, "rounds": a.rounds, "steps": a.steps, "models": {},
              "allocator": a.allocator, "glibc_tunables": TUNABLES}
    for model in a.models.split(","):
        per_row = {r: [] for r in rows}
        for rnd in range(a.rounds):
            order = rows[rnd % len(rows):] + rows[:rnd % len(rows)]
            for row in order:
                t = time.time()
                res = launch(a, model, row, a.world)
                if res is None:
                    print(f"[{model} round {rnd + 1}] {row}: no result within "
                          f"{a.launch_timeout:.0f} s (hung); retrying once", file=sys.stderr)
                    res = launch(a, model, row, a.world)
                    if res is None:
                        raise SystemExit(f"bench_python: {model}/{row} hung twice")
                per_row[row].append(res)
                print(f"[{model} round {rnd + 1}/{a.rounds}] {row:19s} "
                      f"{sum(r['samples_per_s'] for r in res) / len(res):7.1f} samples/s/rank "
                      f"({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
        summary = {r: summarize(per_row[r]) for r in rows}
        report["models"][model] = summary
        print(f"\n{model}, {a.world} ranks, median of {a.rounds} rounds x {a.steps} steps, "
              f"allocator {a.allocator}:")
        print(f"{'row':19s} {'samples/s/rank':>22s} {'vs ddp':>7s} {'vs zero':>8s} "
              f"{'fwd ms':>7s} {'bwd ms':>7s} {'step ms':>8s} {'exposed':>8s} "
              f"{'state MiB':>10s} {'grads MiB':>10s} {'peak RSS MiB':>13s}")
        for r in rows:
            s = summary[r]
            vs = lambda other: (f"{s['samples_per_s'] / summary[other]['samples_per_s']:.2f}x"
                                if other in summary else "-")
            exposed = f"{s['exposed_comm_s'] * 1e3:.0f} ms" if s["exposed_comm_s"] is not None else "-"
            print(f"{r:19s} {s['samples_per_s']:8.1f} ({s['samples_per_s_min']:.1f}-"
                  f"{s['samples_per_s_max']:.1f})  {vs('ddp'):>7s} {vs('ddp_zero'):>8s} "
                  f"{s['forward_s'] * 1e3:7.0f} {s['backward_s'] * 1e3:7.0f} "
                  f"{s['step_s'] * 1e3:8.0f} {exposed:>8s} {s['state_bytes'] / 2**20:10.1f} "
                  f"{s['grad_bytes'] / 2**20:10.1f} "
                  f"{s['peak_rss_bytes'] / 2**20:13.0f}")
        for r in rows:  # per round: the mean over ranks
            summary[r]["samples_per_s_by_round"] = [
                sum(x["samples_per_s"] for x in res) / len(res) for res in per_row[r]]
        if a.ref is not None:
            print(f"paired vs {a.ref} (median of per-round ratios [lowest, highest] over "
                  f"{a.rounds} rounds):")
            for r in rows:
                ratios = [x / y for x, y in zip(summary[r]["samples_per_s_by_round"],
                                                summary[a.ref]["samples_per_s_by_round"])]
                summary[r]["paired"] = {"ref": a.ref, "median_ratio": statistics.median(ratios),
                                        "ratios": ratios}
                print(f"  {r:19s} {statistics.median(ratios):.3f}x "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}]")
        ab = [r for r in rows if r + "#ab" in summary]
        if ab:
            print(f"A/B: this build over --ab={a.ab} (median of per-round ratios "
                  f"[lowest, highest] over {a.rounds} rounds):")
            for r in ab:
                ratios = [x / y for x, y in zip(summary[r]["samples_per_s_by_round"],
                                                summary[r + "#ab"]["samples_per_s_by_round"])]
                summary[r]["ab"] = {"median_ratio": statistics.median(ratios), "ratios": ratios}
                print(f"  {r:19s} {statistics.median(ratios):.3f}x "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}]")
        if "compute_only" in summary:
            ceiling = summary["compute_only"]["samples_per_s"]
            for r in rows:
                summary[r]["vs_compute_only"] = summary[r]["samples_per_s"] / ceiling
            print("ceiling (compute_only: forward + backward, nothing else): " +
                  " ".join(f"{r} {summary[r]['vs_compute_only']:.3f}" for r in rows
                           if r != "compute_only") + " of it")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
