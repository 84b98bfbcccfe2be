#!/usr/bin/env python3
"""The partition advisor's validation tables (docs/advisor.md), from `shardctl plan --json`.

    tools/advisor/validate.py machine --comm=COMM.json --kernels=KERNELS.json --oss=OSS.json
        Every bench_oss row of OSS.json at its world size, predicted from measured
        primitives only (bench_comm per transport, bench_kernels, OSS.json's compute_only
        row) against its measured step time, and the ranking of the rows.
    tools/advisor/validate.py memory --oss=OSS.json
        Gradient and optimizer-state bytes per rank, predicted against bench_oss's counts.
    tools/advisor/validate.py fairscale
        fairscale issue 1131's table on paper (public hardware figures; compute calibrated
        on the vanilla DDP row).
    tools/advisor/validate.py scale
        ResNet-101, GPT-2 small, 1.3B and 7B GPT models on 8 GPUs (NVLink) and 64, 512,
        1024 GPUs (8 per node, 400 Gb/s per GPU): step time ratio to DDP and memory per GPU,
        memory against the ZeRO paper's formulas.

--shardctl=PATH (default bazel-bin/tools/shardctl). Markdown on stdout; --json=FILE too.
"""
import argparse
import json
import subprocess
import sys

MODELS = {  # bench_oss model -> (shardctl plan --model, batch per rank)
    "resnet101": ("tests/fixtures/resnet101_params.json", 32),
    "mlp": ("mlp:1024,4096,4096,4096,1024", 64),
}
ROW_STRATEGY = {"ddp": "ddp", "ddp_fused": "ddp_fused", "oss_ddp": "oss_ddp",
                "shardopt": "shardopt", "shardopt_overlap": "shardopt_overlap",
                "shardopt_zero2": "shardopt_zero2"}


