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

See the README's "Python" section.
"""

import contextlib
import json
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
_META_GROUPS = "shardopt.param_groups"


@dataclass
class Context:
    """How this process takes part in the job (see init())."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "shardrun", "torchrun" or "single"
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
    how glibc's heap happened to split (the README's "Allocator": it helps
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
        return _context
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
    local_rank = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    launcher = "single"
    if world > 1 or "MASTER_PORT" in os.environ:
        launcher = "shardrun" if os.environ.get("SHARDOPT_COORDINATOR") else "torchrun"
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
    if launcher == "torchrun" and rank == 0:
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


def _split_group(params, g: int) -> Tuple[List[str], List[torch.Tensor]]:
    names, tensors = [], []
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of (name, tensor) pairs or of tensors, "
                        "not a single tensor")
    for i, x in enumerate(params):
        if _is_named_pair(x):
            names.append(x[0])
            tensors.append(x[1])
        elif isinstance(x, torch.Tensor):
            names.append(f"group{g}.param{i}")
            tensors.append(x)
        else:
            raise TypeError(f"parameter {i} of group {g} is a {type(x).__name__}: expected a "
                            "(name, tensor) pair or a tensor")
    return names, tensors


def _hyper_keys(kind: str) -> Tuple[str, ...]:
    if kind == "sgd":
        return ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    return ("lr", "betas", "eps", "weight_decay")


