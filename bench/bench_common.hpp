// Shared helpers of the benchmark suite: random layers, counters.
#pragma once

#include <headmix/headmix.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <utility>

namespace headmix::bench {

template <class T>
Matrix<T> random_matrix(Index rows, Index cols, double scale, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> n(0.0, scale);
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(n(rng));
  return m;
}

template <class T>
Linear<T> random_linear(Index out, Index in, unsigned seed) {
  return {random_matrix<T>(out, in, 1.0 / std::sqrt(double(in)), seed), Vector<T>::Zero(out)};
}

/// A variant's flops() result as a FlopCount (DCMHA's breaks its count down
/// by kind and offers total()).
inline FlopCount as_flop_count(const FlopCount& f) { return f; }
template <class F>
auto as_flop_count(const F& f) -> decltype(f.total()) {
  return f.total();
}

template <class T>
Tensor<T> random_tensor(std::vector<Index> shape, double scale, unsigned seed) {
  Tensor<T> t(std::move(shape));
  const Matrix<T> m = random_matrix<T>(1, t.size(), scale, seed);
  std::copy_n(m.data(), t.size(), t.data());
  return t;
}

/// Counters every layer benchmark reports: analytic FLOPs per call, the
/// rate they give, and the scratch memory the layer kept.
inline void report(benchmark::State& state, const FlopCount& flops, std::size_t scratch_bytes) {
  state.counters["FLOPs"] = benchmark::Counter(flops.flops());
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["scratch_MiB"] = benchmark::Counter(double(scratch_bytes) / (1 << 20));
}

/// The suite's shared shapes: B = 1; (D, H) in {(768, 12), (1024, 16)};
/// T = S in {256, 1024, 4096}; causal and not; 1 and 2 threads. Every
/// variant's suite entry uses exactly these argument names, which is what
/// the closing "relative to MHA" table matches on.
inline void shared_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"D", "H", "T", "causal", "threads"});
  for (auto [D, H] : {std::pair{768, 12}, std::pair{1024, 16}})
    for (int T : {256, 1024, 4096})
      for (int causal : {0, 1})
        for (int threads : {1, 2}) b->Args({D, H, T, causal, threads});
}

/// Time `layer.forward` on one random sequence [T, D] (self-attention) and
/// report FLOPs, GFLOP/s and scratch. The workspace is sized by one call
/// before the timed loop, so the loop allocates nothing.
template <class Layer>
void time_self_attention(benchmark::State& state, const Layer& layer, Index T, Index D) {
  Matrix<float> x = random_matrix<float>(T, D, 1.0, 99);
  Matrix<float> y(T, layer.out_dim());
  Workspace<float> ws;
  AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  report(state, as_flop_count(layer.flops(1, T, T)), ws.bytes());
}

}  // namespace headmix::bench
