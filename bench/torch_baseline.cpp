// PyTorch baseline: torch::nn::MultiheadAttention (libtorch, float, eval,
// InferenceMode) at the suite's shared shapes and thread counts, so that
// headmix's MHA can be read against it in the same run (see the
// "relative to MHA" table at the end of the output). at::set_num_threads
// bounds torch's own workers, not OpenBLAS's: for a one-core torch run
// OPENBLAS_NUM_THREADS=1 must be set as well (the context header shows it).
#include "bench_common.hpp"

#include <torch/torch.h>

namespace {

void Suite_TorchMHA(benchmark::State& state) {
  const int64_t D = state.range(0), H = state.range(1), T = state.range(2);
  const bool causal = state.range(3) != 0;
  at::set_num_threads(static_cast<int>(state.range(4)));
  c10::InferenceMode no_grad;
  torch::manual_seed(0);
  torch::nn::MultiheadAttention mha(torch::nn::MultiheadAttentionOptions(D, H));
  mha->eval();
  torch::Tensor x = torch::randn({T, 1, D});  // [T, B, D]: this torch's C++ API has no batch_first
  torch::Tensor mask;
  if (causal) mask = torch::ones({T, T}, torch::kBool).triu(1);
  for (auto _ : state) {
    auto out = mha->forward(x, x, x, {}, /*need_weights=*/false, mask);
    benchmark::DoNotOptimize(std::get<0>(out).data_ptr());
  }
  const double macs = 4.0 * T * D * D + (causal ? T * (T + 1) / 2.0 : double(T) * T) * 2.0 * D;
  state.counters["FLOPs"] = benchmark::Counter(2 * macs);
  state.counters["GFLOP/s"] = benchmark::Counter(2 * macs * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(Suite_TorchMHA)->Apply(headmix::bench::shared_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
