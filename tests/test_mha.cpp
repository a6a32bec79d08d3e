// Mha<T> against the naive double reference (tests/reference/mha_reference.hpp),
// plus the layer's argument checks (the BadInput suite).
//
// Expectations always come from the reference, never from headmix itself.
// Inputs and weights are drawn in T, and the reference gets exactly those
// values widened to double, so the comparison measures only the layer's
// arithmetic error.
//
// Tolerance, element-wise: |got - want| <= atol + rtol * |want|
//   double: rtol 1e-10, atol 1e-12. Values are O(1) and every result is a
//           few dot products of <= ~40 terms, so the error is a few hundred
//           roundings of 1.1e-16 at most; 1e-10 leaves a wide margin.
//   float:  rtol 2e-4,  atol 2e-5. Same reasoning with float's unit roundoff
//           6e-8: ~1e-6 typical, and the softmax can pass a logit error on
//           to a probability at most twice over.
// The 1e4-logit test loosens float further; its bound is derived there.

#include "headmix/decomp.hpp"
#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "reference/mha_reference.hpp"
#include "cases/mha.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace mha_case;  // Shape/Problem/run/expect_matches_reference: cases/mha.hpp

HEADMIX_TYPED_OVER_SCALARS(MhaTest);

// ---------------------------------------------------------------------------
// Agreement with the reference

TYPED_TEST(MhaTest, RandomShapesMatchReference) {
  const Index blocks[] = {1, 2, 3, 5, 64};
  const auto heads = [](Rng& rng, Shape& s) {
    s.H = uniform_int(rng, 1, 4), s.Dk = uniform_int(rng, 1, 6), s.bias = uniform_int(rng, 0, 1) == 1;
    s.key_block = uniform_int(rng, 0, 3);  // 1-3: several online-softmax steps per row
  };
  for_random_dense_shapes<Shape>(20240611, blocks, heads, [](const Shape& s, unsigned seed) {
    expect_matches_reference(make_problem<TypeParam>(s, seed));
  });
}

TYPED_TEST(MhaTest, SingleHead) {
  Shape s;
  s.H = 1, s.Dk = 7, s.Dv = 5;
  expect_matches_reference(make_problem<TypeParam>(s, 7));
}

// Head widths are free of D / H, and Dk, Dv and out_dim are all independent.
TYPED_TEST(MhaTest, HeadAndOutputWidthsIndependentOfEmbedDim) {
  Shape s;
  s.D = 20, s.H = 4, s.Dk = 8, s.Dv = 6, s.out = 7, s.pad_rate = 0.2;
  expect_matches_reference(make_problem<TypeParam>(s, 8));
  s.H = 3, s.Dk = 2, s.Dv = 9, s.out = 25;
  expect_matches_reference(make_problem<TypeParam>(s, 9));
}

TYPED_TEST(MhaTest, NoBiases) {
  Shape s;
  s.bias = false;
  expect_matches_reference(make_problem<TypeParam>(s, 10));
  s.cross = true, s.S = 7, s.Dkv = 3, s.causal = true;
  expect_matches_reference(make_problem<TypeParam>(s, 11));
}

