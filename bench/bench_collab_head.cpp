// CollabHead latency and GFLOP/s (analytic FLOPs) next to MHA on the same
// shapes in the same run, and the cost of converting an MHA layer.
//
//   BM_CollabHead_R384 / _R768    dense random mixing, shared width R
//   BM_CollabHead_R768_block      block (CONCATENATE) mixing at R = H·Dk = 768:
//                                 what an exact MHA conversion produces; each
//                                 head reads only its own 64 shared columns
//   BM_CollabHead_MHA             MHA with BM_MHA's setup, so that
//                                 --benchmark_filter=CollabHead times all of
//                                 them side by side (the closing table also
//                                 divides by BM_MHA at the same arguments)
//   BM_CollabConvert              one BERT-base layer (D = 768, H = 12,
//                                 Dk = 64) to R = 384 with 100 CP-ALS sweeps,
//                                 one iteration (target: < 20 s on one core)
//
// Expected from the FLOP counts (CollabHead::flops): at T = 1024 the dense
// R = 384 layer does ~1.9× MHA's work and R = 768 ~3.2×; block mixing at
// R = 768 does MHA's work plus ~1%.
#include "bench_common.hpp"

#include <headmix/decomp/mha_to_collab.hpp>

#include <algorithm>
#include <vector>

namespace {

using namespace headmix;

CollabHeadWeights<float> collab_weights(Index D, Index H, Index R, bool block) {
  CollabHeadWeights<float> w;
  w.q = bench::random_matrix<float>(R, D, 1.0 / std::sqrt(double(D)), 11);
  w.k = bench::random_matrix<float>(R, D, 1.0 / std::sqrt(double(D)), 12);
  w.mixing = bench::random_matrix<float>(H, R, 1.0, 13);
  if (block) {
    const Index c = (R + H - 1) / H;
    for (Index h = 0; h < H; ++h)
      for (Index r = 0; r < R; ++r)
        if (r / c != h) w.mixing(h, r) = 0.0f;
  }
  w.content_bias = bench::random_matrix<float>(H, D, 1.0 / std::sqrt(double(D)), 14);
  w.v = bench::random_linear<float>(D, D, 3);
  w.o = bench::random_linear<float>(D, D, 4);
  return w;
}

void run_collab(benchmark::State& state, Index R, bool block) {
  const Index D = state.range(0), H = state.range(1), T = state.range(2);
  CollabHeadOptions opt;
  opt.num_heads = H;
  opt.causal = state.range(3) != 0;
  opt.threads = static_cast<int>(state.range(4));
  bench::time_self_attention(state, CollabHead<float>(collab_weights(D, H, R, block), opt), T, D);
}

void BM_CollabHead_R384(benchmark::State& state) { run_collab(state, 384, false); }
void BM_CollabHead_R768(benchmark::State& state) { run_collab(state, 768, false); }
void BM_CollabHead_R768_block(benchmark::State& state) { run_collab(state, 768, true); }

void BM_CollabHead_MHA(benchmark::State& state) {
  const Index D = state.range(0), H = state.range(1), T = state.range(2);
  MhaWeights<float> w{bench::random_linear<float>(D, D, 1), bench::random_linear<float>(D, D, 2),
                      bench::random_linear<float>(D, D, 3), bench::random_linear<float>(D, D, 4)};
  MhaOptions opt;
  opt.num_heads = H;
  opt.causal = state.range(3) != 0;
  opt.threads = static_cast<int>(state.range(4));
  bench::time_self_attention(state, Mha<float>(std::move(w), opt), T, D);
}

// Converting a random BERT-base-sized layer: CP-ALS on the [768, 12, 768]
// tensor of its heads' bilinear forms (never formed), 100 sweeps.
void BM_CollabConvert(benchmark::State& state) {
  const Index D = state.range(0), H = state.range(1), R = state.range(2), sweeps = state.range(3);
  const Index dk = D / H;
  MhaWeights<double> w{bench::random_linear<double>(H * dk, D, 1), bench::random_linear<double>(H * dk, D, 2),
                       bench::random_linear<double>(D, D, 3), bench::random_linear<double>(D, D, 4)};
  MhaOptions opt;
  opt.num_heads = H;
  const Mha<double> mha(std::move(w), opt);
  decomp::CpAlsOptions cp;
  cp.max_iterations = sweeps;
  cp.tolerance = 0;  // always the full budget, so that runs compare
  double error = 0;
  Index done = 0;
  for (auto _ : state) {
    const auto c = decomp::mha_to_collab(mha, R, cp);
    error = c.relative_error;
    done = c.iterations;
    benchmark::DoNotOptimize(c.weights.q.data());
  }
  state.counters["rec_err"] = error;
  state.counters["sweeps"] = static_cast<double>(done);
}

double fastest(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }

void collab_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"D", "H", "T", "causal", "threads"});  // the suite's shared names, for the relative table
  b->Args({768, 12, 1024, 0, 1})->Args({768, 12, 256, 0, 1})->Args({768, 12, 1024, 1, 1});
  b->ComputeStatistics("min", fastest)->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_CollabHead_MHA)->Apply(collab_shapes);
BENCHMARK(BM_CollabHead_R384)->Apply(collab_shapes);
BENCHMARK(BM_CollabHead_R768)->Apply(collab_shapes);
BENCHMARK(BM_CollabHead_R768_block)->Apply(collab_shapes);
BENCHMARK(BM_CollabConvert)
    ->ArgNames({"D", "H", "R", "sweeps"})
    ->Args({768, 12, 384, 100})
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();
