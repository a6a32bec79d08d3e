// TalkingHeads<T> against the naive double reference
// (tests/reference/talking_heads_reference.hpp), plus the layer's argument
// checks (the TalkingHeadsBadInput suite).
//
// Expectations come from the reference (or from the MHA reference, for the
// no-mix reduction), never from headmix itself. Inputs and weights are drawn
// in T and handed to the reference widened to double, so a comparison only
// measures the layer's own arithmetic error.
//
// Tolerance, element-wise: |got - want| <= atol + rtol * |want|
//   double: rtol 1e-10, atol 1e-12. Values are O(1); every result is a chain
//           of dot products of <= ~60 terms (scores, <= 6-head mixes, the
//           readout, the projections), a few hundred roundings of 1.1e-16.
//   float:  rtol 2e-4, atol 2e-5. Same chain at float's 6e-8: ~1e-6 typical.
//           The mixes add two sums of <= 6 terms with weights <= 1 in
//           magnitude, and the post-mixed weights may cancel to near zero,
//           which atol covers (their terms are O(1), so the absolute error
//           stays ~1e-6).
// Tests with other bounds derive them where they are used.

#include "headmix/headmix.hpp"
#include "headmix/io/safetensors.hpp"
#include "test_util.hpp"
#include "reference/mha_reference.hpp"
#include "reference/talking_heads_reference.hpp"
#include "cases/talking_heads.hpp"

#include <gtest/gtest.h>

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

