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

template <class T>
class MhaTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MhaTest, Scalars);

// ---------------------------------------------------------------------------
// Agreement with the reference

TYPED_TEST(MhaTest, RandomShapesMatchReference) {
  Rng rng(20240611);
  const Index block_choices[] = {1, 2, 3, 5, 64};
  for (unsigned n = 0; n < 80; ++n) {
    Shape s;
    s.B = uniform_int(rng, 1, 3);
    s.T = uniform_int(rng, 1, 12);
    s.cross = uniform_int(rng, 0, 1) == 1;
    s.S = uniform_int(rng, 1, 12);
    s.D = uniform_int(rng, 1, 12);
    s.Dkv = uniform_int(rng, 1, 12);
    s.H = uniform_int(rng, 1, 4);
    s.Dk = uniform_int(rng, 1, 6);
    s.Dv = uniform_int(rng, 1, 6);
    s.out_proj = uniform_int(rng, 0, 3) != 0;
    s.out = uniform_int(rng, 1, 12);
    s.bias = uniform_int(rng, 0, 1) == 1;
    s.causal = uniform_int(rng, 0, 1) == 1;
    s.offset = s.causal ? uniform_int(rng, -3, 3) : 0;
    s.pad_rate = uniform_int(rng, 0, 2) == 0 ? 0.3 : 0.0;
    s.block_rows = block_choices[uniform_int(rng, 0, 4)];
    s.key_block = uniform_int(rng, 0, 3);  // 1-3: several online-softmax steps per row
    s.threads = uniform_int(rng, 1, 3);
    expect_matches_reference(make_problem<TypeParam>(s, 1000 + n));
  }
}

TYPED_TEST(MhaTest, SingleQuery) {
  Shape s;
  s.T = 1;
  expect_matches_reference(make_problem<TypeParam>(s, 1));  // self: one key
  s.cross = true, s.S = 9, s.Dkv = 5, s.pad_rate = 0.3;
  expect_matches_reference(make_problem<TypeParam>(s, 2));
  s.causal = true;  // top-left alignment: the single query sees key 0 only
  expect_matches_reference(make_problem<TypeParam>(s, 3));
  s.offset = s.S - 1;  // decoding one new token: sees the whole cache
  expect_matches_reference(make_problem<TypeParam>(s, 4));
}

