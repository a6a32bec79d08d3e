#!/usr/bin/python3
"""Plot latency against sequence length, one line per variant, from the
suite's Google Benchmark JSON.

    build/bench/bench/headmix_bench --benchmark_out=results.json --benchmark_out_format=json
    /usr/bin/python3 bench/plot.py results.json latency.png [--D 768] [--causal 0] [--threads 1]

Needs Debian's python3-matplotlib. Reads the shared-shape entries
(Suite_<Variant>/D:../H:../T:../causal:../threads:..) and ignores the rest.
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
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    with open(args.results) as f:
        data = json.load(f)
    pattern = re.compile(r"^Suite_(\w+)/D:(\d+)/H:(\d+)/T:(\d+)/causal:(\d)/threads:(\d+)")
    series = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        m = pattern.match(b["name"])
        if not m:
            continue
        variant, D, H, T, causal, threads = m.group(1), *map(int, m.groups()[1:])
        if (D, causal, threads) != (args.D, args.causal, args.threads):
            continue
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        series[variant].append((T, b["real_time"] * scale))
    if not series:
        sys.exit("no shared-shape results for D=%d causal=%d threads=%d" % (args.D, args.causal, args.threads))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T = S")
    ax.set_ylabel("latency per call (ms)")
    ctx = data.get("context", {})
    ax.set_title("headmix, B=1, D=%d, %s, %d thread(s)\n%s" % (
        args.D, "causal" if args.causal else "non-causal", args.threads, ctx.get("gemm_backend", "")), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print("wrote", args.png)


if __name__ == "__main__":
    main()
