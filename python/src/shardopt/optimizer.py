"""ShardedOptimizer (a torch.optim.Optimizer with its state sharded over
the ranks) and StepStats, what one step did."""

import collections
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer

from . import _C  # the C++ core (built against this torch)
from ._exit import _live
from ._launch import Context, _hostname, _join_epoch, _tls, _token, _torch_world, init
from ._options import (_UNSET, _WRAPPER_KWARGS, _check_torch_kwargs, _hyper_keys, _is_ddp,
                       _is_generic, _kind_of, _split_group)
from ._state import _StateMixin


@dataclass
class ResizeEvent:
    """A live resize of an elastic job (docs/elastic.md): after step `step`
    the job went from `from_world` to `to_world` ranks (membership epoch
    `epoch`); this rank was `previous_rank` (-1: it joined then) and is
    `rank` now. `seconds`: how long the resize took on this rank;
    `moved_bytes`: the optimizer state that crossed between ranks (summed
    over them), `least_bytes`: the slices that changed owner (the least any
    resize must move)."""

    step: int
    epoch: int
    from_world: int
    to_world: int
    previous_rank: int
    rank: int
    seconds: float
    moved_bytes: int = 0
    least_bytes: int = 0


@dataclass
class StepStats:
    """What one step did. `loss` is the closure's result, if one was given;
    `resize` the live resize made after this step (elastic=True), else None."""

    step: int
    grad_norm: float
    clipped: bool
    comm_wait_seconds: float
    update_seconds: float
    loss: Any = None
    resize: Optional[ResizeEvent] = None


