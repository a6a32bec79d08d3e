// Extreme values, every variant, float and double: logits near the largest
// finite value of T, all-equal logits, a single key, a single query, fully
// masked rows, causal offsets at the ends of Index's range; then what one
// variant's own math makes extreme (LSH's key norms, an MHA row of 65536
// keys). No NaN may appear where the math has none, and each result is
// compared with what the math says: a closed form where there is one
// (one-hot or uniform weights, weights of exactly 0 or 1, rows that are
// the same), and the naive double reference of tests/reference/.
//
// Part 1 is typed over the variant list in tests/variants.hpp: a new
// variant is covered by its entry there, whose hooks say how to make its
// logits huge (limit_shape(), limit_logits()) or equal (equal_logits()),
// how to give it one key or one query, and which of these checks its math
// allows (causal_offsets, masks_exactly, equal_logits_uniform, ...).
//
// Tolerances, element-wise |got - want| <= atol + rtol·|want|, unless a test
// derives its own: each entry's reference_tolerance<T>():
//   double: rtol 1e-10, atol 1e-12; float: rtol 2e-4, atol 2e-5 (as the
//   per-variant suites, for O(1) values and dot products of a few terms);
//   DCMHA: double 1e-10 / 1e-11, float 5e-4 / 1e-4 (see test_dcmha.cpp).
// Weights that the math makes exactly 0 or 1 are held to 1e-6 (float) /
// 1e-12 (double) absolute: a clamped exp may leave ~1e-38 where 0 is exact.

#include "variants.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;

// ---------------------------------------------------------------------------
// Helpers

template <class T>
Tolerance weight_tol() {  // weights the math makes 0 or 1
  return std::is_same_v<T, float> ? Tolerance{0, 1e-6} : Tolerance{0, 1e-12};
}

// The largest logit magnitude used: 3e38 in float (max 3.4e38), 1e308 in double.
template <class T>
double logit_limit() {
  return std::is_same_v<T, float> ? 3e38 : 1e308;
}

// Softmax weights [.., S] of logits that are one-hot or tied at the top:
// every weight of a row is 0 or the row's largest, and those sum to 1 (or
// the row sees no key).
template <class T>
::testing::AssertionResult one_hot_or_tied(const Tensor<T>& probs) {
  const Index S = probs.dim(probs.rank() - 1), rows = probs.size() / S;
  const double tol = weight_tol<T>().atol;
  for (Index r = 0; r < rows; ++r) {
    const T* row = probs.data() + r * S;
    const double top = static_cast<double>(*std::max_element(row, row + S));
    Index n = 0;
    for (Index j = 0; j < S; ++j) {
      const double w = static_cast<double>(row[j]);
      if (std::abs(w) <= tol) continue;
      if (std::abs(w - top) > tol)
        return ::testing::AssertionFailure() << "row " << r << " key " << j << ": " << w
                                             << " is neither 0 nor the row's largest " << top;
      ++n;
    }
    if (n > 0 && std::abs(top * static_cast<double>(n) - 1) > static_cast<double>(n) * tol)
      return ::testing::AssertionFailure() << "row " << r << ": " << n << " weights of " << top << " do not sum to 1";
  }
  return ::testing::AssertionSuccess();
}

// Each row's weights at the keys the reference sees (want != 0) are equal:
// exactly fl(1 / visible) when `exact`, else within 1e-6 of the row's first.
template <class T>
::testing::AssertionResult equal_along_rows(const Tensor<T>& probs, const std::vector<double>& want, bool exact) {
  const Index S = probs.dim(probs.rank() - 1), rows = probs.size() / S;
  for (Index r = 0; r < rows; ++r) {
    std::vector<Index> seen;
    for (Index j = 0; j < S; ++j)
      if (want[static_cast<std::size_t>(r * S + j)] != 0) seen.push_back(j);
    if (seen.empty()) continue;
    const T first = probs[r * S + seen[0]], uniform = T(1) / static_cast<T>(seen.size());
    for (Index j : seen) {
      const T w = probs[r * S + j];
      const bool ok = exact ? w == uniform
                            : std::abs(static_cast<double>(w - first)) <= 1e-6 * std::max(1.0, std::abs(double(first)));
      if (!ok)
        return ::testing::AssertionFailure() << "row " << r << " key " << j << ": " << w << ", not "
                                             << (exact ? uniform : first) << " as its " << seen.size()
                                             << " visible keys";
    }
  }
  return ::testing::AssertionSuccess();
}

