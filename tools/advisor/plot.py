#!/usr/bin/env python3
"""Chart of `shardctl plan --json` output: predicted step time (as a ratio to DDP's) and memory
per rank against world size, one line per strategy.

    bazel-bin/tools/shardctl plan --model=gpt-1.3b --world=8,64,512,1024 --ranks-per-node=8 \\
        --intra=nvlink4 --inter=ib400 --precision=mixed --forward-ms=110 --backward-ms=220 \\
        --json > plan.json
    tools/advisor/plot.py plan.json plan.png      # needs python3-matplotlib (setup.sh --with-bench)
"""
import json
import sys


def main():
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) == 2 else 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: needs matplotlib (tools/setup.sh --with-bench installs python3-matplotlib)",
              file=sys.stderr)
        return 1
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    if not isinstance(runs, list) or not runs or "strategies" not in runs[0]:
        print(f"plot.py: {sys.argv[1]} is not `shardctl plan --json` output", file=sys.stderr)
        return 1
    worlds = [r["world_size"] for r in runs]
    names = [s["strategy"] for s in runs[0]["strategies"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        ratio = [r["strategies"][i]["step_s"] / r["strategies"][0]["step_s"] for r in runs]
        mem = [r["strategies"][i]["memory"]["total"] / 2**30 for r in runs]
        a.plot(worlds, ratio, marker="o", label=name)
        b.plot(worlds, mem, marker="o", label=name)
    for ax, title in ((a, "predicted step time / DDP's"), (b, "memory per rank, GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    a.set_yscale("log")
    b.legend(fontsize=8)
    fig.suptitle(f"{runs[0].get('model', '')}: {runs[0]['parameters'] / 1e6:.0f}M parameters")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(f"wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
