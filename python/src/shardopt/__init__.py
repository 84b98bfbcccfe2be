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

import contextlib
import json
import zlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer

from . import _C  # the C++ core (built against this torch)

__all__ = ["init", "Context", "ShardedOptimizer", "StepStats", "install_host_allocator",
           "host_allocator_stats"]

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
_META_GROUPS = "shardopt.param_groups"
_META_GROUP_OF = "shardopt.param_group_of"  # group of each trainable parameter, layout order
_META_BUFFERS = "shardopt.buffers"
# A torch.optim class without fused kernels: its class, its param_groups'
# options, and every rank's state file (step-N/optimizer-R-of-W.pt) with its
# size and CRC-32.
_META_TORCH_OPTIM = "shardopt.torch_optimizer"


def _json_or_none(text: Optional[str]):
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _encode_buffers(module: torch.nn.Module) -> str:
    """Module buffers as JSON: name, dtype, shape, base64 of the raw bytes
    (no pickle: loading a checkpoint never runs code)."""
    import base64
    out = []
    for name, b in module.named_buffers():
        if b is None:
            continue
        t = b.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""),
                    "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")})
    return json.dumps(out)


def _decode_buffers(module: torch.nn.Module, text: str, where: str) -> None:
    import base64
    try:
        saved = json.loads(text)
        assert isinstance(saved, list)
    except (ValueError, AssertionError):
        raise ValueError(f"{where}: the saved module buffers are corrupt") from None
    own = dict(module.named_buffers())
    for entry in saved:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in own:
            raise ValueError(f"{where}: holds buffer {name!r}, which this module does not have")
        b = own[name]
        dtype = getattr(torch, str(entry.get("dtype")), None)
        shape = entry.get("shape")
        if dtype != b.dtype or not isinstance(shape, list) or list(b.shape) != shape:
            raise ValueError(f"{where}: buffer {name!r} is {entry.get('dtype')} {shape}, this "
                             f"module's {str(b.dtype).replace('torch.', '')} {list(b.shape)}")
        raw = base64.b64decode(entry.get("data", ""), validate=True)
        if len(raw) != b.numel() * b.element_size():
            raise ValueError(f"{where}: buffer {name!r} holds {len(raw)} bytes, expected "
                             f"{b.numel() * b.element_size()}")
        if b.numel():
            with torch.no_grad():
                b.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
                        .reshape(b.shape))
    missing = [n for n in own if n not in {e.get("name") for e in saved}]
    if missing:
        print(f"shardopt: {where} has no saved value for buffer {missing[0]!r} "
              f"({len(missing)} missing): kept as is", file=sys.stderr)


@dataclass
class Context:
    """How this process takes part in the job (see init())."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "shardrun", "torchrun", "torch.distributed" (a process group the script made) or "single"
    control_plane: bool
    job_id: str = ""
    # How ranks exchange gradients and parameters: "auto" (shared memory when
    # every rank is on one host, else Gloo over TCP), "gloo" or "shm".
    transport: str = "auto"
    _prefixes: int = field(repr=False, default=0)
    _agent_taken: bool = field(repr=False, default=False)

    def _new_communicator(self, timeout: float):
        """One communicator per optimizer (its own rendezvous keys)."""
        self._prefixes += 1
        prefix = f"shardopt-py/{self._prefixes}"
        if self.control_plane:
            env = os.environ
            return _C.make_coordinator_communicator(
                self.rank, self.world_size, env["SHARDOPT_COORDINATOR"], _token(), self.job_id,
                prefix, timeout, _hostname(), env.get("SHARDOPT_TLS_CA", ""),
                env.get("SHARDOPT_TLS_CERT", ""), env.get("SHARDOPT_TLS_KEY", ""),
                self.transport)
        if self.world_size == 1:
            return _C.make_communicator(0, 1, None, "", timeout, "127.0.0.1")
        return _C.make_communicator(self.rank, self.world_size, _default_store(), prefix, timeout,
                                    _hostname(), self.transport)


_context: Optional[Context] = None


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _hostname() -> str:
    return os.environ.get("SHARDOPT_BIND", "127.0.0.1")


def _token() -> str:
    path = os.environ.get("SHARDOPT_TOKEN_FILE", "")
    if not path:
        return ""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read SHARDOPT_TOKEN_FILE '{path}': {e.strerror}") from None
    if not token:
        raise ValueError(f"token file '{path}' is empty")
    return token


def _torch_world() -> int:
    """The world size of torch.distributed's default process group (0: none)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_world_size()


def _torch_backend() -> str:
    import torch.distributed as dist
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else ""


def _default_store():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    return c10d._get_default_store()


_TRANSPORTS = ("auto", "gloo", "shm")


def install_host_allocator() -> str:
    """Makes shardopt's host allocator PyTorch's CPU allocator in this process.

    CPU tensors of 1 MiB or more then get their own memory mappings, kept when
    freed for the next tensor they fit (best fit, at most twice its size; up
    to 2 GiB kept unused); smaller ones still come from malloc. A training
    loop asks for the same sizes every step, so peak memory stops depending on
    how glibc's heap happened to split (docs/performance.md, "Allocator": it helps
    models with few tensor sizes, and keeps more than glibc where a step's
    phases use many different sizes, as torchvision's resnet101). Call it
    once, early, before the model is built: tensors allocated before keep
    their own allocator. It is process-wide and cannot be undone; idempotent.
    Returns a one-line description for logs.
    """
    return _C.install_host_allocator()


def host_allocator_stats() -> Dict[str, int]:
    """Counters of the allocator install_host_allocator() installed ({} before):
    mapped_bytes, kept_bytes, peak_mapped_bytes, maps (cache misses), reuses,
    reuses_larger (of those, from a larger kept block)."""
    return dict(_C.host_allocator_stats())


