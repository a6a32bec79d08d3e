// Every variant at the suite's shared shapes (bench_common.hpp), float,
// B = 1: the side-by-side comparison the README's first command prints.
// Suite_MHA is the baseline of the closing "relative to MHA" table.
//
// Variant settings: Talking-Heads h_k = h = h_v with both mixes; CollabHead
// R = H·Dk / 2 (half the shared dimension, the re-parameterisation target);
// LSH bucket_size 64,
// n_hashes 4 (also at T = 16384, where dense attention is not run).
#include "bench_common.hpp"

namespace {

using namespace headmix;

struct Shape {
  Index D, H, T;
  bool causal;
  int threads;
  explicit Shape(const benchmark::State& s)
      : D(s.range(0)), H(s.range(1)), T(s.range(2)), causal(s.range(3) != 0), threads(int(s.range(4))) {}
};

void Suite_MHA(benchmark::State& state) {
  const Shape s(state);
  MhaWeights<float> w{bench::random_linear<float>(s.D, s.D, 1), bench::random_linear<float>(s.D, s.D, 2),
                      bench::random_linear<float>(s.D, s.D, 3), bench::random_linear<float>(s.D, s.D, 4)};
  MhaOptions opt;
  opt.num_heads = s.H;
  opt.causal = s.causal;
  opt.threads = s.threads;
  bench::time_self_attention(state, Mha<float>(std::move(w), opt), s.T, s.D);
}

void Suite_TalkingHeads(benchmark::State& state) {
  const Shape s(state);
  TalkingHeadsWeights<float> w;
  w.q = bench::random_linear<float>(s.D, s.D, 1);
  w.k = bench::random_linear<float>(s.D, s.D, 2);
  w.v = bench::random_linear<float>(s.D, s.D, 3);
  w.o = bench::random_linear<float>(s.D, s.D, 4);
  w.pre_softmax = bench::random_matrix<float>(s.H, s.H, 1.0 / std::sqrt(double(s.H)), 5);
  w.post_softmax = bench::random_matrix<float>(s.H, s.H, 1.0 / std::sqrt(double(s.H)), 6);
  TalkingHeadsOptions opt;
  opt.num_heads = s.H;
  opt.causal = s.causal;
  opt.threads = s.threads;
  bench::time_self_attention(state, TalkingHeads<float>(std::move(w), opt), s.T, s.D);
}

void Suite_CollabHead(benchmark::State& state) {
  const Shape s(state);
  const Index R = s.D / 2;
  CollabHeadWeights<float> w;
  w.q = bench::random_matrix<float>(R, s.D, 1.0 / std::sqrt(double(s.D)), 1);
  w.k = bench::random_matrix<float>(R, s.D, 1.0 / std::sqrt(double(s.D)), 2);
  w.mixing = bench::random_matrix<float>(s.H, R, 1.0, 3);
  w.content_bias = bench::random_matrix<float>(s.H, s.D, 1.0 / std::sqrt(double(s.D)), 4);
  w.v = bench::random_linear<float>(s.D, s.D, 5);
  w.o = bench::random_linear<float>(s.D, s.D, 6);
  CollabHeadOptions opt;
  opt.num_heads = s.H;
  opt.causal = s.causal;
  opt.threads = s.threads;
  bench::time_self_attention(state, CollabHead<float>(std::move(w), opt), s.T, s.D);
}

void Suite_LSH(benchmark::State& state) {
  const Shape s(state);
  LshWeights<float> w;
  w.qk = bench::random_linear<float>(s.D, s.D, 1);
  w.v = bench::random_linear<float>(s.D, s.D, 2);
  w.o = bench::random_linear<float>(s.D, s.D, 3);
  LshOptions opt;
  opt.num_heads = s.H;
  opt.bucket_size = 64;
  opt.n_hashes = 4;
  opt.causal = s.causal;
  opt.threads = s.threads;
  opt.seed = 7;
  bench::time_self_attention(state, Lsh<float>(std::move(w), opt), s.T, s.D);
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
BENCHMARK(Suite_LSH)->Apply(lsh_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