// Every query row of an item has the same output [B, T, out], bit for bit
// (within `tol` when given).
template <class T>
::testing::AssertionResult same_rows(const Tensor<T>& y, Index items, const Tolerance* tol = nullptr) {
  const Index rows = y.size() / (items * y.dim(2)), out = y.dim(2);
  for (Index b = 0; b < items; ++b)
    for (Index i = 1; i < rows; ++i)
      for (Index c = 0; c < out; ++c) {
        const double a = y[(b * rows + i) * out + c], first = y[(b * rows) * out + c];
        if (tol ? std::abs(a - first) > tol->atol + tol->rtol * std::abs(first) : a != first)
          return ::testing::AssertionFailure() << "item " << b << " row " << i << " col " << c << ": " << a
                                               << " vs row 0's " << first;
      }
  return ::testing::AssertionSuccess();
}

// The rows (b, i) whose weights [B, heads, T, S] are all 0 in the
// reference: they see no key.
std::vector<std::pair<Index, Index>> unseen_rows(const std::vector<double>& probs, const Dims& d) {
  std::vector<std::pair<Index, Index>> rows;
  for (Index b = 0; b < d.B; ++b)
    for (Index i = 0; i < d.T; ++i) {
      bool none = true;
      for (Index h = 0; h < d.probs_heads && none; ++h)
        for (Index j = 0; j < d.S && none; ++j) none = probs[static_cast<std::size_t>(((b * d.probs_heads + h) * d.T + i) * d.S + j)] == 0;
      if (none) rows.emplace_back(b, i);
    }
  return rows;
}

// ---------------------------------------------------------------------------
// Part 1: every variant, float and double

// In<V, T>: the variant V in scalar type T.
template <class In>
struct Extremes : ::testing::Test {
  using V = typename In::Variant;
  using T = typename In::Scalar;
  static auto make(const typename V::Shape& s, unsigned seed) { return V::template make<T>(s, seed); }
  static Tolerance tol() { return V::template reference_tolerance<T>(); }
};
TYPED_TEST_SUITE(Extremes, AllVariantsInBothScalars, VariantInName);

// Logits near the largest finite value. One-dimensional query/key heads
// (limit_shape()), q_i = a·x_i, k_j = a·y_j with a² = L and scale 1, so
// logit(i, j) = L·x_i·y_j with |x|, |y| <= 1 (limit_logits()): the
// difference of a row's extreme logits, up to 2L, overflows to -inf, and
// the math's weights are one-hot at the row's argmax key (MHA, CollabHead:
// checked as such; Talking-Heads: mixed by its post mix; DCMHA: composed),
// uniform where the last item's keys are all equal. Nothing may be NaN; on
// one thread and on two.
template <class Fixture>
void expect_limit_logits_handled() {
  using V = typename Fixture::V;
  using T = typename Fixture::T;
  auto p = Fixture::make(V::limit_shape(), 1);
  V::limit_logits(p, std::sqrt(logit_limit<T>()));
  const auto want = p.reference();
  for (int threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    V::set_threads(p, threads);
    const auto got = run(p);
    EXPECT_TRUE(all_finite("output", got.out));
    EXPECT_TRUE(all_finite("weights", got.probs));
    if (V::probs_sum_to_one) {
      EXPECT_TRUE(one_hot_or_tied(got.probs));
    }
    EXPECT_TRUE(all_close("weights", got.probs, want.probs, Fixture::tol()));
    EXPECT_TRUE(all_close("output", got.out, want.output, Fixture::tol()));
  }
}
TYPED_TEST(Extremes, LogitsNearTheLargestFiniteValue) {
  using V = typename TestFixture::V;
  if constexpr (V::extremes_limit)
    expect_limit_logits_handled<TestFixture>();
  else
    GTEST_SKIP() << V::name << "'s logits are bounded by its key norms: see its own tests below";
}

