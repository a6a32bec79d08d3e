// The machine's yardstick: one Eigen GEMM of the layer's size (the fused
// Q/K/V projection, [T, D] x [D, 3D]), same compiler flags and backend as
// the layers, so layer GFLOP/s can be read against it.
#include "bench_common.hpp"

namespace {

void BM_GemmYardstick(benchmark::State& state) {
  using namespace headmix;
  const Index T = state.range(0), D = state.range(1);
  Matrix<float> x = bench::random_matrix<float>(T, D, 1.0, 1);
  Matrix<float> w = bench::random_matrix<float>(D, 3 * D, 1.0, 2);
  Matrix<float> y(T, 3 * D);
  for (auto _ : state) {
    y.noalias() = x * w;
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  FlopCount f;
  f.projection_macs = T * D * 3 * D;
  bench::report(state, f, 0);
}

}  // namespace

BENCHMARK(BM_GemmYardstick)
    ->ArgNames({"T", "D"})
    ->ArgsProduct({{128, 256, 512, 1024, 2048, 4096}, {768, 1024}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