TYPED_TEST(MhaTest, CrossAttentionWithKeyWidthNotEmbedWidth) {
  Shape s;
  s.cross = true, s.T = 4, s.S = 9, s.D = 10, s.Dkv = 6;
  expect_matches_reference(make_problem<TypeParam>(s, 5));
  s.T = 9, s.S = 3;  // fewer keys than queries
  expect_matches_reference(make_problem<TypeParam>(s, 6));
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

TYPED_TEST(MhaTest, NoOutputProjectionGivesConcatenatedHeads) {
  Shape s;
  s.out_proj = false, s.H = 3, s.Dv = 5;  // output width H*Dv = 15 != D
  const auto p = make_problem<TypeParam>(s, 12);
  ASSERT_TRUE(p.w.o.empty());
  EXPECT_EQ(p.layer().out_dim(), 15);
  expect_matches_reference(p);
  s.bias = false, s.causal = true;
  expect_matches_reference(make_problem<TypeParam>(s, 13));
}

TYPED_TEST(MhaTest, Causal) {
  Shape s;
  s.T = 9, s.D = 32, s.H = 4, s.Dk = 8, s.Dv = 8, s.out = 32, s.causal = true;
  expect_matches_reference(make_problem<TypeParam>(s, 14));
}

// Offset 0 is top-left aligned (torch's triu(ones(T, S), 1)) also when S != T.
TYPED_TEST(MhaTest, CausalWithKeyCountNotQueryCount) {
  Shape s;
  s.cross = true, s.causal = true, s.Dkv = 6;
  s.T = 5, s.S = 11;
  expect_matches_reference(make_problem<TypeParam>(s, 15));
  s.T = 11, s.S = 5;
  expect_matches_reference(make_problem<TypeParam>(s, 16));
}

// A negative offset hides every key from the first rows: their context is
// zero, so the output row is exactly o.bias and the weights exactly zero.
TYPED_TEST(MhaTest, CausalNegativeOffsetFullyMasksFirstRows) {
  using T = TypeParam;
  Shape shape;
  shape.T = 8, shape.causal = true, shape.offset = -3, shape.block_rows = 2;
  const auto p = make_problem<T>(shape, 17);
  const Shape& s = p.s;  // self-attention: S = T
  expect_matches_reference(p);
  const Result<T> got = run(p);
  for (Index b = 0; b < s.B; ++b)
    for (Index i = 0; i < 3; ++i) {
      for (Index c = 0; c < s.out; ++c) EXPECT_EQ(got.out.batch().item(b)(i, c), p.w.o.bias(c)) << b << "," << i;
      for (Index h = 0; h < s.H; ++h)
        for (Index j = 0; j < s.S; ++j) EXPECT_EQ(got.probs[((b * s.H + h) * s.T + i) * s.S + j], T(0));
    }
  shape.offset = -20;  // nothing visible anywhere
  expect_matches_reference(make_problem<T>(shape, 18));
}

// Decoding: n new queries over a cache of S keys use offset S - n.
TYPED_TEST(MhaTest, CausalPositiveOffsetAsInDecoding) {
  Shape s;
  s.cross = true, s.causal = true, s.T = 3, s.S = 10, s.offset = 7;
  expect_matches_reference(make_problem<TypeParam>(s, 19));
  s.offset = 2, s.T = 6;
  expect_matches_reference(make_problem<TypeParam>(s, 20));
  s.offset = 50;  // beyond S: every key visible
  expect_matches_reference(make_problem<TypeParam>(s, 21));
}

TYPED_TEST(MhaTest, KeyPadding) {
  Shape s;
  s.cross = true, s.T = 5, s.S = 11, s.D = 24, s.Dkv = 24, s.H = 3, s.Dk = 8, s.Dv = 8, s.out = 24;
  auto p = make_problem<TypeParam>(s, 22);
  p.padding = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1,   // trailing
               0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0};  // scattered
  expect_matches_reference(p);
  s.cross = false, s.pad_rate = 0.4;
  expect_matches_reference(make_problem<TypeParam>(s, 23));
}

TYPED_TEST(MhaTest, CausalWithPadding) {
  Shape s;
  s.T = 9, s.causal = true, s.pad_rate = 0.35, s.block_rows = 4;
  expect_matches_reference(make_problem<TypeParam>(s, 24));
  s.cross = true, s.S = 12, s.offset = 2;
  expect_matches_reference(make_problem<TypeParam>(s, 25));
}

// All keys of one batch item padded: its output rows are exactly o.bias
// (zero without o or without bias), its weights exactly zero, and no NaN
// leaks into it or into the other items.
TYPED_TEST(MhaTest, FullyMaskedRowGivesBiasAndZeroWeights) {
  using T = TypeParam;
  for (int variant = 0; variant < 3; ++variant) {
    Shape s;
    s.B = 3, s.cross = true, s.T = 4, s.S = 6;
    s.out_proj = variant != 1;
    s.bias = variant != 2;
    auto p = make_problem<T>(s, 26 + variant);
    p.padding.assign(static_cast<std::size_t>(s.B) * s.S, 0);
    std::fill(p.padding.begin() + s.S, p.padding.begin() + 2 * s.S, 1);  // item 1
    p.padding[2 * s.S + 4] = 1;
    SCOPED_TRACE("variant " + std::to_string(variant));
    expect_matches_reference(p);

    const Result<T> got = run(p);
    for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.out[i])));
    for (Index i = 0; i < got.probs.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.probs[i])));
    const auto masked = got.out.batch().item(1);
    for (Index i = 0; i < s.T; ++i)
      for (Index c = 0; c < s.out_dim(); ++c) {
        const T want = s.out_proj && s.bias ? p.w.o.bias(c) : T(0);
        EXPECT_EQ(masked(i, c), want) << "row " << i << " col " << c;
      }
    for (Index h = 0; h < s.H; ++h)
      for (Index i = 0; i < s.T; ++i)
        for (Index j = 0; j < s.S; ++j) EXPECT_EQ(got.probs[((1 * s.H + h) * s.T + i) * s.S + j], T(0));
  }
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

