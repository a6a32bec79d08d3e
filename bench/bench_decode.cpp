// Incremental decoding: the time to generate one token with S positions in
// view (a step of 1 new position over a cache of S - 1), for each dense
// variant, next to the time of recomputing the causal forward over all S
// positions, which is what generating that token costs without a cache.
// B = 1, D = 1024, H = 16, float, 1 thread; the suite's layers
// (bench::make_*). Counters: allocs per step (0 once the cache and the
// workspace are sized), and for Decode_Step the cache's memory.
//
//   headmix_bench --benchmark_filter='Decode_'
#include "bench_common.hpp"

namespace {

using namespace headmix;

constexpr Index kD = 1024, kH = 16;
const bench::LayerShape kShape{kD, kH, true, 1};

template <class Layer>
void step_one_token(benchmark::State& state, const Layer& layer) {
  const Index S = state.range(0);
  SequenceCache<float> cache(1, S);
  Workspace<float> ws;
  const Matrix<float> prompt = bench::random_matrix<float>(S - 1, kD, 1.0, 11);
  Matrix<float> y_prompt(S - 1, layer.out_dim());
  layer.step(as_batch(prompt), cache, as_batch(y_prompt), ws);  // S - 1 positions cached
  const Matrix<float> x = bench::random_matrix<float>(1, kD, 1.0, 12);
  Matrix<float> y(1, layer.out_dim());
  layer.step(as_batch(x), cache, as_batch(y), ws);
  cache.truncate(S - 1);
  const long before = bench::heap_allocations();
  for (auto _ : state) {
    layer.step(as_batch(x), cache, as_batch(y), ws);
    cache.truncate(S - 1);  // the next iteration generates the same token again
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  bench::report_allocations(state, before);
  state.counters["scratch_MiB"] = benchmark::Counter(double(ws.bytes()) / (1 << 20));
}

template <class Layer>
void recompute(benchmark::State& state, const Layer& layer) {
  const Index S = state.range(0);
  bench::time_self_attention(state, layer, S, kD);
}

void Decode_Step_MHA(benchmark::State& s) { step_one_token(s, bench::make_mha(kShape)); }
void Decode_Step_TalkingHeads(benchmark::State& s) { step_one_token(s, bench::make_talking_heads(kShape)); }
void Decode_Step_CollabHead(benchmark::State& s) { step_one_token(s, bench::make_collab_head(kShape)); }
void Decode_Step_DCMHA(benchmark::State& s) { step_one_token(s, bench::make_dcmha(kShape)); }
void Decode_Recompute_MHA(benchmark::State& s) { recompute(s, bench::make_mha(kShape)); }
void Decode_Recompute_TalkingHeads(benchmark::State& s) { recompute(s, bench::make_talking_heads(kShape)); }
void Decode_Recompute_CollabHead(benchmark::State& s) { recompute(s, bench::make_collab_head(kShape)); }
void Decode_Recompute_DCMHA(benchmark::State& s) { recompute(s, bench::make_dcmha(kShape)); }

void lengths(benchmark::internal::Benchmark* b) {
  b->ArgNames({"S"})->Arg(512)->Arg(2048)->Arg(8192)->UseRealTime();
}

}  // namespace

BENCHMARK(Decode_Step_MHA)->Apply(lengths)->Unit(benchmark::kMicrosecond);
BENCHMARK(Decode_Step_TalkingHeads)->Apply(lengths)->Unit(benchmark::kMicrosecond);
BENCHMARK(Decode_Step_CollabHead)->Apply(lengths)->Unit(benchmark::kMicrosecond);
BENCHMARK(Decode_Step_DCMHA)->Apply(lengths)->Unit(benchmark::kMicrosecond);
// A forward over S positions takes seconds at S = 8192: two timed calls.
BENCHMARK(Decode_Recompute_MHA)->Apply(lengths)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(Decode_Recompute_TalkingHeads)->Apply(lengths)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(Decode_Recompute_CollabHead)->Apply(lengths)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(Decode_Recompute_DCMHA)->Apply(lengths)->Unit(benchmark::kMillisecond)->Iterations(2);
