// Paired comparisons: the measurement behind every ratio the suite prints.
//
// A ratio of two times taken minutes apart on a shared machine measures the
// machine's load as much as the code. So each ratio here comes from one
// comparison that builds both sides, warms both, and then alternates them:
// pair i times side A then side B (A B), pair i + 1 times B then A (B A),
// so that neither side always runs first, after a warm cache or a cold one.
// Each pair gives one ratio, A's time over B's; the comparison reports the
// median of those ratios and their interquartile range, and flags a ratio
// whose quartiles lie more than 10% from its median. At least min_pairs
// pairs; more while the comparison is under its time budget.
//
// One "repetition" of a side is calls_per_rep back-to-back calls, timed
// together so that short calls (a decoding step) are not timed at the
// clock's resolution; per-call times are that time / calls_per_rep.
//
// Two clocks are read around every repetition: wall time, and the calling
// thread's CPU time. A comparison whose two sides both run on the calling
// thread (headmix, torch and OpenBLAS at 1 thread all do) takes its ratio
// from that thread's CPU time: its latency minus the time other processes
// took from its core, so the ratio moves far less when the machine is
// shared (with five compilers on a 2-core machine, two runs' wall-time
// ratios differed by up to 21%, their CPU-time ratios by up to 9%; caches
// and memory bandwidth stay shared either way). The thread's clock, not the
// process's: worker threads that an earlier multi-threaded row left
// spinning (OpenBLAS's spin for ~0.1 s after a call) would otherwise be
// charged to whichever side runs next. A comparison with a multi-threaded
// side takes wall time: its latency is the point.
//
// A comparison on the CPU clock also keeps the calling thread on one CPU
// (PairSettings::cpu) while it runs, so that both sides of every pair run
// on the same core. The two vCPUs of the VM in docs/bench/reproducibility.md
// are not alike: pinned there, the same forward call took 3-4% longer on
// the second, whose read bandwidth moved between 28 and 37 GB/s from one
// process to the next where the first held 41-43. Unpinned, three runs of
// the decoding table in a row differed by up to 58-74% in a ratio; pinned,
// by up to 19-37% (the rest is the host's memory contention). Threads that
// multi-threaded rows start are not affected: the calling thread is pinned
// only while a one-thread comparison is timed.
//
// A side that leaves threads spinning declares a settle time; the
// comparison then pauses that long before each repetition of either side,
// so that no repetition shares the cores with the other side's idle spin,
// and then makes one untimed call of the side: the first call after the
// pause finds the cores idle (on the Zen 5 VM of round 38, headmix's
// 2-thread forward at T = 1024 took 24-43 ms a call timed so, 22-26 ms
// after a warm-up call; torch's side did not move).
//
// Warming runs both sides, as they will alternate, until a round of both
// takes no page fault (at most PairSettings::max_warm_rounds, within the
// budget): a call that touches fresh memory pays the kernel for every page
// (a torch call that grew its heap took 2.5-3.6x as long), and some sides
// reach their steady state only after several calls. A repetition that
// still takes faults is counted, like a preempted one, so that a row whose
// side never settles shows why (the suite grows the heap ahead of torch's
// rows for that reason: suite_main.cpp).
#pragma once

#include <sys/resource.h>
#include <time.h>
#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace headmix::bench {

struct PairSettings {
  int min_pairs = 5;
  int max_pairs = 25;
  double budget_seconds = 1.5;  // keep adding pairs (up to max_pairs) until then
  double min_rep_seconds = 0.03;  // a repetition is at least this long
  double flag_spread = 0.10;      // quartiles beyond ±10% of the median
  int max_warm_rounds = 8;        // warm until a round of both sides takes no page fault, at most this many
  int cpu = -1;                   // CPU-clock comparisons run pinned to this CPU; -1: not pinned
};

/// While alive, keeps the calling thread on CPU `cpu` (none if cpu < 0),
/// then gives it back the CPUs it had. Linux only; elsewhere it does nothing.
class PinnedThread {
 public:
  explicit PinnedThread(int cpu) {
#ifdef __linux__
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof saved_, &saved_) != 0) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pinned_ = sched_setaffinity(0, sizeof one, &one) == 0;
#else
    (void)cpu;
