#!/usr/bin/python3
"""Cross-check headmix_suite's torch rows against Python's own
nn.MultiheadAttention (eval, inference mode, batch_first: the fast path,
torch._native_multi_head_attention) at one shape and thread count.

    OPENBLAS_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 \\
    MALLOC_TOP_PAD_=67108864 /usr/bin/python3 bench/torch_python_check.py [--T 1024]

The environment repeats the suite's settings: OpenBLAS on the row's thread
count, and the suite's mallopt values (glibc reads them from MALLOC_*_).
Prints the median of 9 timed calls (wall and CPU time) for the fast path (non-causal) and for the
module with an additive causal mask (the slow path; the fast path takes no
attention mask in torch 1.13).
"""
import argparse
import statistics
import time

import torch


def median_ms(fn, reps=9):
    """Median wall and process-CPU milliseconds per call (the suite's two clocks)."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return "%.1f ms wall, %.1f ms CPU" % (1e3 * statistics.median(wall), 1e3 * statistics.median(cpu))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=768)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(a.D, a.H, batch_first=True).eval()
    x = torch.randn(1, a.T, a.D)
    mask = torch.zeros(a.T, a.T).masked_fill(torch.ones(a.T, a.T, dtype=torch.bool).triu(1), float("-inf"))
    with torch.inference_mode():
        fast = median_ms(lambda: m(x, x, x, need_weights=False))
        causal = median_ms(lambda: m(x, x, x, need_weights=False, attn_mask=mask))
    print("torch %s, D=%d H=%d T=%d, %d thread(s): fast path %s; module causal %s"
          % (torch.__version__, a.D, a.H, a.T, a.threads, fast, causal))


if __name__ == "__main__":
    main()
