// The suite's main: records which GEMM backend and SIMD set ran, counts heap
// allocations, runs every registered benchmark, and closes with the tables
// the README reads the targets from, all from this one run:
//
//   * each variant's time relative to MHA at the same shape, next to its
//     analytic FLOP ratio to MHA (entries `Suite_<variant>/<args>` against
//     `Suite_MHA/<args>` with identical argument strings);
//   * the 2-thread speedup of every suite entry (threads:1 against threads:2);
//   * MHA's GFLOP/s against the GEMM yardstick at the same T and D;
//   * headmix MHA's time relative to PyTorch's, when the torch baseline is built;
//   * decoding: the time of a cached step against recomputing the forward.
#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

// ---- allocation counting ------------------------------------------------------
// glibc's allocator under a counting front: every malloc-family call of the
// process (operator new, Eigen's aligned buffers, std::thread) goes through
// these, so "allocs" in the counters is the true number of heap
// allocations per call. Not with other C libraries, and not under a
// sanitizer (which owns malloc): then there is no "allocs" counter.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HEADMIX_BENCH_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define HEADMIX_BENCH_SANITIZED 1
#endif
#endif
#if defined(__GLIBC__) && !defined(HEADMIX_BENCH_SANITIZED)
#define HEADMIX_BENCH_COUNTS_ALLOCATIONS 1
#endif

namespace {
std::atomic<long> g_heap_allocations{0};
}

#ifdef HEADMIX_BENCH_COUNTS_ALLOCATIONS
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);

