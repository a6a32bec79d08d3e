// The dcmha test problem (shape, random weights and inputs, the naive
// double reference, running and comparing), shared by test_dcmha.cpp and
// the typed contract tests (tests/variants.hpp).
#pragma once

#include "test_util.hpp"
#include "cases/common.hpp"
#include "cases/ref_adapters.hpp"
#include "headmix/headmix.hpp"
#include "reference/dcmha_reference.hpp"
#include "conformance/case_dcmha.hpp"
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>
#include <gtest/gtest.h>

namespace dcmha_case {

using namespace headmix_test;
using headmix::Dcmha;
using headmix::SequenceCache;
using headmix::CachePrecision;
using headmix::DcmhaOptions;
using headmix::DcmhaWeights;
using headmix::Index;
using headmix::Matrix;
using headmix::Tensor;

// ---------------------------------------------------------------------------
// Random problems

/// One test problem.
struct Config {
  int B = 2, T = 7, D = 12, H = 4, dk = 3, dv = 3, out = 10;  // out 0: no output projection
  int G = 1, R = 2, K = 6;
  bool bias = false;
  bool use_pre = true, use_post = true, query_wise = true, key_wise = true, static_w = false;
  bool causal = true;
  long offset = 0;  // causal_offset
  int window = 0;
  bool gelu_tanh = false;
  double pad_rate = 0;       // chance that each key is padded
  bool pad_all_of_last = false;  // every key of the last batch item padded
  double weight_gain = 1;    // scales q and k weights (bigger scores)
  double dw_norm_eps = 1e-6;  // the W1 RMSNorm epsilon, given to the layer and the reference alike
  double scale = 0;           // 0: the default 1/sqrt(dk)
  Index block_rows = 0;
  int threads = 1;

  int M() const { return H / G; }
  int out_dim() const { return out == 0 ? H * dv : out; }
};

std::string describe(const Config& c) {
  std::ostringstream o;
  o << "B=" << c.B << " T=" << c.T << " D=" << c.D << " H=" << c.H << " dk=" << c.dk << " dv=" << c.dv
    << " out=" << c.out << " G=" << c.G << " R=" << c.R << " K=" << c.K << " bias=" << c.bias << " pre=" << c.use_pre
    << " post=" << c.use_post << " qw=" << c.query_wise << " kw=" << c.key_wise << " static=" << c.static_w
    << " causal=" << c.causal << " offset=" << c.offset << " window=" << c.window << " gelu_tanh=" << c.gelu_tanh
    << " eps=" << c.dw_norm_eps << " scale=" << c.scale
    << " pad=" << c.pad_rate
    << " block_rows=" << c.block_rows << " threads=" << c.threads;
  return o.str();
}

template <class T>
struct Problem {
  Config c;
  DcmhaWeights<T> w;
  Matrix<T> x;                       // [B*T, D]
  std::vector<std::uint8_t> padding;  // [B, T] or empty