// Every logit of a row is ~±1e4 with O(1) differences, as in mha.md's
// large_logits case: a naive exp overflows in float (e^88 already does).
//
// Float bound: in [8192, 16384) float's ulp is 2^-10 ~ 9.8e-4. The ±1e4 term
// of a logit (head coordinate 0) is the same for every key of a row, so it
// cancels in the softmax; what does not cancel is rounding of the Dk - 1 = 7
// other terms added to a running sum near 1e4: |dlogit| <= 7 * ulp/2 ~ 3.4e-3.
// Since p_j ~ exp(l_j), |dp_j| / p_j <= 2 max|dlogit| ~ 6.8e-3, so probs use
// rtol 1e-2 (atol 1e-6 for underflowing tails). The output moves by at most
// sum_j |dp_j| |v_j| <= 6.8e-3 max|v| per context entry, times |o.weight|'s
// row sum (<= 16 * 0.25 = 4): rtol 1e-2, atol 1e-2 (mha.md uses 1e-2/1e-2 for
// torch's float32 run on the same kind of case). Measured: probs 1.9e-3
// relative, output 2.8e-4 absolute. Double keeps the defaults (measured 4e-12).
TYPED_TEST(MhaTest, LogitsNear1e4DoNotOverflow) {
  using T = TypeParam;
  Shape shape;
  shape.B = 2, shape.T = 8, shape.D = 16, shape.H = 2, shape.Dk = 8, shape.Dv = 8, shape.out = 16;
  shape.causal = true;
  auto p = make_problem<T>(shape, 30);
  const Shape& s = p.s;  // self-attention: S = T
  p.padding = {0, 0, 1, 0, 0, 1, 0, 0,   // key 0 always visible
               0, 1, 0, 0, 0, 0, 1, 1};
  // Coordinate 0 of head h: K = alpha for every key, Q = ±beta + a small
  // per-row term, so scale * alpha * beta = 1e4 is a per-row offset, positive
  // in head 0 and negative in head 1.
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.Dk));
  const double alpha = std::sqrt(1e4 / scale), beta = alpha;
  for (int h = 0; h < s.H; ++h) {
    const Index r = h * s.Dk;
    p.w.k.weight.row(r).setZero();
    p.w.k.bias(r) = static_cast<T>(alpha);
    p.w.q.weight.row(r) *= T(0.01);
    p.w.q.bias(r) = static_cast<T>(h == 0 ? beta : -beta);
  }

  const Result<T> got = run(p);
  for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.out[i])));
  for (Index row = 0; row < got.probs.size() / s.S; ++row) {
    double sum = 0;
    for (Index j = 0; j < s.S; ++j) sum += static_cast<double>(got.probs[row * s.S + j]);
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;  // key 0 is visible to every row
  }
  const headmix_ref::RefMhaResult want = p.reference();
  const bool is_float = std::is_same_v<T, float>;
  const Tolerance probs_tol = is_float ? Tolerance{1e-2, 1e-6} : default_tolerance<T>();
  const Tolerance out_tol = is_float ? Tolerance{1e-2, 1e-2} : default_tolerance<T>();
  EXPECT_TRUE(all_close("probs", got.probs, want.probs, probs_tol));
  EXPECT_TRUE(masked_weights_exactly_zero(got.probs, want.probs));
  EXPECT_TRUE(all_close("output", got.out, want.output, out_tol));
}

// ---------------------------------------------------------------------------
// Grouped-query attention (num_kv_heads) and sliding windows

// H = 4 query heads over Hkv = 1 (multi-query), 2 and 4 (standard) KV
// heads, self and cross, padded, causal with offsets, several block sizes
// (0 = automatic) and thread counts.
TYPED_TEST(MhaTest, GroupedQueryMatchesReference) {
  unsigned seed = 300;
  for (int hkv : {1, 2, 4}) {
    for (int variant = 0; variant < 4; ++variant) {
      Shape s;
      s.H = 4, s.Hkv = hkv, s.T = 7, s.Dk = 3, s.Dv = 5;
      s.cross = variant % 2 == 1, s.S = 10, s.Dkv = 6;
      s.pad_rate = variant >= 1 ? 0.3 : 0.0;
      s.causal = variant >= 2, s.offset = variant == 3 ? -1 : (s.cross ? 3 : 0);
      s.block_rows = variant == 0 ? 0 : variant;
      s.threads = 1 + variant % 3;
      expect_matches_reference(make_problem<TypeParam>(s, seed++));
    }
  }
  Shape s;  // no output projection: the context still has H heads
  s.H = 4, s.Hkv = 2, s.out_proj = false, s.bias = false;
  const auto p = make_problem<TypeParam>(s, seed);
  EXPECT_EQ(p.layer().out_dim(), 4 * s.Dv);
  expect_matches_reference(p);
}

