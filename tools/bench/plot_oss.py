#!/usr/bin/python3
"""Draws bench_oss's JSON as a PNG: throughput (relative to ddp) and memory per row."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    models = [m for m in data if m != "setup"]
    rows = ["ddp", "ddp_fused", "oss_ddp", "shardopt"]
    colors = ["#888888", "#5b8fd1", "#d1825b", "#3fa34d"]
    fig, axes = plt.subplots(len(models), 3, figsize=(13, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        present = [r for r in rows if r in data[model]]
        col = [colors[rows.index(r)] for r in present]
        sps = [data[model][r]["samples_per_s"] for r in present]
        err = [data[model][r]["samples_per_s_spread"] for r in present]
        ax = axes[i][0]
        ax.bar(present, sps, yerr=err, color=col, capsize=4)
        base = data[model].get("ddp", {}).get("samples_per_s", 0)
        for x, v in enumerate(sps):
            if base:
                ax.text(x, v, f"{v / base:.2f}x", ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{model}: samples/s per rank (median)")
        ax = axes[i][1]
        ax.bar(present, [data[model][r]["peak_rss_bytes"] / 2**20 for r in present], color=col,
               label="peak RSS")
        ax.bar(present, [data[model][r]["optimizer_state_bytes"] / 2**20 for r in present],
               color="black", alpha=0.35, label="optimizer state")
        ax.set_title(f"{model}: memory per rank (MiB)")
        ax.legend(fontsize=8)
        ax = axes[i][2]
        bottom = [0.0] * len(present)
        for key, label, c in [("fwd_bwd_s", "forward+backward", "#bbbbbb"),
                              ("exposed_comm_s", "exposed comm", "#d1825b"),
                              ("optimizer_s", "optimizer", "#3fa34d")]:
            vals = [data[model][r][key] for r in present]
            ax.bar(present, vals, bottom=bottom, color=c, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{model}: step breakdown (s)")
        ax.legend(fontsize=8)
        for ax in axes[i]:
            ax.tick_params(axis="x", labelsize=9)
    s = data.get("setup", {})
    fig.suptitle(f"bench_oss: {s.get('ranks', 2)} ranks, {s.get('transport', '')}, "
                 f"{s.get('optimizer', '')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_oss.py BENCH.json OUT.png")
    main(sys.argv[1], sys.argv[2])
