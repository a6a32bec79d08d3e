// MHA latency and GFLOP/s (analytic FLOPs) at BERT-base width over a
// sweep of lengths (the shared-shape suite entry is bench_suite_mha.cpp).
#include "bench_common.hpp"

namespace {

using namespace headmix;

void BM_MhaSweep(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = state.range(2);
  const bool causal = state.range(3) != 0;
  MhaWeights<float> w{bench::random_linear<float>(D, D, 1), bench::random_linear<float>(D, D, 2),
                      bench::random_linear<float>(D, D, 3), bench::random_linear<float>(D, D, 4)};
  MhaOptions opt;
  opt.num_heads = H;
  opt.causal = causal;
  Mha<float> layer(w, opt);
  Matrix<float> x = bench::random_matrix<float>(T, D, 1.0, 5);
  Matrix<float> y(T, D);
  Workspace<float> ws;
  AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);  // size the workspace outside the timed loop
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
  }
  bench::report(state, layer.flops(1, T, T), ws.bytes());
}

}  // namespace

BENCHMARK(BM_MhaSweep)
    ->ArgNames({"T", "D", "H", "causal"})
    ->Args({128, 768, 12, 0})->Args({512, 768, 12, 0})->Args({1024, 768, 12, 0})->Args({2048, 768, 12, 0})
    ->Args({2048, 768, 12, 1})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