namespace {

using namespace th_case;  // Shape/Problem/run/expect_matches_reference: cases/talking_heads.hpp

HEADMIX_TYPED_OVER_SCALARS(TalkingHeadsTest);

// ---------------------------------------------------------------------------
// Agreement with the reference

TYPED_TEST(TalkingHeadsTest, RandomShapesMatchReference) {
  const Index blocks[] = {1, 2, 3, 5, 16, 64};
  const auto heads = [](Rng& rng, Shape& s) {
    s.Hk = uniform_int(rng, 1, 5), s.H = uniform_int(rng, 1, 5), s.Hv = uniform_int(rng, 1, 5);
    s.pre = uniform_int(rng, 0, 3) != 0, s.post = uniform_int(rng, 0, 3) != 0;
    s.Dk = uniform_int(rng, 1, 6), s.bias = uniform_int(rng, 0, 1) == 1;
    s.scale = uniform_int(rng, 0, 3) == 0 ? uniform(rng, 0.1, 1.0) : 0.0;
  };
  for_random_dense_shapes<Shape>(20240612, blocks, heads, [](const Shape& s, unsigned seed) {
    expect_matches_reference(make_problem<TypeParam>(s, seed));
  });
}

// h_k != h != h_v in every order: reduction (h_k > h > h_v), expansion
// (h_k < h with h_v between), and the conformance case's 3, 5, 4.
TYPED_TEST(TalkingHeadsTest, ThreeDifferentHeadCounts) {
  Shape s;
  s.T = 9, s.Hk = 3, s.H = 5, s.Hv = 4, s.Dk = 6, s.Dv = 5, s.D = 24, s.out = 24;
  expect_matches_reference(make_problem<TypeParam>(s, 1));
  s.Hk = 8, s.H = 4, s.Hv = 2, s.cross = true, s.S = 11, s.Dkv = 10, s.scale = 0.3;
  expect_matches_reference(make_problem<TypeParam>(s, 2));
  s.Hk = 2, s.H = 6, s.Hv = 4, s.cross = false, s.causal = true, s.scale = 0;
  expect_matches_reference(make_problem<TypeParam>(s, 3));
  s.Hk = 1, s.H = 4, s.Hv = 1, s.pad_rate = 0.3;  // one key head fanned out, then folded back to one
  expect_matches_reference(make_problem<TypeParam>(s, 4));
}

TYPED_TEST(TalkingHeadsTest, PreMixOnly) {
  Shape s;
  s.post = false, s.T = 10, s.Hk = 4, s.H = 6, s.Dv = 2, s.out = 5, s.pad_rate = 0.3;
  const auto p = make_problem<TypeParam>(s, 5);
  ASSERT_FALSE(p.layer().has_post_mix());
  ASSERT_EQ(p.layer().value_heads(), 6);
  expect_matches_reference(p);
  // Without a post mix the weights are the softmax itself: rows sum to 1.
  const Result<TypeParam> got = run(p);
  for (Index row = 0; row < got.probs.size() / p.s.S; ++row) {
    double sum = 0;
    for (Index j = 0; j < p.s.S; ++j) sum += static_cast<double>(got.probs[row * p.s.S + j]);
    if (sum != 0) {
      EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
    }
  }
}

TYPED_TEST(TalkingHeadsTest, PostMixOnly) {
  Shape s;
  s.pre = false, s.T = 9, s.H = 3, s.Hv = 5, s.causal = true;
  const auto p = make_problem<TypeParam>(s, 6);
  ASSERT_FALSE(p.layer().has_pre_mix());
  ASSERT_EQ(p.layer().key_heads(), 3);
  expect_matches_reference(p);
}

// Without either mix the layer is MHA: checked against the independent MHA
// reference, and bit for bit against Mha<T> (the same stages run).
TYPED_TEST(TalkingHeadsTest, NoMixesReducesToMha) {
  using T = TypeParam;
  for (int variant = 0; variant < 2; ++variant) {
    Shape s;
    s.pre = false, s.post = false, s.H = 3, s.T = 8, s.Dk = 4, s.Dv = 5, s.out = 7, s.pad_rate = 0.25;
    if (variant == 1) s.cross = true, s.S = 11, s.Dkv = 6, s.causal = true, s.offset = 2, s.block_rows = 3;
    const auto p = make_problem<T>(s, 7 + variant);
    SCOPED_TRACE(describe(p.s));

    headmix_ref::RefMhaWeights mw;
    auto to_mha = [](const headmix_ref::RefThLinear& l) {
      return headmix_ref::RefLinear{l.out, l.in, l.weight, l.bias};
    };
    mw.q = to_mha(to_ref(p.w.q)), mw.k = to_mha(to_ref(p.w.k)), mw.v = to_mha(to_ref(p.w.v));
    mw.o = to_mha(to_ref(p.w.o));
    headmix_ref::RefMhaOptions mo;
    mo.num_heads = s.H, mo.causal = s.causal, mo.causal_offset = s.offset;
    const auto q = to_ref_batch(p.xq, s.B);
    headmix_ref::RefBatch mq{q.batch, q.length, q.width, q.data};
    headmix_ref::RefBatch mk;
    if (s.cross) {
      const auto k = to_ref_batch(p.xk, s.B);
      mk = {k.batch, k.length, k.width, k.data};
    }
    const headmix_ref::RefMhaResult want = headmix_ref::mha_reference(mw, mo, mq, s.cross ? &mk : nullptr, p.padding);

    const Result<T> got = run(p);
    EXPECT_TRUE(all_close("output", got.out, want.output, default_tolerance<T>()));
    EXPECT_TRUE(all_close("probs", got.probs, want.probs, default_tolerance<T>()));

    headmix::MhaOptions opt;
    opt.num_heads = s.H, opt.causal = s.causal, opt.causal_offset = s.offset, opt.block_rows = s.block_rows;
    headmix::Mha<T> mha(headmix::MhaWeights<T>{p.w.q, p.w.k, p.w.v, p.w.o}, opt);
    headmix::Workspace<T> ws;
    Tensor<T> mha_probs;
    const Tensor<T> mha_out = mha.forward(p.input(), ws, &mha_probs);
    EXPECT_TRUE(bit_identical("output vs Mha", got.out, mha_out));
    EXPECT_TRUE(bit_identical("probs vs Mha", got.probs, mha_probs));
  }
}

// Identity mixing matrices give MHA's result (to rounding: the mix
// multiplies by 1 and adds exact zeros, so in fact exactly).
TYPED_TEST(TalkingHeadsTest, IdentityMixesEqualNoMixes) {
  using T = TypeParam;
  Shape s;
  s.pre = false, s.post = false, s.H = 4, s.T = 7, s.causal = true, s.pad_rate = 0.2;
  auto p = make_problem<T>(s, 9);
  const Result<T> plain = run(p);
  p.w.pre_softmax = Matrix<T>::Identity(4, 4);
  p.w.post_softmax = Matrix<T>::Identity(4, 4);
  p.s.pre = p.s.post = true;
  const Result<T> mixed = run(p);
  EXPECT_TRUE(all_close("output", mixed.out, std::vector<double>(plain.out.data(), plain.out.data() + plain.out.size()),
                        default_tolerance<T>()));
  EXPECT_TRUE(all_close("probs", mixed.probs,
                        std::vector<double>(plain.probs.data(), plain.probs.data() + plain.probs.size()),
                        default_tolerance<T>()));
}

// The spec's check of orientation: a transposed mix is a different layer.
TYPED_TEST(TalkingHeadsTest, MixOrientationMatters) {
  using T = TypeParam;
  Shape s;
  s.Hk = s.H = s.Hv = 4, s.T = 6;
  auto p = make_problem<T>(s, 10);
  const headmix_ref::RefThResult want = p.reference();
  p.w.pre_softmax.transposeInPlace();
  const Result<T> transposed = run(p);
  EXPECT_FALSE(all_close("output", transposed.out, want.output, default_tolerance<T>()));
}

TYPED_TEST(TalkingHeadsTest, NoBiasesAndNoOutputProjection) {
  Shape s;
  s.bias = false;
  expect_matches_reference(make_problem<TypeParam>(s, 18));
  s.out_proj = false, s.Hv = 3, s.Dv = 5;
  const auto p = make_problem<TypeParam>(s, 19);
  EXPECT_EQ(p.layer().out_dim(), 15);
  expect_matches_reference(p);
  s.bias = true, s.causal = true;
  expect_matches_reference(make_problem<TypeParam>(s, 20));
}

TYPED_TEST(TalkingHeadsTest, Causal) {
  Shape s;
  s.T = 12, s.D = 48, s.Hk = s.H = s.Hv = 6, s.Dk = s.Dv = 8, s.out = 48, s.causal = true, s.block_rows = 5;
  expect_matches_reference(make_problem<TypeParam>(s, 21));
}

// The mask must come after the pre mix. The pre mix here has rows of
// negative sum, and a whole band of keys is padded; masking before the mix
// (with -inf: NaN; with -1e9: a huge positive logit) would fail the
// reference comparison, produce NaN, or put weight on padded keys. The
// padded keys' post-mix weights must be exactly zero.
TYPED_TEST(TalkingHeadsTest, MaskAfterPreMix) {
  using T = TypeParam;
  Shape s;
  s.T = 8, s.Hk = 3, s.H = 4, s.Hv = 2, s.causal = true;
  auto p = make_problem<T>(s, 30);
  p.w.pre_softmax << -1, -0.5, -0.7,  //
      0.2, -1, -0.3,                  //
      1, 0.5, -0.1,                   //
      -0.2, 0.1, -0.9;
  p.padding.assign(static_cast<std::size_t>(s.B) * s.T, 0);
  for (int j : {2, 3, 5}) p.padding[j] = 1;
  for (int j : {1, 6}) p.padding[s.T + j] = 1;
  expect_matches_reference(p);
  const Result<T> got = run(p);
  for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.out[i])));
  for (Index b = 0; b < s.B; ++b)
    for (Index c = 0; c < s.Hv; ++c)
      for (Index i = 0; i < s.T; ++i)
        for (Index j = 0; j < s.T; ++j)
          if (p.padding[b * s.T + j] || j > i) {
            EXPECT_EQ(got.probs[((b * s.Hv + c) * s.T + i) * s.T + j], T(0)) << b << "," << c << "," << i << "," << j;
          }
}

