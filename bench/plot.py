#!/usr/bin/python3
"""Plot latency against sequence length from one headmix_suite run.

    build/bench/bench/headmix_suite --json=results.json
    /usr/bin/python3 bench/plot.py results.json latency.png [--D 768] [--threads 1]

Two panels, non-causal and causal; one line per variant, each point the
median per-call time of that variant's side in its paired comparison with
MHA (MHA: the median over its sides in all four comparisons at that shape),
error bars its interquartile range, on the comparison's clock (CPU time for
single-threaded comparisons, see bench/paired.hpp). With torch rows, the faster torch path
at each shape as a dashed line. Needs matplotlib (Debian: python3-matplotlib,
installed by `sh scripts/install-deps.sh bench`, for /usr/bin/python3).
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def quartiles(values):
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def collect(data, D, threads):
    """{causal: {line label: {T: [per-call seconds]}}} from the comparisons."""
    series = {False: defaultdict(lambda: defaultdict(list)), True: defaultdict(lambda: defaultdict(list))}
    torch_best = {}  # (causal, T) -> (median, samples) of the faster torch path
    for c in data["comparisons"]:
        p = c["params"]
        if p.get("D") != D or p.get("threads") != threads:
            continue
        causal, T = p["causal"], p["T"]
        times = "%s_seconds_per_call" % c["clock"]  # the clock the comparison's ratio used
        if c["table"] == "vs_mha":
            series[causal][p["variant"]][T] += c["a"][times]
            series[causal]["MHA"][T] += c["b"][times]
        elif c["table"] == "torch":
            med = c["b"]["median_seconds"]
            if (causal, T) not in torch_best or med < torch_best[(causal, T)][0]:
                torch_best[(causal, T)] = (med, c["b"][times])
    for (causal, T), (_, samples) in torch_best.items():
        series[causal]["PyTorch (faster path)"][T] += samples
    return series


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("png")
    ap.add_argument("--D", type=int, default=768)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        print("plot.py: no matplotlib for %s, so no latency plot; install python3-matplotlib "
              "(sh scripts/install-deps.sh bench) and run\n  /usr/bin/python3 %s %s %s"
              % (sys.executable, sys.argv[0], args.results, args.png))
        return 0
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    with open(args.results) as f:
        data = json.load(f)
    series = collect(data, args.D, args.threads)
    if not series[False] and not series[True]:
        sys.exit("plot.py: no comparisons at D=%d, threads=%d in %s" % (args.D, args.threads, args.results))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    for causal, ax in zip((False, True), axes):
        for label in sorted(series[causal], key=lambda s: (s.startswith("PyTorch"), s != "MHA", s)):
            points = sorted(series[causal][label].items())
            Ts = [T for T, _ in points]
            q = [quartiles([1e3 * s for s in samples]) for _, samples in points]
            med = [m for _, m, _ in q]
            err = [[m - lo for lo, m, _ in q], [hi - m for _, m, hi in q]]
            style = "--" if label.startswith("PyTorch") else "-"
            ax.errorbar(Ts, med, yerr=err, marker="o", linestyle=style, capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({T for pts in series[causal].values() for T in pts}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("sequence length T = S")
        ax.set_title("causal" if causal else "non-causal", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time per call (ms), median and IQR")
    axes[0].legend(fontsize=8)
    ctx = data.get("context", {})
    clock = "CPU time of the calling thread" if args.threads == 1 else "wall time"
    fig.suptitle("headmix_suite (%s mode), B=1, D=%d, %d thread(s), float, %s; %s\n%s" % (
        ctx.get("mode", "?"), args.D, args.threads, clock, ctx.get("headmix_gemm", ""), ctx.get("cpu", "")),
        fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print("plot.py: wrote", args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
