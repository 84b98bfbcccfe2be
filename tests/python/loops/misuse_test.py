"""What used to train silently wrong, hang, or be accepted, each at 2 ranks
(tests/python/loops/misuse_worker.py): now an error that says what to do, or
the same result as PyTorch. Run by //tests:python_loops_test."""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import outputs, start_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "misuse_worker.py")


def run_case(case, world=2, timeout=120):
    """Returns each rank's RESULT dict."""
    procs = start_ranks(world, [WORKER, "--case", case, "--dir", tempfile.mkdtemp()])
    logs, _ = outputs(procs, timeout)
    results = []
    for out in logs:
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if not lines:
            raise AssertionError(f"{case}: no result:\n{out}")
        results.append(json.loads(lines[-1][7:]))
    for r, res in enumerate(results):
        if "crash" in res:
            raise AssertionError(f"{case}: rank {r} crashed:\n{res['crash']}")
    print(case, json.dumps(results))
    return results


class MisuseTest(unittest.TestCase):
    def assertError(self, res, *words):
        self.assertIsNotNone(res["error"], "expected an error")
        for w in words:
            self.assertIn(w, res["error"])

    def test_ddp_wrapped_module_refused(self):
        for res in run_case("ddp_module"):
            self.assertError(res, "ValueError", "DistributedDataParallel", "ddp_model.module")

    def test_clip_grad_norm_on_grad_detected(self):
        for res in run_case("clip_on_grad"):
            self.assertError(res, "changed between backward and step", "max_grad_norm")

    def test_ddp_left_on_detected(self):
        for res in run_case("ddp_left_on"):
            self.assertError(res, "changed between backward and step", "DDP")

    def test_state_dict_on_one_rank_fails_fast(self):
        res = run_case("state_dict_one_rank")[0]
        self.assertError(res, "state_dict() is collective", "consolidate_state_dict(to=0)")
        self.assertLess(res["seconds"], 20)

    def test_consolidate_state_dict(self):
        r0, r1 = run_case("consolidate")
        self.assertIsNone(r0["error"])
        self.assertEqual(r0["states"], r0["params"])
        self.assertError(r1, "consolidated on rank 0")

    def test_hyper_parameters_disagree_at_construction(self):
        for res in run_case("hyper_mismatch"):
            self.assertError(res, "group 0: lr=")
        self.assertTrue(any("rank 1 has" in res["error"] for res in run_case("hyper_mismatch")))

    def test_param_groups_edit_on_one_rank(self):
        for res in run_case("hyper_edit"):
            self.assertError(res, "disagree on hyper-parameters at step 2")
        # The rank that differs names both values.

    def test_lr_beyond_float32(self):
        for res in run_case("lr_float32"):
            self.assertError(res["ctor"], "ValueError", "float32")
            self.assertError(res["edit"], "ValueError", "invalid lr")

    def test_params_in_a_set_refused(self):
        for res in run_case("params_set"):
            self.assertError(res, "TypeError", "set")

    def test_unnamed_parameters_in_another_order(self):
        for res in run_case("unnamed_order"):
            self.assertIsNotNone(res["error"])
        self.assertTrue(any("layers.0.weight" in res["error"] or "layers.2.weight" in res["error"]
                            for res in run_case("unnamed_order")))

    def test_clipping_norm_as_accurate_as_torch(self):
        for res in run_case("clip_accuracy", timeout=240):
            self.assertLessEqual(res["shardopt_rel"], max(res["torch_rel"], 1e-9))
            self.assertLess(res["shardopt_rel"], 1e-7)

    def test_buffers_saved_and_restored(self):
        for res in run_case("buffers_checkpoint"):
            self.assertGreater(res["running_mean_abs_sum"], 0)
            self.assertEqual(res["max_diff"], 0.0)

    def test_pt_file_shapes_checked(self):
        for res in run_case("pt_shape"):
            self.assertError(res, "has shape [", "this model [")

    def test_pt_file_with_scheduler_and_extra_keys(self):
        for res in run_case("pt_with_scheduler"):
            self.assertEqual(res["max_diff"], 0.0)
            self.assertIn("key 'optimizer' holds object of torch.optim.adamw.AdamW", res["refusal"])
            self.assertIn("has 2 param_groups, this optimizer 1", res["groups_refusal"])

    def test_scheduler_resumed_with_last_epoch(self):
        for res in run_case("scheduler_resume"):
            for how in ("load_state_dict", "load_checkpoint"):
                self.assertIsNone(res[how]["error"], how)  # was KeyError: 'initial_lr'
                self.assertEqual(res[how]["max_diff"], 0.0, how)
                self.assertEqual(res[how]["lr"], res["torch_lr"], how)
                self.assertEqual(res[how]["tag"], "mine", how)
            self.assertEqual(res["lr"], res["torch_lr"])
            self.assertError(res["ctor"], "ValueError", "amsgrad", "does not support")
            self.assertError(res["edit"], "ValueError", "amsgrad", "does not support")
            self.assertError(res["state_dict"], "ValueError", "maximize", "does not support")


if __name__ == "__main__":
    unittest.main(verbosity=2)