// Masked keys never reach an output: changing the padded keys' inputs, or
// (causal) the future's, leaves the other outputs bit-identical.
TYPED_TEST(TalkingHeadsTest, MaskedKeysDoNotLeak) {
  using T = TypeParam;
  Shape s;
  s.T = 10, s.Hk = 3, s.H = 4, s.Hv = 2, s.causal = true, s.block_rows = 4;
  auto p = make_problem<T>(s, 31);
  p.padding.assign(static_cast<std::size_t>(s.B) * s.T, 0);
  p.padding[3] = p.padding[s.T + 7] = 1;
  const Result<T> before = run(p);
  p.xq.row(3).setConstant(T(5));          // padded key of item 0
  p.xq.row(s.T + 7).setConstant(T(-5));   // padded key of item 1 ...
  p.xq.row(s.T + 9).setConstant(T(3));    // ... and the last query of item 1: only its own row may move
  const Result<T> after = run(p);
  for (Index b = 0; b < s.B; ++b)
    for (Index i = 0; i < s.T; ++i) {
      // Row 3 of item 0 and row 7 of item 1 are themselves queries whose
      // inputs changed; row 9 of item 1 too.
      if ((b == 0 && i == 3) || (b == 1 && (i == 7 || i == 9))) continue;
      for (Index c = 0; c < s.out; ++c)
        EXPECT_EQ(before.out.batch().item(b)(i, c), after.out.batch().item(b)(i, c)) << b << "," << i << "," << c;
    }
}

