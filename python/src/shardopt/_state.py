"""ShardedOptimizer's state: state_dict / load_state_dict in torch.optim's
format, consolidate_state_dict, sharded checkpoints (save_checkpoint /
load_checkpoint, with the metadata keys they write), the collective-call
check, and module buffers in checkpoints."""

import json
import zlib
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from ._launch import _torch_backend, _torch_world
from ._options import _hyper_keys


_META_GROUPS = "shardopt.param_groups"
_META_GROUP_OF = "shardopt.param_group_of"  # group of each trainable parameter, layout order
_META_BUFFERS = "shardopt.buffers"
# The param_groups' other keys (a scheduler's initial_lr, torch.optim's
# flags, the script's own), where JSON can carry them: one dict per group.
_META_GROUP_EXTRAS = "shardopt.param_group_extras"
# torch.optim options the fused kernels do not have: only False is taken.
_FIXED_KEYS = ("amsgrad", "maximize", "capturable", "differentiable")
# A torch.optim class without fused kernels: its class, its param_groups'
# options, and every rank's state file (step-N/optimizer-R-of-W.pt) with its
# size and CRC-32.
_META_TORCH_OPTIM = "shardopt.torch_optimizer"


def _json_value(v):
    """`v` as JSON would give it back (tuples become lists), or a
    ValueError/TypeError where JSON cannot carry it."""
    return json.loads(json.dumps(v, allow_nan=False))


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


class _StateMixin:
    """ShardedOptimizer's state_dict, checkpoint and collective-call methods
    (they use its core, parameter groups and layout)."""

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

    # -- param_groups keys beyond the hyper-parameters -------------------------
    def _group_extras(self) -> List[Dict[str, Any]]:
        """Each group's keys other than `params` and the hyper-parameters the
        core holds: LR schedulers' initial_lr (max_lr, min_lr, ...),
        torch.optim's flags, keys of the script's own. Values JSON cannot
        carry (tensors, objects) are left out."""
        skip = set(_hyper_keys(self._kind)) | {"params"}
        out = []
        for group in self.param_groups:
            extras = {}
            for k, v in group.items():
                if not isinstance(k, str) or k in skip:
                    continue
                try:
                    extras[k] = _json_value(v)
                except (TypeError, ValueError):
                    continue
            out.append(extras)
        return out

    def _set_group_extras(self, extras: Any, where: str) -> None:
        """Sets the keys of _group_extras() (a list, one dict per group) in
        param_groups; a key whose value is already that one is left as it is
        (a tuple stays a tuple)."""
        if not isinstance(extras, list) or len(extras) != len(self.param_groups):
            return
        self._refuse_fixed_keys([e if isinstance(e, dict) else {} for e in extras],
                                f"{where}: param_groups")
        skip = set(_hyper_keys(self._kind)) | {"params"}
        for group, e in zip(self.param_groups, extras):
            if not isinstance(e, dict):
                continue
            for k, v in e.items():
                if k in skip:
                    continue
                if k in group:
                    try:
                        if _json_value(group[k]) == v:
                            continue
                    except (TypeError, ValueError):
                        pass
                group[k] = v

    def _refuse_fixed_keys(self, groups: List[Dict[str, Any]], what: str) -> None:
        """The fused kernels have no amsgrad, maximize, ...: a group (of
        param_groups, a state_dict, a checkpoint) that turns one on is refused
        rather than ignored. `what` names the groups ("param_groups")."""
        if self._kind == "torch":
            return
        for g, group in enumerate(groups):
            for k in _FIXED_KEYS:
                if group.get(k):
                    raise ValueError(f"{what}[{g}] has {k}={group[k]!r}, which shardopt's "
                                     f"{self._kind} does not support (only False)")

    def _check_fixed_keys(self) -> None:
        self._refuse_fixed_keys(self.param_groups, "param_groups")

    # -- checkpoints -----------------------------------------------------------
    def save_checkpoint(self, root: str, keep: int = 0) -> Optional[str]:
        """Collective. Writes ROOT/step-N (each rank its shard; crash-safe) in
        the same format as the C++ side; returns the directory. keep > 0
        prunes older checkpoints. Right after a live grow (elastic=True), on
        the ranks that were there, before the next step: skipped, saying so,
        and returns None (the ranks that joined start with the next step and
        never make this call)."""
        r = getattr(self, "last_resize", None)
        if (r is not None and r.previous_rank >= 0 and r.to_world > r.from_world
                and r.step == self._core.step_count):
            if self.rank == 0:
                print(f"shardopt: save_checkpoint after step {r.step} skipped: the job grew to "
                      f"{r.to_world} ranks after this step, and the ranks that joined start with "
                      "the next one (they do not make this call); the next save_checkpoint "
                      "writes one", file=sys.stderr, flush=True)
            return None
        self._sync_groups()
        meta = {_META_GROUPS: json.dumps([self._hyper(g) for g in self.param_groups]),
                _META_GROUP_OF: json.dumps(self._trainable_groups()),
                _META_GROUP_EXTRAS: json.dumps(self._group_extras())}
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
        parameters, state, step, hyper-parameters and the param_groups' other
        keys saved with them (a scheduler's initial_lr, ...)."""
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
        self._set_group_extras(_json_or_none(meta.get(_META_GROUP_EXTRAS)), os.fspath(path))
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
        self._refuse_fixed_keys(groups, "the state_dict's param_groups")
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
        hyper = _hyper_keys(self._kind)
        for theirs, ours in zip(groups, self.param_groups):
            for k, v in theirs.items():
                if k in hyper:
                    ours[k] = tuple(v) if k == "betas" else v
                elif k != "params":
                    ours[k] = v  # as torch.optim: a scheduler's initial_lr, flags, the script's keys
        self._sync_groups()
