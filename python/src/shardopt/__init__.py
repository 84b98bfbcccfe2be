"""shardopt: a sharded data-parallel optimizer for PyTorch.

Each rank keeps 1/N of the optimizer state; gradients are reduce-scattered in
buckets during backward, each rank updates its shard with fused kernels, and
parameters are all-gathered. A drop-in for torch.optim.Adam / AdamW / SGD under
data parallelism (instead of DDP + an optimizer, or ZeroRedundancyOptimizer):

    import shardopt, torch
    ctx = shardopt.init()
    opt = shardopt.ShardedOptimizer(model.named_parameters(), optimizer="adamw", lr=1e-3)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # no DDP wrapper: shardopt reduces gradients
        stats = opt.step()

See docs/python.md (API reference) and docs/migration.md.
"""

# The package's modules: _launch (init, Context, the environment), _allocator
# (the host allocator), optimizer (ShardedOptimizer, StepStats), _options (its
# arguments), _state (state_dict, checkpoints), _exit (excepthook / atexit),
# advisor (advise: the partition advisor's predictions).

import torch

from . import _C  # the C++ core (built against this torch)
from . import _exit
from ._allocator import host_allocator_stats, install_host_allocator
from ._launch import Context, init
from .advisor import advise, format_advice
from .optimizer import ResizeEvent, ShardedOptimizer, StepStats

__all__ = ["init", "Context", "ShardedOptimizer", "StepStats", "ResizeEvent",
           "install_host_allocator",
           "host_allocator_stats", "advise", "format_advice"]

_exit._install()