def init(timeout: float = 300.0, transport: Optional[str] = None) -> Context:
    """Joins the job this process was launched into, once per process.

    transport: how ranks exchange gradients and parameters: "shm" (shared
    memory; every rank on this host), "gloo" (TCP, any hosts) or "auto"
    (shm when every rank is on one host, else gloo). Default:
    $SHARDOPT_TRANSPORT, else "auto". ShardedOptimizer.transport says which
    one a job uses.

    Under shardrun (SHARDOPT_COORDINATOR set): ranks meet through the job's
    coordinator, and the first ShardedOptimizer joins its control plane
    (shardctl status/layout/memory, heartbeats, set-lr, checkpoint requests).
    torch.distributed stays the script's own (shardrun gives it a
    MASTER_PORT of its own).

    Under a torchrun-style launcher (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT): ranks meet through torch.distributed's store;
    its default process group (gloo) is initialised here if the script has
    not done so. No control plane. Without a launcher: one rank.
    """
    global _context
    if _context is not None:
        if not (_context.world_size == 1 and _torch_world() > 1):
            return _context
        # init() ran before the script's init_process_group: join its job now.
        _context = None
    if not (timeout > 0):
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if transport is None:
        transport = os.environ.get("SHARDOPT_TRANSPORT", "") or "auto"
        if transport not in _TRANSPORTS:
            raise ValueError(f"SHARDOPT_TRANSPORT={transport!r} is not one of {', '.join(_TRANSPORTS)}")
    elif transport not in _TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {', '.join(_TRANSPORTS)}")
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    # A default process group the script initialised (mp.spawn with
    # init_process_group(init_method=..., rank=r, world_size=w), no
    # RANK/WORLD_SIZE variables) is the job: adopted, never overridden by
    # one rank's defaults; a contradiction with the environment is refused.
    adopted = False
    if _torch_world() > 0:
        import torch.distributed as dist
        pg_rank, pg_world = dist.get_rank(), dist.get_world_size()
        for var, env_v, pg_v in (("WORLD_SIZE", "WORLD_SIZE" in os.environ and world, pg_world),
                                 ("RANK", "RANK" in os.environ and rank, pg_rank)):
            if env_v is not False and env_v != pg_v:
                raise ValueError(f"torch.distributed's default process group is rank {pg_rank} of "
                                 f"{pg_world}, but the environment says {var}={env_v}: launch "
                                 "and init_process_group must agree")
        adopted = "WORLD_SIZE" not in os.environ and pg_world > 1
        world, rank = pg_world, pg_rank
    local_rank = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    launcher = "single"
    if world > 1 or "MASTER_PORT" in os.environ:
        launcher = "shardrun" if os.environ.get("SHARDOPT_COORDINATOR") else "torchrun"
        if adopted:
            launcher = "torch.distributed"
    if launcher == "shardrun":
        job_id = os.environ.get("SHARDOPT_JOB_ID", "job")
        _context = Context(rank, world, local_rank, launcher, True, job_id, transport)
        return _context
    if world > 1:
        import datetime
        import torch.distributed as dist
        if not dist.is_initialized():
            for var in ("MASTER_ADDR", "MASTER_PORT"):
                if var not in os.environ:
                    raise ValueError(f"WORLD_SIZE={world} but {var} is not set: launch with "
                                     "shardrun or a torchrun-style launcher")
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        elif dist.get_rank() != rank or dist.get_world_size() != world:
            raise ValueError(f"torch.distributed is rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, the environment says {rank} of {world}")
    control_plane = False
    if launcher in ("torchrun", "torch.distributed") and rank == 0:
        print("shardopt: no shardopt coordinator in this job (not launched by shardrun): "
              "the control plane (shardctl, heartbeats, set-lr) is off", file=sys.stderr)
    _context = Context(rank, world, local_rank, launcher, control_plane, transport=transport)
    return _context


@dataclass
class StepStats:
    """What one step did. `loss` is the closure's result, if one was given."""

    step: int
    grad_norm: float
    clipped: bool
    comm_wait_seconds: float
    update_seconds: float
    loss: Any = None


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


