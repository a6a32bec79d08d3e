// CollabHead<T> against the naive double reference
// (tests/reference/collab_reference.hpp), plus the layer's argument checks
// (the BadInput suite).
//
// Expectations always come from the reference, never from headmix itself.
// Inputs and weights are drawn in T and the reference gets exactly those
// values widened to double, so the comparison measures only the layer's
// arithmetic error.
//
// Tolerance, element-wise: |got - want| <= atol + rtol * |want|
//   double: rtol 1e-10, atol 1e-12. Values are O(1); each result is a chain
//           of dot products of <= ~40 terms, a few hundred roundings of
//           1.1e-16 at most (LayerNorm divides by a std of O(1)).
//   float:  rtol 2e-4,  atol 2e-5. Same count with float's 6e-8 unit
//           roundoff gives ~1e-6 typically; the softmax passes a logit error
//           on to a probability at most twice over.
// The large-logit test loosens float further; its bound is derived there.

#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "headmix/variants/collab_head.hpp"
#include "reference/collab_reference.hpp"
#include "cases/collab_head.hpp"

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

using namespace collab_case;  // Shape/Problem/run/expect_matches_reference: cases/collab_head.hpp

HEADMIX_TYPED_OVER_SCALARS(CollabHeadTest);

// ---------------------------------------------------------------------------
// Agreement with the reference

TYPED_TEST(CollabHeadTest, RandomShapesMatchReference) {
  const Index blocks[] = {1, 2, 3, 5, 64};
  const auto own = [](Rng& rng, Shape& s) {
    const Mixing mixings[] = {Mixing::dense, Mixing::dense, Mixing::block, Mixing::banded, Mixing::zero_row};
    s.H = uniform_int(rng, 1, 4), s.R = uniform_int(rng, 1, 14), s.content_bias = uniform_int(rng, 0, 3) != 0;
    s.v_bias = uniform_int(rng, 0, 1) == 1, s.layer_norm = uniform_int(rng, 0, 3) == 0;
    s.mixing = mixings[uniform_int(rng, 0, 4)];
    s.key_block = uniform_int(rng, 0, 3);  // 1-3: several online-softmax steps per row
  };
  for_random_dense_shapes<Shape>(20240612, blocks, own, [](const Shape& s, unsigned seed) {
    expect_matches_reference(make_problem<TypeParam>(s, seed));
  });
}

// R/H = 10/3 is not an integer: the default scale is 1/sqrt(10/3), in double.
TYPED_TEST(CollabHeadTest, SharedDimNotMultipleOfHeads) {
  Shape s;
  s.cross = true, s.T = 5, s.S = 11, s.D = 12, s.Dkv = 12, s.H = 3, s.R = 10, s.Dv = 4, s.out = 12, s.pad_rate = 0.2;
  const auto p = make_problem<TypeParam>(s, 8);
  EXPECT_DOUBLE_EQ(p.layer().scale_value(), 1.0 / std::sqrt(10.0 / 3.0));
  expect_matches_reference(p);
  s.causal = true, s.R = 7;
  expect_matches_reference(make_problem<TypeParam>(s, 9));
}

TYPED_TEST(CollabHeadTest, ExplicitScale) {
  Shape s;
  s.scale = 0.125, s.T = 7;
  const auto p = make_problem<TypeParam>(s, 10);
  EXPECT_EQ(p.layer().scale_value(), 0.125);
  expect_matches_reference(p);
  s.scale = -2.0;  // any finite value is the caller's business
  expect_matches_reference(make_problem<TypeParam>(s, 11));
}

TYPED_TEST(CollabHeadTest, NoContentBiasNoValueBias) {
  Shape s;
  s.content_bias = false, s.v_bias = false, s.causal = true, s.T = 6;
  const auto p = make_problem<TypeParam>(s, 12);
  EXPECT_FALSE(p.layer().has_content_bias());
  expect_matches_reference(p);
  s.cross = true, s.S = 8, s.Dkv = 5, s.pad_rate = 0.3;
  expect_matches_reference(make_problem<TypeParam>(s, 13));
}

// LayerNorm(Xq + y): the residual is the query-side input, also in cross-attention.
TYPED_TEST(CollabHeadTest, LayerNorm) {
  Shape s;
  s.layer_norm = true, s.T = 9, s.D = 16, s.H = 4, s.R = 10, s.causal = true;
  expect_matches_reference(make_problem<TypeParam>(s, 16));
  s.cross = true, s.causal = false, s.S = 6, s.Dkv = 7, s.pad_rate = 0.3;
  expect_matches_reference(make_problem<TypeParam>(s, 17));
  s.out_proj = false, s.Dv = 3;  // D becomes H*Dv = 12
  const auto p = make_problem<TypeParam>(s, 18);
  EXPECT_EQ(p.s.D, 12);
  expect_matches_reference(p);
  Shape e = s;  // a non-default eps
  auto q = make_problem<TypeParam>(e, 19);
  q.w.layer_norm.eps = 0.5;
  expect_matches_reference(q);
}