// Query blocks are the pipeline's unit of work; edges must not leak.
TYPED_TEST(MhaTest, BlockRowsNotDividingT) {
  Shape s;
  s.T = 10, s.causal = true, s.offset = -1, s.pad_rate = 0.25;
  for (Index block : {Index(3), Index(1), Index(4), Index(10), Index(100)}) {
    s.block_rows = block;
    expect_matches_reference(make_problem<TypeParam>(s, 31));
  }
  s.causal = false, s.cross = true, s.S = 7, s.block_rows = 3;
  expect_matches_reference(make_problem<TypeParam>(s, 32));
}

// Task boundaries do not depend on the thread count, so neither may a bit
// of the result. The second shape has B*T > 256 rows, so the projections
// also split into several row chunks.
TYPED_TEST(MhaTest, ThreadCountDoesNotChangeBits) {
  using T = TypeParam;
  std::vector<Shape> shapes(2);
  shapes[0].B = 3, shapes[0].T = 10, shapes[0].cross = true, shapes[0].S = 13, shapes[0].Dkv = 5;
  shapes[0].causal = true, shapes[0].offset = 2, shapes[0].pad_rate = 0.3, shapes[0].block_rows = 3;
  shapes[1].B = 2, shapes[1].T = 150, shapes[1].D = 16, shapes[1].out = 12, shapes[1].block_rows = 16;
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    auto p = make_problem<T>(shapes[n], 33 + static_cast<unsigned>(n));
    SCOPED_TRACE(describe(p.s));
    const Result<T> one = run(p);
    for (int threads : {2, 3}) {
      p.s.threads = threads;
      const Result<T> many = run(p);
      EXPECT_TRUE(bit_identical("output", one.out, many.out)) << threads << " threads";
      EXPECT_TRUE(bit_identical("probs", one.probs, many.probs)) << threads << " threads";
    }
    expect_matches_reference(p);
  }
}

// One Workspace through calls of growing, shrinking and differently shaped
// problems must give what a fresh one gives, bit for bit.
TYPED_TEST(MhaTest, WorkspaceReusedAcrossShapes) {
  using T = TypeParam;
  std::vector<Shape> shapes(5);
  shapes[0].B = 3, shapes[0].T = 12, shapes[0].cross = true, shapes[0].S = 9, shapes[0].Dkv = 6,
  shapes[0].pad_rate = 0.3;
  shapes[1].B = 1, shapes[1].T = 2, shapes[1].H = 1, shapes[1].Dk = 3, shapes[1].Dv = 2;
  shapes[2].T = 7, shapes[2].causal = true, shapes[2].threads = 3, shapes[2].block_rows = 2, shapes[2].pad_rate = 0.3;
  shapes[3].B = 3, shapes[3].T = 20, shapes[3].D = 12, shapes[3].H = 3, shapes[3].out_proj = false;
  shapes[4].B = 1, shapes[4].T = 1, shapes[4].cross = true, shapes[4].S = 4, shapes[4].Dkv = 2;
  headmix::Workspace<T> ws;
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const auto p = make_problem<T>(shapes[n], 40 + static_cast<unsigned>(n));
    SCOPED_TRACE(describe(p.s));
    const Result<T> reused = run(p, ws);
    const Result<T> fresh = run(p);
    EXPECT_TRUE(bit_identical("output", reused.out, fresh.out));
    EXPECT_TRUE(bit_identical("probs", reused.probs, fresh.probs));
    EXPECT_TRUE(all_close("output", reused.out, p.reference().output, default_tolerance<T>()));
  }
}

