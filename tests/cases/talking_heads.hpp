// The talking_heads test problem (shape, random weights and inputs, the naive
// double reference, running and comparing), shared by test_talking_heads.cpp and
// the typed contract tests (tests/variants.hpp).
#pragma once

#include "headmix/headmix.hpp"
#include "headmix/io/safetensors.hpp"
#include "cases/common.hpp"
#include "test_util.hpp"
#include "reference/mha_reference.hpp"
#include "reference/talking_heads_reference.hpp"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>
#include <gtest/gtest.h>

namespace th_case {

using namespace headmix_test;
using headmix::Index;
using headmix::Matrix;
using headmix::Tensor;

// ---------------------------------------------------------------------------
// Random problems

/// One test problem. Self-attention forces S = T and Dkv = D. A missing mix
/// needs equal head counts on its two sides; make_problem enforces that.
struct Shape {
  int B = 2, T = 5, S = 5, D = 8, Dkv = 8, Hk = 2, H = 3, Hv = 2, Dk = 4, Dv = 3, out = 8;
  bool pre = true, post = true;
  bool cross = false;
  bool bias = true;
  bool out_proj = true;
  bool causal = false;
  long offset = 0;
  long window = 0;   // sliding window (with causal); 0 means none
  double pad_rate = 0;
  double scale = 0;  // 0: the default 1/sqrt(Dk)
  bool implicit_heads = false;  // options give 0 (num_heads) for h_k or h_v where it equals h
  Index block_rows = 16;
  int threads = 1;

  int out_dim() const { return out_proj ? out : Hv * Dv; }
};

std::string describe(const Shape& s) {
  std::ostringstream o;
  o << "B=" << s.B << " T=" << s.T << " S=" << s.S << " D=" << s.D << " Dkv=" << s.Dkv << " Hk=" << s.Hk
    << " H=" << s.H << " Hv=" << s.Hv << " Dk=" << s.Dk << " Dv=" << s.Dv
    << " out=" << (s.out_proj ? std::to_string(s.out) : "none") << " pre=" << s.pre << " post=" << s.post
    << (s.cross ? " cross" : " self") << (s.bias ? " bias" : " no-bias") << " causal=" << s.causal
    << " offset=" << s.offset << " window=" << s.window << " pad_rate=" << s.pad_rate << " scale=" << s.scale
    << " implicit_heads=" << s.implicit_heads
    << " block_rows=" << s.block_rows << " threads=" << s.threads;
  return o.str();
}

template <class T>
headmix_ref::RefMix to_ref_mix(const Matrix<T>& m) {
  return {static_cast<int>(m.rows()), static_cast<int>(m.cols()), widen(m)};
}

template <class T>
headmix_ref::RefThBatch to_ref_batch(const Matrix<T>& m, int batch) {
  return ref_batch_as<headmix_ref::RefThBatch>(m, batch);
}

template <class T>
struct Problem {
  Shape s;
  headmix::TalkingHeadsWeights<T> w;
  Matrix<T> xq;                       // [B*T, D]
  Matrix<T> xk;                       // [B*S, Dkv]; unused for self-attention
  std::vector<std::uint8_t> padding;  // [B, S] or empty

  headmix::TalkingHeadsOptions options() const {
    auto o = dense_options<headmix::TalkingHeadsOptions>(s);
    o.key_heads = s.implicit_heads && s.Hk == s.H ? 0 : s.Hk;
    o.value_heads = s.implicit_heads && s.Hv == s.H ? 0 : s.Hv;
    if (s.scale != 0) o.scale = s.scale;
    return o;
  }
  headmix::TalkingHeads<T> layer() const { return headmix::TalkingHeads<T>(w, options()); }
  std::vector<Index> out_shape() const { return {s.B, s.T, s.out_dim()}; }
  std::vector<Index> probs_shape() const { return {s.B, s.Hv, s.T, s.S}; }
  headmix::AttentionInput<T> input() const { return dense_input(s, xq, xk, padding); }
  std::string describe() const { return th_case::describe(s); }
  headmix_ref::RefThResult reference() const {
    headmix_ref::RefThWeights rw{to_ref(w.q), to_ref(w.k), to_ref(w.v), to_ref(w.o), to_ref_mix(w.pre_softmax),
                                 to_ref_mix(w.post_softmax)};
    headmix_ref::RefThOptions ro;
    ro.key_heads = s.Hk, ro.heads = s.H, ro.value_heads = s.Hv;
    ro.causal = s.causal, ro.causal_offset = s.offset, ro.window = s.window, ro.scale = s.scale;
    return dense_reference<headmix_ref::RefThBatch>(s, xq, xk, [&](const auto& q, const auto* k) {
      return headmix_ref::talking_heads_reference(rw, ro, q, k, padding);
    });
  }
};

// Mixing weights in [-1, 1]: rows of either sign of sum, as the spec warns.
template <class T>
Problem<T> make_problem(Shape s, unsigned seed) {
  if (!s.cross) s.S = s.T, s.Dkv = s.D;
  if (!s.pre) s.Hk = s.H;
  if (!s.post) s.Hv = s.H;
  Rng rng(seed);
  Problem<T> p;
  p.s = s;
  p.w.q = random_linear<T>(rng, s.Hk * s.Dk, s.D, s.bias);
  p.w.k = random_linear<T>(rng, s.Hk * s.Dk, s.Dkv, s.bias);
  p.w.v = random_linear<T>(rng, s.Hv * s.Dv, s.Dkv, s.bias);
  if (s.out_proj) p.w.o = random_linear<T>(rng, s.out, s.Hv * s.Dv, s.bias);
  if (s.pre) p.w.pre_softmax = random_matrix<T>(rng, s.H, s.Hk, 1.0);
  if (s.post) p.w.post_softmax = random_matrix<T>(rng, s.Hv, s.H, 1.0);
  draw_dense_inputs(rng, p);
  return p;
}

/// A grouped-query layer and its expansion, for test_grouped_query.cpp
/// (as mha_case::GroupedQuery; K repeats over the key heads, V over the
/// value heads).
template <class T>
struct GroupedQuery {
  static constexpr Index kWidth = 11, kKeyHeads = 4, kHeads = 3, kValueHeads = 2, kDk = 3, kDv = 2;
  static Tolerance tolerance() { return default_tolerance<T>(); }  // decoding against the forward
  static headmix::TalkingHeadsOptions options(Index kv) {
    headmix::TalkingHeadsOptions o;
    o.num_heads = kHeads, o.key_heads = kKeyHeads, o.value_heads = kValueHeads, o.num_kv_heads = kv;
    o.causal = true, o.block_rows = 4;
    return o;
  }
  static headmix::TalkingHeadsWeights<T> weights(Rng& rng, Index kv) {
    headmix::TalkingHeadsWeights<T> w;
    w.q = random_linear<T>(rng, kKeyHeads * kDk, kWidth), w.k = random_linear<T>(rng, kv * kDk, kWidth);
    w.v = random_linear<T>(rng, kv * kDv, kWidth), w.o = random_linear<T>(rng, 5, kValueHeads * kDv);
    w.pre_softmax = random_matrix<T>(rng, kHeads, kKeyHeads, 1.0);
    w.post_softmax = random_matrix<T>(rng, kValueHeads, kHeads, 1.0);
    return w;
  }
  static headmix::TalkingHeadsWeights<T> expanded(headmix::TalkingHeadsWeights<T> w, Index kv) {
    return with_repeated_kv(std::move(w), kKeyHeads, kValueHeads, kv, kDk, kDv);
  }
};

}  // namespace th_case