// Block mixing: each head reads only its own R/H shared columns.
TYPED_TEST(CollabHeadTest, BlockMixingUsesOnlyEachHeadsColumns) {
  Shape s;
  s.mixing = Mixing::block, s.H = 4, s.R = 16, s.D = 12, s.T = 8, s.pad_rate = 0.2;
  const auto p = make_problem<TypeParam>(s, 20);
  const auto layer = p.layer();
  for (Index h = 0; h < s.H; ++h) {
    EXPECT_EQ(layer.head_span(h).first, 4 * h);
    EXPECT_EQ(layer.head_span(h).second, 4);
  }
  expect_matches_reference(p);
  s.R = 10;  // c = ceil(10/4) = 3: the last head gets a single column
  const auto q = make_problem<TypeParam>(s, 21);
  EXPECT_EQ(q.layer().head_span(3).first, 9);
  EXPECT_EQ(q.layer().head_span(3).second, 1);
  expect_matches_reference(q);
  s.mixing = Mixing::banded;
  expect_matches_reference(make_problem<TypeParam>(s, 22));
  s.mixing = Mixing::zero_row;
  const auto z = make_problem<TypeParam>(s, 23);
  EXPECT_EQ(z.layer().head_span(0).second, 0);
  expect_matches_reference(z);
  s.content_bias = false;  // a zero row and no content bias: uniform weights over the visible keys
  expect_matches_reference(make_problem<TypeParam>(s, 24));
}

// Masking under LayerNorm(Xq + y) (the typed masking tests in
// test_masking.cpp run without it): a decoder-like offset, causal padded
// cross-attention, rows that see nothing, and an item whose keys are all
// padded without a content bias: finite, with weights exactly 0.
TYPED_TEST(CollabHeadTest, MaskingWithLayerNorm) {
  using T = TypeParam;
  Shape s;
  s.layer_norm = true, s.cross = true, s.T = 1, s.S = 9, s.Dkv = 5, s.pad_rate = 0.3, s.causal = true;
  s.offset = s.S - 1;
  expect_matches_reference(make_problem<T>(s, 5));
  s.T = 9, s.S = 12, s.Dkv = 8, s.pad_rate = 0.35, s.block_rows = 4, s.offset = 2;
  expect_matches_reference(make_problem<T>(s, 34));
  Shape none;  // offset -20: nothing visible anywhere
  none.layer_norm = true, none.T = 8, none.causal = true, none.offset = -20, none.block_rows = 2;
  expect_matches_reference(make_problem<T>(none, 30));
  Shape item;
  item.layer_norm = true, item.content_bias = false, item.B = 3, item.cross = true, item.T = 4, item.S = 6;
  auto p = make_problem<T>(item, 37);
  p.padding.assign(static_cast<std::size_t>(item.B) * item.S, 0);
  std::fill(p.padding.begin() + item.S, p.padding.begin() + 2 * item.S, 1);  // item 1
  p.padding[2 * item.S + 4] = 1;
  expect_matches_reference(p);
  const Result<T> got = run(p);
  ASSERT_TRUE(all_finite("output", got.out));
  ASSERT_TRUE(all_finite("probs", got.probs));
  expect_rows_weights_zero(got, 1, item.T);
}

