// Shared helpers of the benchmark suite (headmix_suite) and the studies
// (headmix_bench): random layers, counters.
#pragma once

#include <headmix/headmix.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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

template <class T>
Tensor<T> random_tensor(std::vector<Index> shape, double scale, unsigned seed) {
  Tensor<T> t(std::move(shape));
  const Matrix<T> m = random_matrix<T>(1, t.size(), scale, seed);
  std::copy_n(m.data(), t.size(), t.data());
  return t;
}

/// Bytes of a layer's weights: what a decoding step reads besides its cache.
/// A Linear with bfloat16 weights: a one-row product reads those instead.
template <class T>
std::size_t bytes_of(const Linear<T>& l) {
  const std::size_t weight = l.weight_half.rows() > 0 ? sizeof(Eigen::bfloat16) : sizeof(T);
  return weight * std::size_t(l.weight.size()) + sizeof(T) * std::size_t(l.bias.size());
}
template <class T>
std::size_t bytes_of(const Matrix<T>& m) { return sizeof(T) * std::size_t(m.size()); }
template <class T>
std::size_t bytes_of(const Tensor<T>& t) { return t.rank() == 0 ? 0 : sizeof(T) * std::size_t(t.size()); }
template <class T>
std::size_t weight_bytes(const Mha<T>& l) {
  const auto& w = l.weights();
  return bytes_of(w.q) + bytes_of(w.k) + bytes_of(w.v) + bytes_of(w.o);
}
template <class T>
std::size_t weight_bytes(const TalkingHeads<T>& l) {
  const auto& w = l.weights();
  return bytes_of(w.q) + bytes_of(w.k) + bytes_of(w.v) + bytes_of(w.o) + bytes_of(w.pre_softmax) +
         bytes_of(w.post_softmax);
}
template <class T>
std::size_t weight_bytes(const CollabHead<T>& l) {
  const auto& w = l.weights();
  return bytes_of(w.q) + bytes_of(w.k) + bytes_of(w.mixing) + bytes_of(w.content_bias) + bytes_of(w.v) +
         bytes_of(w.o);
}
template <class T>
std::size_t weight_bytes(const Dcmha<T>& l) {
  const auto& w = l.weights();
  return bytes_of(w.q) + bytes_of(w.k) + bytes_of(w.v) + bytes_of(w.o) + bytes_of(w.dw1) + bytes_of(w.qkw) +
         bytes_of(w.dd) + bytes_of(w.pre_w) + bytes_of(w.post_w);
}

/// One layer of the suite: B = 1 self-attention, width D, H heads, float.
struct LayerShape {
  Index D, H;
  bool causal;
  int threads;
  Index window = 0;    // sliding window (needs causal), 0 = none
  Index kv_heads = 0;  // MHA's KV heads (grouped-query attention), 0 = H
  bool bfloat16_weights = false;  // DenseOptions::bfloat16_weights
};

// The dense options every suite layer shares.
inline void set_dense(DenseOptions& opt, const LayerShape& s) {
  opt.causal = s.causal;
  opt.window = s.window;
  opt.threads = s.threads;
  opt.bfloat16_weights = s.bfloat16_weights;
}

// The suite's layer of each variant, with weights of unit-variance outputs
// (random_linear's 1/sqrt(in) scale). Settings: Talking-Heads h_k = h = h_v
// with both mixes; CollabHead R = D/2 (half the shared dimension, the
// re-parameterisation target) with dense mixing and a content bias; DCMHA
// R = 2, G = 1, K = 4H, pre and post compose (the released DCFormer
// models); LSH bucket_size 64, n_hashes 4, seeded rotations.
inline Mha<float> make_mha(const LayerShape& s) {
  const Index kv = s.kv_heads > 0 ? s.kv_heads : s.H, kv_width = s.D / s.H * kv;
  MhaWeights<float> w{random_linear<float>(s.D, s.D, 1), random_linear<float>(kv_width, s.D, 2),
                      random_linear<float>(kv_width, s.D, 3), random_linear<float>(s.D, s.D, 4)};
  MhaOptions opt;
  set_dense(opt, s);
  opt.num_heads = s.H;
  opt.num_kv_heads = kv;
  return Mha<float>(std::move(w), opt);
}

inline TalkingHeads<float> make_talking_heads(const LayerShape& s) {
  TalkingHeadsWeights<float> w;
  w.q = random_linear<float>(s.D, s.D, 1);
  w.k = random_linear<float>(s.D, s.D, 2);
  w.v = random_linear<float>(s.D, s.D, 3);
  w.o = random_linear<float>(s.D, s.D, 4);
  w.pre_softmax = random_matrix<float>(s.H, s.H, 1.0 / std::sqrt(double(s.H)), 5);
  w.post_softmax = random_matrix<float>(s.H, s.H, 1.0 / std::sqrt(double(s.H)), 6);
  TalkingHeadsOptions opt;
  set_dense(opt, s);
  opt.num_heads = s.H;
  return TalkingHeads<float>(std::move(w), opt);
}

