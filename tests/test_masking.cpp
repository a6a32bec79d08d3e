// Masking as every dense layer does it (MHA, Talking-Heads, CollabHead: the
// variants whose shapes share cross, S, Dkv, causal, offset, window,
// pad_rate and block_rows), as typed tests over
// DenseVariantsInBothScalars (tests/variants.hpp): a new dense variant is
// covered by its entry there. Each case is compared with the variant's naive
// double reference (its cases/<variant>.hpp Problem; MHA's comparison also
// holds masked weights to exactly 0). The variant's own switches vary
// through V::masking_variation; what one variant adds to masking (CollabHead's
// LayerNorm, Talking-Heads' mixes) stays in its own test file.

#include "variants.hpp"

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;

// Whether a shape has a `bias` switch for all its biases (CollabHead has
// separate ones and keeps its no-bias cases).
template <class S, class = void>
struct has_bias_switch : std::false_type {};
template <class S>
struct has_bias_switch<S, std::void_t<decltype(std::declval<S&>().bias = false)>> : std::true_type {};

template <class Param>
class Masking : public ::testing::Test {
 public:
  using V = typename Param::Variant;
  using T = typename Param::Scalar;
  using Shape = typename V::Shape;
  using Problem = typename V::template Problem<T>;

  static Problem make(const Shape& s, unsigned seed) { return V::template make<T>(s, seed); }
  static void check(const Problem& p) { expect_matches_reference(p); }
  static void check(const Shape& s, unsigned seed) { check(make(s, seed)); }
};
TYPED_TEST_SUITE(Masking, DenseVariantsInBothScalars, VariantInName);

TYPED_TEST(Masking, SingleQueryAndSingleKey) {
  using F = TestFixture;
  typename F::Shape s;
  s.T = 1;
  F::check(s, 1);  // self: one key
  s.cross = true, s.S = 9, s.Dkv = 5, s.pad_rate = 0.3;
  F::check(s, 2);
  s.causal = true;  // top-left alignment: the single query sees key 0 only
  F::check(s, 3);
  s.offset = s.S - 1;  // decoding one new token: sees every key
  F::check(s, 4);
  s.T = 6, s.S = 1, s.causal = false, s.pad_rate = 0;  // every query over one key
  F::check(s, 5);
}

TYPED_TEST(Masking, CrossAttentionWithKeyWidthNotEmbedWidth) {
  using F = TestFixture;
  typename F::Shape s;
  s.cross = true, s.T = 4, s.S = 9, s.D = 10, s.Dkv = 6, s.out = 13;
  F::check(s, 6);
  s.T = 9, s.S = 3;  // fewer keys than queries
  F::check(s, 7);
}

// Causal self-attention in a wider layer (D 32, 4 heads of value width 8).
TYPED_TEST(Masking, CausalWiderLayer) {
  typename TestFixture::Shape s;
  s.T = 9, s.D = 32, s.H = 4, s.Dv = 8, s.out = 32, s.causal = true;
  TestFixture::check(s, 14);
}

// Offset 0 is top-left aligned (torch's triu(ones(T, S), 1)) also when
// S != T; n new queries over a cache of S keys use offset S - n.
TYPED_TEST(Masking, CausalOffsetsWithKeyCountNotQueryCount) {
  using F = TestFixture;
  typename F::Shape s;
  s.cross = true, s.causal = true, s.Dkv = 6;
  const int cases[][3] = {{5, 11, 0}, {11, 5, 0}, {11, 5, 2}, {3, 10, 7}, {6, 10, 2}, {6, 10, 50}};  // T, S, offset
  unsigned seed = 10;
  for (const auto& c : cases) {
    s.T = c[0], s.S = c[1], s.offset = c[2];  // 50: beyond S, every key visible
    F::check(s, seed++);
  }
}

// A negative offset hides every key from the first rows: their context is
// zero, so the output row is exactly o.bias and the weights exactly zero.
TYPED_TEST(Masking, CausalNegativeOffsetFullyMasksFirstRows) {
  using F = TestFixture;
  using T = typename F::T;
  typename F::Shape shape;
  shape.T = 8, shape.causal = true, shape.offset = -3, shape.block_rows = 2;
  const auto p = F::make(shape, 17);
  F::check(p);
  const Result<T> got = run(p);
  for (Index b = 0; b < p.s.B; ++b) {
    expect_rows_output(got, b, 3, [&](Index c) { return p.w.o.bias(c); });
    expect_rows_weights_zero(got, b, 3);
  }
  shape.offset = -20;  // nothing visible anywhere
  F::check(shape, 18);
}

