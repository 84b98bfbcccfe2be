"""Launching test workers on CPU ranks (127.0.0.1, OS-chosen ports), shared by
api_test.py and loops/ (loops_test.py, misuse_test.py)."""
import os
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world, argv, env_extra=None):
    """`world` processes of `argv` (after the interpreter), torchrun-style."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def outputs(procs, timeout):
    """Each process's output and whether any failed or hung (all killed then)."""
    logs, failed = [], False
    for p in procs:
        try:
            o, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, _ = p.communicate()
            o += "\n(killed: timed out)"
            failed = True
        logs.append(o)
        failed |= p.returncode != 0
    return logs, failed