inline CollabHead<float> make_collab_head(const LayerShape& s) {
  const Index R = s.D / 2;
  CollabHeadWeights<float> w;
  w.q = random_matrix<float>(R, s.D, 1.0 / std::sqrt(double(s.D)), 1);
  w.k = random_matrix<float>(R, s.D, 1.0 / std::sqrt(double(s.D)), 2);
  w.mixing = random_matrix<float>(s.H, R, 1.0, 3);
  w.content_bias = random_matrix<float>(s.H, s.D, 1.0 / std::sqrt(double(s.D)), 4);
  w.v = random_linear<float>(s.D, s.D, 5);
  w.o = random_linear<float>(s.D, s.D, 6);
  CollabHeadOptions opt;
  set_dense(opt, s);
  opt.num_heads = s.H;
  return CollabHead<float>(std::move(w), opt);
}

inline Dcmha<float> make_dcmha(const LayerShape& s, Index block_rows = 0) {
  const Index H = s.H, R = 2, K = 4 * H;
  DcmhaWeights<float> w;
  w.q = random_linear<float>(s.D, s.D, 1);
  w.k = random_linear<float>(s.D, s.D, 2);
  w.v = random_linear<float>(s.D, s.D, 3);
  w.o = random_linear<float>(s.D, s.D, 4);
  w.dw1 = random_tensor<float>({s.D, 1, 4, K}, 1.0 / std::sqrt(double(s.D)), 5);
  w.qkw = random_tensor<float>({1, 4, K, 2 * R, H}, 1.0 / std::sqrt(double(K)), 6);
  w.dd = random_tensor<float>({s.D, 1, 4 * H}, 1.0 / std::sqrt(double(s.D)), 7);
  DcmhaOptions opt;
  set_dense(opt, s);
  opt.num_heads = H;
  opt.rank = R;
  opt.block_rows = block_rows;
  return Dcmha<float>(std::move(w), opt);
}

inline Lsh<float> make_lsh(const LayerShape& s) {
  LshWeights<float> w;
  w.qk = random_linear<float>(s.D, s.D, 1);
  w.v = random_linear<float>(s.D, s.D, 2);
  w.o = random_linear<float>(s.D, s.D, 3);
  LshOptions opt;
  opt.num_heads = s.H;
  opt.bucket_size = 64;
  opt.n_hashes = 4;
  opt.causal = s.causal;
  opt.threads = s.threads;
  opt.seed = 7;
  return Lsh<float>(std::move(w), opt);
}

/// The variants the suite compares, in its tables' order (MHA first: the
/// others are timed against it). A new variant adds its make_ function and
/// weight_bytes above, one row here and one branch in with_layer.
struct SuiteVariant {
  const char* name;
  bool windowed;    // takes a sliding window (the window table)
  bool decodes;     // has step() (the decode and bandwidth tables)
  bool half_cache;  // its steps may read a bfloat16 cache (the half_cache table)
};
inline const std::vector<SuiteVariant>& suite_variants() {
  static const std::vector<SuiteVariant> v = {
      {"MHA", true, true, true},   {"TalkingHeads", true, true, true}, {"CollabHead", true, true, false},
      {"DCMHA", true, true, true}, {"LSH", false, false, false},
  };
  return v;
}

/// f(the suite's layer of variant `name` at shape s).
template <class F>
auto with_layer(const std::string& name, const LayerShape& s, F&& f) {
  if (name == "MHA") return f(make_mha(s));
  if (name == "TalkingHeads") return f(make_talking_heads(s));
  if (name == "CollabHead") return f(make_collab_head(s));
  if (name == "DCMHA") return f(make_dcmha(s));
  if (name == "LSH") return f(make_lsh(s));
  throw std::invalid_argument("unknown variant " + name);
}

/// Heap allocations (malloc, operator new, Eigen's aligned buffers) made by
/// this process so far, or -1 where bench_main.cpp cannot count them.
long heap_allocations();

/// Report the allocations made since `before` (a heap_allocations() value)
/// as "allocs" per iteration, when they are counted.
inline void report_allocations(benchmark::State& state, long before) {
  if (before < 0) return;
  state.counters["allocs"] =
      benchmark::Counter(double(heap_allocations() - before), benchmark::Counter::kAvgIterations);
}

/// Counters every layer benchmark reports: analytic FLOPs per call, the
/// rate they give, and the scratch memory the layer kept.
inline void report(benchmark::State& state, const FlopCount& flops, std::size_t scratch_bytes) {
  state.counters["FLOPs"] = benchmark::Counter(flops.flops());
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["scratch_MiB"] = benchmark::Counter(double(scratch_bytes) / (1 << 20));
}

/// Time `layer.forward` on one random sequence [T, D] (self-attention) and
/// report FLOPs, GFLOP/s and scratch. The workspace is sized by one call
/// before the timed loop, so the loop allocates nothing.
/// Also counts heap allocations in the timed loop ("allocs": per call).
template <class Layer>
void time_self_attention(benchmark::State& state, const Layer& layer, Index T, Index D) {
  Matrix<float> x = random_matrix<float>(T, D, 1.0, 99);
  Matrix<float> y(T, layer.out_dim());
  Workspace<float> ws;
  AttentionInput<float> in{as_batch(x), {}, {}};
  layer.forward(in, as_batch(y), ws);
  const long before = heap_allocations();
  for (auto _ : state) {
    layer.forward(in, as_batch(y), ws);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  report_allocations(state, before);
  report(state, layer.flops(1, T, T), ws.bytes());
}

}  // namespace headmix::bench