// Masking with head counts the typed tests in test_masking.cpp do not use:
// all equal, and more value heads than heads (key padding, causal with
// padding, an item whose keys are all padded).
TYPED_TEST(TalkingHeadsTest, MaskingWithOtherHeadCounts) {
  using T = TypeParam;
  Shape s;
  s.cross = true, s.T = 5, s.S = 11, s.Hk = 2, s.H = 2, s.Hv = 2, s.pad_rate = 0.3;
  expect_matches_reference(make_problem<T>(s, 26));
  s.cross = false, s.pad_rate = 0.4, s.Hk = 3, s.H = 5, s.Hv = 4;
  expect_matches_reference(make_problem<T>(s, 27));
  s.T = 9, s.causal = true, s.pad_rate = 0.35, s.block_rows = 4;
  expect_matches_reference(make_problem<T>(s, 28));
  s.cross = true, s.S = 12, s.offset = 2;
  expect_matches_reference(make_problem<T>(s, 29));
  Shape m;
  m.B = 3, m.cross = true, m.T = 4, m.S = 6, m.Hk = 2, m.H = 3, m.Hv = 4;
  auto p = make_problem<T>(m, 32);
  p.padding.assign(static_cast<std::size_t>(m.B) * m.S, 0);
  std::fill(p.padding.begin() + m.S, p.padding.begin() + 2 * m.S, 1);  // item 1
  expect_matches_reference(p);
  const Result<T> got = run(p);
  ASSERT_TRUE(all_finite("output", got.out));
  expect_rows_output(got, 1, m.T, [&](Index c) { return p.w.o.bias(c); });
  expect_rows_weights_zero(got, 1, m.T);
}

// No renormalisation after the post mix: each softmax row sums to 1, so a
// row of U sums to Σ_g post[c, g], whatever its sign. Bound: the sum of S
// float weights carries ~S·6e-8 relative error; 1e-5 covers S = 9.
TYPED_TEST(TalkingHeadsTest, PostMixedWeightsAreNotRenormalised) {
  using T = TypeParam;
  Shape s;
  s.cross = true, s.T = 5, s.S = 9, s.Hk = 2, s.H = 3, s.Hv = 4, s.pad_rate = 0.3;
  auto p = make_problem<T>(s, 37);
  p.padding[0] = 0, p.padding[s.S] = 0;  // every row sees key 0
  p.w.post_softmax << 0.9, -0.4, 0.3,  // rows of either sign of sum
      -1, -0.2, 0.5,                   //
      0.1, 0.1, -0.8,                  //
      0.6, 0.7, 0.2;
  const Result<T> got = run(p);
  bool some_negative = false;
  for (Index b = 0; b < s.B; ++b)
    for (Index c = 0; c < s.Hv; ++c) {
      const double want = static_cast<double>(p.w.post_softmax.row(c).sum());
      for (Index i = 0; i < s.T; ++i) {
        double sum = 0;
        for (Index j = 0; j < s.S; ++j) {
          const double u = static_cast<double>(got.probs[((b * s.Hv + c) * s.T + i) * s.S + j]);
          sum += u;
          some_negative = some_negative || u < 0;
        }
        EXPECT_NEAR(sum, want, 1e-5) << b << "," << c << "," << i;
      }
    }
  EXPECT_TRUE(some_negative);  // rows 1 and 2 of the mix make some weights negative
}

// The pre mix can make logits large: 1e3-sized mixing weights give logits of
// ~1e3 that a naive exp overflows in float. Float bound: a logit ~1e3 is the
// sum of h_k = 2 products of ~1e3, so it carries ~2·1e3·6e-8 ~ 1.2e-4 of
// absolute error, and p_j ~ exp(l_j) moves by a relative ~2.4e-4; rtol 2e-3
// gives a margin of ~8. Outputs are convex-ish mixes of O(1) values: atol 2e-3.
TYPED_TEST(TalkingHeadsTest, LargeMixedLogitsDoNotOverflow) {
  using T = TypeParam;
  Shape s;
  s.T = 8, s.Hk = 2, s.H = 3, s.Hv = 2, s.causal = true, s.pad_rate = 0.2;
  auto p = make_problem<T>(s, 38);
  p.w.pre_softmax *= T(1000);
  const Result<T> got = run(p);
  for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.out[i])));
  const bool is_float = std::is_same_v<T, float>;
  const Tolerance tol = is_float ? Tolerance{2e-3, 2e-3} : default_tolerance<T>();
  const headmix_ref::RefThResult want = p.reference();
  EXPECT_TRUE(all_close("probs", got.probs, want.probs, tol));
  EXPECT_TRUE(all_close("output", got.out, want.output, tol));
}

