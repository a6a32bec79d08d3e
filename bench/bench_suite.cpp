// MHA at the suite's shared shapes: the baseline every other variant's time
// is divided by in the closing table.
#include "bench_common.hpp"

namespace {

using namespace headmix;

void BM_MHA(benchmark::State& state) {
  const Index D = state.range(0), H = state.range(1), T = state.range(2);
  MhaWeights<float> w{bench::random_linear<float>(D, D, 1), bench::random_linear<float>(D, D, 2),
                      bench::random_linear<float>(D, D, 3), bench::random_linear<float>(D, D, 4)};
  MhaOptions opt;
  opt.num_heads = H;
  opt.causal = state.range(3) != 0;
  opt.threads = static_cast<int>(state.range(4));
  bench::time_self_attention(state, Mha<float>(std::move(w), opt), T, D);
}

}  // namespace

BENCHMARK(BM_MHA)->Apply(bench::shared_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