// All-equal logits (equal_logits(): keys that all give the same logit, or
// positions that are all the same): the weights of every visible key of a
// row are equal, exactly fl(1 / visible) for a plain softmax, and the
// attention output is their mean value. probs_shape()'s causal offset and
// padding give each row its own count of visible keys. LSH attends within
// chunks only, but its values are all the same: every output row is o(v(x)).
TYPED_TEST(Extremes, AllEqualLogits) {
  using V = typename TestFixture::V;
  auto p = TestFixture::make(V::probs_shape(), 7);
  V::equal_logits(p);
  SCOPED_TRACE(p.describe());
  const auto got = run(p);
  const auto want = p.reference();
  EXPECT_TRUE(all_close("weights", got.probs, want.probs, TestFixture::tol()));
  EXPECT_TRUE(all_close("output", got.out, want.output, TestFixture::tol()));
  if constexpr (V::masks_exactly) {
    EXPECT_TRUE(masked_weights_exactly_zero(got.probs, want.probs));
  }
  if constexpr (V::equal_logits_uniform) {
    EXPECT_TRUE(equal_along_rows(got.probs, want.probs, V::probs_sum_to_one));
  } else {
    const Tolerance tol = TestFixture::tol();
    EXPECT_TRUE(same_rows(got.out, 1, &tol));
  }
}

// One key (single_key(); variants whose keys are their queries skip): its
// weight is exactly 1 for a plain softmax (Talking-Heads: the post mix's
// row sum), so every query row of an item has the same output.
TYPED_TEST(Extremes, SingleKey) {
  using V = typename TestFixture::V;
  using T = typename TestFixture::T;
  auto s = V::probs_shape();
  if (!V::single_key(s)) GTEST_SKIP() << V::name << " attends over its own positions: see SingleQuery";
  const auto p = TestFixture::make(s, 12);
  const auto got = run(p);
  const auto want = p.reference();
  if (V::probs_sum_to_one) {
    for (Index i = 0; i < got.probs.size(); ++i) EXPECT_EQ(got.probs[i], T(1)) << i;
  }
  EXPECT_TRUE(all_close("weights", got.probs, want.probs, weight_tol<T>()));
  EXPECT_TRUE(same_rows(got.out, V::dims(p).B));
  EXPECT_TRUE(all_close("output", got.out, want.output, TestFixture::tol()));
}

// One query (single_query()). Cross-attention: over 9 keys, causal offset
// 0 (it sees key 0 only: weight exactly 1 for a plain softmax) and 8 (all).
// Self-attention: the position attends to itself alone, and a variant that
// decodes gives the same from step() on an empty cache.
TYPED_TEST(Extremes, SingleQuery) {
  using V = typename TestFixture::V;
  using T = typename TestFixture::T;
  for (long offset : {0L, 8L}) {
    if (!V::causal_offsets && offset != 0) continue;
    auto s = V::probs_shape();
    V::single_query(s, offset);
    const auto p = TestFixture::make(s, 13);
    SCOPED_TRACE(p.describe());
    const auto got = run(p);
    const auto want = p.reference();
    EXPECT_TRUE(all_close("weights", got.probs, want.probs, TestFixture::tol()));
    EXPECT_TRUE(all_close("output", got.out, want.output, TestFixture::tol()));
    const Dims d = V::dims(p);
    if (V::probs_sum_to_one && offset == 0) {  // a row that sees one key gives it weight exactly 1
      Index one_key_rows = 0;
      for (Index r = 0; r < got.probs.size() / d.S; ++r) {
        const auto w = want.probs.begin() + r * d.S;
        if (std::count(w, w + d.S, 0.0) != d.S - 1) continue;
        ++one_key_rows;
        for (Index j = 0; j < d.S; ++j)
          if (w[j] != 0) {
            EXPECT_EQ(got.probs[r * d.S + j], T(1)) << "row " << r;
          }
      }
      EXPECT_GT(one_key_rows, 0);
    }
    if constexpr (V::decodes) {
      if (d.S == d.T && offset == 0) {
        const auto& x = V::query(p);
        headmix::SequenceCache<T> cache(d.B, 1);
        headmix::Workspace<T> ws;
        const Tensor<T> stepped = p.layer().step({x.data(), d.B, 1, d.D}, cache, ws);
        EXPECT_TRUE(all_close("step", stepped, want.output, TestFixture::tol()));
      }
    }
  }
}