// probs is resized to [B, H, T, S] and every entry written, even when the
// tensor arrives with another shape and stale contents.
TYPED_TEST(MhaTest, ProbsOutputResizedAndFullyWritten) {
  using T = TypeParam;
  Shape s;
  s.cross = true, s.T = 6, s.S = 9, s.H = 3, s.causal = true, s.offset = 1, s.pad_rate = 0.3;
  const auto p = make_problem<T>(s, 50);
  const headmix_ref::RefMhaResult want = p.reference();
  for (const std::vector<Index>& stale_shape : {std::vector<Index>{1, 1, 1, 1000}, std::vector<Index>{3}}) {
    Tensor<T> probs(stale_shape);
    std::fill(probs.data(), probs.data() + probs.size(), std::numeric_limits<T>::quiet_NaN());
    Tensor<T> out({s.B, s.T, s.out});
    headmix::Workspace<T> ws;
    p.layer().forward(p.input(), out.batch(), ws, &probs);
    EXPECT_EQ(probs.shape(), (std::vector<Index>{s.B, s.H, s.T, s.S}));
    EXPECT_TRUE(all_close("probs", probs, want.probs, default_tolerance<T>()));
    for (Index row = 0; row < probs.size() / s.S; ++row) {
      double sum = 0;
      for (Index j = 0; j < s.S; ++j) sum += static_cast<double>(probs[row * s.S + j]);
      // 1 where a key is visible; 0 for rows that see only padded keys.
      if (sum != 0) {
        EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
      }
    }
  }
}

TYPED_TEST(MhaTest, AllocatingForwardMatchesBufferForward) {
  using T = TypeParam;
  Shape s;
  s.cross = true, s.S = 7, s.out = 5, s.pad_rate = 0.2;
  const auto p = make_problem<T>(s, 51);
  const Result<T> expected = run(p);
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> out = p.layer().forward(p.input(), ws, &probs);
  EXPECT_EQ(out.shape(), (std::vector<Index>{s.B, s.T, s.out}));
  EXPECT_TRUE(bit_identical("output", out, expected.out));
  EXPECT_TRUE(bit_identical("probs", probs, expected.probs));
  const Tensor<T> out_without_probs = p.layer().forward(p.input(), ws);
  EXPECT_TRUE(bit_identical("output without probs", out_without_probs, expected.out));
  EXPECT_TRUE(all_close("output", out, p.reference().output, default_tolerance<T>()));
}

// forward(Matrix) is self-attention over one [T, D] sequence.
TYPED_TEST(MhaTest, SingleSequenceForward) {
  using T = TypeParam;
  Shape s;
  s.B = 1, s.T = 7, s.out = 6, s.causal = true;
  const auto p = make_problem<T>(s, 52);
  const Matrix<T> y = p.layer().forward(p.xq);
  ASSERT_EQ(y.rows(), s.T);
  ASSERT_EQ(y.cols(), s.out);
  EXPECT_TRUE(all_close("output", y.data(), static_cast<std::size_t>(y.size()), p.reference().output,
                        default_tolerance<T>()));
  const Result<T> batched = run(p);
  for (Index i = 0; i < y.size(); ++i) EXPECT_EQ(y.data()[i], batched.out[i]) << i;
}

// set_options() may change masking, block size and threads between calls.
TYPED_TEST(MhaTest, OptionsChangedBetweenCalls) {
  using T = TypeParam;
  Shape s;
  s.T = 9, s.pad_rate = 0.2;
  auto p = make_problem<T>(s, 53);
  headmix::Mha<T> layer = p.layer();
  headmix::Workspace<T> ws;
  for (int step = 0; step < 3; ++step) {
    p.s.causal = step > 0, p.s.offset = step == 2 ? -2 : 0, p.s.block_rows = 2 + step, p.s.threads = 1 + step;
    layer.set_options(p.options());
    Tensor<T> out({s.B, s.T, s.out});
    layer.forward(p.input(), out.batch(), ws);
    EXPECT_TRUE(all_close("output", out, p.reference().output, default_tolerance<T>())) << "step " << step;
  }
}