class ShardedOptimizer(Optimizer):
    """torch.optim.Adam / AdamW / SGD (fused kernels), or any other
    torch.optim class (its own step on each rank's whole owned tensors, as
    ZeroRedundancyOptimizer runs it), with the state sharded over the ranks.

    `params`: model.named_parameters(), or parameter groups
    [{"params": [(name, p), ...], "weight_decay": 0.0, "lr": ...}, ...]
    (tensors without names are accepted; names make checkpoints and layouts
    readable and must match between ranks). Every rank must pass the same
    model. Parameters become views of the optimizer's flat buffers (the same
    tensor objects, so the model is unchanged for the user).

    Do not wrap the model in DistributedDataParallel: shardopt reduces the
    gradients itself (bucketed reduce-scatter during backward).

    `module`: the model the parameters belong to. Given it, step() returns
    with the parameter all-gathers still in flight (overlap_param_gather,
    the default then) and each layer waits for its own parameters in a
    forward pre-hook, so the gathers hide behind the next forward;
    module.state_dict(), checkpoints and state_dict() wait for them too.
    Read parameters any other way between steps only after
    wait_for_parameters().

    `shard_gradients=True` (ZeRO-2): each rank keeps only the reduced
    gradients of the slices it owns, 1/N of the gradient memory plus staging
    for the other ranks' chunks of two buckets, or of the largest tensor if
    that is more (bucket_cap_mb defaults to 8 then, to keep it small). Backward hands every gradient to the optimizer, so
    `p.grad` is None after backward: clip with max_grad_norm=, not with
    torch.nn.utils.clip_grad_norm_. Under no_sync() micro-batches accumulate
    in a full-size buffer that lives only until the next step.
    """

    def __init__(self, params, optimizer="adamw", lr: float = _UNSET,
                 betas: Tuple[float, float] = _UNSET, eps: float = _UNSET,
                 weight_decay: Optional[float] = _UNSET, momentum: float = _UNSET,
                 dampening: float = _UNSET, nesterov: bool = _UNSET, max_grad_norm: float = 0.0,
                 bucket_cap_mb: Optional[float] = None, grad_dtype: Optional[torch.dtype] = None,
                 timeout: float = 300.0, kernel_threads: int = 1,
                 checkpoint_dir: Optional[str] = None, checkpoint_keep: int = 0,
                 module: Optional[torch.nn.Module] = None,
                 overlap_param_gather: Optional[bool] = None,
                 shard_gradients: bool = False,
                 context: Optional[Context] = None,
                 broadcast_buffers: Optional[bool] = None,
                 batch_size: int = 0,
                 optim=None, optimizer_class=None, **torch_kwargs):
        # fairscale OSS (optim=torch.optim.X) and ZeroRedundancyOptimizer
        # (optimizer_class=torch.optim.X, or second positional) signatures.
        for given in (optim, optimizer_class):
            if given is not None:
                optimizer = given
        # Any other torch.optim class (RMSprop, Adagrad, ...): its own step on
        # this rank's whole owned tensors, as ZeroRedundancyOptimizer runs it.
        generic_class = optimizer if _is_generic(optimizer) else None
        explicit = {k: v for k, v in (("lr", lr), ("betas", betas), ("eps", eps),
                                      ("weight_decay", weight_decay), ("momentum", momentum),
                                      ("dampening", dampening), ("nesterov", nesterov))
                    if v is not _UNSET}
        if generic_class is not None:
            optimizer = "torch"
            # OSS / ZeroRedundancyOptimizer's own options are the wrapper's;
            # the rest are the class's.
            wrapper = {k: v for k, v in torch_kwargs.items() if k in _WRAPPER_KWARGS}
            _check_torch_kwargs(wrapper, generic_class.__name__)
            probe_kwargs = dict({k: v for k, v in torch_kwargs.items()
                                 if k not in _WRAPPER_KWARGS}, **explicit)
            try:  # the class checks its own arguments, as it would for the script
                probe = generic_class([torch.zeros(1, requires_grad=True)], **probe_kwargs)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{generic_class.__name__}: {e}") from None
            class_defaults = dict(probe.defaults)
            lr = class_defaults.get("lr", 1e-3)
            if isinstance(lr, torch.Tensor):
                lr = lr.item()
            betas, eps, weight_decay, momentum, dampening, nesterov = (
                (0.9, 0.999), 1e-8, 0.0, 0.0, 0.0, False)
            if shard_gradients:
                raise ValueError(f"shard_gradients=True needs an optimizer with fused kernels "
                                 f"(Adam, AdamW, SGD); {generic_class.__name__} runs its own step "
                                 "on whole owned tensors with the full gradients")
        else:
            optimizer = _kind_of(optimizer)
            _check_torch_kwargs(torch_kwargs, optimizer)
            lr = explicit.get("lr", 1e-3)
            betas = explicit.get("betas", (0.9, 0.999))
            eps = explicit.get("eps", 1e-8)
            weight_decay = explicit.get("weight_decay", None)
            momentum = explicit.get("momentum", 0.0)
            dampening = explicit.get("dampening", 0.0)
            nesterov = explicit.get("nesterov", False)
        if weight_decay is None:
            weight_decay = 1e-2 if optimizer == "adamw" else 0.0
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"invalid betas {betas!r}: must be two numbers")
        for name, v in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1]), ("eps", eps),
                        ("weight_decay", weight_decay), ("momentum", momentum),
                        ("dampening", dampening), ("max_grad_norm", max_grad_norm)):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"invalid {name} {v!r}: must be a number")
            # The one rule every path shares (common/hyper_params.h).
            try:
                fv = float(v)
            except OverflowError:  # an int past float64
                fv = float("inf")
            _C.validate_hyper_parameter(name, fv)
        if not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0 (samples per rank per step), "
                             f"got {batch_size!r}")
        if module is not None and _is_ddp(module):
            raise ValueError("module is wrapped in DistributedDataParallel: shardopt reduces the "
                             "gradients itself, so DDP would all-reduce them a second time; pass "
                             "the model without the DDP wrapper (ddp_model.module)")
        if broadcast_buffers is None:
            broadcast_buffers = module is not None
        if broadcast_buffers and module is None:
            raise ValueError("broadcast_buffers needs module= (the model whose buffers rank 0 "
                             "broadcasts before each forward, as DistributedDataParallel does)")
        if not isinstance(shard_gradients, bool):
            raise ValueError(f"shard_gradients must be True or False, not {shard_gradients!r}")
        if bucket_cap_mb is None:
            bucket_cap_mb = 8.0 if shard_gradients else 25.0
        if not isinstance(bucket_cap_mb, (int, float)) or not (bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if grad_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"grad_dtype must be None, torch.float32 or torch.bfloat16, "
                             f"not {grad_dtype}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if optimizer == "torch":
            defaults = class_defaults
        elif optimizer == "sgd":
            defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, nesterov=nesterov, maximize=False,
                            foreach=None, differentiable=False)
        else:
            defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                            amsgrad=False, maximize=False, foreach=None, capturable=False,
                            differentiable=False, fused=False)
        # Normalise to groups of (names, tensors).
        if isinstance(params, (set, frozenset)):
            raise TypeError("params is a set: its order differs between processes, so ranks "
                            "would pair different tensors; pass a list (model.named_parameters())")
        params = list(params)
        if not params:
            raise ValueError("the optimizer got an empty parameter list")
        raw_groups = params if isinstance(params[0], dict) else [{"params": params}]
        # Unnamed tensors take their names in `module`, so ranks that pass
        # them in different orders are told apart (positions would match).
        module_names = ({id(p): n for n, p in module.named_parameters()}
                        if module is not None else {})
        names: List[str] = []
        tensors: List[torch.Tensor] = []
        param_group: List[int] = []
        torch_groups = []
        for g, group in enumerate(raw_groups):
            if not isinstance(group, dict) or "params" not in group:
                raise TypeError(f"parameter group {g} must be a dict with 'params'")
            for key in group:
                if key != "params" and key not in defaults:
                    raise ValueError(f"parameter group {g} has unknown option {key!r} for "
                                     f"{optimizer} (known: {', '.join(_hyper_keys(optimizer))})")
            if isinstance(group["params"], (set, frozenset)):
                raise TypeError(f"parameter group {g}'s params is a set: its order differs between "
                                "processes; pass a list")
            n, t = _split_group(group["params"], g, module_names)
            if not t:
                raise ValueError(f"parameter group {g} has no parameters")
            names += n
            tensors += t
            param_group += [g] * len(t)
            torch_groups.append(dict(group, params=t))
        seen_names = set()
        for n in names:
            if n in seen_names:
                raise ValueError(f"parameter name {n!r} appears twice")
            seen_names.add(n)
        seen = set()
        for n, t in zip(names, tensors):
            if id(t) in seen:
                raise ValueError(f"parameter {n!r} is passed twice (the same tensor)")
            seen.add(id(t))
        if any(t.is_cuda for t in tensors) and not _C.has_cuda:
            raise ValueError("parameters are on a CUDA device, but this build of shardopt has no "
                             "CUDA kernels (it was built against a CPU-only PyTorch); see the "
                             "docs/gpu.md")
        # torch.optim.Optimizer: param_groups, state, hooks; checks the groups.
        super().__init__(torch_groups, defaults)
        self._kind = optimizer
        self._param_group = param_group
        self._names = names
        self._tensors = tensors
        self._index = {n: i for i, n in enumerate(names)}
        self._context = context or init()
        elem = tensors[0].element_size() if tensors else 4
        if overlap_param_gather is None:
            overlap_param_gather = module is not None
        if overlap_param_gather and module is None:
            raise ValueError("overlap_param_gather needs module= (the model whose forward waits "
                             "for its parameters)")
        if module is not None:
            in_module = {id(p) for p in module.parameters()}
            missing = [n for n, t in zip(names, tensors) if id(t) not in in_module]
            if missing:
                raise ValueError(f"parameter {missing[0]!r} is not in `module` ({len(missing)} "
                                 "are not): pass the module that uses the parameters")
        comm = self._context._new_communicator(timeout)
        self._transport = comm.transport
        self._generic_class = generic_class
        self._local = None  # generic: the torch.optim instance over this rank's owned tensors
        if generic_class is not None:
            if checkpoint_dir is not None:
                raise ValueError(f"checkpoint_dir= (checkpoints requested by shardctl) is for the "
                                 f"fused optimizers only; save {generic_class.__name__}'s with "
                                 "opt.save_checkpoint(root) or torch.save(opt.state_dict())")
            if any(t.dtype != torch.float32 for t in tensors if t.requires_grad):
                raise ValueError(f"{generic_class.__name__} runs on the parameters themselves: "
                                 "they must be float32 (no master copy)")
        # The core's own update: SGD's lr-only kernel (never run) for a
        # generic class, whose step the core calls back instead.
        self._core = _C.Optimizer(
            comm, names, tensors, param_group, "sgd" if generic_class else optimizer,
            [self._hyper(g) for g in self.param_groups], float(max_grad_norm),
            max(1, int(bucket_cap_mb * 1024 * 1024 / elem)), grad_dtype == torch.bfloat16,
            float(timeout), int(kernel_threads), bool(overlap_param_gather), shard_gradients,
            external_update=self._external_step if generic_class else None,
            allow_cut=generic_class is None)
        if generic_class is not None:
            self._build_local(probe_kwargs)
        self._pushed = [self._hyper(g) for g in self.param_groups]
        self._initialised = True
        self._hooks = []
        self._module = module
        self._timeout = float(timeout)
        self._consolidated = None  # (step, state_dict, rank): consolidate_state_dict()
        self._broadcast_buffers = bool(broadcast_buffers)
        self._sync_enabled = True
        # DistributedDataParallel's rule: buffers are broadcast from rank 0
        # before a forward iff the previous forward ran with grad enabled
        # outside no_sync() (and once at construction).
        self._require_forward_buffer_sync = True
        if overlap_param_gather:
            self._attach(module)
        if module is not None:
            self._attach_module(module)
        self._finished = False
        ctx = self._context
        if ctx.control_plane and not ctx._agent_taken:
            # shardctl checkpoint requests write under checkpoint_dir.
            ctx._agent_taken = True
            self._core.start_agent(_hostname(), _token(), os.fspath(checkpoint_dir or ""),
                                   int(checkpoint_keep), int(batch_size), float(timeout))
            _live.add(self)
        elif ctx.control_plane:
            print("shardopt: only the first ShardedOptimizer of a process joins the control "
                  "plane", file=sys.stderr)

    # -- optimizers without fused kernels ------------------------------------
    def _build_local(self, kwargs: Dict[str, Any]) -> None:
        """The torch.optim instance over the whole tensors this rank owns
        (the planner keeps every tensor whole for such a class), one group
        per parameter group (empty where this rank owns none of it)."""
        layout = self._core.layout()
        rank = self.rank
        owned = {i for i, p in enumerate(layout["params"])
                 if p["trainable"] and any(o[0] == rank for o in p["owners"])}
        self._owned = sorted(owned)
        by_id = {id(t): i for i, t in enumerate(self._tensors)}
        groups = []
        for group in self.param_groups:
            mine = [p for p in group["params"] if by_id[id(p)] in owned]
            groups.append(dict({k: v for k, v in group.items() if k != "params"}, params=mine))
        self._local = self._generic_class(groups, **kwargs)

    def _external_step(self, mask: bytes) -> None:
        """Called by the core's step with the GIL, after the reductions (and
        clipping): the class's own step on the owned tensors, whose .grad is
        the averaged gradient; a parameter no rank has a gradient for gets
        .grad None for it, so the class skips it as torch.optim does."""
        for group, local in zip(self.param_groups, self._local.param_groups):
            for k, v in group.items():
                if k != "params":
                    local[k] = v
        hidden = []
        for i in self._owned:
            if not mask[i]:
                t = self._tensors[i]
                hidden.append((t, t.grad))
                t.grad = None
        try:
            self._local.step()
        finally:
            for t, g in hidden:
                t.grad = g

    def _global_index(self) -> Dict[int, int]:
        """id(parameter) -> its index in torch.optim's numbering (group after group)."""
        out, k = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                out[id(p)] = k
                k += 1
        return out

    def _generic_state_dict(self) -> Dict[str, Any]:
        """Every rank's owned state, exchanged (each rank's torch.save bytes
        broadcast in turn), in the class's own state_dict format."""
        import io
        index = self._global_index()
        state: Dict[int, Any] = {}
        for data in self._exchange_bytes(self._owned_state()):
            state.update(torch.load(io.BytesIO(data), weights_only=True))
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [index[id(p)] for p in group["params"]]
            groups.append(g)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _generic_load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("state", {})
        theirs_of = {}
        for theirs, ours in zip(state_dict["param_groups"], self.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    ours[k] = v
            for pid, p in zip(theirs["params"], ours["params"]):
                theirs_of[id(p)] = pid
        local_state, local_groups, k = {}, [], 0
        for theirs, local in zip(state_dict["param_groups"], self._local.param_groups):
            ids = []
            for p in local["params"]:
                if theirs_of[id(p)] in saved:
                    local_state[k] = saved[theirs_of[id(p)]]
                ids.append(k)
                k += 1
            local_groups.append(dict({key: v for key, v in theirs.items() if key != "params"},
                                     params=ids))
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_groups()

    def _attach(self, module: torch.nn.Module) -> None:
        """Forward pre-hooks: each module waits for the buckets of its own
        parameters before its forward; state_dict() waits for all."""
        ours = {id(t) for t in self._tensors}
        core = self._core
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if id(p) in ours]
            if not own:
                continue
            buckets = core.buckets_of(own)
            if buckets:
                self._hooks.append(sub.register_forward_pre_hook(
                    lambda m, inputs, b=buckets: core.wait_buckets(b)))
        self._hooks.append(module._register_state_dict_hook(
            lambda m, sd, prefix, meta: core.wait_all()))

    def _attach_module(self, module: torch.nn.Module) -> None:
        """Buffers broadcast as DDP does; module.zero_grad() as zero_grad();
        micro-batches accumulated without no_sync() as DDP accumulates them."""
        # A forward after a backward whose gradients were reduced (sync on)
        # starts another micro-batch: keep the reduced gradients aside, so
        # that step() sees their sum with the next (avg(g1) + avg(g2), DDP's).
        core = self._core
        self._hooks.append(module.register_forward_pre_hook(
            lambda m, inputs: core.fold_reduced_gradients()))
        if self._broadcast_buffers:
            self._sync_buffers()  # DDP syncs module states at construction
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, inputs: self._before_forward()))
            self._hooks.append(module.register_forward_hook(
                lambda m, inputs, output: self._after_forward()))
        # module.zero_grad() zeroes through the optimizer too (with
        # shard_gradients the gradients live in the optimizer, where
        # Module.zero_grad cannot see them).
        original = module.zero_grad

        def zero_grad(set_to_none: bool = False):
            original(set_to_none)
            core.zero_grad(set_to_none)
            core.before_step()
        zero_grad.__doc__ = original.__doc__
        module.zero_grad = zero_grad

    def _buffers(self) -> List[torch.Tensor]:
        return [b for b in self._module.buffers() if b is not None and b.numel() > 0]

    def _sync_buffers(self) -> None:
        """Rank 0's module buffers into every rank's (coalesced per dtype)."""
        if self.world_size == 1:
            return
        by_dtype: Dict[Any, List[torch.Tensor]] = {}
        for b in self._buffers():
            by_dtype.setdefault((b.dtype, b.device), []).append(b)
        with torch.no_grad():
            for bufs in by_dtype.values():
                flat = torch.cat([b.detach().reshape(-1) for b in bufs])
                self._core.broadcast(flat, 0)
                offset = 0
                for b in bufs:
                    n = b.numel()
                    b.copy_(flat[offset:offset + n].view_as(b))
                    offset += n

    def _before_forward(self) -> None:
        if self._require_forward_buffer_sync:
            self._sync_buffers()

    def _after_forward(self) -> None:
        self._require_forward_buffer_sync = torch.is_grad_enabled() and self._sync_enabled

    def wait_for_parameters(self) -> None:
        """Waits until every parameter has been all-gathered (only needed to
        read parameters outside the module's forward and state_dict when the
        gathers overlap the next forward)."""
        self._core.wait_all()

    # -- hyper-parameters -----------------------------------------------------
    def _hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        h = {}
        for k in _hyper_keys(self._kind):
            v = group[k]
            if isinstance(v, torch.Tensor):
                v = v.item()
            h[k] = tuple(float(b) for b in v) if k == "betas" else v
        return h

    def _sync_groups(self) -> None:
        """Pushes param_groups edits (LR schedulers, user code) to the core."""
        for g, group in enumerate(self.param_groups):
            h = self._hyper(group)
            if h != self._pushed[g]:
                try:
                    self._core.set_group(g, h)
                except ValueError as e:
                    raise ValueError(f"param_groups[{g}]: {e}") from None
                self._pushed[g] = h

    def _pull_groups(self) -> None:
        for g, group in enumerate(self.param_groups):
            h = self._core.group(g)
            if self._kind == "torch":
                h = {"lr": h["lr"]}
            for k, v in h.items():
                group[k] = tuple(v) if k == "betas" else v
            self._pushed[g] = self._hyper(group)

    def add_param_group(self, param_group):
        if getattr(self, "_initialised", False):
            raise NotImplementedError(
                "shardopt partitions the model when the optimizer is built: parameter groups "
                "cannot be added afterwards")
        super().add_param_group(param_group)

    # -- the step -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, loss=None) -> StepStats:
        """Waits for the gradient reduce-scatters, updates this rank's shard
        (fused kernels), all-gathers the parameters. Returns StepStats (also
        kept in `last_stats`), or with a closure its loss, as torch.optim does.

        Under shardrun, pass the step's loss (`loss=`, or a closure) so that
        heartbeats report it and a non-finite loss on any rank stops every
        rank at the same step; a learning rate set with `shardctl set-lr` is
        applied to every group at the same step on all ranks (and shows in
        param_groups); `shardctl checkpoint` writes under checkpoint_dir."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups()
        value = None
        if loss is not None:
            value = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        r = self._core.step(value)
        new_lr = r.pop("new_lr", None)
        if new_lr is not None:
            for g, group in enumerate(self.param_groups):
                group["lr"] = new_lr
                self._pushed[g] = self._hyper(group)
        self._consolidated = None
        self.last_stats = StepStats(loss=loss, **r)
        # torch.optim's contract: step(closure) returns the closure's loss.
        return loss if closure is not None else self.last_stats

    def finish(self) -> None:
        """Tells the control plane this rank finished (shardrun). Called at
        exit if the script does not."""
        if not self._finished:
            self._finished = True
            self._core.finish()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the gradients. They stay views of the flat gradient buffer
        (so .grad is a zero tensor, not None, even with set_to_none=True).
        set_to_none=True keeps torch.optim's rule for missing gradients: a
        parameter that no rank's backward reaches before the next step() is
        not updated, and its state (moments, momentum, step count) stays, as
        torch.optim skips a parameter whose .grad is None. With
        shard_gradients, drops what backward accumulated since the last step
        (parameters have no .grad then)."""
        self._core.zero_grad(set_to_none)
        self._core.before_step()  # the step's clock starts (heartbeats, slow-rank detection)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally, as
        DistributedDataParallel.no_sync() does; the next backward outside
        reduces the accumulated sum."""
        self._core.set_grad_sync(False)
        self._sync_enabled = False
        try:
            yield
        finally:
            self._core.set_grad_sync(True)
            self._sync_enabled = True

    # -- checkpoints -----------------------------------------------------------
    def save_checkpoint(self, root: str, keep: int = 0) -> str:
        """Collective. Writes ROOT/step-N (each rank its shard; crash-safe) in
        the same format as the C++ side; returns the directory. keep > 0
        prunes older checkpoints."""
        self._sync_groups()
        meta = {_META_GROUPS: json.dumps([self._hyper(g) for g in self.param_groups]),
                _META_GROUP_OF: json.dumps(self._trainable_groups())}
        if self._module is not None:
            # Rank 0's buffers (BatchNorm statistics): the ones every rank
            # gets at the next forward under broadcast_buffers.
            meta[_META_BUFFERS] = _encode_buffers(self._module)
        if self._generic_class is None:
            return self._core.save_checkpoint(os.fspath(root), meta, int(keep))
        # A class without fused kernels: each rank's state in a file of its
        # own beside its shard, written before the manifest commits them.
        self.wait_for_parameters()
        step_dir = os.path.join(os.fspath(root), f"step-{self._core.step_count}")
        mine = self._owned_state()
        name = f"optimizer-{self.rank}-of-{self.world_size}.pt"
        path = os.path.join(step_dir, name)
        # As the C++ save: a failed save removes what it wrote, and the
        # directory if it was not there before (rank 0 tells).
        created = not self._exchange_json(os.path.exists(step_dir))[0]
        error = ""
        try:
            os.makedirs(step_dir, exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(mine)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        except OSError as e:
            error = f"rank {self.rank}: writing {path}: {e}"
        files = self._exchange_json({"file": name, "bytes": len(mine),
                                     "crc32": zlib.crc32(mine), "error": error})
        errors = [f["error"] for f in files if f["error"]]
        if errors:
            self._remove_own_state(path, step_dir, created)
            raise OSError(f"save_checkpoint failed: {errors[0]}")
        meta[_META_TORCH_OPTIM] = json.dumps({
            "class": f"{self._generic_class.__module__}.{self._generic_class.__name__}",
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.param_groups],
            "files": [{k: f[k] for k in ("file", "bytes", "crc32")} for f in files]})
        try:
            return self._core.save_checkpoint(os.fspath(root), meta, int(keep))
        except Exception:
            self._remove_own_state(path, step_dir, created)
            raise

    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        """Collective. Resumes from a checkpoint directory or root (any world
        size), a consolidated .safetensors file, or a torch.save file. Restores
        parameters, state, step and hyper-parameters (into param_groups)."""
        if self._generic_class is not None and not os.path.isdir(os.fspath(path)):
            raise ValueError(f"{os.fspath(path)}: {self._generic_class.__name__}'s state is "
                             "resumed from a sharded checkpoint directory, or from a torch.save "
                             "file with opt.load_state_dict(torch.load(file)['optimizer'])")
        info = self._core.load_checkpoint(os.fspath(path))
        meta = info["metadata"]
        groups = _json_or_none(meta.get(_META_GROUPS))
        group_of = _json_or_none(meta.get(_META_GROUP_OF))
        if group_of is not None and group_of != self._trainable_groups():
            raise ValueError(f"{os.fspath(path)}: saved with {len(groups or [])} parameter groups "
                             "holding other parameters than this optimizer's: build it with the "
                             "same groups, in the same order")
        if isinstance(groups, list) and len(groups) == len(self.param_groups):
            for g, h in enumerate(groups):
                self._core.set_group(g, h)
        self._pull_groups()
        if self._generic_class is not None:
            self._load_generic_checkpoint(info, os.fspath(path))
        buffers = info["metadata"].get(_META_BUFFERS)
        if buffers is not None and self._module is not None:
            _decode_buffers(self._module, buffers, os.fspath(path))
        elif buffers is not None:
            print("shardopt: the checkpoint holds module buffers; pass module= to restore them",
                  file=sys.stderr)
        self._consolidated = None
        return info

    def _remove_own_state(self, path: str, step_dir: str, created: bool) -> None:
        """After a failed save: this rank's state file, and where the save made
        the directory, what the C++ save of this rank left too."""
        try:  # committed after all (LATEST names it): it is complete, keep it
            with open(os.path.join(os.path.dirname(step_dir), "LATEST")) as f:
                if f.read().strip() == os.path.basename(step_dir):
                    return
        except OSError:
            pass
        doomed = [path, path + ".tmp"]
        if created:
            shard = os.path.join(step_dir, f"shard-{self.rank}-of-{self.world_size}.safetensors")
            doomed += [shard, shard + ".tmp"]
            if self.rank == 0:
                manifest = os.path.join(step_dir, "manifest.json")
                doomed += [manifest, manifest + ".tmp"]
        for p in doomed:
            try:
                os.remove(p)
            except OSError:
                pass
        if created:
            try:
                os.rmdir(step_dir)  # the last rank to get here
            except OSError:
                pass

    def _owned_state(self) -> bytes:
        """This rank's state of the class, keyed by torch.optim's index, as bytes."""
        import io
        index = self._global_index()
        local = self._local.state_dict()
        order = [p for g in self._local.param_groups for p in g["params"]]
        buf = io.BytesIO()
        torch.save({index[id(order[k])]: st for k, st in local["state"].items()}, buf)
        return buf.getvalue()

    def _exchange_bytes(self, data: bytes) -> List[bytes]:
        """Every rank's bytes on every rank (each rank's broadcast in turn)."""
        out = []
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.empty(0, dtype=torch.uint8)
        for r in range(self.world_size):
            n = torch.tensor([mine.numel() if r == self.rank else 0], dtype=torch.int64)
            self._core.broadcast(n, r)
            payload = mine if r == self.rank else torch.empty(int(n.item()), dtype=torch.uint8)
            if payload.numel() > 0:
                self._core.broadcast(payload, r)
            out.append(payload.numpy().tobytes())
        return out

    def _exchange_json(self, value) -> List[Any]:
        return [json.loads(b.decode()) for b in self._exchange_bytes(json.dumps(value).encode())]

    def _load_generic_checkpoint(self, info: Dict[str, Any], where: str) -> None:
        """The class's state from every rank's file of a sharded checkpoint
        (any world size: each rank takes what it owns now)."""
        import io
        raw = info["metadata"].get(_META_TORCH_OPTIM)
        cls = f"{self._generic_class.__module__}.{self._generic_class.__name__}"
        saved = _json_or_none(raw)
        if not isinstance(saved, dict) or not isinstance(saved.get("files"), list):
            raise ValueError(f"{where}: holds no state of {cls} (saved by another optimizer, or "
                             "not by the Python API): build the optimizer the checkpoint was "
                             "saved with")
        if saved.get("class") != cls:
            raise ValueError(f"{where}: saved by {saved.get('class')}, this optimizer is {cls}")
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError(f"{where}: saved with other parameter groups than this optimizer's")
        state: Dict[int, Any] = {}
        for f in saved["files"]:
            name = str(f.get("file", ""))
            if not name.startswith("optimizer-") or "/" in name or not name.endswith(".pt"):
                raise ValueError(f"{where}: a bad optimizer file name {name!r}")
            path = os.path.join(info["path"], name)
            with open(path, "rb") as fh:
                data = fh.read(int(f["bytes"]) + 1)
            if len(data) != f["bytes"] or zlib.crc32(data) != f["crc32"]:
                raise ValueError(f"{path}: corrupt (size or CRC-32 differs from the manifest's)")
            # weights_only: tensors and plain values, never code.
            part = torch.load(io.BytesIO(data), weights_only=True)
            if not isinstance(part, dict):
                raise ValueError(f"{path}: not an optimizer state")
            state.update(part)
        index = 0
        param_groups = []
        for g, group in zip(groups, self.param_groups):
            ids = list(range(index, index + len(group["params"])))
            index += len(ids)
            param_groups.append(dict(g, params=ids))
        self._generic_load_state_dict({"state": state, "param_groups": param_groups})

    _JOIN_TIMEOUT = 30.0  # seconds every rank has to reach a collective state_dict call

    def _join(self, what: str) -> None:
        """Fails within seconds, naming the ranks that did not come, when a
        collective call is made on some ranks only (`if rank == 0:
        opt.state_dict()`), where torch.distributed's gloo group can tell."""
        if self.world_size == 1:
            return
        # Shorter than the collective timeout, so that the ranks that did call
        # it report this, not the collective the other ranks then wait in.
        wait = min(self._timeout * 0.5, self._JOIN_TIMEOUT)
        if _torch_world() != self.world_size or _torch_backend() != "gloo":
            # Under shardrun: through the coordinator's key-value store.
            self._join_seq = getattr(self, "_join_seq", 0) + 1
            missing = self._core.join(what.split("(")[0], self._join_seq, wait)
            if missing:
                raise RuntimeError(
                    f"{what} is collective: every rank must call it at the same point, and "
                    f"rank(s) {', '.join(map(str, missing))} did not within {wait:.0f} s. To save "
                    "on one rank: call opt.consolidate_state_dict(to=0) on every rank, then "
                    "opt.state_dict() on rank 0 only (or save_checkpoint() on every rank)")
            return
        import datetime
        import torch.distributed as dist
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=wait), wait_all_ranks=True)
        except RuntimeError as e:
            raise RuntimeError(
                f"{what} is collective: every rank must call it at the same point, and not all "
                f"did within {wait:.0f} s ({str(e).strip().splitlines()[0]}). To save on one "
                "rank: call opt.consolidate_state_dict(to=0) on every rank, then "
                "opt.state_dict() on rank 0 only (or save_checkpoint() on every rank)") from None

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective (fairscale OSS / ZeroRedundancyOptimizer API): gathers
        the whole state on rank `to`, whose state_dict() then returns it
        without communicating, until the next step."""
        if not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(f"to={to!r} is not a rank of this job (world size {self.world_size})")
        self._join("consolidate_state_dict()")
        sd = self._full_state_dict()
        self._consolidated = (self._core.step_count, sd if self.rank == to else None, to)

    def _trainable_groups(self) -> List[int]:
        """The group of each trainable parameter, in the layout's order."""
        return [g for g, t in zip(self._param_group, self._tensors) if t.requires_grad]

    def state_dict(self) -> Dict[str, Any]:
        """The whole state in torch.optim's format (as torch.optim.AdamW /
        SGD's state_dict() of the same model): a fresh torch optimizer can
        load it, and load_state_dict takes theirs. Collective (every rank
        calls it), unless consolidate_state_dict(to=R) ran since the last
        step: then rank R gets the consolidated state and the others an error."""
        if self._consolidated is not None and self._consolidated[0] == self._core.step_count:
            _, sd, to = self._consolidated
            if self.rank == to:
                return sd
            raise RuntimeError(f"the state was consolidated on rank {to} "
                               f"(consolidate_state_dict(to={to})): call state_dict() there")
        self._join("state_dict()")
        return self._full_state_dict()

    def _full_state_dict(self) -> Dict[str, Any]:
        self._sync_groups()
        if self._generic_class is not None:
            return self._generic_state_dict()
        full = self._core.full_state()
        step = self._core.step_count
        state = {}
        index = 0
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            ids = []
            for p in group["params"]:
                name = self._names[index]
                # torch.optim keeps no state for a parameter it never updated
                # (no gradient yet), and a step count per parameter.
                if name in full and full[name]["step"] > 0:
                    s = full[name]
                    if self._kind == "sgd":
                        state[index] = {"momentum_buffer": s.get("momentum_buffer")}
                    else:
                        state[index] = {"step": torch.tensor(float(s["step"])),
                                        "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
                ids.append(index)
                index += 1
            g["params"] = ids
            groups.append(g)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Collective. Takes a state_dict of this class or of torch.optim's
        Adam / AdamW / SGD for the same parameters (same group sizes)."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError("not an optimizer state_dict (no 'param_groups')")
        self._consolidated = None
        self._join("load_state_dict()")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state_dict has {len(groups)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for g, (theirs, ours) in enumerate(zip(groups, self.param_groups)):
            if len(theirs["params"]) != len(ours["params"]):
                raise ValueError(f"parameter group {g} has {len(theirs['params'])} parameters in "
                                 f"the state_dict, {len(ours['params'])} here")
        if self._generic_class is not None:
            self._generic_load_state_dict(state_dict)
            return
        saved = state_dict.get("state", {})
        wanted = ["momentum_buffer"] if self._kind == "sgd" else ["exp_avg", "exp_avg_sq"]
        full: Dict[str, Dict[str, torch.Tensor]] = {}
        counts: Dict[str, int] = {}  # per-parameter state['step'] (0: no state)
        step = 0
        index = 0
        for theirs, ours in zip(groups, self.param_groups):
            for pid, p in zip(theirs["params"], ours["params"]):
                name = self._names[index]
                index += 1
                if not p.requires_grad:
                    continue
                s = saved.get(pid, {})
                entry = {}
                for k in wanted:
                    t = s.get(k)
                    entry[k] = t if t is not None else torch.zeros(p.shape, dtype=torch.float32)
                full[name] = entry
                counts[name] = 0
                if "step" in s:
                    st = s["step"]
                    counts[name] = int(st.item() if isinstance(st, torch.Tensor) else st)
                    step = max(step, counts[name])
        if self._kind == "sgd" and saved:
            step = max(step, self._core.step_count, 1)
            counts = {}  # torch's SGD keeps no count
        self._core.load_state(full, step, {n: c for n, c in counts.items() if c != step})
        for g, (theirs, ours) in enumerate(zip(groups, self.param_groups)):
            for k in _hyper_keys(self._kind):
                if k in theirs:
                    ours[k] = tuple(theirs[k]) if k == "betas" else theirs[k]
        self._sync_groups()

    # -- what the job looks like --------------------------------------------
    @property
    def layout(self) -> Dict[str, Any]:
        """Who owns what: world size, layout hash, buckets, and for every
        parameter its bucket and (rank, first element, elements) pieces."""
        return self._core.layout()

    def memory(self) -> Dict[str, int]:
        """Bytes this rank holds, by role (master, state, grad, param)."""
        return self._core.memory()

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def transport(self) -> str:
        """The transport in use: "shm", "gloo", or "none" (one rank, no launcher)."""
        return self._transport

    def __repr__(self) -> str:
        kind = self._generic_class.__name__ if self._generic_class is not None else self._kind
        return (f"shardopt.ShardedOptimizer({kind}, {len(self._names)} parameters, "
                f"{len(self.param_groups)} groups, rank {self.rank} of {self.world_size})")


# Ranks in the control plane say at exit whether they finished or failed.
import atexit
import weakref

_live = weakref.WeakSet()
_previous_excepthook = sys.excepthook


def _excepthook(kind, value, tb):
    for opt in list(_live):
        if not opt._finished:
            opt._finished = True
            opt._core.fail(f"{kind.__name__}: {value}")
    _previous_excepthook(kind, value, tb)


def _at_exit():
    for opt in list(_live):
        opt.finish()


sys.excepthook = _excepthook
atexit.register(_at_exit)