TYPED_TEST(Masking, KeyPadding) {
  using F = TestFixture;
  typename F::Shape s;
  s.cross = true, s.T = 5, s.S = 11, s.D = 24, s.Dkv = 24, s.out = 24;
  auto p = F::make(s, 22);
  p.padding = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1,   // trailing
               0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0};  // scattered
  F::check(p);
  s.cross = false, s.pad_rate = 0.4;
  F::check(s, 23);
}

TYPED_TEST(Masking, CausalWithPadding) {
  using F = TestFixture;
  typename F::Shape s;
  s.T = 9, s.causal = true, s.pad_rate = 0.35, s.block_rows = 4;
  F::check(s, 24);
  s.cross = true, s.S = 12, s.offset = 2;
  F::check(s, 25);
}

// All keys of one batch item padded: its output rows are exactly o.bias
// (zero without o or without biases), its weights exactly zero, and no NaN
// leaks into it or into the other items.
TYPED_TEST(Masking, FullyMaskedRowGivesBiasAndZeroWeights) {
  using F = TestFixture;
  using T = typename F::T;
  for (int variant = 0; variant < 3; ++variant) {
    typename F::Shape s;
    s.B = 3, s.cross = true, s.T = 4, s.S = 6;
    s.out_proj = variant != 1;
    if constexpr (has_bias_switch<typename F::Shape>::value) {
      s.bias = variant != 2;
    } else if (variant == 2) {
      continue;
    }
    auto p = F::make(s, 26 + variant);
    p.padding.assign(static_cast<std::size_t>(s.B) * s.S, 0);
    std::fill(p.padding.begin() + s.S, p.padding.begin() + 2 * s.S, 1);  // item 1
    p.padding[2 * s.S + 4] = 1;
    SCOPED_TRACE("variant " + std::to_string(variant));
    F::check(p);

    const Result<T> got = run(p);
    ASSERT_TRUE(all_finite("output", got.out));
    ASSERT_TRUE(all_finite("probs", got.probs));
    const auto& bias = p.w.o.bias;  // empty without o or without biases
    expect_rows_output(got, 1, s.T, [&](Index c) { return bias.size() != 0 ? bias(c) : T(0); });
    expect_rows_weights_zero(got, 1, s.T);
  }
}

// Query blocks are the pipeline's unit of work; edges must not leak.
TYPED_TEST(Masking, BlockRowsNotDividingT) {
  using F = TestFixture;
  typename F::Shape s;
  s.T = 10, s.causal = true, s.offset = -1, s.pad_rate = 0.25;
  for (Index block : {Index(3), Index(1), Index(4), Index(10), Index(100)}) {
    s.block_rows = block;
    F::check(s, 39);
  }
  s.causal = false, s.cross = true, s.S = 7, s.block_rows = 3;
  F::V::masking_variation(s, 40);  // CollabHead: block mixing
  F::check(s, 40);
}

// Windows of 1, 3 and more than T over causal offsets, self and padded
// cross (the test_util.hpp cases), with the variant's own switches varied.
TYPED_TEST(Masking, SlidingWindowMatchesReference) {
  using F = TestFixture;
  for_each_window_case<typename F::Shape>(400, [](typename F::Shape s, unsigned seed) {
    F::V::masking_variation(s, seed);
    F::check(s, seed);
  });
}

// A window of at least T is plain causal, bit for bit; block_rows = 0
// picks a block size itself and gives the reference's result over more
// than one block.
TYPED_TEST(Masking, LongWindowIsPlainCausalAndAutomaticBlockRows) {
  using F = TestFixture;
  typename F::Shape s;
  s.T = 9, s.causal = true, s.pad_rate = 0.2, s.block_rows = 4;
  expect_long_window_is_plain_causal(F::make(s, 350), [](const auto& p) { return run(p); });
  s.B = 1, s.T = 70, s.block_rows = 0, s.causal = false;
  F::check(s, 360);
  s.causal = true, s.window = 5, s.threads = 2;
  F::V::masking_variation(s, 363);  // MHA: one KV head; CollabHead: LayerNorm
  F::check(s, 363);
}

// Without o the output is the concatenated heads, of width heads · Dv.
TYPED_TEST(Masking, NoOutputProjectionGivesConcatenatedHeads) {
  using F = TestFixture;
  typename F::Shape s;
  s.out_proj = false, s.Dv = 5;
  const auto p = F::make(s, 12);
  ASSERT_TRUE(p.w.o.empty());
  const Dims d = F::V::dims(p);
  EXPECT_EQ(p.layer().out_dim(), d.probs_heads * 5);
  EXPECT_NE(d.out, d.D);
  F::check(p);
  s.causal = true, s.pad_rate = 0.3;
  F::check(s, 13);
  if constexpr (has_bias_switch<typename F::Shape>::value) {
    s.bias = false;
    F::check(s, 14);
  }
}

}  // namespace
