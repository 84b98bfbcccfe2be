"""How ShardedOptimizer reads its arguments: the optimizer's name or
torch.optim class, torch.optim / ZeroRedundancyOptimizer / fairscale OSS
keyword arguments, parameter lists and groups, and each kind's
hyper-parameters."""

from typing import Any, Dict, List, Tuple

import torch

_KINDS = ("adam", "adamw", "sgd")


_FUSED = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
_UNSET = object()  # an argument the caller did not pass


def _is_generic(optimizer) -> bool:
    """A torch.optim.Optimizer class without fused kernels here (RMSprop,
    Adagrad, ...): its own step runs on each rank's whole owned tensors."""
    return (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
            and optimizer not in _FUSED)


def _kind_of(optimizer) -> str:
    """'adam', 'adamw' or 'sgd' from a name or a torch.optim class."""
    if isinstance(optimizer, str):
        if optimizer not in _KINDS:
            raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {', '.join(_KINDS)}"
                             " or torch.optim.Adam / AdamW / SGD")
        return optimizer
    if isinstance(optimizer, type):
        for cls, kind in ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"),
                          (torch.optim.SGD, "sgd")):
            if optimizer is cls:
                return kind
        raise TypeError(f"{optimizer.__module__}.{optimizer.__name__} is not a "
                        "torch.optim.Optimizer subclass")
    raise TypeError(f"optimizer must be a name ({', '.join(_KINDS)}) or a torch.optim class, "
                    f"not {type(optimizer).__name__}")


# torch.optim options shardopt's kernels do not have: accepted at their
# defaults (scripts pass them explicitly), refused otherwise.
_TORCH_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                   "differentiable": False, "fused": None, "process_group": None, "group": None,
                   "parameters_as_bucket_view": None, "overlap_with_ddp": False,
                   "broadcast_buffer_size": None, "broadcast_fp16": False, "force_broadcast_object": False}


# Options of fairscale OSS / ZeroRedundancyOptimizer themselves (not of the
# torch.optim class they wrap).
_WRAPPER_KWARGS = ("process_group", "group", "parameters_as_bucket_view", "overlap_with_ddp",
                   "broadcast_buffer_size", "broadcast_fp16", "force_broadcast_object")


def _check_torch_kwargs(kwargs: Dict[str, Any], kind: str) -> None:
    for key, value in kwargs.items():
        if key not in _TORCH_DEFAULTS:
            raise TypeError(f"ShardedOptimizer got an unexpected keyword argument {key!r}")
        if key in ("process_group", "group") and value is not None:
            import torch.distributed as dist
            if not (dist.is_initialized() and value is dist.group.WORLD):
                raise ValueError(f"{key}=: shardopt shards over every rank of the job; only the "
                                 "default group (None or dist.group.WORLD) is supported")
            continue
        if key in ("parameters_as_bucket_view", "broadcast_buffer_size", "fused", "foreach"):
            continue  # layout and kernel choices: shardopt's own
        if value != _TORCH_DEFAULTS[key]:
            raise ValueError(f"{key}={value!r} is not supported by shardopt's {kind} "
                             f"(only {key}={_TORCH_DEFAULTS[key]!r})")


def _is_ddp(module) -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(module, DistributedDataParallel)


def _is_named_pair(x) -> bool:
    return (isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor))


def _split_group(params, g: int, module_names=None) -> Tuple[List[str], List[torch.Tensor]]:
    names, tensors = [], []
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of (name, tensor) pairs or of tensors, "
                        "not a single tensor")
    for i, x in enumerate(params):
        if _is_named_pair(x):
            names.append(x[0])
            tensors.append(x[1])
        elif isinstance(x, torch.Tensor):
            names.append((module_names or {}).get(id(x), f"group{g}.param{i}"))
            tensors.append(x)
        else:
            raise TypeError(f"parameter {i} of group {g} is a {type(x).__name__}: expected a "
                            "(name, tensor) pair or a tensor")
    return names, tensors


def _hyper_keys(kind: str) -> Tuple[str, ...]:
    if kind == "torch":  # the core knows the learning rate only (set-lr, agreement)
        return ("lr",)
    if kind == "sgd":
        return ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    return ("lr", "betas", "eps", "weight_decay")
