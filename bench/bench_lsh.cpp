// LSH self-attention on long sequences (issue 5), with headmix's dense MHA
// of the same size beside it where it fits in memory.
//
//   D = 512, H = 8 (dh = 64), bucket_size = 64, n_hashes = 4, float, B = 1,
//   T = 4096, 16384, 65536 (dense MHA: 4096 and 16384).
//
// Counters: analytic FLOPs and GFLOP/s, the layer's workspace (scratch_MiB)
// and the process's peak resident set (peak_rss_MiB, getrusage). The peak
// is a high-water mark of the whole process, so measure one size per
// process for a clean figure, e.g.
//   headmix_bench --benchmark_filter='BM_LSH/T:65536'
// Each benchmark makes one untimed call first (sizing the workspace); a
// T = 65536 call takes seconds, a dense T = 16384 call tens of seconds.
#include "bench_common.hpp"

#include <sys/resource.h>

namespace {

using namespace headmix;

constexpr Index kD = 512, kH = 8, kBucket = 64, kHashes = 4;

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;  // Linux reports KiB
}

void report_memory(benchmark::State& state) {
  state.counters["peak_rss_MiB"] = benchmark::Counter(peak_rss_mib());
}

void BM_LSH(benchmark::State& state) {
  const Index T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  // reformer-pytorch's layout: toqk and tov without bias, to_out with bias.
  LshWeights<float> w{{bench::random_matrix<float>(kD, kD, 1.0 / std::sqrt(double(kD)), 1), {}},
                      {bench::random_matrix<float>(kD, kD, 1.0 / std::sqrt(double(kD)), 2), {}},
                      bench::random_linear<float>(kD, kD, 3),
                      {}};
  LshOptions opt;
  opt.num_heads = kH;
  opt.bucket_size = kBucket;
  opt.n_hashes = kHashes;
  opt.threads = threads;
  opt.seed = 7;
  Lsh<float> layer(std::move(w), opt);
  Matrix<float> x = bench::random_matrix<float>(T, kD, 1.0, 5);
  Matrix<float> y(T, kD);
  Workspace<float> ws;
  AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);  // size the workspace outside the timed loop
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
  }
  bench::report(state, layer.flops(1, T, T), ws.bytes());
  report_memory(state);
}

// headmix's dense MHA of the same size: Q, K, V and O projections
// [D, D], 8 heads of 64, block_rows x S score tiles.
void BM_LSH_DenseMha(benchmark::State& state) {
  const Index T = state.range(0);
  MhaWeights<float> w{bench::random_linear<float>(kD, kD, 1), bench::random_linear<float>(kD, kD, 2),
                      bench::random_linear<float>(kD, kD, 3), bench::random_linear<float>(kD, kD, 4)};
  MhaOptions opt;
  opt.num_heads = kH;
  opt.threads = static_cast<int>(state.range(1));
  Mha<float> layer(w, opt);
  Matrix<float> x = bench::random_matrix<float>(T, kD, 1.0, 5);
  Matrix<float> y(T, kD);
  Workspace<float> ws;
  AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
  }
  bench::report(state, layer.flops(1, T, T), ws.bytes());
  report_memory(state);
}

}  // namespace

// No fixed iteration count: a call longer than the minimum time (0.5 s by
// default) runs once, shorter ones a few times.
BENCHMARK(BM_LSH)
    ->ArgNames({"T", "threads"})
    ->Args({4096, 1})->Args({16384, 1})->Args({65536, 1})->Args({16384, 2})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LSH_DenseMha)
    ->ArgNames({"T", "threads"})
    ->Args({4096, 1})->Args({16384, 1})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