  DcmhaOptions options() const {
    DcmhaOptions o;
    o.num_heads = c.H;
    o.groups = c.G;
    o.rank = c.R;
    o.use_pre = c.use_pre;
    o.use_post = c.use_post;
    o.query_wise = c.query_wise;
    o.key_wise = c.key_wise;
    o.static_w = c.static_w;
    o.causal = c.causal;
    o.causal_offset = c.offset;
    o.window = c.window;
    o.gelu = c.gelu_tanh ? headmix::DcmhaGelu::tanh : headmix::DcmhaGelu::erf;
    o.dw_norm_eps = c.dw_norm_eps;
    if (c.scale != 0) o.scale = c.scale;
    o.block_rows = c.block_rows;
    o.threads = c.threads;
    return o;
  }
  Dcmha<T> layer() const { return Dcmha<T>(w, options()); }
  headmix::AttentionInput<T> input() const { return self_input(x, c.B, c.T, c.D, padding); }
  std::string describe() const { return dcmha_case::describe(c); }
  std::vector<Index> out_shape() const { return {c.B, c.T, c.out_dim()}; }
  std::vector<Index> probs_shape() const { return {c.B, c.H, c.T, c.T}; }
  headmix_ref::RefDcmhaWeights ref_weights() const { return ref_dcmha_weights(w, c.D, c.H, c.G, c.R); }
  headmix_ref::RefDcmhaOptions ref_options() const {
    headmix_ref::RefDcmhaOptions o;
    o.use_pre = c.use_pre, o.use_post = c.use_post, o.query_wise = c.query_wise, o.key_wise = c.key_wise;
    o.static_w = c.static_w, o.causal = c.causal, o.causal_offset = c.offset, o.window = c.window;
    o.gelu_tanh = c.gelu_tanh;
    o.eps = c.dw_norm_eps, o.scale = c.scale;
    return o;
  }
  headmix_ref::RefDcmhaResult reference() const {
    return headmix_ref::dcmha_reference(ref_weights(), ref_options(), c.B, c.T, widen(x), padding);
  }
};

// Weights scaled so that every branch changes the output by a lot: F and
// the gates are O(1), so W1ᵀW2 and dd are comparable to the identity.
template <class T>
Problem<T> make_problem(const Config& c, unsigned seed) {
  Rng rng(seed);
  Problem<T> p;
  p.c = c;
  p.w.q = random_linear<T>(rng, c.H * c.dk, c.D, c.bias);
  p.w.k = random_linear<T>(rng, c.H * c.dk, c.D, c.bias);
  p.w.v = random_linear<T>(rng, c.H * c.dv, c.D, c.bias);
  if (c.weight_gain != 1) {
    p.w.q.weight *= static_cast<T>(c.weight_gain);
    p.w.k.weight *= static_cast<T>(c.weight_gain);
  }
  if (c.out != 0) p.w.o = random_linear<T>(rng, c.out, c.H * c.dv, c.bias);
  const int M = c.M();
  p.w.dw1 = random_tensor<T>(rng, {c.D, c.G, 4, c.K}, 2.0 / std::sqrt(static_cast<double>(c.D)));
  p.w.qkw = random_tensor<T>(rng, {c.G, 4, c.K, 2 * c.R, M}, 1.0 / std::sqrt(static_cast<double>(c.K)));
  p.w.dd = random_tensor<T>(rng, {c.D, c.G, 4 * M}, 2.0 / std::sqrt(static_cast<double>(c.D)));
  p.x = random_matrix<T>(rng, c.B * c.T, c.D, 1.0);
  if (c.static_w) {  // drawn after x, so that toggling it keeps every other value
    p.w.pre_w = random_tensor<T>(rng, {c.G, M, M}, 0.5);
    p.w.post_w = random_tensor<T>(rng, {c.G, M, M}, 0.5);
  }
  if (c.pad_rate > 0 || c.pad_all_of_last) {
    p.padding.assign(static_cast<std::size_t>(c.B) * c.T, 0);
    for (int b = 0; b < c.B; ++b)
      for (int t = 0; t < c.T; ++t)
        p.padding[static_cast<std::size_t>(b) * c.T + t] =
            (c.pad_all_of_last && b == c.B - 1) || uniform(rng, 0, 1) < c.pad_rate ? 1 : 0;
  }
  return p;
}

// ---------------------------------------------------------------------------
// Running and comparing

// Same shape and equal entries, NaN matching NaN. Unlike
// headmix_test::bit_identical, +0 and -0 (and NaN payloads) count as equal.
template <class T>
::testing::AssertionResult equal_values(const char* what, const Tensor<T>& a, const Tensor<T>& b) {
  if (a.shape() != b.shape()) return ::testing::AssertionFailure() << what << ": shapes differ";
  for (Index i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i]) && !(a[i] != a[i] && b[i] != b[i]))
      return ::testing::AssertionFailure() << what << ": differ at " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}
double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double v : a) m = std::max(m, std::abs(v));
  return m;
}

/// A grouped-query layer and its expansion, for test_grouped_query.cpp
/// (as mha_case::GroupedQuery).
template <class T>
struct GroupedQuery {
  static constexpr Index kWidth = 11, kHeads = 4, kGroups = 2, kM = 2, kRank = 2, kHidden = 5, kDk = 3, kDv = 2;
  static Tolerance tolerance() { return dcmha_tolerance<T>(); }  // decoding against the forward
  static headmix::DcmhaOptions options(Index kv) {
    headmix::DcmhaOptions o;
    o.num_heads = kHeads, o.groups = kGroups, o.rank = kRank, o.num_kv_heads = kv, o.causal = true;
    o.block_rows = 4;
    return o;
  }
  static headmix::DcmhaWeights<T> weights(Rng& rng, Index kv) {
    headmix::DcmhaWeights<T> w;
    w.q = random_linear<T>(rng, kHeads * kDk, kWidth), w.k = random_linear<T>(rng, kv * kDk, kWidth);
    w.v = random_linear<T>(rng, kv * kDv, kWidth), w.o = random_linear<T>(rng, 5, kHeads * kDv);
    w.dw1 = random_tensor<T>(rng, {kWidth, kGroups, 4, kHidden}, 0.6);
    w.qkw = random_tensor<T>(rng, {kGroups, 4, kHidden, 2 * kRank, kM}, 0.45);
    w.dd = random_tensor<T>(rng, {kWidth, kGroups, 4 * kM}, 0.6);
    return w;
  }
  static headmix::DcmhaWeights<T> expanded(headmix::DcmhaWeights<T> w, Index kv) {
    return with_repeated_kv(std::move(w), kHeads, kHeads, kv, kDk, kDv);
  }
};

}  // namespace dcmha_case