// Long key rows make the fused stage split each tile into chunks of one or
// two query rows (its chunk holds ~64 KiB of logits); chunk edges must not
// show, with padding and a causal offset cutting through them.
TYPED_TEST(TalkingHeadsTest, LongKeyRowsSplitTilesIntoChunks) {
  Shape s;
  s.cross = true, s.B = 1, s.T = 9, s.S = 1500, s.D = 6, s.Dkv = 5, s.Hk = 3, s.H = 5, s.Hv = 2, s.Dk = 2, s.Dv = 2;
  s.out = 4, s.block_rows = 4, s.pad_rate = 0.3, s.causal = true, s.offset = 1495;
  expect_matches_reference(make_problem<TypeParam>(s, 70));
  s.causal = false, s.pre = false;
  expect_matches_reference(make_problem<TypeParam>(s, 71));
  s.pre = true, s.post = false;
  expect_matches_reference(make_problem<TypeParam>(s, 72));
}

// ---------------------------------------------------------------------------
// The head-mixing stages of core/head_mix.hpp on their own, against plain
// loops in double (float bound: sums of <= 5 products of O(1) values, plus a
// softmax: 2e-5 absolute, 2e-4 relative as elsewhere).

template <class T>
std::vector<T> random_values(Rng& rng, std::size_t n) {
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(uniform(rng, -2, 2));
  return v;
}

// mix_heads, mix_heads_add and mix_heads_strided are Σ_a W[g, a] in[a, e];
// 5000 entries cross mix_heads_strided's panel edges in both types.
TYPED_TEST(TalkingHeadsTest, HeadMixKernelsAreProductsOverHeads) {
  using T = TypeParam;
  Rng rng(80);
  const Index hin = 3, hout = 4, rows = 2, cols = 2500, n = rows * cols, stride = n + 7;
  const Matrix<T> w = random_matrix<T>(rng, hout, hin, 1.0);
  const std::vector<T> in = random_values<T>(rng, static_cast<std::size_t>(hin * stride));
  std::vector<double> want(static_cast<std::size_t>(hout * n));
  for (Index g = 0; g < hout; ++g)
    for (Index e = 0; e < n; ++e) {
      double acc = 0;
      for (Index a = 0; a < hin; ++a) acc += double(w(g, a)) * double(in[a * stride + e]);
      want[g * n + e] = acc;
    }
  std::vector<T> packed(static_cast<std::size_t>(hin * n));  // the same values as a contiguous tile
  for (Index a = 0; a < hin; ++a) std::copy_n(in.data() + a * stride, n, packed.data() + a * n);

  std::vector<T> out(static_cast<std::size_t>(hout * n), T(7));
  headmix::mix_heads(w, headmix::AttentionTensor<T>(packed.data(), hin, rows, cols),
                     headmix::AttentionTensor<T>(out.data(), hout, rows, cols));
  EXPECT_TRUE(all_close("mix_heads", out.data(), out.size(), want, default_tolerance<T>()));

  std::vector<double> twice = want;
  for (auto& x : twice) x *= 2;
  headmix::mix_heads_add(w, headmix::AttentionTensor<T>(packed.data(), hin, rows, cols),
                         headmix::AttentionTensor<T>(out.data(), hout, rows, cols));
  EXPECT_TRUE(all_close("mix_heads_add", out.data(), out.size(), twice, default_tolerance<T>()));

  const Index out_stride = n + 3;
  std::vector<T> strided(static_cast<std::size_t>(hout * out_stride), T(7));
  headmix::mix_heads_strided(w, in.data(), stride, strided.data(), out_stride, n);
  std::vector<T> got(static_cast<std::size_t>(hout * n));
  for (Index g = 0; g < hout; ++g) {
    std::copy_n(strided.data() + g * out_stride, n, got.data() + g * n);
    for (Index e = n; e < out_stride; ++e) EXPECT_EQ(strided[g * out_stride + e], T(7)) << "wrote past head " << g;
  }
  EXPECT_TRUE(all_close("mix_heads_strided", got.data(), got.size(), want, default_tolerance<T>()));
}

