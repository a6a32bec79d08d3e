// Talking-Heads latency and GFLOP/s (analytic FLOPs) at BERT-base width,
// next to MHA on the same shapes in the same run.
//
// The target: at B = 1, T = S = 1024, D = 768, H = 12, float,
// time(BM_TalkingHeads/.../mix:3) / time(BM_TalkingHeads_MHA/...) <= 1.25.
// BM_TalkingHeads_MHA is the same setup as bench_mha.cpp's BM_MHA, here so
// that one filter (--benchmark_filter=TalkingHeads) times both side by side.
#include "bench_common.hpp"

#include <algorithm>
#include <vector>

namespace {

using namespace headmix;

// Mixing matrices near the identity, as a trained layer's tend to be; their
// values do not change the work.
Matrix<float> mixing_matrix(Index heads, unsigned seed) {
  Matrix<float> m = bench::random_matrix<float>(heads, heads, 0.1, seed);
  m.diagonal().array() += 1.0f;
  return m;
}

// mix: bit 0 = pre-softmax mix, bit 1 = post-softmax mix.
void BM_TalkingHeads(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = state.range(2);
  const bool causal = state.range(3) != 0;
  const int mix = static_cast<int>(state.range(4));
  TalkingHeadsWeights<float> w;
  w.q = bench::random_linear<float>(D, D, 1);
  w.k = bench::random_linear<float>(D, D, 2);
  w.v = bench::random_linear<float>(D, D, 3);
  w.o = bench::random_linear<float>(D, D, 4);
  if (mix & 1) w.pre_softmax = mixing_matrix(H, 6);
  if (mix & 2) w.post_softmax = mixing_matrix(H, 7);
  TalkingHeadsOptions opt;
  opt.num_heads = H;
  opt.causal = causal;
  TalkingHeads<float> layer(w, opt);
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

// The MHA baseline of the ratio (BM_MHA's setup).
void BM_TalkingHeads_MHA(benchmark::State& state) {
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
  layer.forward(in, as_batch(y), ws);
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
  }
  bench::report(state, layer.flops(1, T, T), ws.bytes());
}

// On a shared, noisy machine the fastest repetition is the steadiest
// estimate: --benchmark_repetitions=N reports it as _min.
double fastest(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }

}  // namespace

BENCHMARK(BM_TalkingHeads_MHA)
    ->ArgNames({"T", "D", "H", "causal"})
    ->Args({128, 768, 12, 0})->Args({1024, 768, 12, 0})->Args({1024, 768, 12, 1})
    ->ComputeStatistics("min", fastest)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TalkingHeads)
    ->ArgNames({"T", "D", "H", "causal", "mix"})
    ->Args({128, 768, 12, 0, 3})
    ->Args({1024, 768, 12, 0, 3})->Args({1024, 768, 12, 0, 1})->Args({1024, 768, 12, 0, 2})
    ->Args({1024, 768, 12, 1, 3})
    ->ComputeStatistics("min", fastest)->Unit(benchmark::kMillisecond)->UseRealTime();