// Fully masked rows: every key of the last item padded, and (causal_offsets)
// offset -2, which hides every key from rows 0 and 1. Their weights are
// exactly 0 and their attention output 0, so the layer output is exactly
// the reference's (o.bias; CollabHead with LayerNorm: LN(x + o.bias), held
// to the tolerance). LSH masks with finite values (lsh.md): its rows
// follow the reference, finite. On two threads.
TYPED_TEST(Extremes, FullyMaskedRows) {
  using V = typename TestFixture::V;
  using T = typename TestFixture::T;
  for (const auto& s : V::extremes_shapes(V::probs_shape())) {
    auto p = TestFixture::make(s, 14);
    const Dims d = V::dims(p);
    if (p.padding.empty()) p.padding.assign(static_cast<std::size_t>(d.B * d.S), 0);
    std::fill(p.padding.end() - d.S, p.padding.end(), 1);
    if constexpr (V::causal_offsets) V::set_masking(p, true, -2);
    V::set_threads(p, 2);
    SCOPED_TRACE(p.describe());
    const auto got = run(p);
    const auto want = p.reference();
    EXPECT_TRUE(all_finite("output", got.out));
    EXPECT_TRUE(all_finite("weights", got.probs));
    EXPECT_TRUE(all_close("output", got.out, want.output, TestFixture::tol()));
    if constexpr (V::masks_exactly) {
      const auto rows = unseen_rows(want.probs, d);
      EXPECT_GE(rows.size(), static_cast<std::size_t>(d.T)) << "the last item's rows see no key";
      for (const auto& [b, i] : rows) {
        for (Index h = 0; h < d.probs_heads; ++h)
          for (Index j = 0; j < d.S; ++j)
            EXPECT_EQ(got.probs[((b * d.probs_heads + h) * d.T + i) * d.S + j], T(0)) << b << "," << i;
        if (V::masked_output_exact(p))
          for (Index c = 0; c < d.out; ++c) {
            const Index at = (b * d.T + i) * d.out + c;
            EXPECT_EQ(got.out[at], static_cast<T>(want.output[static_cast<std::size_t>(at)])) << b << "," << i;
          }
      }
    }
  }
}

// Causal offsets at the ends of Index's range: the largest shows every key
// (the non-causal result), the smallest none (exactly the reference's
// output, o.bias); also in flops(). Offsets this large are what "no limit"
// / "nothing" look like in code that computes them, e.g. from a cache
// position. (The reference computes i + offset, so it is not asked at the
// largest.)
template <class Fixture>
void expect_offsets_at_range_ends() {
  using V = typename Fixture::V;
  using T = typename Fixture::T;
  auto p = Fixture::make(V::probs_shape(), 15);
  p.padding.clear();
  const Dims d = V::dims(p);
  V::set_masking(p, false, 0);
  const auto open = run(p);
  const auto open_flops = p.layer().flops(d.B, d.T, d.S);
  V::set_masking(p, true, std::numeric_limits<long>::max());
  const auto all_visible = run(p);
  EXPECT_TRUE(all_close("offset max", all_visible.out, widen(open.out), Fixture::tol()));
  EXPECT_TRUE(all_close("offset max weights", all_visible.probs, widen(open.probs), Fixture::tol()));
  EXPECT_EQ(p.layer().flops(d.B, d.T, d.S).attention_macs, open_flops.attention_macs);
  V::set_masking(p, true, std::numeric_limits<long>::min());
  const auto none_visible = run(p);
  const auto want = p.reference();
  for (Index i = 0; i < none_visible.out.size(); ++i)
    EXPECT_EQ(none_visible.out[i], static_cast<T>(want.output[static_cast<std::size_t>(i)])) << i;
  for (Index i = 0; i < none_visible.probs.size(); ++i) EXPECT_EQ(none_visible.probs[i], T(0)) << i;
  V::expect_flops(p);  // the reference's counts: no visible pair
}
TYPED_TEST(Extremes, CausalOffsetsAtTheEndsOfTheRange) {
  if constexpr (!TestFixture::V::causal_offsets) GTEST_SKIP() << "no causal offset in " << TestFixture::V::name;
  else expect_offsets_at_range_ends<TestFixture>();
}

// ---------------------------------------------------------------------------
// Part 2: what one variant's own math makes extreme (float and double)