// p's K and V weights repeated per group by a loop: the weights of the
// standard MHA (num_kv_heads = H) that p's grouped-query layer stands for.
template <class T>
Problem<T> with_repeated_kv(const Problem<T>& p) {
  Problem<T> full = p;
  const int H = p.s.H, group = H / p.s.kv_heads();
  full.s.Hkv = 0;
  auto repeat = [&](const headmix::Linear<T>& in, int width) {
    headmix::Linear<T> out;
    out.weight.resize(H * width, in.weight.cols());
    out.bias.resize(in.bias.size() == 0 ? 0 : H * width);
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < width; ++r) {
        const int from = (h / group) * width + r, to = h * width + r;
        for (Index c = 0; c < in.weight.cols(); ++c) out.weight(to, c) = in.weight(from, c);
        if (in.bias.size() != 0) out.bias(to) = in.bias(from);
      }
    return out;
  };
  full.w.k = repeat(p.w.k, p.s.Dk);
  full.w.v = repeat(p.w.v, p.s.Dv);
  return full;
}

// The grouped layer is the standard MHA with K and V repeated per group.
// Q, each head's scores and readout are the same products, but the K and V
// projections are GEMMs of a different width, which Eigen may block
// differently; so agreement is to a few roundings, not bit for bit.
TYPED_TEST(MhaTest, GroupedQueryEqualsMhaWithRepeatedKv) {
  using T = TypeParam;
  const Tolerance tight = std::is_same_v<T, double> ? Tolerance{1e-13, 1e-15} : Tolerance{4e-6, 1e-7};
  for (int hkv : {1, 2}) {
    Shape s;
    s.H = 4, s.Hkv = hkv, s.T = 9, s.cross = true, s.S = 11, s.Dkv = 7, s.pad_rate = 0.3;
    s.causal = true, s.offset = 2, s.window = hkv == 1 ? 0 : 4, s.block_rows = 3;
    const auto p = make_problem<T>(s, 320 + static_cast<unsigned>(hkv));
    SCOPED_TRACE(describe(p.s));
    const auto full = with_repeated_kv(p);
    const Result<T> grouped = run(p), standard = run(full);
    EXPECT_TRUE(all_close("output", grouped.out, widen(standard.out), tight));
    EXPECT_TRUE(all_close("probs", grouped.probs, widen(standard.probs), tight));
    expect_matches_reference(full);
  }
}

// expand_kv_heads() gives exactly the loop-repeated weights, so a standard
// MHA built from them is the grouped layer; mha_to_collab() accepts the
// grouped layer and its exact copy (R = H·Dk) keeps the layer's output,
// window included, within the reference tolerance.
TYPED_TEST(MhaTest, ExpandKvHeadsAndMhaToCollabAcceptGroupedQuery) {
  using T = TypeParam;
  Shape s;
  s.H = 4, s.Hkv = 2, s.T = 8, s.D = 10, s.Dk = 3, s.Dv = 2, s.causal = true, s.window = 3, s.pad_rate = 0.25;
  const auto p = make_problem<T>(s, 330);
  const headmix::Mha<T> grouped = p.layer();
  const auto full = with_repeated_kv(p);
  const headmix::MhaWeights<T> expanded = headmix::decomp::expand_kv_heads(grouped);
  auto same = [](const headmix::Linear<T>& a, const headmix::Linear<T>& b) {
    return a.weight.rows() == b.weight.rows() && a.weight.cols() == b.weight.cols() &&
           a.bias.size() == b.bias.size() && a.weight == b.weight && a.bias == b.bias;
  };
  EXPECT_TRUE(same(expanded.k, full.w.k));
  EXPECT_TRUE(same(expanded.v, full.w.v));
  EXPECT_TRUE(same(expanded.q, p.w.q) && same(expanded.o, p.w.o));

  const auto c = headmix::decomp::mha_to_collab(grouped, s.H * s.Dk);
  EXPECT_TRUE(c.exact);
  EXPECT_EQ(c.options.window, s.window);
  const headmix::CollabHead<T> collab(c.weights, c.options);
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> out = collab.forward(p.input(), ws, &probs);
  const auto want = p.reference();
  EXPECT_TRUE(all_close("collab output", out, want.output, default_tolerance<T>()));
  EXPECT_TRUE(all_close("collab probs", probs, want.probs, default_tolerance<T>()));
}

