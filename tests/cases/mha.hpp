// The mha test problem (shape, random weights and inputs, the naive
// double reference, running and comparing), shared by test_mha.cpp and
// the typed contract tests (tests/variants.hpp).
#pragma once

#include "headmix/decomp.hpp"
#include "headmix/headmix.hpp"
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
    << " offset=" << s.offset << " window=" << s.window << " pad_rate=" << s.pad_rate
    << " block_rows=" << s.block_rows << " key_block=" << s.key_block << " threads=" << s.threads;
  return o.str();
}

template <class T>
headmix_ref::RefLinear to_ref(const headmix::Linear<T>& lin) {
  return ref_linear_as<headmix_ref::RefLinear>(lin);
}

// A [batch * length, width] matrix as the reference's batch.
template <class T>
headmix_ref::RefBatch to_ref_batch(const Matrix<T>& m, int batch) {
  return ref_batch_as<headmix_ref::RefBatch>(m, batch);
}

template <class T>
struct Problem {
  Shape s;
  headmix::MhaWeights<T> w;
  Matrix<T> xq;                        // [B*T, D]
  Matrix<T> xk;                        // [B*S, Dkv]; unused for self-attention
  std::vector<std::uint8_t> padding;   // [B, S] or empty

  headmix::MhaOptions options() const {
    headmix::MhaOptions o;
    o.num_heads = s.H;
    o.num_kv_heads = s.Hkv;
    o.causal = s.causal;
    o.causal_offset = s.offset;
    o.window = s.window;
    o.block_rows = s.block_rows;
    o.key_block = s.key_block;
    o.threads = s.threads;
    return o;
  }
  headmix::Mha<T> layer() const { return headmix::Mha<T>(w, options()); }
  headmix::AttentionInput<T> input() const {
    headmix::AttentionInput<T> in;
    in.query = headmix::ConstBatchView<T>(xq.data(), s.B, s.T, s.D);
    if (s.cross) in.key = headmix::ConstBatchView<T>(xk.data(), s.B, s.S, s.Dkv);
    if (!padding.empty()) in.key_padding = headmix::KeyPadding{padding.data(), s.B, s.S};
    return in;
  }
  headmix_ref::RefMhaResult reference() const {
    headmix_ref::RefMhaWeights rw{to_ref(w.q), to_ref(w.k), to_ref(w.v), to_ref(w.o)};
    headmix_ref::RefMhaOptions ro;
    ro.num_heads = s.H;
    ro.num_kv_heads = s.Hkv;
    ro.causal = s.causal;
    ro.causal_offset = s.offset;
    ro.window = s.window;
    const headmix_ref::RefBatch q = to_ref_batch(xq, s.B);
    if (!s.cross) return headmix_ref::mha_reference(rw, ro, q, nullptr, padding);
    const headmix_ref::RefBatch k = to_ref_batch(xk, s.B);
    return headmix_ref::mha_reference(rw, ro, q, &k, padding);
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
  p.xq = random_matrix<T>(rng, s.B * s.T, s.D, 1.0);
  if (s.cross) p.xk = random_matrix<T>(rng, s.B * s.S, s.Dkv, 1.0);
  if (s.pad_rate > 0) {
    p.padding.resize(static_cast<std::size_t>(s.B) * s.S);
    for (auto& m : p.padding) m = uniform(rng, 0, 1) < s.pad_rate ? 1 : 0;
  }
  return p;
}

// ---------------------------------------------------------------------------
// Running and comparing

template <class T>
struct Result {
  Tensor<T> out, probs;
};

template <class T>
Result<T> run(const Problem<T>& p, headmix::Workspace<T>& ws) {
  Result<T> r;
  r.out = Tensor<T>({p.s.B, p.s.T, p.s.out_dim()});
  p.layer().forward(p.input(), r.out.batch(), ws, &r.probs);
  return r;
}

template <class T>
Result<T> run(const Problem<T>& p) {
  headmix::Workspace<T> ws;
  return run(p, ws);
}

// The reference gives masked keys exactly 0 (and float underflows before
// double does), so wherever it has 0 the layer must have 0 exactly, not ~1e-38.
template <class T>
::testing::AssertionResult masked_weights_exactly_zero(const Tensor<T>& got, const std::vector<double>& want) {
  if (static_cast<std::size_t>(got.size()) != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (std::size_t i = 0; i < want.size(); ++i)
    if (want[i] == 0 && got[static_cast<Index>(i)] != T(0))
      return ::testing::AssertionFailure() << "masked weight at flat index " << i << " is "
                                           << got[static_cast<Index>(i)] << ", not 0";
  return ::testing::AssertionSuccess();
}

template <class T>
void expect_matches_reference(const Problem<T>& p, Tolerance tol = default_tolerance<T>()) {
  SCOPED_TRACE(describe(p.s));
  const Result<T> got = run(p);
  const headmix_ref::RefMhaResult want = p.reference();
  EXPECT_EQ(got.out.shape(), (std::vector<Index>{p.s.B, p.s.T, p.s.out_dim()}));
  EXPECT_EQ(got.probs.shape(), (std::vector<Index>{p.s.B, p.s.H, p.s.T, p.s.S}));
  EXPECT_TRUE(all_close("output", got.out, want.output, tol));
  EXPECT_TRUE(all_close("probs", got.probs, want.probs, tol));
  EXPECT_TRUE(masked_weights_exactly_zero(got.probs, want.probs));
}

}  // namespace mha_case