HEADMIX_TYPED_OVER_SCALARS(ExtremesOfOneVariant);

// LSH logits are q·k̂/sqrt(dh) with k̂ = qk / ‖qk‖, so |logit| <= ‖qk‖: a
// logit near T's limit needs ‖qk‖ near it. qk = magnitude · x here, so the
// buckets (an argmax, scale-free) and the values do not depend on the
// magnitude, and from ~1e15 (float) / 1e150 (double) on, the weights are
// one-hot within each chunk window (logit gaps ~1e14 or more): the output
// is the same at every larger magnitude.
// One hash round: several rounds would weigh the rounds by exp(row max), and
// maxima that are equal in exact arithmetic may differ by an ulp (~1e8 at
// 1e15) between two GEMM tiles, which exp turns into 0 / 1 instead of 1/2.
template <class T>
lsh_case::Problem<T> lsh_at_magnitude(double magnitude) {
  lsh_case::Shape s;
  s.B = 2, s.T = 16, s.D = 2, s.H = 1, s.dh = 2, s.dv = 3, s.out = 4, s.bs = 4, s.NH = 1;
  auto p = lsh_case::make_problem<T>(s, 5);
  // Rotations with a safe hash margin for qk = x (the margin is scale-free).
  p.w.qk.weight = Matrix<T>::Identity(2, 2);
  Rng rng(6);
  for (int attempt = 0; p.reference(true).min_hash_margin < lsh_case::kHashMargin<T>; ++attempt) {
    if (attempt == 200) throw std::runtime_error("no rotation with a safe hash margin");
    p.w.rotations = lsh_case::random_rotations<T>(rng, s);
  }
  p.w.qk.weight *= static_cast<T>(magnitude);
  return p;
}
template <class T>
double safe_magnitude() {
  return std::is_same_v<T, float> ? 1e15 : 1e150;
}

TYPED_TEST(ExtremesOfOneVariant, LshLargeQueryKeyNorms) {
  using T = TypeParam;
  const auto p = lsh_at_magnitude<T>(safe_magnitude<T>());
  const auto got = run(p);
  const auto want = p.reference();
  EXPECT_TRUE(all_finite("output", got.out));
  EXPECT_TRUE(all_close("weights", got.probs, want.probs, weight_tol<T>()));
  EXPECT_TRUE(all_close("output", got.out, want.output, default_tolerance<T>()));
}

// Beyond sqrt(max) the squared norm ‖qk‖² overflows, while the logits
// (|logit| <= ‖qk‖ ~ 1e30 in float, 1e300 in double) are still finite: the
// result must still be the one-hot one of the safe magnitude. (The naive
// reference squares too, so in double it shares the overflow and is not
// the judge here.)
TYPED_TEST(ExtremesOfOneVariant, LshQueryKeyNormsBeyondTheSquareRootOfTheLimit) {
  using T = TypeParam;
  const auto safe = run(lsh_at_magnitude<T>(safe_magnitude<T>()));
  const auto big = run(lsh_at_magnitude<T>(std::is_same_v<T, float> ? 1e30 : 1e300));
  EXPECT_TRUE(all_finite("output", big.out));
  EXPECT_TRUE(all_close("weights", big.probs, widen(safe.probs), weight_tol<T>()));
  EXPECT_TRUE(all_close("output", big.out, widen(safe.out), default_tolerance<T>()));
}

// A very long row: MHA, S = 65536 keys for 4 queries, one row block
// (block_rows 64 >= T), small D and H so that the naive reference stays
// fast.
//
// Float bound for this test. Each weight is exp(l_j - m) / Σ exp: the sum
// runs over up to 65536 terms in float; Eigen sums in vector lanes and then
// across them, so its rounding error grows like sqrt(n)·u ~ 256 · 6e-8 ~ 1.5e-5
// relative (the worst case n·u ~ 4e-3 needs every rounding to go one way).
// The readout is a GEMM whose inner dimension is 65536: the same growth on
// Σ p_j v_j with |v| ~ 1. Weights: rtol 1e-4 (one exp and one division by
// the sum each), atol 1e-10 (they are ~1e-5). Output (|y| ~ 0.2): rtol
// 1e-4, atol 1e-5. Measured: weights 1.4e-6 relative, output 1.6e-7
// absolute. Double: rtol 1e-9, atol 1e-12 (a hundred times the default:
// 65536-term sums).

