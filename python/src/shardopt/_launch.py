"""Joining the job: init(), the Context it returns (launcher, rank, world
size, transport, control plane) and the environment it reads (shardrun's
coordinator, torchrun's variables, a process group the script made)."""

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from . import _C  # the C++ core (built against this torch)


@dataclass
class Context:
    """How this process takes part in the job (see init())."""

    rank: int
    world_size: int
    local_rank: int
    # "shardrun", "slurm" (srun), "kubernetes" (an Indexed Job), "torchrun",
    # "torch.distributed" (a process group the script made) or "single"
    launcher: str
    control_plane: bool
    job_id: str = ""
    # How ranks exchange gradients and parameters: "auto" (shared memory when
    # every rank is on one host, else Gloo over TCP), "gloo" or "shm".
    transport: str = "auto"
    # How many times shardrun --max-restarts has started this job again
    # ($SHARDOPT_RESTART; 0 the first time): resume from the last checkpoint.
    restart: int = 0
    # The rank whose process serves the coordinator (0 under srun or an
    # Indexed Job), -1 for shardrun's own process.
    _coordinator_rank: int = field(repr=False, default=-1)
    _prefixes: int = field(repr=False, default=0)
    _agent_taken: bool = field(repr=False, default=False)

    def __post_init__(self):
        self.restart = _env_int("SHARDOPT_RESTART", 0)
        if self.restart < 0:
            raise ValueError(f"environment variable SHARDOPT_RESTART={self.restart} must be >= 0")

    def _new_communicator(self, timeout: float, epoch: int = 0, index: int = 0):
        """One communicator per optimizer (its own rendezvous keys: the
        optimizer's index in the process, and each membership epoch of an
        elastic job apart). Returns (communicator, index)."""
        if index == 0:
            self._prefixes += 1
            index = self._prefixes
        prefix = f"shardopt-py/{index}" + (f"/epoch-{epoch}" if epoch > 0 else "")
        return self._connect(prefix, timeout), index

    def _connect(self, prefix: str, timeout: float):
        if self.control_plane:
            env = os.environ
            return _C.make_coordinator_communicator(
                self.rank, self.world_size, env["SHARDOPT_COORDINATOR"], _token(), self.job_id,
                prefix, timeout, _hostname(), *_tls(), self.transport)
        if self.world_size == 1:
            return _C.make_communicator(0, 1, None, "", timeout, "127.0.0.1")
        return _C.make_communicator(self.rank, self.world_size, _default_store(), prefix, timeout,
                                    _hostname(), self.transport)


_context: Optional[Context] = None
_hosted = None  # the coordinator this process serves (rank 0 under srun / an Indexed Job)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _join_epoch() -> int:
    """The membership epoch this process was started to join
    ($SHARDOPT_JOIN_EPOCH, set by shardrun when it grows a running job), or 0."""
    epoch = _env_int("SHARDOPT_JOIN_EPOCH", 0)
    if epoch < 0:
        raise ValueError(f"environment variable SHARDOPT_JOIN_EPOCH={epoch} must be >= 0")
    return epoch


def _tls() -> tuple:
    env = os.environ
    return (env.get("SHARDOPT_TLS_CA", ""), env.get("SHARDOPT_TLS_CERT", ""),
            env.get("SHARDOPT_TLS_KEY", ""))


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