// mix_softmax_mix in place on a tile, for every chunk size, with and without
// each mix, against: L = pre·J, mask (causal offset + padding) AFTER the mix,
// softmax, U = post·W.
TYPED_TEST(TalkingHeadsTest, FusedMixSoftmaxMixMatchesLoopsForAnyChunk) {
  using T = TypeParam;
  const Index hk = 3, h = 4, hv = 5, rows = 5, cols = 7, first_query = 10, first_key = 2, num_keys = 12;
  const headmix::PositionMask mask{true, -6, 0};  // query 10 + r sees keys <= 4 + r: row 0 sees keys 2..4
  std::vector<std::uint8_t> padding(num_keys, 0);
  padding[3] = padding[7] = 1;
  std::vector<T> bias(cols);
  headmix::key_padding_bias(padding.data(), first_key, cols, bias.data());
  for (int variant = 0; variant < 3; ++variant) {
    const bool has_pre = variant != 1, has_post = variant != 2;
    const Index mid = has_pre ? h : hk, out_heads = has_post ? hv : mid;
    Rng rng(81 + variant);
    const Matrix<T> pre = random_matrix<T>(rng, h, hk, 1.0), post = random_matrix<T>(rng, hv, mid, 1.0);
    const std::vector<T> scores = random_values<T>(rng, static_cast<std::size_t>(hk * rows * cols));

    std::vector<double> want(static_cast<std::size_t>(out_heads * rows * cols), 0.0);
    for (Index r = 0; r < rows; ++r) {
      std::vector<double> w(static_cast<std::size_t>(mid * cols), 0.0);
      for (Index g = 0; g < mid; ++g) {
        std::vector<double> l(cols);
        double top = -std::numeric_limits<double>::infinity();
        for (Index c = 0; c < cols; ++c) {
          const Index j = first_key + c;
          const bool visible = j <= first_query + r + mask.causal_offset && !padding[j];
          double v = 0;
          for (Index a = 0; a < hk; ++a)
            v += (has_pre ? double(pre(g, a)) : double(a == g)) * double(scores[(a * rows + r) * cols + c]);
          l[c] = visible ? v : -std::numeric_limits<double>::infinity();
          top = std::max(top, l[c]);
        }
        double sum = 0;
        for (Index c = 0; c < cols; ++c) sum += l[c] == -std::numeric_limits<double>::infinity() ? 0 : std::exp(l[c] - top);
        for (Index c = 0; c < cols; ++c)
          w[g * cols + c] = l[c] == -std::numeric_limits<double>::infinity() ? 0 : std::exp(l[c] - top) / sum;
      }
      for (Index o = 0; o < out_heads; ++o)
        for (Index c = 0; c < cols; ++c) {
          double u = 0;
          for (Index g = 0; g < mid; ++g) u += (has_post ? double(post(o, g)) : double(o == g)) * w[g * cols + c];
          want[(o * rows + r) * cols + c] = u;
        }
    }

    for (Index chunk : {Index(1), Index(2), Index(3), Index(5), Index(50)}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + " chunk " + std::to_string(chunk));
      std::vector<T> tile(static_cast<std::size_t>(std::max(hk, out_heads) * rows * cols), T(-9));
      std::copy(scores.begin(), scores.end(), tile.begin());
      std::vector<T> scratch(static_cast<std::size_t>(mid * std::min(chunk, rows) * cols));
      const headmix::AttentionTensor<T> in(tile.data(), hk, rows, cols, first_query, first_key);
      const headmix::AttentionTensor<T> got = headmix::mix_softmax_mix<T>(
          has_pre ? &pre : nullptr, has_post ? &post : nullptr, in, num_keys, mask, bias.data(), scratch.data(), chunk);
      EXPECT_EQ(got.data(), tile.data());
      EXPECT_EQ(got.heads(), out_heads);
      EXPECT_EQ(got.first_query(), first_query);
      EXPECT_TRUE(all_close("U", tile.data(), want.size(), want, default_tolerance<T>()));
      for (Index o = 0; o < out_heads; ++o)  // masked entries exactly zero
        for (Index c : {Index(1), Index(3), Index(5)}) EXPECT_EQ(got.head(o)(0, c), T(0)) << o << "," << c;
    }
  }
}