#endif
  }
  ~PinnedThread() {
#ifdef __linux__
    if (pinned_) sched_setaffinity(0, sizeof saved_, &saved_);
#endif
  }
  PinnedThread(const PinnedThread&) = delete;
  PinnedThread& operator=(const PinnedThread&) = delete;
  bool pinned() const { return pinned_; }

 private:
#ifdef __linux__
  cpu_set_t saved_;
#endif
  bool pinned_ = false;
};

/// The CPUs the calling thread may run on, in increasing order (empty where
/// that is not known).
inline std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
#endif
  return cpus;
}

/// One side of a comparison: a name and a call that does one unit of work
/// (one forward, one decoding step, one GEMM) on state it owns.
struct Side {
  std::string label;
  std::function<void()> call;
  double settle_seconds = 0;  // pause before each repetition of this comparison
};

/// Median and quartiles (linear interpolation) of a sample, plus min/max.
struct Summary {
  double median = 0, q1 = 0, q3 = 0, min = 0, max = 0;
};

inline double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double at = q * double(sorted.size() - 1);
  const std::size_t lo = std::size_t(std::floor(at)), hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (at - double(lo)) * (sorted[hi] - sorted[lo]);
}

inline Summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Summary s;
  if (v.empty()) return s;
  s.median = quantile(v, 0.5);
  s.q1 = quantile(v, 0.25);
  s.q3 = quantile(v, 0.75);
  s.min = v.front();
  s.max = v.back();
  return s;
}

/// Largest relative distance of the quartiles from the median (0.04: ±4%).
inline double spread(const Summary& s) {
  if (s.median <= 0) return 0;
  return std::max(s.q3 / s.median - 1, 1 - s.q1 / s.median);
}

enum class Clock { wall, cpu };

inline const char* clock_name(Clock c) { return c == Clock::cpu ? "cpu" : "wall"; }

struct SideTimes {
  std::string label;
  int calls_per_rep = 1;
  std::vector<double> seconds;      // wall time per call, one entry per repetition
  std::vector<double> cpu_seconds;  // the calling thread's CPU time per call, same repetitions
  // Repetitions during which the kernel preempted a thread of this process
  // (involuntary context switches, getrusage): another process wanted the
  // core. Not discarded (the median takes care of a few); reported so that
  // a noisy comparison shows why.
  int preempted_reps = 0;
  // Repetitions during which the process took page faults (getrusage's
  // minor and major faults): memory touched for the first time, not the
  // steady state. Counted and reported, not discarded.
  int faulted_reps = 0;
  const std::vector<double>& times(Clock c) const { return c == Clock::cpu ? cpu_seconds : seconds; }
  Summary summary(Clock c) const { return summarize(times(c)); }
};

struct PairedResult {
  SideTimes a, b;
  Clock clock = Clock::wall;   // the clock of `ratios`
  std::vector<double> ratios;  // per pair: scale · time(A) / time(B) on `clock`
  std::vector<double> wall_ratios, cpu_ratios;  // the same on each clock
  double scale = 1;
  Summary ratio;
  bool flagged = false;
  double wall_seconds = 0;
};

namespace detail {
using Steady = std::chrono::steady_clock;

inline double seconds_since(Steady::time_point t0) {
  return std::chrono::duration<double>(Steady::now() - t0).count();
}

inline long involuntary_switches() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_nivcsw;
}

inline long page_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt + u.ru_majflt;
}

inline double cpu_now() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// Time one repetition of `s` (wall clock, per call); record it, and its CPU
// time and preemption, in `out` when given.
inline double time_rep(const Side& s, int calls, SideTimes* out = nullptr, double settle = 0) {
  if (settle > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(settle));
    s.call();
  }
  const long switches = involuntary_switches(), faults = page_faults();
  const double cpu0 = cpu_now();
  const auto t0 = Steady::now();
  for (int i = 0; i < calls; ++i) s.call();
  const double t = seconds_since(t0) / calls;
  if (out) {
    out->seconds.push_back(t);
    out->cpu_seconds.push_back((cpu_now() - cpu0) / calls);
    if (involuntary_switches() != switches) ++out->preempted_reps;
    if (page_faults() != faults) ++out->faulted_reps;
  }
  return t;
}