def _env_seconds(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        x = float(v)
    except ValueError:
        x = float("nan")
    if not 0.1 <= x <= 86400:
        raise ValueError(f"environment variable {name}={v!r} must be seconds in [0.1, 86400]")
    return x


def _destroy_own_group() -> None:
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # at exit: say it, never raise
        print(f"shardopt: destroying the process group at exit failed: {e}", file=sys.stderr)


def _release_hosted(linger_s: float) -> None:
    """At exit (after this rank's own end is reported): wait until every rank
    has finished or the job has failed, then stop serving."""
    global _hosted
    h, _hosted = _hosted, None
    if h is None:
        return
    if h.release(linger_s) == "running":
        print(f"shardopt: stopping the coordinator after {linger_s:g} s with ranks still "
              "running", file=sys.stderr)


def _join_launcher(env: dict, timeout: float, transport: str) -> Context:
    """Under srun or a Kubernetes Indexed Job (no shardrun): rank 0 serves the
    job's coordinator at the address every rank derives from the launcher's
    variables, and every rank joins its control plane."""
    global _hosted
    from . import _exit
    rank, world = env["rank"], env["world_size"]
    job_id = env["rendezvous_job_id"]
    if env["host_coordinator"] and _hosted is None:
        _hosted = _C.host_coordinator(env["listen"], env["coordinator"], job_id, world, _token(),
                                      _env_seconds("SHARDOPT_HEARTBEAT_TIMEOUT", 10.0))
        print(f"shardopt: coordinator listening on {env['coordinator']} ({env['launcher']} job "
              f"{job_id}, {world} ranks; shardctl --coordinator={env['coordinator']} status)",
              file=sys.stderr, flush=True)
        _exit._after_finish.append(lambda: _release_hosted(timeout + 10.0))
    # What the rest of the package (and the script's own subprocesses) read.
    os.environ["SHARDOPT_COORDINATOR"] = env["coordinator"]
    os.environ["SHARDOPT_JOB_ID"] = job_id
    os.environ.setdefault("SHARDOPT_BIND", env["bind"])
    return Context(rank, world, env["local_rank"], env["launcher"], True, job_id, transport,
                   _coordinator_rank=0 if env["served_by_rank0"] else -1)


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

    Under srun (each task a rank: SLURM_PROCID, SLURM_NTASKS, the step's
    node list) or a Kubernetes Indexed Job (JOB_COMPLETION_INDEX, WORLD_SIZE,
    MASTER_ADDR): rank 0 serves the job's coordinator on $MASTER_ADDR (Slurm:
    the step's first node) and port $SHARDOPT_PORT (Slurm: derived from the
    job and step ids; Kubernetes: 29400), and every rank joins its control
    plane as under shardrun (docs/slurm.md, docs/kubernetes.md). Rank 0's
    process waits at exit until the other ranks have finished.

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
    launch = _C.launch_environment()  # the C++ trainer's and shardrun's reading, ValueError if bad
    if launch["note"]:
        print(f"shardopt: {launch['note']}", file=sys.stderr)
    if launch["launcher"] in ("slurm", "kubernetes"):
        if _torch_world() > 0:
            import torch.distributed as dist
            if (dist.get_rank(), dist.get_world_size()) != (launch["rank"], launch["world_size"]):
                raise ValueError(f"torch.distributed's default process group is rank "
                                 f"{dist.get_rank()} of {dist.get_world_size()}, but "
                                 f"{launch['launcher']} says rank {launch['rank']} of "
                                 f"{launch['world_size']}: launch and init_process_group must "
                                 "agree")
        _context = _join_launcher(launch, timeout, transport)
        return _context
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
            # The group is ours: destroy it at exit, after the optimizers have
            # finished. A gloo group left to interpreter teardown aborts the
            # process at random ("terminate called without an active
            # exception", pytorch/pytorch#190489).
            from . import _exit
            _exit._after_finish.append(_destroy_own_group)
        elif dist.get_rank() != rank or dist.get_world_size() != world:
            raise ValueError(f"torch.distributed is rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, the environment says {rank} of {world}")
    control_plane = False
    if launcher in ("torchrun", "torch.distributed") and rank == 0:
        print("shardopt: no shardopt coordinator in this job (not launched by shardrun): "
              "the control plane (shardctl, heartbeats, set-lr) is off", file=sys.stderr)
    _context = Context(rank, world, local_rank, launcher, control_plane, transport=transport)
    return _context