// flops() must equal the multiply-adds the naive algorithm performs: all
// projections, plus (Dk + Dv) per causally visible (query, key) pair per head.
TYPED_TEST(MhaTest, FlopsEqualReferenceCount) {
  std::vector<Shape> shapes(10);
  shapes[0].D = 16, shapes[0].Dk = 8, shapes[0].Dv = 8, shapes[0].out = 16, shapes[0].T = 7;
  shapes[1].cross = true, shapes[1].T = 5, shapes[1].S = 11, shapes[1].Dkv = 6, shapes[1].Dk = 3, shapes[1].Dv = 5,
  shapes[1].causal = true, shapes[1].out_proj = false;
  shapes[2].T = 8, shapes[2].causal = true, shapes[2].offset = -3, shapes[2].pad_rate = 0.5;
  shapes[3].cross = true, shapes[3].T = 3, shapes[3].S = 10, shapes[3].causal = true, shapes[3].offset = 7;
  shapes[4].T = 6, shapes[4].causal = true, shapes[4].offset = -20;  // nothing visible
  shapes[5].B = 3, shapes[5].T = 1, shapes[5].H = 3, shapes[5].out = 2, shapes[5].bias = false;
  shapes[6].cross = true, shapes[6].T = 11, shapes[6].S = 4, shapes[6].causal = true, shapes[6].offset = 1,
  shapes[6].H = 1, shapes[6].pad_rate = 0.3;
  // Grouped-query K/V projections count Hkv heads; windows count only
  // the pairs inside the window.
  shapes[7].H = 4, shapes[7].Hkv = 2, shapes[7].T = 6, shapes[7].cross = true, shapes[7].S = 9;
  shapes[8].H = 4, shapes[8].Hkv = 1, shapes[8].T = 9, shapes[8].causal = true, shapes[8].window = 3;
  shapes[9].cross = true, shapes[9].T = 5, shapes[9].S = 12, shapes[9].causal = true, shapes[9].offset = 4,
  shapes[9].window = 2, shapes[9].pad_rate = 0.3;
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const auto p = make_problem<TypeParam>(shapes[n], 60 + static_cast<unsigned>(n));
    SCOPED_TRACE(describe(p.s));
    const headmix_ref::RefMhaResult want = p.reference();
    const headmix::FlopCount got = p.layer().flops(p.s.B, p.s.T, p.s.S);
    EXPECT_EQ(got.projection_macs, want.projection_macs);
    EXPECT_EQ(got.attention_macs, want.attention_macs);
    EXPECT_EQ(got.macs(), want.projection_macs + want.attention_macs);
  }
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

// Windows of 1, 3 and more than T over causal offsets, self and padded
// cross (the test_util.hpp cases), with 3 query heads over 3 or 1 KV heads.
TYPED_TEST(MhaTest, SlidingWindowMatchesReference) {
  for_each_window_case<Shape>(340, [](Shape s, unsigned seed) {
    s.H = 3, s.Hkv = seed % 2 == 0 ? 0 : 1;
    expect_matches_reference(make_problem<TypeParam>(s, seed));
  });
}

// A window of at least T is plain causal, bit for bit; block_rows = 0
// picks a block size itself (16 with a short window, 64 without) and gives
// the reference's result over more than one block.
TYPED_TEST(MhaTest, LongWindowIsPlainCausalAndAutomaticBlockRows) {
  Shape s;
  s.T = 9, s.causal = true, s.pad_rate = 0.2, s.block_rows = 4;
  expect_long_window_is_plain_causal(make_problem<TypeParam>(s, 350), [](const auto& p) { return run(p); });
  s.B = 1, s.T = 70, s.block_rows = 0, s.causal = false;
  expect_matches_reference(make_problem<TypeParam>(s, 360));
  s.causal = true, s.window = 5, s.threads = 2, s.Hkv = 1;
  expect_matches_reference(make_problem<TypeParam>(s, 361));
}

// ---------------------------------------------------------------------------
// BadInput: every mismatch throws shape_error whose message names the
// variant, the argument and both shapes.

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN("[mha]", call, __VA_ARGS__)

// A valid cross-attention setup (D != Dkv, Dk != Dv, out != D); each test
// breaks exactly one thing.
class BadInput : public ::testing::Test {
 protected:
  static constexpr int B = 2, T = 5, S = 7, D = 16, Dkv = 12, H = 2, Dk = 4, Dv = 3, Out = 10;

  BadInput() {
    Rng rng(99);
    w.q = random_linear<double>(rng, H * Dk, D, true);
    w.k = random_linear<double>(rng, H * Dk, Dkv, true);
    w.v = random_linear<double>(rng, H * Dv, Dkv, true);
    w.o = random_linear<double>(rng, Out, H * Dv, true);
    opt.num_heads = H;
    xq = random_matrix<double>(rng, B * T, D, 1.0);
    xk = random_matrix<double>(rng, B * S, Dkv, 1.0);
    out.resize(B * T, Out);
  }