// ---------------------------------------------------------------------------
// TalkingHeadsBadInput (the BadInput suite, named apart from other
// variants' so that ctest names stay unique): every mismatch throws
// shape_error naming the variant, the argument and both shapes.

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN("[talking_heads]", call, __VA_ARGS__)

// A valid cross-attention setup with three different head counts (D != Dkv,
// Dk != Dv, out != D); each test breaks exactly one thing.
class TalkingHeadsBadInput : public CrossBadInput<headmix::TalkingHeads<double>, headmix::TalkingHeadsWeights<double>, headmix::TalkingHeadsOptions> {
 protected:
  static constexpr int B = 2, T = 5, S = 7, D = 16, Dkv = 12, Hk = 2, H = 3, Hv = 4, Dk = 4, Dv = 3, Out = 10;

  TalkingHeadsBadInput() : CrossBadInput(B, T, S, D, Dkv, Out) {
    Shape s;
    s.B = B, s.T = T, s.cross = true, s.S = S, s.D = D, s.Dkv = Dkv, s.Hk = Hk, s.H = H, s.Hv = Hv, s.Dk = Dk, s.Dv = Dv;
    s.out = Out;
    w = make_problem<double>(s, 99).w;
    opt.num_heads = H;
    opt.key_heads = Hk;
    opt.value_heads = Hv;
  }
};

TEST_F(TalkingHeadsBadInput, ValidSetupRuns) { EXPECT_NO_THROW(forward(input(), out_view())); }

TEST_F(TalkingHeadsBadInput, NegativeKeyHeads) {
  opt.key_heads = -1;
  EXPECT_SHAPE_ERROR(build(), "key_heads", "expected >= 1 (or 0 for num_heads)", "got -1");
}

TEST_F(TalkingHeadsBadInput, NegativeValueHeads) {
  opt.value_heads = -2;
  EXPECT_SHAPE_ERROR(build(), "value_heads", "expected >= 1 (or 0 for num_heads)", "got -2");
}

TEST_F(TalkingHeadsBadInput, QueryRowsNotDivisibleByKeyHeads) {
  opt.key_heads = 3;  // q has 8 rows
  w.pre_softmax.resize(H, 3);
  EXPECT_SHAPE_ERROR(build(), "q.weight", "expected [", "key_heads = 3", "got [8, 16]");
}

TEST_F(TalkingHeadsBadInput, ValueRowsNotDivisibleByValueHeads) {
  opt.value_heads = 5;  // v has 12 rows
  w.post_softmax.resize(5, H);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [", "value_heads = 5", "got [12, 12]");
}

// The mixes are pre [H, Hk] and post [Hv, H]: wrong rows or columns,
// transposed, or present with no columns.
TEST_F(TalkingHeadsBadInput, MixShapes) {
  using W = headmix::TalkingHeadsWeights<double>;
  struct Case {
    Matrix<double> W::*mix;
    Index rows, cols;
  };
  const Case cases[] = {{&W::pre_softmax, H + 1, Hk}, {&W::pre_softmax, H, Hk + 2}, {&W::pre_softmax, Hk, H},
                        {&W::pre_softmax, H, 0},      {&W::post_softmax, Hv - 1, H}, {&W::post_softmax, Hv, H + 1},
                        {&W::post_softmax, H, Hv}};
  const W valid = w;
  for (const Case& c : cases) {
    w = valid;
    (w.*c.mix).resize(c.rows, c.cols);
    const bool pre = c.mix == &W::pre_softmax;
    EXPECT_SHAPE_ERROR(build(), pre ? "pre_softmax.weight" : "post_softmax.weight",
                       pre ? "expected [3, 2]" : "expected [4, 3]",
                       "got [" + std::to_string(c.rows) + ", " + std::to_string(c.cols) + "]");
  }
}

TEST_F(TalkingHeadsBadInput, MissingPreMixNeedsKeyHeadsEqualNumHeads) {
  w.pre_softmax.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "pre_softmax.weight", "expected [3, 2]", "key_heads = 2", "num_heads = 3",
                     "got none");
}

TEST_F(TalkingHeadsBadInput, MissingPostMixNeedsNumHeadsEqualValueHeads) {
  w.post_softmax.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "post_softmax.weight", "expected [4, 3]", "num_heads = 3", "value_heads = 4",
                     "got none");
}

// value_heads = 0 (and key_heads = 0) mean num_heads: the mix must then be [h, h].
TEST_F(TalkingHeadsBadInput, DefaultHeadCountsFollowNumHeads) {
  opt.value_heads = 0;  // 3 value heads of width 4 still fit v's 12 rows
  EXPECT_SHAPE_ERROR(build(), "post_softmax.weight", "expected [3, 3]", "got [4, 3]");
}