// As collab.md's large_logits case: the key input has a common component of
// 300, so every logit row carries an offset of several hundred (from the
// shared key and the content bias alike; the test checks > 300) with O(1)
// differences; a naive exp overflows.
//
// Float bound: logits below 1024, where float's ulp is <= 1.2e-4. Each logit
// is a sum of R = 8 scaled products plus the content bias; the parts that do
// not cancel across a row are rounded at most ~10 times at ulp/2:
// |dlogit| <= 10 · 6e-5 ~ 6e-4, so |dp|/p <= 2·|dlogit| ~ 1.2e-3: probs use
// rtol 1e-2 (atol 1e-6 for underflowed tails). The output moves by at most
// Σ_j |dp_j||v_j| <= 1.2e-3 · max|v| per context entry times o's row sums
// (<= 4): rtol 1e-2, atol 2e-2. Double keeps the defaults.
TYPED_TEST(CollabHeadTest, LargeLogitOffsetsDoNotOverflow) {
  using T = TypeParam;
  Shape shape;
  shape.cross = true, shape.B = 2, shape.T = 8, shape.S = 10, shape.D = 16, shape.Dkv = 16, shape.H = 2,
  shape.R = 8, shape.Dv = 8, shape.out = 16, shape.causal = true, shape.pad_rate = 0.2;
  auto p = make_problem<T>(shape, 40);
  const Shape& s = p.s;
  for (Index r = 0; r < p.xk.rows(); ++r) p.xk(r, 0) += T(300);
  for (Index r = 0; r < s.R; ++r) p.w.k(r, 0) = T(r % 2 ? 10.0f : -10.0f);  // K̃[:, r] ≈ ±3000 for every key
  for (Index b = 0; b < s.B; ++b) p.padding[b * s.S] = 0;                 // key 0 visible to every row

  const Result<T> got = run(p);
  for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.out[i])));
  for (Index row = 0; row < got.probs.size() / s.S; ++row) {
    double sum = 0;
    for (Index j = 0; j < s.S; ++j) sum += static_cast<double>(got.probs[row * s.S + j]);
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }
  const headmix_ref::RefMhaResult want = p.reference();
  double max_abs_logit_offset = 0;  // check that the offsets are as large as intended
  {
    const auto rw = p.ref_weights();
    for (Index i = 0; i < s.T; ++i) {
      double qk = 0;
      for (Index r = 0; r < s.R; ++r) {
        double qr = 0;
        for (Index c = 0; c < s.D; ++c) qr += double(p.xq(i, c)) * rw.q[r * s.D + c];
        qk += qr * rw.mixing[r] * 3000.0 * (r % 2 ? 1 : -1);
      }
      max_abs_logit_offset = std::max(max_abs_logit_offset, std::abs(qk) * p.layer().scale_value());
    }
  }
  EXPECT_GT(max_abs_logit_offset, 300.0);
  const bool is_float = std::is_same_v<T, float>;
  EXPECT_TRUE(all_close("probs", got.probs, want.probs, is_float ? Tolerance{1e-2, 1e-6} : default_tolerance<T>()));
  EXPECT_TRUE(all_close("output", got.out, want.output, is_float ? Tolerance{1e-2, 2e-2} : default_tolerance<T>()));
}

// With block mixing at R = H·Dk the score stage costs what MHA's does: the
// attention work differs from Mha::flops only by the T·R mixed-query
// multiplies, and the projections by the S·D·H content bias.
TYPED_TEST(CollabHeadTest, BlockMixingCostsWhatMhaCosts) {
  using T = TypeParam;
  Shape s;
  s.mixing = Mixing::block, s.H = 4, s.R = 16, s.D = 16, s.Dv = 4, s.out = 16, s.T = 10;
  const auto p = make_problem<T>(s, 80);
  headmix::MhaWeights<T> mw;
  mw.q.weight = p.w.q, mw.k.weight = p.w.k, mw.v = p.w.v, mw.o = p.w.o;
  headmix::MhaOptions mo;
  mo.num_heads = s.H;
  for (bool causal : {false, true}) {
    mo.causal = causal;
    auto po = p.options();
    po.causal = causal;
    const auto collab = headmix::CollabHead<T>(p.w, po).flops(3, s.T, s.T);
    const auto plain = headmix::Mha<T>(mw, mo).flops(3, s.T, s.T);
    EXPECT_EQ(collab.attention_macs - plain.attention_macs, 3 * s.T * s.R);
    EXPECT_EQ(collab.projection_macs - plain.projection_macs, 3 * s.T * s.D * s.H);
  }
}

// ---------------------------------------------------------------------------
// BadInput: every mismatch throws shape_error whose message names the
// variant, the argument and both shapes.

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN("[collab]", call, __VA_ARGS__)

// A valid cross-attention setup (D != Dkv, R not a multiple of H, Dv, out != D,
// content bias, o); each test breaks exactly one thing.
class BadInput : public CrossBadInput<headmix::CollabHead<double>, headmix::CollabHeadWeights<double>, headmix::CollabHeadOptions> {
 protected:
  static constexpr int B = 2, T = 5, S = 7, D = 16, Dkv = 12, H = 2, R = 6, Dv = 3, Out = 10;

  BadInput() : CrossBadInput(B, T, S, D, Dkv, Out) {
    Rng rng(99);
    w.q = random_matrix<double>(rng, R, D, 0.25);
    w.k = random_matrix<double>(rng, R, Dkv, 0.25);
    w.mixing = random_matrix<double>(rng, H, R, 1.0);
    w.content_bias = random_matrix<double>(rng, H, Dkv, 0.25);
    w.v = random_linear<double>(rng, H * Dv, Dkv, true);
    w.o = random_linear<double>(rng, Out, H * Dv, true);
    opt.num_heads = H;
  }
  // A LayerNorm needs out_dim == D: make o [D, H·Dv] first.
  void with_layer_norm() {
    Rng rng(7);
    w.o = random_linear<double>(rng, D, H * Dv, true);
    w.layer_norm.weight = headmix::Vector<double>::Ones(D);
    w.layer_norm.bias = headmix::Vector<double>::Zero(D);
    out.resize(B * T, D);
  }
};

