"""Training loops as people write them, under DDP + torch.optim and ported to
shardopt, on the same data at 2 ranks: parameters, buffers, losses and the
evaluation loss after 20 steps within 1e-6 (relative), and every rank holding
the same model. Run by Bazel (//tests:python_loops_test) with PYTHONPATH at the
built package; the losses of both runs are printed."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import free_port, outputs, start_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "loop_worker.py")
TOL = 1e-6

STYLES = [
    "plain",                 # opt.zero_grad(); backward; step
    "model_zero_grad",       # model.zero_grad() (fairscale's benchmark, HF Trainer)
    "model_zero_grad_none",  # model.zero_grad(set_to_none=True)
    "grad_none",             # p.grad = None for every parameter
    "set_to_none",           # opt.zero_grad(set_to_none=True)
    "closure",               # loss = opt.step(closure)
    "accum_no_sync",         # two micro-batches, the first under no_sync()
    "groups_onecycle_clip",  # AdamW decay/no-decay groups + OneCycleLR + clipping (class as optimizer)
    "sgd_nesterov",          # SGD(momentum, nesterov, weight_decay) through optim=
    "zero_api",              # ZeroRedundancyOptimizer's optimizer_class= signature
    "batchnorm",             # BatchNorm buffers broadcast as DDP does; eval under no_grad
]


def collect(procs, timeout):
    logs, failed = outputs(procs, timeout)
    text = "\n---\n".join(logs)
    print(text)
    if failed:
        raise AssertionError("a rank failed:\n" + text)


def launch_env(world, styles, out, timeout=600):
    collect(start_ranks(world, [WORKER, "--styles", ",".join(styles), "--out", out]), timeout)


def launch_spawn(world, styles, out, timeout=600):
    # mp.spawn: no RANK/WORLD_SIZE/MASTER_* in the environment at all.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.Popen([sys.executable, WORKER, "--styles", ",".join(styles), "--out", out,
                          "--spawn", str(world),
                          "--init-method", f"tcp://127.0.0.1:{free_port()}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    collect([p], timeout)


class LoopsTest(unittest.TestCase):
    def check(self, results, styles):
        for style in styles:
            r = results[style]
            with self.subTest(style=style):
                self.assertLess(r["worst_rel"], TOL, f"{style}: {r['worst_tensor']}")
                self.assertLess(r["loss_rel"], TOL, style)
                self.assertLess(r["eval_rel"], TOL, style)
                self.assertTrue(r["ranks_agree"], f"{style}: ranks hold different models")

    def test_loops_torchrun_env(self):
        out = os.path.join(tempfile.mkdtemp(), "r.json")
        launch_env(2, STYLES, out)
        with open(out) as f:
            self.check(json.load(f), STYLES)

    def test_mp_spawn(self):
        # The launch that trained each rank alone before init() adopted the
        # script's process group.
        styles = ["plain", "batchnorm"]
        out = os.path.join(tempfile.mkdtemp(), "r.json")
        launch_spawn(2, styles, out)
        with open(out) as f:
            self.check(json.load(f), styles)


if __name__ == "__main__":
    unittest.main(verbosity=2)
