// The mha test problem (shape, random weights and inputs, the naive
// double reference, running and comparing), shared by test_mha.cpp and
// the typed contract tests (tests/variants.hpp).
#pragma once

#include "headmix/decomp.hpp"
#include "headmix/headmix.hpp"
#include "cases/common.hpp"
#include "test_util.hpp"
#include "reference/mha_reference.hpp"
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

namespace mha_case {

using namespace headmix_test;
using headmix::Index;
using headmix::Matrix;
using headmix::Tensor;

// ---------------------------------------------------------------------------
// Random problems

/// One test problem. Self-attention forces S = T and Dkv = D.
struct Shape {
  int B = 2, T = 5, S = 5, D = 8, Dkv = 8, H = 2, Dk = 4, Dv = 4, out = 8;
  int Hkv = 0;            // KV heads (grouped-query attention); 0 means H
  bool cross = false;
  bool bias = true;       // false: all four biases absent
  bool out_proj = true;   // false: o is empty and the output is the concatenated heads
  bool causal = false;
  long offset = 0;
  long window = 0;        // sliding window (with causal); 0 means none
  double scale = 0;       // 0: the default 1/sqrt(Dk)
  double pad_rate = 0;    // chance that each key is padded
  Index block_rows = 64;
  Index key_block = 0;    // keys per online-softmax step; 0 = automatic
  int threads = 1;

  int kv_heads() const { return Hkv > 0 ? Hkv : H; }
  int out_dim() const { return out_proj ? out : H * Dv; }
};

std::string describe(const Shape& s) {
  std::ostringstream o;
  o << "B=" << s.B << " T=" << s.T << " S=" << s.S << " D=" << s.D << " Dkv=" << s.Dkv << " H=" << s.H
    << " Hkv=" << s.kv_heads() << " Dk=" << s.Dk << " Dv=" << s.Dv
    << " out=" << (s.out_proj ? std::to_string(s.out) : "none")
    << (s.cross ? " cross" : " self") << (s.bias ? " bias" : " no-bias") << " causal=" << s.causal
    << " offset=" << s.offset << " window=" << s.window << " scale=" << s.scale << " pad_rate=" << s.pad_rate
    << " block_rows=" << s.block_rows << " key_block=" << s.key_block << " threads=" << s.threads;
  return o.str();
}

template <class T>
struct Problem {
  Shape s;
  headmix::MhaWeights<T> w;
  Matrix<T> xq;                        // [B*T, D]
  Matrix<T> xk;                        // [B*S, Dkv]; unused for self-attention
  std::vector<std::uint8_t> padding;   // [B, S] or empty

  headmix::MhaOptions options() const {
    auto o = dense_options<headmix::MhaOptions>(s);
    o.num_kv_heads = s.Hkv, o.key_block = s.key_block;
    if (s.scale != 0) o.scale = s.scale;
    return o;
  }
  headmix::Mha<T> layer() const { return headmix::Mha<T>(w, options()); }
  std::vector<Index> out_shape() const { return {s.B, s.T, s.out_dim()}; }
  std::vector<Index> probs_shape() const { return {s.B, s.H, s.T, s.S}; }
  headmix::AttentionInput<T> input() const { return dense_input(s, xq, xk, padding); }
  std::string describe() const { return mha_case::describe(s); }
  headmix_ref::RefMhaResult reference() const {
    headmix_ref::RefMhaWeights rw{to_ref(w.q), to_ref(w.k), to_ref(w.v), to_ref(w.o)};
    headmix_ref::RefMhaOptions ro;
    ro.num_heads = s.H, ro.num_kv_heads = s.Hkv, ro.causal = s.causal, ro.causal_offset = s.offset;
    ro.window = s.window, ro.scale = s.scale;
    return dense_reference<headmix_ref::RefBatch>(
        s, xq, xk, [&](const auto& q, const auto* k) { return headmix_ref::mha_reference(rw, ro, q, k, padding); });
  }
};

template <class T>
Problem<T> make_problem(Shape s, unsigned seed) {
  if (!s.cross) s.S = s.T, s.Dkv = s.D;
  Rng rng(seed);
  Problem<T> p;
  p.s = s;
  p.w.q = random_linear<T>(rng, s.H * s.Dk, s.D, s.bias);
  p.w.k = random_linear<T>(rng, s.kv_heads() * s.Dk, s.Dkv, s.bias);
  p.w.v = random_linear<T>(rng, s.kv_heads() * s.Dv, s.Dkv, s.bias);
  if (s.out_proj) p.w.o = random_linear<T>(rng, s.out, s.H * s.Dv, s.bias);
  draw_dense_inputs(rng, p);
  return p;
}

// ---------------------------------------------------------------------------
// Running and comparing

template <class T>
void expect_matches_reference(const Problem<T>& p, Tolerance tol = default_tolerance<T>()) {
  const auto c = compare_with_reference(p, tol);
  SCOPED_TRACE(p.describe());
  EXPECT_TRUE(masked_weights_exactly_zero(c.got.probs, c.want.probs));
}

/// A grouped-query layer and its expansion, for test_grouped_query.cpp:
/// weights with `kv` stored K/V heads, options (kv = 0: a K/V head per
/// head) and the weights with K and V repeated over each group.
template <class T>
struct GroupedQuery {
  static constexpr Index kWidth = 11, kHeads = 4, kDk = 3, kDv = 2;
  static Tolerance tolerance() { return default_tolerance<T>(); }  // decoding against the forward
  static headmix::MhaOptions options(Index kv) {
    headmix::MhaOptions o;
    o.num_heads = kHeads, o.num_kv_heads = kv, o.causal = true, o.block_rows = 4;
    return o;
  }
  static headmix::MhaWeights<T> weights(Rng& rng, Index kv) {
    return {random_linear<T>(rng, kHeads * kDk, kWidth), random_linear<T>(rng, kv * kDk, kWidth),
            random_linear<T>(rng, kv * kDv, kWidth), random_linear<T>(rng, 5, kHeads * kDv)};
  }
  static headmix::MhaWeights<T> expanded(headmix::MhaWeights<T> w, Index kv) {
    return with_repeated_kv(std::move(w), kHeads, kHeads, kv, kDk, kDv);
  }
};

}  // namespace mha_case
