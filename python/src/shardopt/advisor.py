"""shardopt.advise: the partition advisor from Python (docs/advisor.md).

    import shardopt
    adv = shardopt.advise(model, world_size=8, network="nvlink4",
                          forward_ms=40, backward_ms=80)
    print(shardopt.format_advice(adv))

Predicts, per data-parallel strategy (DDP, DDP with a fused optimizer,
fairscale OSS + DDP, OSS + ShardedDDP, ZeroRedundancyOptimizer, shardopt,
shardopt with overlapped all-gathers, shardopt with gradient sharding), the
step time split into compute, exposed communication and optimizer, and the
memory per rank; and recommends shardopt's bucket size and whether to shard
gradients. The same model as `shardctl plan`.
"""

import os

from . import _C

_STATE = {"adam": "adam", "adamw": "adam", "rmsprop": "rmsprop", "sgd": "sgd"}


def advise(model, *, world_size=None, ranks_per_node=0, network="pcie4-p2p", inter="ib400",
           cpu=None, forward_ms, backward_ms, optimizer="adam", precision="fp32",
           fused_ns=None, memory_gbps=2000.0, unfused_factor=3.0, per_tensor_us=0.0,
           bucket_mb=25.0, zero2_bucket_mb=8.0, activation_mb=0.0, memory_limit_gb=0.0,
           broadcast_buffers=True):
    """model: a torch.nn.Module (its trainable parameters and, with
    broadcast_buffers, its buffers), an iterable of (name, tensor), or a
    standard model name ("gpt2-small", "gpt-1.3b", "gpt-7b",
    "gpt:LAYERS,HIDDEN,VOCAB,SEQ", "mlp:IN,...,OUT").

    world_size: default $WORLD_SIZE or 2. network / inter: a profile name
    (nvlink4, pcie4-p2p, pcie4-nop2p, eth100, ib200, eth200, ib400, eth400) or
    "FILE.json:gloo|shm" (a bench_comm --json result). cpu: communication runs
    on the compute cores (default: the model's parameters are on the CPU).
    forward_ms / backward_ms: measured compute per step. fused_ns: a fused
    optimizer's cost per element (default 28 bytes at memory_gbps); torch.optim
    costs unfused_factor times that plus per_tensor_us per tensor.

    Returns a dict: parameters, tensors, world_size, nodes, ring_bandwidth,
    strategies (one dict each: step_s, compute_s, exposed_comm_s, optimizer_s,
    bytes_sent, collectives, memory{params, grads, state, master, staging,
    activations, total} in bytes) and recommended {strategy, bucket_bytes,
    shard_gradients, why}. ValueError names a bad argument."""
    if optimizer not in _STATE:
        raise ValueError(f"optimizer must be one of {sorted(_STATE)}, got {optimizer!r}")
    shapes, buffers, name, on_cpu = [], [], "", True
    if isinstance(model, str):
        name = model
    else:
        named = model.named_parameters() if hasattr(model, "named_parameters") else model
        for _, t in named:
            if t.requires_grad:
                shapes.append(list(t.shape))
                on_cpu = on_cpu and t.device.type == "cpu"
        if broadcast_buffers and hasattr(model, "named_buffers"):
            buffers = [list(b.shape) for _, b in model.named_buffers()]
        if not shapes:
            raise ValueError("the model has no trainable parameters")
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "2"))
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    for arg, v in (("forward_ms", forward_ms), ("backward_ms", backward_ms)):
        if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
            raise ValueError(f"{arg} must be a finite number >= 0, got {v!r}")
    if backward_ms <= 0:
        raise ValueError("backward_ms must be > 0")
    if memory_gbps <= 0 or unfused_factor < 1 or per_tensor_us < 0:
        raise ValueError("memory_gbps must be > 0, unfused_factor >= 1, per_tensor_us >= 0")
    fused_s = (28.0 / memory_gbps if fused_ns is None else float(fused_ns)) * 1e-9
    return _C.advise(shapes=shapes, buffer_shapes=buffers, model=name, world_size=world_size,
                     ranks_per_node=ranks_per_node, intra=network, inter=inter,
                     cpu=on_cpu if cpu is None else bool(cpu), forward_s=forward_ms * 1e-3,
                     backward_s=backward_ms * 1e-3, fused_s=fused_s,
                     unfused_s=fused_s * unfused_factor, per_tensor_s=per_tensor_us * 1e-6,
                     precision=precision, optimizer=_STATE[optimizer], bucket_mb=bucket_mb,
                     zero2_bucket_mb=zero2_bucket_mb, activation_bytes=activation_mb * 2**20,
                     memory_limit_bytes=memory_limit_gb * 1e9)


def format_advice(adv):
    """The table `shardctl plan` prints, from advise()'s result."""
    rows = adv["strategies"]
    ddp = rows[0]["step_s"]
    lines = [f"{adv['parameters'] / 1e6:.1f}M parameters in {adv['tensors']} tensors; "
             f"{adv['world_size']} ranks on {adv['nodes']} node(s), ring at "
             f"{adv['ring_bandwidth'] / 1e9:.1f} GB/s",
             f"{'strategy':17s} {'step ms':>9s} {'vs ddp':>7s} {'exposed':>9s} "
             f"{'optimizer':>9s} {'total MiB':>10s}"]
    for r in rows:
        lines.append(f"{r['strategy']:17s} {r['step_s'] * 1e3:9.1f} {ddp / r['step_s']:6.3f}x "
                     f"{r['exposed_comm_s'] * 1e3:9.1f} {r['optimizer_s'] * 1e3:9.1f} "
                     f"{r['memory']['total'] / 2**20:10.1f}")
    rec = adv["recommended"]
    lines.append(f"recommended: {rec['strategy']}, {rec['why']}")
    return "\n".join(lines)
