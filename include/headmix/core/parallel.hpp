// A static parallel loop on std::thread.
//
// Work is split into tasks whose boundaries do not depend on the thread
// count, and each task's arithmetic is the same whichever thread runs it,
// so results are bit-identical for any thread count. (std::thread rather
// than OpenMP: no compiler flag leaks into users' builds, and Eigen's own
// OpenMP GEMM threading, which would change summation order, stays off.)
#pragma once

#include "headmix/core/types.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

namespace headmix {

/// Run `fn(task, worker)` for task in [0, tasks) on up to `threads` workers
/// (worker in [0, threads)). Workers take the next task from a shared
/// counter, so uneven tasks (causal blocks) still balance. Which worker runs
/// a task never changes its result; the first exception is rethrown here.
template <class Fn>
void parallel_for(Index tasks, int threads, Fn&& fn) {
  const int workers = static_cast<int>(std::clamp<Index>(tasks, 1, std::max(1, threads)));
  if (workers <= 1) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  std::atomic<Index> next{0};
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
  auto run = [&](int w) {
    try {
      for (Index t = next++; t < tasks; t = next++) fn(t, w);
    } catch (...) {
      errors[static_cast<std::size_t>(w)] = std::current_exception();
      next = tasks;  // stop handing out work
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// `out = in · Wᵀ + b` over many rows, in fixed chunks of rows so that the
/// GEMM shapes (and so the results) do not depend on the thread count.
template <class T, class LinearT>
void project_rows(const LinearT& linear, const Eigen::Map<const Matrix<T>>& in, Eigen::Map<Matrix<T>> out, int threads) {
  constexpr Index chunk = 256;
  const Index n = in.rows();
  parallel_for((n + chunk - 1) / chunk, threads, [&](Index c, int) {
    const Index r0 = c * chunk, rows = std::min(chunk, n - r0);
    linear.apply(in.middleRows(r0, rows), out.middleRows(r0, rows));
  });
}

}  // namespace headmix