// ---------------------------------------------------------------------------
// BadInput: every mismatch throws shape_error whose message names the
// variant, the argument and both shapes.

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN("[mha]", call, __VA_ARGS__)

// A valid cross-attention setup (D != Dkv, Dk != Dv, out != D); each test
// breaks exactly one thing.
class BadInput : public CrossBadInput<headmix::Mha<double>, headmix::MhaWeights<double>, headmix::MhaOptions> {
 protected:
  static constexpr int B = 2, T = 5, S = 7, D = 16, Dkv = 12, H = 2, Dk = 4, Dv = 3, Out = 10;

  BadInput() : CrossBadInput(B, T, S, D, Dkv, Out) {
    Shape s;
    s.B = B, s.T = T, s.cross = true, s.S = S, s.D = D, s.Dkv = Dkv, s.H = H, s.Dk = Dk, s.Dv = Dv, s.out = Out;
    w = make_problem<double>(s, 99).w;
    opt.num_heads = H;
  }
};

TEST_F(BadInput, ValidSetupRuns) {  // so that each failure below is the one broken thing
  EXPECT_NO_THROW(forward(input(), out_view()));
}

TEST_F(BadInput, QueryRowsNotDivisibleByHeads) {
  opt.num_heads = 3;  // q has 8 rows
  EXPECT_SHAPE_ERROR(build(), "q.weight", "expected [", "num_heads = 3", "got [8, 16]");
}

TEST_F(BadInput, ValueRowsNotDivisibleByHeads) {
  w.v.weight.conservativeResize(7, Dkv);
  w.v.bias.conservativeResize(7);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [", "num_heads = 2", "got [7, 12]");
}



TEST_F(BadInput, NegativeKeyBlock) {
  opt.key_block = -1;
  EXPECT_SHAPE_ERROR(build(), "key_block", "expected >= 0", "got -1");
}

TEST_F(BadInput, NumKvHeadsNotDividingNumHeads) {
  opt.num_kv_heads = 3;
  EXPECT_SHAPE_ERROR(build(), "num_kv_heads", "expected a divisor of num_heads = 2", "got 3");
  opt.num_kv_heads = -1;
  EXPECT_SHAPE_ERROR(build(), "num_kv_heads", "expected >= 1 (or 0 for num_heads)", "got -1");
}

// num_kv_heads = 1 with K and V still holding H heads: the K rows are
// checked against Hkv·Dk, and V rows against Hkv·Dv.
TEST_F(BadInput, KeyValueRowsForNumHeadsInsteadOfNumKvHeads) {
  opt.num_kv_heads = 1;
  EXPECT_SHAPE_ERROR(build(), "k.weight", "expected [4, 12]", "got [8, 12]");
  w.k.weight.conservativeResize(Dk, Dkv);
  w.k.bias.conservativeResize(Dk);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [3, 12]", "got [6, 12]");
}

// set_options() checks the head split like the constructor and keeps the
// old options when it throws (the checks every layer shares, block_rows,
// threads and num_heads >= 1: test_layer_contract.cpp, test_bad_input.cpp).
TEST_F(BadInput, SetOptionsValidates) {
  headmix::Mha<double> layer(w, opt);
  headmix::MhaOptions bad = opt;
  bad.num_heads = 3;  // 8 q rows do not split into 3 heads
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "q.weight", "num_heads = 3", "got [8, 16]");
  EXPECT_EQ(layer.options().num_heads, opt.num_heads);
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(layer.forward(input(), out_view(), ws));
}

}  // namespace
