// Shared helpers of the benchmark suite: random layers, counters.
#pragma once

#include <headmix/headmix.hpp>

#include <benchmark/benchmark.h>

#include <random>

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

/// Counters every layer benchmark reports: analytic FLOPs per call, the
/// rate they give, and the scratch memory the layer kept.
inline void report(benchmark::State& state, const FlopCount& flops, std::size_t scratch_bytes) {
  state.counters["FLOPs"] = benchmark::Counter(flops.flops());
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["scratch_MiB"] = benchmark::Counter(double(scratch_bytes) / (1 << 20));
}

}  // namespace headmix::bench
