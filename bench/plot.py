#!/usr/bin/python3
"""Plot latency against sequence length, one line per variant, from the
suite's Google Benchmark JSON.

    build/bench/bench/headmix_bench --benchmark_out=results.json --benchmark_out_format=json
    /usr/bin/python3 bench/plot.py results.json latency.png [--D 768] [--threads 1]

Draws two panels, non-causal and causal. Needs Debian's python3-matplotlib.
Reads the shared-shape entries (Suite_<Variant>/D:../H:../T:../causal:../threads:..)
and ignores the rest.
"""
import argparse
import json
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("png")
    ap.add_argument("--D", type=int, default=768)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    with open(args.results) as f:
        data = json.load(f)
    pattern = re.compile(r"^Suite_(\w+)/D:(\d+)/H:(\d+)/T:(\d+)/causal:(\d)/threads:(\d+)")
    series = {0: defaultdict(list), 1: defaultdict(list)}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        m = pattern.match(b["name"])
        if not m:
            continue
        variant, D, H, T, causal, threads = m.group(1), *map(int, m.groups()[1:])
        if (D, threads) != (args.D, args.threads):
            continue
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        series[causal][variant].append((T, b["real_time"] * scale))
    if not series[0] and not series[1]:
        sys.exit("no shared-shape results for D=%d threads=%d" % (args.D, args.threads))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for causal, ax in zip((0, 1), axes):
        for variant, points in sorted(series[causal].items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T = S")
        ax.set_title("causal" if causal else "non-causal", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("latency per call (ms)")
    axes[0].legend(fontsize=8)
    ctx = data.get("context", {})
    fig.suptitle("headmix, B=1, D=%d, %d thread(s), float; %s" % (
        args.D, args.threads, ctx.get("gemm_backend", "")), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print("wrote", args.png)


if __name__ == "__main__":
    main()