template <class T>
constexpr Tolerance long_weight_tol = std::is_same_v<T, float> ? Tolerance{1e-4, 1e-10} : Tolerance{1e-9, 1e-14};
template <class T>
constexpr Tolerance long_output_tol = std::is_same_v<T, float> ? Tolerance{1e-4, 1e-5} : Tolerance{1e-9, 1e-12};

// y = W x + b in double, for closed-form expectations.
template <class T>
std::vector<double> affine(const headmix::Linear<T>& l, const std::vector<double>& x) {
  std::vector<double> y(static_cast<std::size_t>(l.weight.rows()));
  for (Index r = 0; r < l.weight.rows(); ++r) {
    double acc = l.has_bias() ? static_cast<double>(l.bias(r)) : 0.0;
    for (Index c = 0; c < l.weight.cols(); ++c) acc += static_cast<double>(l.weight(r, c)) * x[static_cast<std::size_t>(c)];
    y[static_cast<std::size_t>(r)] = acc;
  }
  return y;
}

TYPED_TEST(ExtremesOfOneVariant, MhaRowOf65536Keys) {
  using T = TypeParam;
  mha_case::Shape s;
  s.B = 1, s.T = 4, s.cross = true, s.S = 65536, s.D = 4, s.Dkv = 4, s.H = 2, s.Dk = 2, s.Dv = 2, s.out = 3;
  // Decoder-like: row i sees keys j <= S - T - 1001 + i, and its last one is never padded.
  s.causal = true, s.offset = s.S - s.T - 1001;
  s.block_rows = s.T;  // one block: every row's tile spans all 65536 keys
  auto p = mha_case::make_problem<T>(s, 16);
  p.w.q.weight *= T(8);  // logits spread over about ±30: the max subtraction matters
  p.padding.assign(static_cast<std::size_t>(s.S), 0);
  for (Index j = 0; j < s.S; j += 5) p.padding[static_cast<std::size_t>(j)] = 1;
  const auto got = run(p);
  const auto want = p.reference();
  EXPECT_TRUE(all_finite("output", got.out));
  EXPECT_TRUE(all_close("weights", got.probs, want.probs, long_weight_tol<T>));
  EXPECT_TRUE(all_close("output", got.out, want.output, long_output_tol<T>));
  for (Index r = 0; r < s.B * s.H * s.T; ++r) {
    double sum = 0;
    for (Index j = 0; j < s.S; ++j) sum += static_cast<double>(got.probs[r * s.S + j]);
    EXPECT_NEAR(sum, 1.0, (std::is_same_v<T, float> ? 1e-4 : 1e-12)) << "row " << r;
  }

  // All-equal logits over the whole row: weights exactly fl(1 / visible),
  // output o(mean of the visible values).
  p.w.k.weight.setZero();
  const auto uniform = run(p);
  std::vector<double> want_u;
  for (Index i = 0; i < s.T; ++i) {
    std::vector<double> mean(static_cast<std::size_t>(s.H * s.Dv), 0.0);
    Index n = 0;
    for (Index j = 0; j <= i + s.offset; ++j)
      if (!p.padding[static_cast<std::size_t>(j)]) {
        const auto v = affine(p.w.v, widen(p.xk.row(j)));
        for (std::size_t e = 0; e < mean.size(); ++e) mean[e] += v[e];
        ++n;
      }
    for (double& e : mean) e /= static_cast<double>(n);
    for (Index h = 0; h < s.H; ++h) {
      const T* row = uniform.probs.data() + (h * s.T + i) * s.S;
      EXPECT_EQ(row[0], T(0));  // padded
      EXPECT_EQ(row[1], T(1) / static_cast<T>(n));
      EXPECT_EQ(row[i + s.offset], T(1) / static_cast<T>(n));
      EXPECT_EQ(row[i + s.offset + 1], T(0));  // causally hidden
    }
    const auto out = affine(p.w.o, mean);
    want_u.insert(want_u.end(), out.begin(), out.end());
  }
  EXPECT_TRUE(all_close("uniform output", uniform.out, want_u, long_output_tol<T>));
}

}  // namespace