void* malloc(std::size_t n) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(n);
}
void* calloc(std::size_t n, std::size_t size) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(n, size);
}
void* realloc(void* p, std::size_t n) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(p, n);
}
void* memalign(std::size_t align, std::size_t n) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(align, n);
}
void* aligned_alloc(std::size_t align, std::size_t n) { return memalign(align, n); }
int posix_memalign(void** out, std::size_t align, std::size_t n) {
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  void* p = memalign(align, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
}  // extern "C"
#endif

namespace headmix::bench {
long heap_allocations() {
#ifdef HEADMIX_BENCH_COUNTS_ALLOCATIONS
  return g_heap_allocations.load(std::memory_order_relaxed);
#else
  return -1;
#endif
}
}  // namespace headmix::bench

// ---- closing tables -------------------------------------------------------------
namespace {

constexpr const char* kBaseline = "Suite_MHA";

struct Result {
  std::string family, args;
  double seconds, flops, gflops;
};

// The value of `name:<number>` in an argument string "a:1/b:2", or -1.
long arg_value(const std::string& args, const std::string& name) {
  const std::string key = name + ":";
  for (std::size_t at = 0; at < args.size(); at = args.find('/', at) + 1) {
    if (args.compare(at, key.size(), key) == 0) return std::strtol(args.c_str() + at + key.size(), nullptr, 10);
    if (args.find('/', at) == std::string::npos) break;
  }
  return -1;
}

// The shape arguments of a run's name: without "/iterations:N" and
// "/real_time", which say how it was timed.
std::string shape_args(const std::string& args) {
  std::string out;
  for (std::size_t at = 0; at <= args.size();) {
    const std::size_t end = std::min(args.find('/', at), args.size());
    const std::string part = args.substr(at, end - at);
    if (part != "real_time" && part.rfind("iterations:", 0) != 0) out += (out.empty() ? "" : "/") + part;
    at = end + 1;
  }
  return out;
}

double counter(const benchmark::BenchmarkReporter::Run& r, const char* name) {
  const auto it = r.counters.find(name);
  return it == r.counters.end() ? 0.0 : double(it->second);
}

class SuiteReporter : public benchmark::ConsoleReporter {
 public:
  using benchmark::ConsoleReporter::ConsoleReporter;

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred || r.run_type != Run::RT_Iteration) continue;
      const std::string name = r.benchmark_name();
      const auto slash = name.find('/');
      if (slash == std::string::npos) continue;
      const double seconds = r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit);
      results_.push_back({name.substr(0, slash), shape_args(name.substr(slash + 1)), seconds, counter(r, "FLOPs"),
                          counter(r, "GFLOP/s")});
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void Finalize() override {
    relative_to_mha();
    thread_speedups();
    against_yardstick();
    against_torch();
    decoding();
    ConsoleReporter::Finalize();
  }

 private:
  const Result* find(const std::string& family, const std::string& args) const {
    for (const auto& r : results_)
      if (r.family == family && r.args == args) return &r;
    return nullptr;
  }

  void relative_to_mha() const {
    bool header = false;
    for (const auto& r : results_) {
      if (r.family == kBaseline || r.family.rfind("Suite_", 0) != 0) continue;
      const Result* mha = find(kBaseline, r.args);
      if (!mha) continue;
      if (!header) {
        std::printf("\nTime relative to MHA at the same shape (same run); FLOP ratio = analytic FLOPs / MHA's,\n"
                    "time/FLOP = the time ratio over the FLOP ratio (1.00: as efficient as MHA per FLOP):\n");
        std::printf("  %-18s %-34s %8s %10s %10s\n", "variant", "shape", "time", "FLOP ratio", "time/FLOP");
        header = true;
      }
      const double time = r.seconds / mha->seconds;
      const double flops = mha->flops > 0 ? r.flops / mha->flops : 0;
      std::printf("  %-18s %-34s %7.2fx %9.3fx %9.2fx\n", r.family.c_str(), r.args.c_str(), time, flops,
                  flops > 0 ? time / flops : 0.0);
    }
  }

  void thread_speedups() const {
    bool header = false;
    for (const auto& r : results_) {
      if (r.family.rfind("Suite_", 0) != 0 || arg_value(r.args, "threads") != 2) continue;
      std::string one = r.args;
      one.replace(one.find("threads:2"), 9, "threads:1");
      const Result* single = find(r.family, one);
      if (!single) continue;
      if (!header) {
        std::printf("\n2-thread speedup (time at threads:1 / time at threads:2):\n");
        header = true;
      }
      std::printf("  %-18s %-34s %6.2fx\n", r.family.c_str(), one.substr(0, one.find("/threads")).c_str(),
                  single->seconds / r.seconds);
    }
  }

  void against_yardstick() const {
    bool header = false;
    for (const auto& r : results_) {
      if (r.family != kBaseline || arg_value(r.args, "threads") != 1) continue;
      const long T = arg_value(r.args, "T"), D = arg_value(r.args, "D");
      const Result* gemm = find("BM_GemmYardstick", "T:" + std::to_string(T) + "/D:" + std::to_string(D));
      if (!gemm || gemm->gflops <= 0) continue;
      if (!header) {
        std::printf("\nMHA GFLOP/s against the GEMM yardstick ([T, D] x [D, 3D]) at the same T and D, 1 thread:\n");
        header = true;
      }
      std::printf("  %-34s %7.1f / %7.1f GFLOP/s = %5.1f%%\n", r.args.c_str(), r.gflops, gemm->gflops,
                  100 * r.gflops / gemm->gflops);
    }
  }

  void against_torch() const {
    bool header = false;
    for (const auto& r : results_) {
      if (r.family != kBaseline) continue;
      const Result* torch = find("Suite_TorchMHA", r.args);
      if (!torch) continue;
      if (!header) {
        std::printf("\nheadmix MHA time relative to torch::nn::MultiheadAttention (below 1: headmix is faster):\n");
        header = true;
      }
      std::printf("  %-34s %6.2fx\n", r.args.c_str(), r.seconds / torch->seconds);
    }
  }

  void decoding() const {
    bool header = false;
    const std::string step = "Decode_Step_";
    for (const auto& r : results_) {
      if (r.family.rfind(step, 0) != 0) continue;
      const std::string variant = r.family.substr(step.size());
      const Result* full = find("Decode_Recompute_" + variant, r.args);
      if (!full) continue;
      if (!header) {
        std::printf("\nDecoding one token: cached step against recomputing the causal forward over S positions:\n");
        header = true;
      }
      std::printf("  %-14s %-8s step %9.3f ms   recompute %9.1f ms   %8.0fx\n", variant.c_str(), r.args.c_str(),
                  r.seconds * 1e3, full->seconds * 1e3, full->seconds / r.seconds);
    }
  }

  std::vector<Result> results_;
};

}  // namespace

#ifdef EIGEN_USE_BLAS
extern "C" void openblas_set_num_threads(int);
#endif

int main(int argc, char** argv) {
#ifdef EIGEN_USE_BLAS
  // headmix runs its own workers (options.threads); OpenBLAS's threads on
  // top of them oversubscribe the cores (2 threads ran 4x slower than 1).
  openblas_set_num_threads(1);
  benchmark::AddCustomContext("gemm_backend",
                              "BLAS through EIGEN_USE_BLAS (" HEADMIX_BLAS_NAME "), OpenBLAS threads: 1");
#else
  benchmark::AddCustomContext("gemm_backend", "Eigen's built-in GEMM (no BLAS)");
#endif
  // OpenBLAS (EIGEN_USE_BLAS, and PyTorch's baseline) picks its kernel from
  // OPENBLAS_CORETYPE, and its thread count from OPENBLAS_NUM_THREADS: torch's
  // "threads:1" still runs its GEMMs on every core unless that is 1.
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  benchmark::AddCustomContext("openblas_coretype", core ? core : "(unset: OpenBLAS detects the CPU)");
  const char* blas_threads = std::getenv("OPENBLAS_NUM_THREADS");
  benchmark::AddCustomContext("openblas_num_threads", blas_threads ? blas_threads : "(unset: one per core)");
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  SuiteReporter reporter(isatty(1) ? benchmark::ConsoleReporter::OO_ColorTabular
                                   : benchmark::ConsoleReporter::OO_Tabular);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
