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

constexpr Index kD = 1024, kH = 16;

Mha<float> make_mha(bool causal) { return bench::make_mha({kD, kH, causal, 1}); }
Dcmha<float> make_dcmha(Index block_rows = 0) { return bench::make_dcmha({kD, kH, true, 1}, block_rows); }

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

}  // namespace

BENCHMARK(BM_DCMHA_MHA_baseline)->ArgNames({"T"})->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DCMHA)
    ->ArgNames({"T", "block_rows"})
    ->Args({1024, 0})->Args({2048, 0})->Args({4096, 0})->Args({4096, 64})->Args({4096, 128})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
