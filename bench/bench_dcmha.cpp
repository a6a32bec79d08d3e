// DCMHA against MHA of the same size, in the same run: B = 1, D = 1024,
// H = 16 (d = 64), causal, float. DCMHA as the released DCFormer models:
// G = 1, R = 2, K = 4H, pre- and post-compose with query- and key-wise
// terms, no static term. Counters: analytic FLOPs (and GFLOP/s from them),
// scratch memory, and for DCMHA the analytic FLOP ratio to MHA
// (flop_ratio_vs_mha), to set beside the measured time ratio.
//
//   headmix_bench --benchmark_filter='DCMHA'
#include "bench_common.hpp"

namespace {

using namespace headmix;

constexpr Index kD = 1024, kH = 16, kR = 2, kK = 4 * kH;

template <class T>
Tensor<T> random_tensor(std::vector<Index> shape, double scale, unsigned seed) {
  Tensor<T> t(std::move(shape));
  const Matrix<T> m = bench::random_matrix<T>(1, t.size(), scale, seed);
  std::copy_n(m.data(), t.size(), t.data());
  return t;
}

Mha<float> make_mha(bool causal) {
  MhaWeights<float> w{bench::random_linear<float>(kD, kD, 1), bench::random_linear<float>(kD, kD, 2),
                      bench::random_linear<float>(kD, kD, 3), bench::random_linear<float>(kD, kD, 4)};
  MhaOptions opt;
  opt.num_heads = kH;
  opt.causal = causal;
  return Mha<float>(std::move(w), opt);
}

Dcmha<float> make_dcmha(Index block_rows = 0) {
  DcmhaWeights<float> w;
  w.q = bench::random_linear<float>(kD, kD, 1);
  w.k = bench::random_linear<float>(kD, kD, 2);
  w.v = bench::random_linear<float>(kD, kD, 3);
  w.o = bench::random_linear<float>(kD, kD, 4);
  w.dw1 = random_tensor<float>({kD, 1, 4, kK}, 1.0 / std::sqrt(double(kD)), 6);
  w.qkw = random_tensor<float>({1, 4, kK, 2 * kR, kH}, 1.0 / std::sqrt(double(kK)), 7);
  w.dd = random_tensor<float>({kD, 1, 4 * kH}, 1.0 / std::sqrt(double(kD)), 8);
  DcmhaOptions opt;
  opt.num_heads = kH;
  opt.rank = kR;
  opt.causal = true;
  opt.block_rows = block_rows;
  return Dcmha<float>(std::move(w), opt);
}

// The MHA yardstick at DCMHA's shapes (BM_MHA covers D = 768 only).
void BM_DCMHA_MHA_baseline(benchmark::State& state) {
  const Index T = state.range(0);
  const Mha<float> layer = make_mha(true);
  const Matrix<float> x = bench::random_matrix<float>(T, kD, 1.0, 5);
  Matrix<float> y(T, kD);
  Workspace<float> ws;
  const AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
  }
  bench::report(state, layer.flops(1, T, T), ws.bytes());
}

void BM_DCMHA(benchmark::State& state) {
  const Index T = state.range(0), block_rows = state.range(1);
  const Dcmha<float> layer = make_dcmha(block_rows);
  const Matrix<float> x = bench::random_matrix<float>(T, kD, 1.0, 5);
  Matrix<float> y(T, kD);
  Workspace<float> ws;
  const AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
  }
  bench::report(state, layer.flops(1, T, T), ws.bytes());
  const DcmhaFlops f = layer.flop_breakdown(1, T, T);
  state.counters["flop_ratio_vs_mha"] = double(f.total().macs()) / double(make_mha(true).flops(1, T, T).macs());
  state.counters["dynamic_MFLOP"] = 2e-6 * double(f.dynamic_macs);
  state.counters["compose_MFLOP"] = 2e-6 * double(f.compose_macs);
}

// One decoding step (one new token) with about S positions cached: O(S)
// per head. The cache is refilled (untimed) every 64 tokens.
void BM_DCMHA_Step(benchmark::State& state) {
  const Index S = state.range(0), room = 64;
  const Dcmha<float> layer = make_dcmha();
  const Matrix<float> x = bench::random_matrix<float>(S + room, kD, 1.0, 5);
  SequenceCache<float> cache(1, S + room);
  Workspace<float> ws;
  Matrix<float> y(S, kD);
  auto refill = [&] {
    cache.reset();
    layer.step(ConstBatchView<float>(x.data(), 1, S - 1, kD), cache, BatchView<float>(y.data(), 1, S - 1, kD), ws);
  };
  refill();
  Matrix<float> out(1, kD);
  for (auto _ : state) {
    if (cache.size() == cache.capacity()) {
      state.PauseTiming();
      refill();
      state.ResumeTiming();
    }
    layer.step(ConstBatchView<float>(x.data() + cache.size() * kD, 1, 1, kD), cache, as_batch(out), ws);
    benchmark::DoNotOptimize(out.data());
  }
  bench::report(state, layer.flops(1, 1, S), ws.bytes());
}

}  // namespace

BENCHMARK(BM_DCMHA_MHA_baseline)->ArgNames({"T"})->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DCMHA)
    ->ArgNames({"T", "block_rows"})
    ->Args({1024, 0})->Args({2048, 0})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DCMHA_Step)->ArgNames({"S"})->Arg(1024)->Arg(2048)->Unit(benchmark::kMicrosecond)->UseRealTime();