def plan(shardctl, *args):
    out = subprocess.run([shardctl, "plan", "--json", *args], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def by_strategy(result):
    return {s["strategy"]: s for s in result["strategies"]}


def machine(a):
    oss = json.load(open(a.oss))
    ranks = oss.get("setup", {}).get("ranks", 2)
    rows_out = []
    print(f"| model | row | measured step ms | predicted ms | error | compute | exposed | "
          f"optimizer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, (spec, batch) in MODELS.items():
        if model not in oss:
            continue
        preds = {}
        for transport in ("gloo", "shm"):
            r = plan(a.shardctl, f"--model={spec}", f"--world={ranks}", "--cpu",
                     f"--intra={a.comm}:{transport}", f"--kernels-json={a.kernels}",
                     f"--compute-json={a.oss}:{model}", "--broadcast-buffers=false",
                     f"--zero2-bucket-mb={a.zero2_bucket_mb}")
            preds[transport] = by_strategy(r[0])
        measured_order, predicted_order = [], []
        for row, v in oss[model].items():
            base, _, transport = row.partition("@")
            base = base.split(":")[0]
            if base not in ROW_STRATEGY or row.count(":"):
                continue
            p = preds[transport or "gloo"][ROW_STRATEGY[base]]
            meas = batch / v["samples_per_s"]
            err = p["step_s"] / meas - 1
            rows_out.append({"model": model, "row": row, "measured_s": meas,
                             "predicted_s": p["step_s"], "error": err})
            measured_order.append((meas, row))
            predicted_order.append((p["step_s"], row))
            print(f"| {model} | {row} | {meas * 1e3:.0f} | {p['step_s'] * 1e3:.0f} | "
                  f"{err * 100:+.1f}% | {p['compute_s'] * 1e3:.0f} | "
                  f"{p['exposed_comm_s'] * 1e3:.0f} | {p['optimizer_s'] * 1e3:.0f} |")
        m = [r for _, r in sorted(measured_order)]
        q = [r for _, r in sorted(predicted_order)]
        print(f"| {model} | ranking, fastest first | {', '.join(m)} | {', '.join(q)} | "
              f"{'same' if m == q else 'differs'} | | | |")
    worst = max(abs(r["error"]) for r in rows_out)
    print(f"\nworst error {worst * 100:.1f}% over {len(rows_out)} rows")
    return rows_out


def memory(a):
    oss = json.load(open(a.oss))
    ranks = oss.get("setup", {}).get("ranks", 2)
    out = []
    print(f"{ranks} ranks:\n")
    print("| model | row | grads MiB measured | predicted | state MiB measured | predicted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model, (spec, _) in MODELS.items():
        if model not in oss:
            continue
        r = by_strategy(plan(a.shardctl, f"--model={spec}", f"--world={ranks}",
                             "--forward-ms=1", "--backward-ms=1",
                             f"--zero2-bucket-mb={a.zero2_bucket_mb}")[0])
        for row, v in oss[model].items():
            base = row.partition("@")[0]
            if base not in ROW_STRATEGY:
                continue
            p = r[ROW_STRATEGY[base]]["memory"]
            # bench_oss counts the gradient buffers a row holds (DDP: .grad, no bucket copy).
            grads = p["grads"] / (2 if base.startswith("ddp") else 1) + p["staging"]
            out.append({"model": model, "row": row, "grads": [v["grad_bytes"], grads],
                        "state": [v["optimizer_state_bytes"], p["state"]]})
            print(f"| {model} | {row} | {v['grad_bytes'] / 2**20:.1f} | {grads / 2**20:.1f} | "
                  f"{v['optimizer_state_bytes'] / 2**20:.1f} | {p['state'] / 2**20:.1f} |")
    return out

# fairscale issue 1131: benchmarks/oss.py, ResNet-101 (1000 classes) on MNIST 28x28 x3 channels,
# batch 256 per rank, RMSprop(momentum=0.9), fp32, 2 ranks; img/s at rank 0, peak
# torch.cuda.max_memory_allocated.
FAIRSCALE = [
    # hardware, device memory GB/s (public), measured: (img/s, MiB) for ddp, oss_ddp, oss_sharded_ddp
    ("2x RTX 3080 Ti", 912, {"ddp": (1795.03, 1462.5), "oss_ddp": (1645.64, 1290.0),
                             "oss_sharded_ddp": (1468.54, 1049.7)}),
    ("2x \"4080 Ti\" (RTX 4080), NCCL_P2P_DISABLE=1", 717,
     {"ddp": (2117.12, 1556.4), "oss_ddp": (1850.65, 1377.8),
      "oss_sharded_ddp": (1530.15, 1158.6)}),
]
FAIR_BATCH = 256
# torch.optim.RMSprop(momentum) per element: 19 float reads/writes over its 7 ops against a
# fused kernel's 7 (p, g, square_avg, momentum_buffer in; p, square_avg, buffer out), and
# 7 kernel launches per tensor (~5 us each).
RMSPROP_FUSED_BYTES = 28
RMSPROP_UNFUSED_FACTOR = 19 / 7
RMSPROP_PER_TENSOR_US = 35


def fairscale(a):
    out = []
    print("| hardware | row | measured img/s | ratio to DDP | predicted ratio | miss | "
          "measured MiB | predicted MiB | miss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for hw, gbps, meas in FAIRSCALE:
        t_ddp = FAIR_BATCH / meas["ddp"][0]
        common = ["--model=tests/fixtures/resnet101_params.json", "--world=2",
                  "--intra=pcie4-nop2p", "--optimizer=rmsprop",
                  f"--fused-ns={RMSPROP_FUSED_BYTES / gbps}",
                  f"--unfused-factor={RMSPROP_UNFUSED_FACTOR}",
                  f"--per-tensor-us={RMSPROP_PER_TENSOR_US}"]
        # Calibration on the DDP row (the one figure no public number gives): compute is
        # DDP's step minus what the model adds to it; activations likewise from DDP's memory.
        fb = t_ddp
        for _ in range(4):
            r = by_strategy(plan(a.shardctl, *common, f"--forward-ms={fb / 3 * 1e3}",
                                 f"--backward-ms={fb * 2 / 3 * 1e3}")[0])
            fb = t_ddp - (r["ddp"]["step_s"] - r["ddp"]["compute_s"])
        act = meas["ddp"][1] * 2**20 - r["ddp"]["memory"]["total"]
        r = by_strategy(plan(a.shardctl, *common, f"--forward-ms={fb / 3 * 1e3}",
                             f"--backward-ms={fb * 2 / 3 * 1e3}",
                             f"--activation-mb={act / 2**20}")[0])
        for row in ("ddp", "oss_ddp", "oss_sharded_ddp", "shardopt_overlap", "shardopt_zero2"):
            pred_ratio = r["ddp"]["step_s"] / r[row]["step_s"]
            pred_mib = r[row]["memory"]["total"] / 2**20
            if row in meas:
                img, mib = meas[row]
                ratio = img / meas["ddp"][0]
                print(f"| {hw} | {row} | {img:.2f} | {ratio:.3f} | {pred_ratio:.3f} | "
                      f"{pred_ratio - ratio:+.3f} | {mib:.1f} | {pred_mib:.1f} | "
                      f"{(pred_mib / mib - 1) * 100:+.1f}% |")
            else:
                print(f"| {hw} | {row} (predicted) | {meas['ddp'][0] * pred_ratio:.0f} | | "
                      f"{pred_ratio:.3f} | | | {pred_mib:.1f} | |")
            out.append({"hardware": hw, "row": row, "predicted_ratio": pred_ratio,
                        "predicted_mib": pred_mib, "measured": meas.get(row),
                        "terms": {k: r[row][k] for k in ("compute_s", "exposed_comm_s",
                                                         "optimizer_s", "collectives")}})
        print(f"| {hw} | (calibrated) | compute {fb * 1e3:.1f} ms per step | | | | "
              f"activations {act / 2**20:.0f} MiB | | |")
    return out


# Scale on paper: mixed precision Adam (ZeRO's 2 + 2 + 12 bytes per parameter), H100s.
# Compute from 6 x parameters x tokens (or images x FLOPs) at 40% of 989 TFLOPS (bf16 dense).
SCALE_MODELS = [
    ("resnet101", "tests/fixtures/resnet101_params.json", 3 * 7.8e9 * 64),  # 64 images 224x224
    ("gpt2-small", "gpt2-small", 6 * 124.4e6 * 8 * 1024),
    ("gpt-1.3b", "gpt-1.3b", 6 * 1.32e9 * 8 * 2048),
    ("gpt-7b", "gpt-7b", 6 * 6.65e9 * 4 * 2048),
]
SCALE_CLUSTERS = [("8 GPUs, NVLink", 8, []), ("64 GPUs", 64, ["--ranks-per-node=8"]),
                  ("512 GPUs", 512, ["--ranks-per-node=8"]),
                  ("1024 GPUs", 1024, ["--ranks-per-node=8"])]


def scale(a):
    out = []
    rows = ("ddp", "oss_ddp", "zero", "shardopt_overlap", "shardopt_zero2")
    print("| model | GPUs | " + " | ".join(f"{r} step / ddp" for r in rows[1:]) + " | " +
          " | ".join(f"{r} GiB" for r in rows) + " | ZeRO formula GiB (DDP, P_os, P_os+g) |")
    print("| --- | --- | " + " | ".join("---" for _ in rows[1:]) + " | " +
          " | ".join("---" for _ in rows) + " | --- |")
    for name, spec, flops in SCALE_MODELS:
        t = flops / (0.4 * 989e12)
        for label, n, extra in SCALE_CLUSTERS:
            res = plan(a.shardctl, f"--model={spec}", f"--world={n}", "--intra=nvlink4",
                       "--inter=ib400", "--precision=mixed", f"--forward-ms={t / 3 * 1e3}",
                       f"--backward-ms={t * 2 / 3 * 1e3}", "--memory-gbps=3350",
                       "--broadcast-buffers=false", *extra)[0]
            r = by_strategy(res)
            P = res["parameters"]
            zero = [16 * P, (4 + 12 / n) * P, (2 + 14 / n) * P]
            ratios = [r[x]["step_s"] / r["ddp"]["step_s"] for x in rows[1:]]
            # ZeRO's formulas count no DDP bucket copy and no staging.
            mem = [r[x]["memory"]["total"] for x in rows]
            print(f"| {name} | {label} | " + " | ".join(f"{x:.3f}" for x in ratios) + " | " +
                  " | ".join(f"{m / 2**30:.2f}" for m in mem) + " | " +
                  ", ".join(f"{z / 2**30:.2f}" for z in zero) + " |")
            out.append({"model": name, "gpus": n, "ratios": dict(zip(rows[1:], ratios)),
                        "memory": dict(zip(rows, mem)), "zero_formulas": zero})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=("machine", "memory", "fairscale", "scale"))
    p.add_argument("--shardctl", default="bazel-bin/tools/shardctl")
    p.add_argument("--comm")
    p.add_argument("--kernels")
    p.add_argument("--oss")
    p.add_argument("--zero2-bucket-mb", type=float, default=8)
    p.add_argument("--json")
    a = p.parse_args()
    if a.table == "machine" and not (a.comm and a.kernels and a.oss):
        p.error("machine needs --comm, --kernels and --oss")
    if a.table == "memory" and not a.oss:
        p.error("memory needs --oss")
    result = {"machine": machine, "memory": memory, "fairscale": fairscale, "scale": scale}[a.table](a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
