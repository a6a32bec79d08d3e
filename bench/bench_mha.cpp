// MHA at BERT-base width over the query block size (block_rows: the rows of
// one pipeline task, so one head's score tile is block_rows x S): the
// trade between GEMM efficiency (bigger tiles repack K_h and V_h less often)
// and scratch (block_rows · S per worker). The suite's MHA (headmix_suite) uses the
// default, 64.
#include "bench_common.hpp"

namespace {

using namespace headmix;

void BM_MhaSweep(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = state.range(2);
  const bool causal = state.range(3) != 0;
  const Index block_rows = state.range(4);
  MhaWeights<float> w{bench::random_linear<float>(D, D, 1), bench::random_linear<float>(D, D, 2),
                      bench::random_linear<float>(D, D, 3), bench::random_linear<float>(D, D, 4)};
  MhaOptions opt;
  opt.num_heads = H;
  opt.causal = causal;
  opt.block_rows = block_rows;
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
    ->ArgNames({"T", "D", "H", "causal", "block_rows"})
    ->ArgsProduct({{1024, 4096}, {768}, {12}, {0, 1}, {16, 32, 64, 128, 256}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