class ShardedOptimizer(Optimizer):
    """torch.optim.Adam / AdamW / SGD with the state sharded over the ranks.

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

    def __init__(self, params, optimizer: str = "adamw", lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: Optional[float] = None, momentum: float = 0.0,
                 dampening: float = 0.0, nesterov: bool = False, max_grad_norm: float = 0.0,
                 bucket_cap_mb: Optional[float] = None, grad_dtype: Optional[torch.dtype] = None,
                 timeout: float = 300.0, kernel_threads: int = 1,
                 checkpoint_dir: Optional[str] = None, checkpoint_keep: int = 0,
                 module: Optional[torch.nn.Module] = None,
                 overlap_param_gather: Optional[bool] = None,
                 shard_gradients: bool = False,
                 context: Optional[Context] = None):
        if optimizer not in _KINDS:
            raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {', '.join(_KINDS)}")
        if weight_decay is None:
            weight_decay = 1e-2 if optimizer == "adamw" else 0.0
        for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                        ("momentum", momentum), ("max_grad_norm", max_grad_norm)):
            if not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"invalid {name} {v!r}: must be >= 0 and finite")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"invalid betas {betas!r}: each must be in [0, 1)")
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
        if optimizer == "sgd":
            defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, nesterov=nesterov, maximize=False,
                            foreach=None, differentiable=False)
        else:
            defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                            amsgrad=False, maximize=False, foreach=None, capturable=False,
                            differentiable=False, fused=False)
        # Normalise to groups of (names, tensors).
        params = list(params)
        if not params:
            raise ValueError("the optimizer got an empty parameter list")
        raw_groups = params if isinstance(params[0], dict) else [{"params": params}]
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
            n, t = _split_group(group["params"], g)
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
                             "README's GPU section")
        # torch.optim.Optimizer: param_groups, state, hooks; checks the groups.
        super().__init__(torch_groups, defaults)
        self._kind = optimizer
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
        self._core = _C.Optimizer(
            comm, names, tensors, param_group, optimizer,
            [self._hyper(g) for g in self.param_groups], float(max_grad_norm),
            max(1, int(bucket_cap_mb * 1024 * 1024 / elem)), grad_dtype == torch.bfloat16,
            float(timeout), int(kernel_threads), bool(overlap_param_gather), shard_gradients)
        self._pushed = [self._hyper(g) for g in self.param_groups]
        self._initialised = True
        self._hooks = []
        if overlap_param_gather:
            self._attach(module)
        self._finished = False
        ctx = self._context
        if ctx.control_plane and not ctx._agent_taken:
            # shardctl checkpoint requests write under checkpoint_dir.
            ctx._agent_taken = True
            self._core.start_agent(_hostname(), _token(), os.fspath(checkpoint_dir or ""),
                                   int(checkpoint_keep), 0, float(timeout))
            _live.add(self)
        elif ctx.control_plane:
            print("shardopt: only the first ShardedOptimizer of a process joins the control "
                  "plane", file=sys.stderr)

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
        (fused kernels), all-gathers the parameters. Returns StepStats.

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
        return StepStats(loss=loss, **r)

    def finish(self) -> None:
        """Tells the control plane this rank finished (shardrun). Called at
        exit if the script does not."""
        if not self._finished:
            self._finished = True
            self._core.finish()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the gradients. They stay views of the flat gradient buffer
        (set_to_none is accepted and ignored: None gradients would detach
        them). With shard_gradients, drops what backward accumulated since
        the last step (parameters have no .grad then)."""
        self._core.zero_grad()
        self._core.before_step()  # the step's clock starts (heartbeats, slow-rank detection)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally, as
        DistributedDataParallel.no_sync() does; the next backward outside
        reduces the accumulated sum."""
        self._core.set_grad_sync(False)
        try:
            yield
        finally:
            self._core.set_grad_sync(True)

    # -- checkpoints -----------------------------------------------------------
    def save_checkpoint(self, root: str, keep: int = 0) -> str:
        """Collective. Writes ROOT/step-N (each rank its shard; crash-safe) in
        the same format as the C++ side; returns the directory. keep > 0
        prunes older checkpoints."""
        self._sync_groups()
        meta = {_META_GROUPS: json.dumps([self._hyper(g) for g in self.param_groups])}
        return self._core.save_checkpoint(os.fspath(root), meta, int(keep))

    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        """Collective. Resumes from a checkpoint directory or root (any world
        size), a consolidated .safetensors file, or a torch.save file. Restores
        parameters, state, step and hyper-parameters (into param_groups)."""
        info = self._core.load_checkpoint(os.fspath(path))
        saved = info["metadata"].get(_META_GROUPS)
        groups = None
        if saved is not None:
            try:
                groups = json.loads(saved)
            except ValueError:
                groups = None
        if isinstance(groups, list) and len(groups) == len(self.param_groups):
            for g, h in enumerate(groups):
                self._core.set_group(g, h)
        self._pull_groups()
        return info

    def state_dict(self) -> Dict[str, Any]:
        """Collective. The whole state in torch.optim's format (as
        torch.optim.AdamW / SGD's state_dict() of the same model): a fresh
        torch optimizer can load it, and load_state_dict takes theirs."""
        self._sync_groups()
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
                if step > 0 and name in full:
                    s = full[name]
                    if self._kind == "sgd":
                        state[index] = {"momentum_buffer": s.get("momentum_buffer")}
                    else:
                        state[index] = {"step": torch.tensor(float(step)),
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
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state_dict has {len(groups)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for g, (theirs, ours) in enumerate(zip(groups, self.param_groups)):
            if len(theirs["params"]) != len(ours["params"]):
                raise ValueError(f"parameter group {g} has {len(theirs['params'])} parameters in "
                                 f"the state_dict, {len(ours['params'])} here")
        saved = state_dict.get("state", {})
        wanted = ["momentum_buffer"] if self._kind == "sgd" else ["exp_avg", "exp_avg_sq"]
        full: Dict[str, Dict[str, torch.Tensor]] = {}
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
                if "step" in s:
                    st = s["step"]
                    step = max(step, int(st.item() if isinstance(st, torch.Tensor) else st))
        if self._kind == "sgd" and saved:
            step = max(step, self._core.step_count, 1)
        self._core.load_state(full, step)
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
        return (f"shardopt.ShardedOptimizer({self._kind}, {len(self._names)} parameters, "
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
