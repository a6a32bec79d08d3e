// The studies' main (headmix_bench: the per-variant Google Benchmark runs,
// bench_<name>.cpp): records which GEMM backend and SIMD set ran and counts
// heap allocations. The suite proper, with its paired ratios, is
// headmix_suite (suite_main.cpp).
#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>

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

#ifdef HEADMIX_BENCH_COUNTS_ALLOCATIONS
namespace {
std::atomic<long> g_heap_allocations{0};
}

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
  // OpenBLAS (EIGEN_USE_BLAS) picks its kernel from OPENBLAS_CORETYPE.
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  benchmark::AddCustomContext("openblas_coretype", core ? core : "(unset: OpenBLAS detects the CPU)");
  const char* blas_threads = std::getenv("OPENBLAS_NUM_THREADS");
  benchmark::AddCustomContext("openblas_num_threads", blas_threads ? blas_threads : "(unset: one per core)");
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