TEST_F(BadInput, ValidSetupRuns) {  // so that each failure below is the one broken thing
  EXPECT_NO_THROW(forward(input(), out_view()));
  with_layer_norm();
  EXPECT_NO_THROW(forward(input(), headmix::BatchView<double>(out.data(), B, T, D)));
}

TEST_F(BadInput, MixingRowsNotHeads) {
  opt.num_heads = 3;
  EXPECT_SHAPE_ERROR(build(), "mixing", "expected [3, 6]", "got [2, 6]");
}

TEST_F(BadInput, MixingColumnsNotSharedDim) {
  w.mixing.conservativeResize(H, R - 1);
  EXPECT_SHAPE_ERROR(build(), "mixing", "expected [2, 6]", "got [2, 5]");
}

TEST_F(BadInput, NoQueryWeight) {
  w.q.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "q.weight", "expected [R >= 1, D >= 1]", "got [0, 0]");
}

TEST_F(BadInput, KeyRowsNotSharedDim) {
  w.k.conservativeResize(R - 1, Dkv);
  EXPECT_SHAPE_ERROR(build(), "k.weight", "expected [6, 12]", "got [5, 12]");
}

TEST_F(BadInput, NoKeyWeight) {
  w.k.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "k.weight", "expected [6, Dkv >= 1]", "got [0, 0]");
}

TEST_F(BadInput, ContentBiasShape) {
  w.content_bias.conservativeResize(H, Dkv - 1);
  EXPECT_SHAPE_ERROR(build(), "content_bias.weight", "expected [2, 12]", "got [2, 11]");
  w.content_bias.resize(H + 1, Dkv);
  EXPECT_SHAPE_ERROR(build(), "content_bias.weight", "expected [2, 12]", "got [3, 12]");
}

TEST_F(BadInput, ValueRowsNotDivisibleByHeads) {
  w.v.weight.conservativeResize(7, Dkv);
  w.v.bias.conservativeResize(7);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [", "num_heads = 2", "got [7, 12]");
}

TEST_F(BadInput, ValueColumnsNotKeyWidth) {
  w.v.weight.conservativeResize(H * Dv, Dkv - 1);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [6, 12]", "got [6, 11]");
}

TEST_F(BadInput, ValueBiasLength) {
  w.v.bias.conservativeResize(5);
  EXPECT_SHAPE_ERROR(build(), "v.bias", "expected [6]", "got [5]");
}



TEST_F(BadInput, LayerNormNeedsOutDimEqualToEmbedDim) {
  with_layer_norm();
  Rng rng(8);
  w.o = random_linear<double>(rng, Out, H * Dv, true);
  EXPECT_SHAPE_ERROR(build(), "out_dim", "expected 16", "got 10");
}

TEST_F(BadInput, LayerNormWeightLength) {
  with_layer_norm();
  w.layer_norm.weight.conservativeResize(D - 1);
  EXPECT_SHAPE_ERROR(build(), "layer_norm.weight", "expected [16]", "got [15]");
}

TEST_F(BadInput, LayerNormBiasLengthOrMissing) {
  with_layer_norm();
  w.layer_norm.bias.conservativeResize(D + 1);
  EXPECT_SHAPE_ERROR(build(), "layer_norm.bias", "expected [16]", "got [17]");
  w.layer_norm.bias.resize(0);
  EXPECT_SHAPE_ERROR(build(), "layer_norm.bias", "expected [16]", "got [0]");
}

TEST_F(BadInput, LayerNormEps) {
  with_layer_norm();
  w.layer_norm.eps = -1;
  EXPECT_SHAPE_ERROR(build(), "layer_norm.eps", "expected a finite number >= 0", "got -1");
  w.layer_norm.eps = std::numeric_limits<double>::infinity();
  EXPECT_SHAPE_ERROR(build(), "layer_norm.eps", "expected a finite number >= 0", "got inf");
}

// set_options() checks the mixing rows like the constructor and keeps the
// old options when it throws (the checks every layer shares, block_rows,
// threads, num_heads >= 1 and a finite scale: test_layer_contract.cpp,
// test_bad_input.cpp).
TEST_F(BadInput, SetOptionsChecksAndKeepsTheOldOptions) {
  headmix::CollabHead<double> layer(w, opt);
  headmix::CollabHeadOptions bad = opt;
  bad.num_heads = 3;
  bad.scale = 0.5;
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "mixing", "expected [3, 6]", "got [2, 6]");
  EXPECT_EQ(layer.options().num_heads, opt.num_heads);
  EXPECT_FALSE(layer.options().scale.has_value());
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(layer.forward(input(), out_view(), ws));
}

}  // namespace
