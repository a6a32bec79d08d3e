// The lsh test problem (shape, random weights and inputs, the naive
// double reference, running and comparing), shared by test_lsh.cpp and
// the typed contract tests (tests/variants.hpp).
#pragma once

#include "headmix/headmix.hpp"
#include "cases/common.hpp"
#include "test_util.hpp"
#include "reference/lsh_reference.hpp"
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>
#include <gtest/gtest.h>

namespace lsh_case {

using namespace headmix_test;
using headmix::Index;
using headmix::Matrix;
using headmix::Tensor;

// ---------------------------------------------------------------------------
// Random problems

/// One test problem, the weights distributed as in lsh.md section 9.
struct Shape {
  int B = 2, T = 16, D = 16, H = 2, dh = 8, dv = 8, out = 12;
  int bs = 4, NH = 2, NB = 0;
  bool causal = false, across = true, dup = true, per_head = false;
  bool qkv_bias = false;  // biases on qk and v (the reference has none)
  bool out_proj = true, out_bias = true;
  double pad_rate = 0;    // chance that each position is key-padded
  int threads = 1;

  int out_dim() const { return out_proj ? out : H * dv; }
  int Tp() const { return (T + 2 * bs - 1) / (2 * bs) * (2 * bs); }
  int n_buckets() const { return NB > 0 ? NB : Tp() / bs; }
};

std::string describe(const Shape& s) {
  std::ostringstream o;
  o << "B=" << s.B << " T=" << s.T << " (Tp=" << s.Tp() << ") D=" << s.D << " H=" << s.H << " dh=" << s.dh
    << " dv=" << s.dv << " out=" << (s.out_proj ? std::to_string(s.out) : "none") << " bs=" << s.bs
    << " NH=" << s.NH << " NB=" << s.n_buckets() << " causal=" << s.causal << " across=" << s.across
    << " dup=" << s.dup << " per_head=" << s.per_head << " qkv_bias=" << s.qkv_bias << " pad_rate=" << s.pad_rate
    << " threads=" << s.threads;
  return o.str();
}

template <class T>
struct Problem {
  Shape s;
  headmix::LshWeights<T> w;          // with explicit rotations
  Matrix<T> x;                       // [B*T, D]
  std::vector<std::uint8_t> padding;  // [B, T] or empty

  // The layer's options and the reference's share their field names.
  template <class O>
  O common_options() const {
    O o;
    o.num_heads = s.H, o.bucket_size = s.bs, o.n_hashes = s.NH, o.n_buckets = s.NB, o.causal = s.causal;
    o.attend_across_buckets = s.across, o.allow_duplicate_attention = s.dup, o.rotations_per_head = s.per_head;
    return o;
  }
  headmix::LshOptions options() const {
    auto o = common_options<headmix::LshOptions>();
    o.threads = s.threads;
    return o;
  }
  headmix::Lsh<T> layer() const { return headmix::Lsh<T>(w, options()); }
  headmix::AttentionInput<T> input() const { return self_input(x, s.B, s.T, s.D, padding); }
  std::string describe() const { return lsh_case::describe(s); }
  std::vector<Index> out_shape() const { return {s.B, s.T, s.out_dim()}; }
  std::vector<Index> probs_shape() const { return {s.B, s.H, s.T, s.T}; }
  headmix_ref::LshRefWeights ref_weights() const {
    return {to_ref(w.qk), to_ref(w.v), to_ref(w.o), widen(w.rotations.data(), w.rotations.size())};
  }
  headmix_ref::LshRefOptions ref_options() const { return common_options<headmix_ref::LshRefOptions>(); }
  headmix_ref::LshRefResult reference(bool hash_only = false, bool per_round_count = false) const {
    auto o = ref_options();
    o.per_round_duplicate_count = per_round_count;
    return headmix_ref::lsh_reference(ref_weights(), o, s.B, s.T, s.D, widen(x.data(), x.size()), padding,
                                      hash_only);
  }
  headmix_ref::LshRefResult full_reference() const {
    return headmix_ref::full_shared_qk_reference(ref_weights(), ref_options(), s.B, s.T, s.D,
                                                 widen(x.data(), x.size()), padding);
  }
};

template <class T>
constexpr double kHashMargin = std::is_same_v<T, float> ? 1e-5 : 1e-10;

template <class T>
Tensor<T> random_rotations(Rng& rng, const Shape& s) {
  Tensor<T> rot({s.per_head ? s.B * s.H : 1, s.dh, s.NH, s.n_buckets() / 2});
  std::normal_distribution<double> n(0.0, 1.0);
  for (Index i = 0; i < rot.size(); ++i) rot[i] = static_cast<T>(n(rng));
  return rot;
}

template <class T>
Problem<T> make_problem(const Shape& s, unsigned seed) {
  Rng rng(seed);
  Problem<T> p;
  p.s = s;
  p.w.qk.weight = normal_matrix<T>(rng, s.H * s.dh, s.D, 1.5 / std::sqrt(double(s.D)));
  p.w.v.weight = normal_matrix<T>(rng, s.H * s.dv, s.D, 1.0 / std::sqrt(double(s.D)));
  if (s.qkv_bias) {
    p.w.qk.bias = normal_matrix<T>(rng, s.H * s.dh, 1, 0.5);
    p.w.v.bias = normal_matrix<T>(rng, s.H * s.dv, 1, 0.5);
  }
  if (s.out_proj) {
    p.w.o.weight = normal_matrix<T>(rng, s.out, s.H * s.dv, 1.0 / std::sqrt(double(s.H * s.dv)));
    if (s.out_bias) p.w.o.bias = normal_matrix<T>(rng, s.out, 1, 0.1);
  }
  p.x = normal_matrix<T>(rng, s.B * s.T, s.D, 1.0);
  p.padding = random_padding(rng, s.B, s.T, s.pad_rate);
  for (int attempt = 0;; ++attempt) {  // see the file comment
    p.w.rotations = random_rotations<T>(rng, s);
    const double margin = p.reference(true).min_hash_margin;
    if (margin >= kHashMargin<T>) break;
    if (attempt == 200) throw std::runtime_error("make_problem: no rotation with a safe hash margin");
  }
  return p;
}

// ---------------------------------------------------------------------------
// Running and comparing

template <class T>
::testing::AssertionResult same_buckets(const Problem<T>& p, const headmix_ref::LshRefResult& want) {
  headmix::Workspace<T> ws;
  const Tensor<std::int64_t> got = p.layer().buckets(p.input(), ws);
  const std::vector<Index> shape{p.s.B, p.s.H, p.s.NH, p.s.Tp()};
  if (got.shape() != shape) return ::testing::AssertionFailure() << "buckets shape differs";
  for (Index i = 0; i < got.size(); ++i)
    if (got[i] != want.buckets[static_cast<std::size_t>(i)])
      return ::testing::AssertionFailure() << "bucket " << i << ": got " << got[i] << ", want "
                                           << want.buckets[static_cast<std::size_t>(i)];
  return ::testing::AssertionSuccess();
}

/// Buckets, output and dense weights against the reference.
template <class T>
void expect_matches_reference(const Problem<T>& p, Tolerance tol = default_tolerance<T>()) {
  ASSERT_TRUE(same_buckets(p, p.reference(true))) << p.describe();
  compare_with_reference(p, tol);
  compare_with_reference(p, tol, false);  // the path that keeps no tiles
}

}  // namespace lsh_case