  headmix::AttentionInput<double> input() const {
    return {headmix::ConstBatchView<double>(xq.data(), B, T, D), headmix::ConstBatchView<double>(xk.data(), B, S, Dkv),
            headmix::KeyPadding{padding.data(), B, S}};
  }
  headmix::BatchView<double> out_view() { return headmix::BatchView<double>(out.data(), B, T, Out); }
  void build() const { headmix::Mha<double> layer(w, opt); }
  void forward(const headmix::AttentionInput<double>& in, headmix::BatchView<double> dst) const {
    headmix::Mha<double> layer(w, opt);
    headmix::Workspace<double> ws;
    layer.forward(in, dst, ws);
  }

  headmix::MhaWeights<double> w;
  headmix::MhaOptions opt;
  Matrix<double> xq, xk, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * S, 0);
};

TEST_F(BadInput, ValidSetupRuns) {  // so that each failure below is the one broken thing
  EXPECT_NO_THROW(forward(input(), out_view()));
}

TEST_F(BadInput, ZeroHeads) {
  opt.num_heads = 0;
  EXPECT_SHAPE_ERROR(build(), "num_heads", "expected >= 1", "got 0");
}

TEST_F(BadInput, QueryRowsNotDivisibleByHeads) {
  opt.num_heads = 3;  // q has 8 rows
  EXPECT_SHAPE_ERROR(build(), "q.weight", "expected [", "num_heads = 3", "got [8, 16]");
}

TEST_F(BadInput, KeyRowsNotQueryRows) {
  w.k.weight.conservativeResize(6, Dkv);
  w.k.bias.conservativeResize(6);
  EXPECT_SHAPE_ERROR(build(), "k.weight", "expected [8, 12]", "got [6, 12]");
}

TEST_F(BadInput, KeyColumnsNotValueColumns) {
  w.v.weight.conservativeResize(H * Dv, Dkv - 1);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [6, 12]", "got [6, 11]");
}

TEST_F(BadInput, ValueRowsNotDivisibleByHeads) {
  w.v.weight.conservativeResize(7, Dkv);
  w.v.bias.conservativeResize(7);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [", "num_heads = 2", "got [7, 12]");
}

TEST_F(BadInput, QueryBiasLength) {
  w.q.bias.conservativeResize(7);
  EXPECT_SHAPE_ERROR(build(), "q.bias", "expected [8]", "got [7]");
}

TEST_F(BadInput, KeyBiasLength) {
  w.k.bias.conservativeResize(9);
  EXPECT_SHAPE_ERROR(build(), "k.bias", "expected [8]", "got [9]");
}

TEST_F(BadInput, OutputWeightColumnsNotHeadsTimesValueDim) {
  w.o.weight.conservativeResize(Out, H * Dv - 1);
  EXPECT_SHAPE_ERROR(build(), "o.weight", "expected [10, 6]", "got [10, 5]");
}

TEST_F(BadInput, OutputBiasLength) {
  w.o.bias.conservativeResize(Out - 1);
  EXPECT_SHAPE_ERROR(build(), "o.bias", "expected [10]", "got [9]");
}

TEST_F(BadInput, NoQueryWeight) {
  w.q.weight.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "q.weight", "expected [", "got [0, 0]");
}

TEST_F(BadInput, QueryWidth) {
  auto in = input();
  in.query = headmix::ConstBatchView<double>(xq.data(), B, T, D - 1);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.query", "expected [2, 5, 16]", "got [2, 5, 15]");
}

TEST_F(BadInput, KeyWidth) {
  auto in = input();
  in.key = headmix::ConstBatchView<double>(xk.data(), B, S, Dkv - 1);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key", "expected [2, 7, 12]", "got [2, 7, 11]");
}

TEST_F(BadInput, KeyBatchNotQueryBatch) {
  auto in = input();
  in.key = headmix::ConstBatchView<double>(xk.data(), 1, S, Dkv);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key", "expected [2, 7, 12]", "got [1, 7, 12]");
}

TEST_F(BadInput, KeyPaddingMaskShape) {
  auto in = input();
  in.key_padding.keys = S - 1;
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key_padding_mask", "expected [2, 7]", "got [2, 6]");
  in.key_padding = headmix::KeyPadding{padding.data(), 1, S};
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key_padding_mask", "expected [2, 7]", "got [1, 7]");
}

