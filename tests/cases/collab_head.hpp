// The collab_head test problem (shape, random weights and inputs, the naive
// double reference, running and comparing), shared by test_collab_head.cpp and
// the typed contract tests (tests/variants.hpp).
#pragma once

#include "headmix/headmix.hpp"
#include "cases/common.hpp"
#include "test_util.hpp"
#include "headmix/variants/collab_head.hpp"
#include "reference/collab_reference.hpp"
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

namespace collab_case {

using namespace headmix_test;
using headmix::Index;
using headmix::Matrix;
using headmix::Tensor;

// ---------------------------------------------------------------------------
// Random problems

enum class Mixing {
  dense,     // every entry non-zero
  block,     // CONCATENATE: head h owns columns [h·c, (h+1)·c), c = ceil(R/H), random values there
  banded,    // each head a random column range, zeros outside and one zero inside
  zero_row,  // dense, but head 0 has an all-zero row (its logits are the content bias alone)
};

/// One test problem. Self-attention forces S = T and Dkv = D. LayerNorm
/// forces out_dim = D (out = D, or Dv = D / H without o).
struct Shape {
  int B = 2, T = 5, S = 5, D = 8, Dkv = 8, H = 2, R = 6, Dv = 4, out = 8;
  bool cross = false;
  bool content_bias = true;
  bool v_bias = true;
  bool out_proj = true;
  bool layer_norm = false;
  Mixing mixing = Mixing::dense;
  double scale = 0;  // 0: the default 1/sqrt(R/H)
  bool causal = false;
  long offset = 0;
  long window = 0;  // sliding window (with causal); 0 means none
  double pad_rate = 0;
  Index block_rows = 64;
  Index key_block = 0;  // keys per online-softmax step; 0 = automatic
  int threads = 1;

  int out_dim() const { return out_proj ? out : H * Dv; }
};

std::string describe(const Shape& s) {
  std::ostringstream o;
  o << "B=" << s.B << " T=" << s.T << " S=" << s.S << " D=" << s.D << " Dkv=" << s.Dkv << " H=" << s.H
    << " R=" << s.R << " Dv=" << s.Dv << " out=" << (s.out_proj ? std::to_string(s.out) : "none")
    << (s.cross ? " cross" : " self") << " cb=" << s.content_bias << " v_bias=" << s.v_bias << " ln=" << s.layer_norm
    << " mixing=" << static_cast<int>(s.mixing) << " scale=" << s.scale << " causal=" << s.causal
    << " offset=" << s.offset << " window=" << s.window << " pad_rate=" << s.pad_rate << " block_rows=" << s.block_rows
    << " key_block=" << s.key_block << " threads=" << s.threads;
  return o.str();
}

template <class T>
Matrix<T> make_mixing(Rng& rng, const Shape& s) {
  Matrix<T> m = random_matrix<T>(rng, s.H, s.R, 1.0);
  if (s.mixing == Mixing::block) {
    const int c = (s.R + s.H - 1) / s.H;
    for (int h = 0; h < s.H; ++h)
      for (int r = 0; r < s.R; ++r)
        if (r < h * c || r >= (h + 1) * c) m(h, r) = T(0);
  } else if (s.mixing == Mixing::banded) {
    for (int h = 0; h < s.H; ++h) {
      const int lo = uniform_int(rng, 0, s.R - 1), hi = uniform_int(rng, lo + 1, s.R);
      for (int r = 0; r < s.R; ++r)
        if (r < lo || r >= hi) m(h, r) = T(0);
      if (hi - lo >= 3) m(h, lo + 1) = T(0);  // a zero inside the span is still computed
    }
  } else if (s.mixing == Mixing::zero_row) {
    m.row(0).setZero();
  }
  return m;
}

template <class T>
struct Problem {
  Shape s;
  headmix::CollabHeadWeights<T> w;
  Matrix<T> xq;                       // [B*T, D]
  Matrix<T> xk;                       // [B*S, Dkv]; unused for self-attention
  std::vector<std::uint8_t> padding;  // [B, S] or empty

  headmix::CollabHeadOptions options() const {
    auto o = dense_options<headmix::CollabHeadOptions>(s);
    o.key_block = s.key_block;
    if (s.scale != 0) o.scale = s.scale;
    return o;
  }
  headmix::CollabHead<T> layer() const { return headmix::CollabHead<T>(w, options()); }
  std::vector<Index> out_shape() const { return {s.B, s.T, s.out_dim()}; }
  std::vector<Index> probs_shape() const { return {s.B, s.H, s.T, s.S}; }
  headmix::AttentionInput<T> input() const { return dense_input(s, xq, xk, padding); }
  std::string describe() const { return collab_case::describe(s); }
  headmix_ref::RefCollabWeights ref_weights() const {
    headmix_ref::RefCollabWeights r;
    r.num_heads = s.H, r.shared_dim = s.R, r.embed_dim = s.D, r.key_dim = s.Dkv;
    r.q = widen(w.q), r.k = widen(w.k), r.mixing = widen(w.mixing), r.content_bias = widen(w.content_bias);
    r.v = to_ref(w.v), r.o = to_ref(w.o);
    for (Index i = 0; i < w.layer_norm.weight.size(); ++i) r.ln_weight.push_back(double(w.layer_norm.weight(i)));
    for (Index i = 0; i < w.layer_norm.bias.size(); ++i) r.ln_bias.push_back(double(w.layer_norm.bias(i)));
    r.ln_eps = w.layer_norm.eps;
    return r;
  }
  headmix_ref::RefMhaResult reference() const {
    headmix_ref::RefCollabOptions ro;
    ro.causal = s.causal, ro.causal_offset = s.offset, ro.window = s.window;
    // The shape's scale, or 0: the reference's own default from collab.md,
    // 1/sqrt(R/H), never the layer's (which the float layer rounds to float).
    ro.scale = s.scale;
    const auto rw = ref_weights();
    return dense_reference<headmix_ref::RefBatch>(s, xq, xk, [&](const auto& q, const auto* k) {
      return headmix_ref::collab_reference(rw, ro, q, k, padding);
    });
  }
};

template <class T>
Problem<T> make_problem(Shape s, unsigned seed) {
  if (!s.cross) s.S = s.T, s.Dkv = s.D;
  if (s.layer_norm) {
    if (s.out_proj)
      s.out = s.D;
    else
      s.D = s.H * s.Dv, s.Dkv = s.cross ? s.Dkv : s.D;
  }
  Rng rng(seed);
  Problem<T> p;
  p.s = s;
  p.w.q = random_matrix<T>(rng, s.R, s.D, 1.0 / std::sqrt(double(s.D)));
  p.w.k = random_matrix<T>(rng, s.R, s.Dkv, 1.0 / std::sqrt(double(s.Dkv)));
  p.w.mixing = make_mixing<T>(rng, s);
  if (s.content_bias) p.w.content_bias = random_matrix<T>(rng, s.H, s.Dkv, 1.0 / std::sqrt(double(s.Dkv)));
  p.w.v = random_linear<T>(rng, s.H * s.Dv, s.Dkv, s.v_bias);
  if (s.out_proj) p.w.o = random_linear<T>(rng, s.out, s.H * s.Dv, true);
  if (s.layer_norm) {
    p.w.layer_norm.weight = random_matrix<T>(rng, s.D, 1, 0.5, 1.5);
    p.w.layer_norm.bias = random_matrix<T>(rng, s.D, 1, 0.5);
  }
  draw_dense_inputs(rng, p);
  return p;
}

}  // namespace collab_case
