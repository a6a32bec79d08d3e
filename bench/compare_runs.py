#!/usr/bin/python3
"""How far two headmix_suite runs' ratios are apart: the reproducibility check.

    /usr/bin/python3 bench/compare_runs.py first.json second.json [--tolerance 0.05] [--one-thread]

Matches the comparisons of both runs by table, shape and sides, and prints
for each the two medians and their relative difference (second / first - 1),
largest first, marking with `!` those beyond the tolerance; then how many
are within it. `--one-thread` keeps only comparisons whose sides both ran
on one thread (the CPU-clock rows: what a load on the other core must not
move). Last, both runs' machine probes (GEMM and read rates before and after
their tables), flagged when they differ by more than the tolerance. A report,
not a test: the exit status is 0 whenever both files read.
"""
import argparse
import json
import sys


def key(c):
    return (c["table"], json.dumps(c["params"], sort_keys=True), c["a"]["label"], c["b"]["label"])


def label(c):
    params = " ".join(f"{k}={v}" for k, v in sorted(c["params"].items()))
    return f'{c["table"]:9} {c["a"]["label"]} / {c["b"]["label"]}  {params}'


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--tolerance", type=float, default=0.05, help="relative difference allowed (0.05: 5%%)")
    parser.add_argument("--one-thread", action="store_true", help="only comparisons timed on the CPU clock")
    args = parser.parse_args()
    runs, probes = [], []
    for path in (args.first, args.second):
        with open(path) as f:
            data = json.load(f)
        runs.append({key(c): c for c in data["comparisons"]})
        probes.append(data["context"].get("machine_probe"))
    first, second = runs
    rows = []
    for k, a in first.items():
        b = second.get(k)
        if b is None or (args.one_thread and a["clock"] != "cpu"):
            continue
        rows.append((b["median"] / a["median"] - 1, a, b))
    if not rows:
        sys.exit("compare_runs: the two runs share no comparison")
    rows.sort(key=lambda r: -abs(r[0]))
    within = sum(abs(d) <= args.tolerance for d, _, _ in rows)
    print(f"{'first':>7} {'second':>7} {'diff':>7}  comparison")
    for d, a, b in rows:
        mark = "!" if abs(d) > args.tolerance else " "
        print(f'{a["median"]:7.3f} {b["median"]:7.3f} {d:+7.1%}{mark} {label(a)}')
    unmatched = len(set(first) ^ set(second))
    print(f"\n{within} of {len(rows)} ratios within ±{args.tolerance:.0%}; largest difference {abs(rows[0][0]):.1%}"
          + (f"; {unmatched} comparisons in only one run" if unmatched else ""))
    tables = {}
    for d, a, _ in rows:
        tables.setdefault(a["table"], []).append(abs(d))
    for table, diffs in tables.items():
        print(f"  {table:10} {sum(d <= args.tolerance for d in diffs):3} of {len(diffs):3} within, largest {max(diffs):.1%}")
    compare_probes(probes, args.tolerance)


def compare_probes(probes, tolerance):
    """The machine probes of both runs (suites from f64649c on): a machine
    that was faster or slower in one run explains ratios that moved."""
    if not all(probes):
        print("\n(no machine probe in one of the runs: runs before f64649c)")
        return
    print("\nmachine probe, before / after each run's tables:")
    moved = []
    for name, unit in (("gemm_gflops", "GFLOP/s"), ("read_gbs", "GB/s")):
        values = [p[when][name] for p in probes for when in ("before", "after")]
        print(f"  {name:12} first {values[0]:6.1f} / {values[1]:6.1f}, second {values[2]:6.1f} / {values[3]:6.1f} {unit}")
        if max(values) / min(values) - 1 > tolerance:
            moved.append(name)
    if moved:
        print(f"  the machine itself moved by more than ±{tolerance:.0%} ({', '.join(moved)}): "
              "ratios that mix compute- and memory-bound sides are expected to move with it")


if __name__ == "__main__":
    main()