TEST_F(BadInput, OutputBufferShape) {
  EXPECT_SHAPE_ERROR(forward(input(), headmix::BatchView<double>(out.data(), B, T, Out - 1)), "output",
                     "expected [2, 5, 10]", "got [2, 5, 9]");
  EXPECT_SHAPE_ERROR(forward(input(), headmix::BatchView<double>(out.data(), B, T - 1, Out)), "output",
                     "expected [2, 5, 10]", "got [2, 4, 10]");
  EXPECT_SHAPE_ERROR(forward(input(), headmix::BatchView<double>()), "output", "expected [2, 5, 10]", "no buffer");
}

TEST_F(BadInput, ZeroLengthQuery) {
  auto in = input();
  in.query = headmix::ConstBatchView<double>(xq.data(), B, 0, D);
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), B, 0, Out)), "input.query", "expected [",
                     "T >= 1", "got [2, 0, 16]");
}

TEST_F(BadInput, ZeroBatch) {
  auto in = input();
  in.query = headmix::ConstBatchView<double>(xq.data(), 0, T, D);
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), 0, T, Out)), "input.query", "expected [",
                     "B >= 1", "got [0, 5, 16]");
}

TEST_F(BadInput, ZeroLengthKey) {
  auto in = input();
  in.key = headmix::ConstBatchView<double>(xk.data(), B, 0, Dkv);
  in.key_padding = {};
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key", "expected [2, S >= 1, 12]", "got [2, 0, 12]");
}

// Self-attention uses the query as key; there is no key shape to show, so
// the message names the key width the layer wants and says none was given.
TEST_F(BadInput, SelfAttentionWithKeyWidthNotEmbedWidth) {
  auto in = input();
  in.key = {};
  in.key_padding = {};
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key", "expected a key sequence of width 12", "got none");
}

TEST_F(BadInput, NegativeBlockRows) {
  opt.block_rows = -1;
  EXPECT_SHAPE_ERROR(build(), "block_rows", "expected >= 0", "got -1");
}

TEST_F(BadInput, NegativeKeyBlock) {
  opt.key_block = -1;
  EXPECT_SHAPE_ERROR(build(), "key_block", "expected >= 0", "got -1");
}

TEST_F(BadInput, ZeroThreads) {
  opt.threads = 0;
  EXPECT_SHAPE_ERROR(build(), "threads", "expected >= 1", "got 0");
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

TEST_F(BadInput, WindowNeedsCausalAndIsNotNegative) {
  opt.window = 2;
  EXPECT_SHAPE_ERROR(build(), "window", "expected 0 unless causal (a window needs causal = true)", "got 2");
  opt.causal = true, opt.window = -1;
  EXPECT_SHAPE_ERROR(build(), "window", "expected >= 0", "got -1");
}

TEST_F(BadInput, NonFiniteScale) {
  opt.scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_SHAPE_ERROR(build(), "scale", "expected a finite number", "got nan");
}

// set_options() validates like the constructor and keeps the old options
// when the new ones are invalid, so a layer can never run with a broken
// configuration.
TEST_F(BadInput, SetOptionsValidates) {
  headmix::Mha<double> layer(w, opt);
  headmix::Workspace<double> ws;
  headmix::MhaOptions bad = opt;
  bad.block_rows = -1;
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "block_rows", "expected >= 0", "got -1");
  bad = opt;
  bad.threads = 0;
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "threads", "expected >= 1", "got 0");
  bad = opt;
  bad.num_heads = 3;  // 8 q rows do not split into 3 heads
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "q.weight", "num_heads = 3", "got [8, 16]");
  bad.num_heads = 0;
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "num_heads", "expected >= 1", "got 0");
  EXPECT_EQ(layer.options().num_heads, opt.num_heads);  // unchanged after the failures
  EXPECT_NO_THROW(layer.forward(input(), out_view(), ws));
}

// An o.bias without an o.weight is a broken weight set, not "no output
// projection": it is rejected.
TEST_F(BadInput, OutputBiasWithoutOutputWeight) {
  w.o.weight.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "o.weight", "expected [", "got [0, 0]");
}

}  // namespace