// First call of a side (it sizes workspaces and caches), then one timed
// call that sets its calls per repetition.
inline int first_calls(const Side& s, const PairSettings& set) {
  if (!s.call) throw std::invalid_argument("paired comparison: side '" + s.label + "' has no call");
  s.call();
  const double once = time_rep(s, 1);
  return std::max(1, int(std::ceil(set.min_rep_seconds / std::max(once, 1e-9))));
}

// Run rounds of repetitions, each side's in turn as the comparison will
// alternate them, until a round takes no page fault (at most
// max_warm_rounds, or the budget). One side warmed alone may stop faulting
// and fault again once the other side's allocations interleave with its own.
inline void settle_heap(const std::vector<std::pair<const Side*, int>>& sides, const PairSettings& set) {
  const auto start = Steady::now();
  for (int round = 1;; ++round) {
    const long faults = page_faults();
    for (const auto& [side, calls] : sides)
      for (int i = 0; i < calls; ++i) side->call();
    if (page_faults() == faults || round >= set.max_warm_rounds || seconds_since(start) >= set.budget_seconds) break;
  }
}
}  // namespace detail

/// Alternate A and B (A B, B A, A B, ...) and summarize the per-pair
/// ratios scale · time(A) / time(B) on `clock`.
inline PairedResult compare(const Side& a, const Side& b, const PairSettings& set, Clock clock, double scale = 1) {
  const PinnedThread pin(clock == Clock::cpu ? set.cpu : -1);
  const auto t0 = detail::Steady::now();
  PairedResult r;
  r.clock = clock;
  r.scale = scale;
  r.a.label = a.label;
  r.b.label = b.label;
  r.a.calls_per_rep = detail::first_calls(a, set);
  r.b.calls_per_rep = detail::first_calls(b, set);
  detail::settle_heap({{&a, r.a.calls_per_rep}, {&b, r.b.calls_per_rep}}, set);
  const double settle = std::max(a.settle_seconds, b.settle_seconds);
  const auto start = detail::Steady::now();  // the budget counts timed pairs, pauses excluded
  double paused = 0;
  for (int pair = 0;; ++pair) {
    if (pair % 2 == 0) {
      detail::time_rep(a, r.a.calls_per_rep, &r.a, settle);
      detail::time_rep(b, r.b.calls_per_rep, &r.b, settle);
    } else {
      detail::time_rep(b, r.b.calls_per_rep, &r.b, settle);
      detail::time_rep(a, r.a.calls_per_rep, &r.a, settle);
    }
    paused += 2 * settle;
    r.wall_ratios.push_back(scale * r.a.seconds.back() / r.b.seconds.back());
    r.cpu_ratios.push_back(scale * r.a.cpu_seconds.back() / r.b.cpu_seconds.back());
    const int done = pair + 1;
    if (done >= set.min_pairs && (done >= set.max_pairs || detail::seconds_since(start) - paused >= set.budget_seconds)) break;
  }
  r.ratios = clock == Clock::cpu ? r.cpu_ratios : r.wall_ratios;
  r.ratio = summarize(r.ratios);
  r.flagged = spread(r.ratio) > set.flag_spread;
  r.wall_seconds = detail::seconds_since(t0);
  return r;
}

/// One side alone (a time with no partner, e.g. LSH where dense attention
/// does not fit): warmed, then at least min_pairs repetitions; pinned as
/// compare() pins when read on the CPU clock.
inline SideTimes series(const Side& s, const PairSettings& set, Clock clock) {
  const PinnedThread pin(clock == Clock::cpu ? set.cpu : -1);
  SideTimes t;
  t.label = s.label;
  t.calls_per_rep = detail::first_calls(s, set);
  detail::settle_heap({{&s, t.calls_per_rep}}, set);
  const auto start = detail::Steady::now();
  for (int rep = 1;; ++rep) {
    detail::time_rep(s, t.calls_per_rep, &t);
    if (rep >= set.min_pairs && (rep >= set.max_pairs || detail::seconds_since(start) >= set.budget_seconds)) break;
  }
  return t;
}

}  // namespace headmix::bench