// set_options() checks the three head counts like the constructor and keeps
// the old options when it throws (the checks every layer shares:
// test_layer_contract.cpp, test_bad_input.cpp).
TEST_F(TalkingHeadsBadInput, SetOptionsValidates) {
  headmix::TalkingHeads<double> layer(w, opt);
  headmix::TalkingHeadsOptions bad = opt;
  bad.value_heads = 3;  // v's 12 rows split into 3 heads, but post_softmax is [4, 3]
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "post_softmax.weight", "expected [3, 3]", "got [4, 3]");
  bad = opt, bad.key_heads = 3;  // 8 q rows do not split into 3 heads
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "q.weight", "key_heads = 3", "got [8, 16]");
  EXPECT_EQ(layer.options().key_heads, Hk);
  EXPECT_EQ(layer.options().value_heads, Hv);
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(layer.forward(input(), out_view(), ws));
}

// from_tensors reads the spec's tensor names under a prefix; absent biases,
// o and mixes stay absent, and the result is validated like the constructor.
struct NamedTensors {
  std::map<std::string, Matrix<double>> tensors;

  bool contains(const std::string& name) const { return tensors.count(name) != 0; }
  template <class T>
  Matrix<T> matrix(const std::string& name) const {
    return tensors.at(name).template cast<T>();
  }
  template <class T>
  headmix::Vector<T> vector(const std::string& name) const {
    const Matrix<double>& m = tensors.at(name);
    return Eigen::Map<const headmix::Vector<double>>(m.data(), m.size()).template cast<T>();
  }
};

TEST_F(TalkingHeadsBadInput, FromTensorsReadsNamedWeights) {
  NamedTensors src;
  const std::string pre = "layers.3.attn.";
  src.tensors[pre + "q.weight"] = w.q.weight;
  src.tensors[pre + "q.bias"] = w.q.bias;
  src.tensors[pre + "k.weight"] = w.k.weight;
  src.tensors[pre + "v.weight"] = w.v.weight;
  src.tensors[pre + "o.weight"] = w.o.weight;
  src.tensors[pre + "pre_softmax.weight"] = w.pre_softmax;
  src.tensors[pre + "post_softmax.weight"] = w.post_softmax;
  const auto layer = headmix::TalkingHeads<float>::from_tensors(src, pre, opt);
  EXPECT_TRUE(layer.has_pre_mix());
  EXPECT_TRUE(layer.has_post_mix());
  EXPECT_EQ(layer.weights().q.bias.size(), Hk * Dk);
  EXPECT_FALSE(layer.weights().k.has_bias());
  EXPECT_EQ(layer.out_dim(), Out);
  EXPECT_EQ(layer.weights().post_softmax(1, 2), static_cast<float>(w.post_softmax(1, 2)));

  src.tensors.erase(pre + "post_softmax.weight");  // h = 3 != h_v = 4: the mix is required, so it is read
  EXPECT_THROW(headmix::TalkingHeads<double>::from_tensors(src, pre, opt), std::out_of_range);  // this source's "missing"
  {
    headmix::io::TensorFile file;  // a real file's missing-tensor error names the stored tensor
    for (const auto& [name, m] : src.tensors) {
      const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
      Tensor<double> t(bias ? std::vector<Index>{m.size()} : std::vector<Index>{m.rows(), m.cols()});
      std::copy_n(m.data(), m.size(), t.data());
      file.tensors[name] = headmix::io::StoredTensor::from(t);
    }
    try {
      (void)headmix::TalkingHeads<double>::from_tensors(file, pre, opt);
      ADD_FAILURE() << "a required post-softmax mix was not read";
    } catch (const headmix::io::io_error& e) {
      EXPECT_NE(std::string(e.what()).find("missing tensor '" + pre + "post_softmax.weight'"), std::string::npos)
          << e.what();
    }
  }
  src.tensors.erase(pre + "o.weight");
  opt.value_heads = H;  // v's 12 rows as 3 heads of 4: no post mix needed, output is the heads
  const auto no_post = headmix::TalkingHeads<double>::from_tensors(src, pre, opt);
  EXPECT_FALSE(no_post.has_post_mix());
  EXPECT_EQ(no_post.out_dim(), Hv * Dv);
}

}  // namespace
