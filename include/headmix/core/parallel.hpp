// A parallel loop on persistent std::thread workers.
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
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace headmix {

namespace detail {

// The process's worker threads. Starting threads costs tens of microseconds
// and a heap allocation each, and a decoding step calls parallel_for several
// times per token, so workers are started once and then woken per loop.
// One loop owns the pool at a time; a loop that finds it busy (another user
// thread, or a nested loop) starts threads of its own instead.
//
// Waking a blocked thread is slow too: on a 2-vCPU VM a loop of two empty
// tasks took 31 µs when the hand-over went through the condition variables.
// A layer's loops follow each other within microseconds (a decoding step
// runs several per token), so a worker polls for the next loop, and the
// caller for the workers' end, for kSpin before it blocks: 1.4-2 µs then.
// The poll is short: a 100 µs one made CollabHead 2% slower on 2 threads at
// T = 1024, for a reason not found.
class WorkerPool {
 public:
  using Job = void (*)(void* context, int worker);

  static WorkerPool& instance() {
    static WorkerPool pool;
    return pool;
  }

  /// Run job(context, w) for w in [0, workers): w = 0 on the calling thread,
  /// the others on pool threads. Returns false, having run nothing, if the
  /// pool is busy. `job` must not throw.
  bool try_run(int workers, Job job, void* context) {
    std::unique_lock<std::mutex> owner(busy_, std::try_to_lock);
    if (!owner.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(m_);
      while (static_cast<int>(threads_.size()) < workers - 1) {
        const int w = static_cast<int>(threads_.size()) + 1;
        threads_.emplace_back([this, w, seen = generation_.load()] { serve(w, seen); });
      }
      job_ = job, context_ = context, active_ = workers - 1, pending_ = workers - 1;
      ++generation_;
    }
    wake_.notify_all();
    job(context, 0);
    spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [this] { return pending_ == 0; });
    return true;
  }

  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  WorkerPool() = default;

  static constexpr std::chrono::microseconds kSpin{20};

  // Poll ready() until it holds or kSpin has passed.
  template <class Ready>
  static void spin_until(Ready ready) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (unsigned i = 1; !ready(); ++i)
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return;
  }

  void serve(int worker, std::uint64_t seen) {
    for (;;) {
      Job job;
      void* context;
      spin_until([&] {
        return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
      });
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (worker > active_) continue;  // this loop needs fewer workers
        job = job_, context = context_;
      }
      job(context, worker);
      std::lock_guard<std::mutex> lock(m_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex busy_;  // held by the loop that owns the pool
  std::mutex m_;     // guards everything below
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  Job job_ = nullptr;
  void* context_ = nullptr;
  int active_ = 0;
  // Written under m_; atomic so that a spinning thread may read them without it.
  std::atomic<int> pending_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace detail

/// Run `fn(task, worker)` for task in [0, tasks) on up to `threads` workers
/// (worker in [0, threads)). Workers take the next task from a shared
/// counter, so uneven tasks (causal blocks) still balance. Which worker runs
/// a task never changes its result; the first exception is rethrown here.
/// Allocates nothing once the pool has started enough threads.
template <class Fn>
void parallel_for(Index tasks, int threads, Fn&& fn) {
  const int workers = static_cast<int>(std::clamp<Index>(tasks, 1, std::max(1, threads)));
  if (workers <= 1) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  std::atomic<Index> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  auto run = [&](int w) {
    try {
      for (Index t = next++; t < tasks; t = next++) fn(t, w);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
      next = tasks;  // stop handing out work
    }
  };
  using Run = decltype(run);
  const auto job = [](void* context, int w) { (*static_cast<Run*>(context))(w); };
  if (!detail::WorkerPool::instance().try_run(workers, job, &run)) {
    std::vector<std::thread> own;
    own.reserve(static_cast<std::size_t>(workers - 1));
    for (int w = 1; w < workers; ++w) own.emplace_back(run, w);
    run(0);
    for (auto& th : own) th.join();
  }
  if (error) std::rethrow_exception(error);
}

/// `out = in · Wᵀ + b` in tasks of 64 rows, or, for one task's rows (a
/// decoding step, a short chunk), of 128 output columns (two of the GEMM's
/// 64-column panels). The tasks are fixed by the shapes, so the GEMMs, and
/// the results, do not depend on the thread count, and a short input still
/// gives every thread work: tasks of 256 rows left the second thread idle
/// at T = 256. Row tasks keep their full width: splitting the columns of
/// long inputs too ran 1-2% slower. A lone last row joins the task before
/// it: one row alone takes Linear's one-row product, whose sums round
/// differently, and every row of a longer input comes from the GEMM.
template <class T, class LinearT>
void project_rows(const LinearT& linear, const Eigen::Map<const Matrix<T>>& in, Eigen::Map<Matrix<T>> out, int threads) {
  constexpr Index row_chunk = 64;
  const Index n = in.rows(), cols = out.cols();
  const Index row_tasks = n > 1 && n % row_chunk == 1 ? n / row_chunk : (n + row_chunk - 1) / row_chunk;
  const Index col_chunk = row_tasks > 1 ? std::max<Index>(1, cols) : 128;
  const Index col_tasks = std::max<Index>(1, (cols + col_chunk - 1) / col_chunk);
  parallel_for(row_tasks * col_tasks, threads, [&](Index task, int) {
    const Index r0 = task / col_tasks * row_chunk, c0 = task % col_tasks * col_chunk;
    const Index rows = task / col_tasks == row_tasks - 1 ? n - r0 : row_chunk, width = std::min(col_chunk, cols - c0);
    linear.apply_columns(in.middleRows(r0, rows), c0, out.block(r0, c0, rows, width));
  });
}

}  // namespace headmix