# state_dict, load_state_dict, consolidate_state_dict and the checkpoints are
# _StateMixin's (_state.py).
class ShardedOptimizer(_StateMixin, Optimizer):
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

    `advise=True` (every rank alike: it measures the link collectively at
    construction): after the fourth step, rank 0 prints what the partition
    advisor predicts for this run against DDP and OSS, and its
    recommendation (docs/advisor.md), from the run's own forward + backward
    (zero_grad() to step()) and update times.

    `elastic=True` (under shardrun; docs/elastic.md): the job can change its
    number of ranks while it trains (`shardctl resize --ranks=M`,
    `shardctl drain --rank=R`). After the step the ranks agree on, the
    optimizer state moves to the new ranks directly, step() returns with
    `opt.rank` and `opt.world_size` changed and `StepStats.resize` set, and
    the functions given to `opt.on_resize(fn)` run (rebuild the data sampler
    there). A rank that leaves exits inside step() (SystemExit(0)) once the
    others hold its state. A rank that shardrun starts to grow the job
    builds its model and optimizer as the first ranks did; its optimizer
    takes the job's state and step (`opt.step_count`, `opt.last_resize`),
    and the script trains on from there. The fused optimizers only; the
    script's own torch.distributed group cannot change size, so it must not
    have one.
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
                 advise: bool = False,
                 elastic: bool = False,
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
        if not isinstance(advise, bool):
            raise ValueError(f"advise must be True or False, got {advise!r}")
        if not isinstance(elastic, bool):
            raise ValueError(f"elastic must be True or False, got {elastic!r}")
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
        self._check_fixed_keys()  # a group's own amsgrad=True, ...: refused, not ignored
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
        ctx = self._context
        join_epoch = _join_epoch() if ctx.control_plane and not ctx._agent_taken else 0
        self._check_elastic(elastic, join_epoch, generic_class)
        if (ctx.control_plane and not ctx._agent_taken and ctx.rank == 0
                and os.environ.get("SHARDOPT_REPLICATE_EVERY")):
            # shardrun --replicate-shards: only shardopt_train keeps replicas.
            print("shardopt: shardrun --replicate-shards: Python ranks keep no in-memory replicas "
                  "(only shardopt_train does; docs/elastic.md): a lost rank fails the job, or "
                  "restarts it from the last checkpoint with --max-restarts", file=sys.stderr,
                  flush=True)
        ticket = None
        if join_epoch > 0:
            # Started by shardrun to grow the running job: the ranks there go
            # on training until every new rank is ready, then hand over
            # their state.
            ticket = _C.await_join(os.environ["SHARDOPT_COORDINATOR"], _token(), *_tls(),
                                   join_epoch, ctx.rank, ctx.world_size,
                                   sum(t.numel() for t in tensors), float(timeout))
            if ticket is None:
                print(f"shardopt: rank {ctx.rank}: the job finished before it could grow to "
                      f"{ctx.world_size} ranks; this rank is not needed", file=sys.stderr,
                      flush=True)
                raise SystemExit(0)
            if advise:
                print("shardopt: advise=True is ignored on a rank that joins a running job",
                      file=sys.stderr)
                advise = False
        comm, self._comm_index = ctx._new_communicator(timeout, epoch=join_epoch)
        self._transport = comm.transport
        self._elastic = elastic
        self._resize_hooks: Dict[int, Any] = collections.OrderedDict()  # (RemovableHandle's)
        self.last_resize: Optional[ResizeEvent] = None
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
        args = _C.OptimizerArgs()
        args.param_group = param_group
        args.kind = "sgd" if generic_class else optimizer
        args.groups = [self._hyper(g) for g in self.param_groups]
        args.max_grad_norm = float(max_grad_norm)
        args.bucket_cap_elements = max(1, int(bucket_cap_mb * 1024 * 1024 / elem))
        args.grad_bf16 = grad_dtype == torch.bfloat16
        args.timeout_s = float(timeout)
        args.kernel_threads = int(kernel_threads)
        args.overlap_param_gather = bool(overlap_param_gather)
        args.shard_gradients = shard_gradients
        args.external_update = self._external_step if generic_class else None
        args.allow_cut = generic_class is None
        args.broadcast_initial_values = ticket is None
        self._core = _C.Optimizer(comm, names, tensors, args)
        # advise=True: [steps seen, best forward + backward, best update, zero_grad's time]
        self._advice = None
        if advise:
            self._core.measure_link()
            self._advice = [0, float("inf"), float("inf"), None]
        if generic_class is not None:
            self._build_local(probe_kwargs)
        self._pushed = [self._hyper(g) for g in self.param_groups]
        self._initialised = True
        self._hooks = []
        self._bucket_hooks = []  # _attach's (bucket numbers change with a resize)
        self._overlap = bool(overlap_param_gather)
        self._module = module
        self._timeout = float(timeout)
        self._consolidated = None  # (step, state_dict, rank): consolidate_state_dict()
        self._broadcast_buffers = bool(broadcast_buffers)
        self._sync_enabled = True
        # DistributedDataParallel's rule: buffers are broadcast from rank 0
        # before a forward iff the previous forward ran with grad enabled
        # outside no_sync() (and once at construction).
        self._require_forward_buffer_sync = True
        self._finished = False
        if ticket is not None:
            # Collective with the ranks already there (their step()).
            ctx._agent_taken = True
            _live.add(self)
            j = self._core.join_running(ticket, _hostname(), _token(),
                                        os.fspath(checkpoint_dir or ""), int(checkpoint_keep),
                                        int(batch_size), float(timeout))
            self.last_resize = ResizeEvent(
                step=j["step"], epoch=j["epoch"], from_world=j["from_world"],
                to_world=j["to_world"], previous_rank=-1, rank=j["rank"], seconds=j["seconds"])
            self._pull_groups()  # the job's hyper-parameters (set-lr, schedulers) as loaded
            print(f"shardopt: rank {j['rank']} joined the job at step {j['step']} (epoch "
                  f"{j['epoch']}, {j['to_world']} ranks)", file=sys.stderr, flush=True)
        if overlap_param_gather:
            self._attach(module)
        if module is not None:
            # A rank that joins takes the buffers of rank 0, as the ranks
            # that stay do after a resize.
            self._attach_module(module, sync_now=self._broadcast_buffers or ticket is not None)
        if ticket is not None:
            # Collective with the ranks already there (their _after_resize).
            self._share_group_extras(join=True)
        if ticket is None and ctx.control_plane and not ctx._agent_taken:
            # shardctl checkpoint requests write under checkpoint_dir.
            ctx._agent_taken = True
            self._core.start_agent(_hostname(), _token(), os.fspath(checkpoint_dir or ""),
                                   int(checkpoint_keep), int(batch_size), float(timeout),
                                   ctx._coordinator_rank, elastic)
            _live.add(self)
        elif ticket is None and ctx.control_plane:
            print("shardopt: only the first ShardedOptimizer of a process joins the control "
                  "plane", file=sys.stderr)

    # -- elastic jobs ---------------------------------------------------------
    def _check_elastic(self, elastic: bool, join_epoch: int, generic_class) -> None:
        ctx = self._context
        if join_epoch > 0 and not elastic:
            raise ValueError(f"this rank was started to join a running job (membership epoch "
                             f"{join_epoch}), but its ShardedOptimizer is not elastic=True")
        if not elastic:
            return
        if not ctx.control_plane:
            raise ValueError(f"elastic=True needs a shardopt coordinator (launch with shardrun); "
                             f"this process was launched by {ctx.launcher}")
        if ctx._agent_taken:
            raise ValueError("elastic=True is for the first ShardedOptimizer of a process (the "
                             "one that joins the control plane)")
        if generic_class is not None:
            raise ValueError(f"elastic=True needs a fused optimizer (Adam, AdamW, SGD): "
                             f"{generic_class.__name__}'s state lives in Python and cannot move "
                             "between ranks live")
        if _torch_world() > 0:
            raise ValueError("elastic=True: this process has a torch.distributed process group, "
                             "whose size cannot change while it runs; an elastic script leaves "
                             "the collectives to shardopt")

    def on_resize(self, fn):
        """Registers fn(opt, event: ResizeEvent), called on every rank that
        stays after a live resize (elastic=True), when the state has moved
        and opt.rank / opt.world_size are the new ones: rebuild the data
        sampler, rescale the learning rate or batch there. A rank that joins
        reads the same values at construction (opt.last_resize). Returns a
        handle whose remove() unregisters fn."""
        if not callable(fn):
            raise TypeError(f"on_resize needs a callable, not {type(fn).__name__}")
        import torch.utils.hooks
        handle = torch.utils.hooks.RemovableHandle(self._resize_hooks)
        self._resize_hooks[handle.id] = fn
        return handle

    def drain(self) -> bool:
        """elastic=True: asks the job to go on without this rank. At the next
        step boundary the ranks agree on, this rank hands its state over and
        its step() exits the process with status 0 (as `shardctl drain
        --rank=R`). Safe in a signal handler, for a SIGTERM that should drain
        (a preempted node):

            signal.signal(signal.SIGTERM, lambda *_: opt.drain() or sys.exit(143))

        Returns True when the coordinator accepted; False, saying why on
        stderr, when it refused (the last rank, a resize already under way,
        a job that is not running)."""
        why = self._core.request_drain()
        if why:
            print(f"shardopt: rank {self.rank} cannot drain: {why}", file=sys.stderr, flush=True)
            return False
        print(f"shardopt: rank {self.rank} leaves the job at the next step boundary",
              file=sys.stderr, flush=True)
        return True

    def _share_group_extras(self, join: bool) -> None:
        """Collective, after a live resize: a rank that joined takes rank 0's
        param_groups keys beyond the hyper-parameters (a scheduler's
        initial_lr: LambdaLR(opt, f, last_epoch=opt.step_count - 1) then
        resumes as it does after load_checkpoint)."""
        if self.world_size == 1:
            return
        extras = self._exchange_json(self._group_extras() if self.rank == 0 else None)[0]
        if join:
            self._set_group_extras(extras, "rank 0's param_groups")

    def _after_resize(self, info: Dict[str, Any]) -> ResizeEvent:
        """The rest of a live resize agreed after this step (the core has
        taken this rank's snapshot): leave, or move to the new epoch."""
        step, epoch = info["step"], info["epoch"]
        if info["rank"] < 0:
            self._finished = True  # the job goes on without this rank
            print(f"shardopt: rank {info['previous_rank']} left the job after step {step}: "
                  f"{info['bytes_served'] / 2**20:.1f} MiB of its state was read by the "
                  "others", file=sys.stderr, flush=True)
            raise SystemExit(0)
        ctx = self._context
        ctx.rank, ctx.world_size = info["rank"], info["to_world"]
        ctx.local_rank = ctx.rank if ctx.launcher == "shardrun" else ctx.local_rank
        for var, v in (("RANK", ctx.rank), ("WORLD_SIZE", ctx.world_size)):
            if var in os.environ:
                os.environ[var] = str(v)
        comm, _ = ctx._new_communicator(self._timeout, epoch=epoch, index=self._comm_index)
        done = self._core.complete_resize(comm)
        self._transport = comm.transport
        # Bucket numbers and owners are the new layout's.
        for h in self._bucket_hooks:
            h.remove()
        self._bucket_hooks = []
        if self._module is not None and self._overlap:
            self._attach(self._module)
        if self._module is not None:
            self._sync_buffers()  # rank 0's buffers, as a rank that joins takes them
        self._join_seq = 0
        self._pull_groups()
        self._share_group_extras(join=False)
        event = ResizeEvent(step=step, epoch=epoch, from_world=info["from_world"],
                            to_world=info["to_world"], previous_rank=info["previous_rank"],
                            rank=info["rank"], seconds=done["seconds"],
                            moved_bytes=int(done["moved_mib"] * 2**20),
                            least_bytes=int(done["least_mib"] * 2**20))
        self.last_resize = event
        if self.rank == 0:
            print(f"shardopt: resized {event.from_world} -> {event.to_world} ranks after step "
                  f"{step} in {done['seconds']:.2f} s (epoch {epoch}; snapshot "
                  f"{done['snapshot_seconds']:.2f} s, new epoch formed {done['form_seconds']:.2f} "
                  f"s, state loaded {done['load_seconds']:.2f} s): moved {done['moved_mib']:.1f} "
                  f"MiB between ranks (the slices that changed owner: {done['least_mib']:.1f} "
                  "MiB)", file=sys.stderr, flush=True)
        for fn in list(self._resize_hooks.values()):
            fn(self, event)
        return event

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
                self._bucket_hooks.append(sub.register_forward_pre_hook(
                    lambda m, inputs, b=buckets: core.wait_buckets(b)))
        self._hooks.append(module._register_state_dict_hook(
            lambda m, sd, prefix, meta: core.wait_all()))

    def _attach_module(self, module: torch.nn.Module, sync_now: bool) -> None:
        """Buffers broadcast as DDP does; module.zero_grad() as zero_grad();
        micro-batches accumulated without no_sync() as DDP accumulates them."""
        # A forward after a backward whose gradients were reduced (sync on)
        # starts another micro-batch: keep the reduced gradients aside, so
        # that step() sees their sum with the next (avg(g1) + avg(g2), DDP's).
        core = self._core
        self._hooks.append(module.register_forward_pre_hook(
            lambda m, inputs: core.fold_reduced_gradients()))
        if sync_now:
            self._sync_buffers()  # DDP syncs module states at construction
        if self._broadcast_buffers:
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
        self._check_fixed_keys()
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
        t_step = time.perf_counter()
        r = self._core.step(value)
        new_lr = r.pop("new_lr", None)
        if new_lr is not None:
            for g, group in enumerate(self.param_groups):
                group["lr"] = new_lr
                self._pushed[g] = self._hyper(group)
        self._consolidated = None
        resize = r.pop("resize", None)
        self.last_stats = StepStats(loss=loss, **r)
        if resize is not None:
            self.last_stats.resize = self._after_resize(resize)
        if self._advice is not None:
            self._advise_after_step(t_step, r)
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
        if self._advice is not None:
            self._advice[3] = time.perf_counter()

    def _advise_after_step(self, t_step, r) -> None:
        """advise=True: the run's best forward + backward and update over steps 2-4, then
        the advisor's lines (rank 0)."""
        a = self._advice
        a[0] += 1
        if a[0] >= 2 and a[3] is not None:  # (the first step warms up)
            a[1] = min(a[1], t_step - a[3])
            a[2] = min(a[2], r.get("update_seconds", 0.0))
        if a[0] == 4:
            if self._core.rank == 0 and a[1] != float("inf"):
                print(self._core.advice_lines(a[1], a[2]), flush=True)
            self._advice = None

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
    def step_count(self) -> int:
        """Steps the optimizer state has taken: 0 at first, the checkpoint's
        after load_checkpoint, the job's on a rank that joined it live."""
        return self._core.step_count

    @property
    def epoch(self) -> int:
        """The job's membership epoch (0 until its first live resize)."""
        return self._core.epoch

    @property
    def transport(self) -> str:
        """The transport in use: "shm", "gloo", or "none" (one rank, no launcher)."""
        return self._transport

    def __repr__(self) -> str:
        kind = self._generic_class.__name__ if self._generic_class is not None else self._kind
        return (f"shardopt.ShardedOptimizer({kind}, {len(self._names)} parameters, "
                f"{len(self.param_groups)} groups, rank {self.rank} of {self.world_size})")
