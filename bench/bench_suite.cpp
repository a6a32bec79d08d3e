// Every variant at the suite's shared shapes (bench_common.hpp), float,
// B = 1: the side-by-side comparison the README's first command prints.
// Suite_MHA is the baseline of the closing "relative to MHA" table.
//
// Variant settings: see bench::make_* in bench_common.hpp. LSH also runs at
// T = 16384, where dense attention is not run.
#include "bench_common.hpp"

namespace {

using namespace headmix;

bench::LayerShape layer_shape(const benchmark::State& s) {
  return {s.range(0), s.range(1), s.range(3) != 0, int(s.range(4))};
}
Index length(const benchmark::State& s) { return s.range(2); }

void Suite_MHA(benchmark::State& state) {
  bench::time_self_attention(state, bench::make_mha(layer_shape(state)), length(state), state.range(0));
}
void Suite_TalkingHeads(benchmark::State& state) {
  bench::time_self_attention(state, bench::make_talking_heads(layer_shape(state)), length(state), state.range(0));
}
void Suite_CollabHead(benchmark::State& state) {
  bench::time_self_attention(state, bench::make_collab_head(layer_shape(state)), length(state), state.range(0));
}
void Suite_DCMHA(benchmark::State& state) {
  bench::time_self_attention(state, bench::make_dcmha(layer_shape(state)), length(state), state.range(0));
}
void Suite_LSH(benchmark::State& state) {
  bench::time_self_attention(state, bench::make_lsh(layer_shape(state)), length(state), state.range(0));
}

void lsh_shapes(benchmark::internal::Benchmark* b) {
  bench::shared_shapes(b);
  for (auto [D, H] : {std::pair{768, 12}, std::pair{1024, 16}})
    for (int causal : {0, 1})
      for (int threads : {1, 2}) b->Args({D, H, 16384, causal, threads});
}

}  // namespace

BENCHMARK(Suite_MHA)->Apply(bench::shared_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Suite_TalkingHeads)->Apply(bench::shared_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Suite_CollabHead)->Apply(bench::shared_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Suite_DCMHA)->Apply(bench::shared_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Suite_LSH)->Apply(lsh_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
