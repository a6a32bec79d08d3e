// Lsh<T> against the naive double reference (tests/reference/lsh_reference.hpp,
// written from shared/conformance/lsh.md), the seeded rotation generator,
// and the layer's argument checks (the BadInput suite).
//
// Expectations come from the reference (or from an independent
// re-implementation, for the generator), never from headmix itself. Inputs,
// weights and rotations are drawn in T and handed to the reference widened
// to double, so a comparison measures only the layer's arithmetic.
//
// Hashing is discontinuous: a float run matches only if it picks the
// reference's buckets. make_problem() redraws the rotations until every
// argmax of the reference has a relative gap of at least 1e-5 between its
// top two entries (float's error in those entries is ~1e-6), as the
// conformance cases do, and every test checks the buckets too.
//
// Tolerance, element-wise: |got - want| <= atol + rtol * |want|
//   double: rtol 1e-10, atol 1e-12. Each value is a few dot products of
//           <= 64 terms and a softmax; self-only rows (logits −5e4) are
//           computed without forming lse = max + log(sum), so no ulp(5e4)
//           error enters. A few hundred roundings of 1.1e-16 at most.
//   float:  rtol 2e-4, atol 2e-5: the same with float's 6e-8, where a
//           logit error passes at most twice over into a weight.

#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "reference/lsh_reference.hpp"
#include "cases/lsh.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace lsh_case;  // Shape/Problem/run/expect_matches_reference: cases/lsh.hpp

HEADMIX_TYPED_OVER_SCALARS(LshTest);

// ---------------------------------------------------------------------------
// Against the reference, option by option

TYPED_TEST(LshTest, Basic) {
  Shape s;
  s.B = 1, s.T = 16, s.NH = 1;
  expect_matches_reference(make_problem<TypeParam>(s, 1));
  s.B = 2, s.T = 32, s.NH = 2;
  expect_matches_reference(make_problem<TypeParam>(s, 2));
  s.T = 64, s.bs = 8, s.NH = 3, s.H = 3;
  expect_matches_reference(make_problem<TypeParam>(s, 3));
}

TYPED_TEST(LshTest, Causal) {
  Shape s;
  s.causal = true, s.T = 32, s.NH = 2, s.H = 4;
  expect_matches_reference(make_problem<TypeParam>(s, 4));
  s.NH = 4, s.bs = 2;
  expect_matches_reference(make_problem<TypeParam>(s, 5));
}

TYPED_TEST(LshTest, KeyPadding) {
  Shape s;
  s.T = 32, s.NH = 3, s.pad_rate = 0.3;
  expect_matches_reference(make_problem<TypeParam>(s, 6));
  auto p = make_problem<TypeParam>(s, 7);
  p.padding.assign(static_cast<std::size_t>(s.B) * s.T, 0);
  for (int j = 28; j < 32; ++j) p.padding[j] = 1;       // item 0: a padded tail
  for (int j = 12; j < 32; ++j) p.padding[32 + j] = 1;  // item 1: mostly padding
  expect_matches_reference(p);
}

// Lengths that are not a multiple of 2·bs: pad, mask, slice back.
TYPED_TEST(LshTest, Autopad) {
  for (int T : {9, 13, 20, 23}) {
    Shape s;
    s.T = T, s.NH = 2;
    expect_matches_reference(make_problem<TypeParam>(s, 10 + static_cast<unsigned>(T)));
    s.causal = true, s.pad_rate = 0.2;
    expect_matches_reference(make_problem<TypeParam>(s, 40 + static_cast<unsigned>(T)));
  }
}

TYPED_TEST(LshTest, RotationsPerHead) {
  Shape s;
  s.per_head = true, s.T = 24, s.B = 2, s.H = 3, s.NH = 2, s.causal = true;
  expect_matches_reference(make_problem<TypeParam>(s, 8));
  s.causal = false, s.T = 20, s.pad_rate = 0.2;
  expect_matches_reference(make_problem<TypeParam>(s, 9));
}

TYPED_TEST(LshTest, SameBucketOnly) {
  Shape s;
  s.across = false, s.T = 32, s.NH = 3;
  expect_matches_reference(make_problem<TypeParam>(s, 70));
  s.causal = true, s.pad_rate = 0.25, s.T = 27;
  expect_matches_reference(make_problem<TypeParam>(s, 71));
}

TYPED_TEST(LshTest, NoDuplicatesSameBucket) {
  Shape s;
  s.dup = false, s.across = false, s.T = 32, s.NH = 2;
  expect_matches_reference(make_problem<TypeParam>(s, 72));
  s.NH = 4, s.causal = true, s.pad_rate = 0.2;
  expect_matches_reference(make_problem<TypeParam>(s, 73));
}

// allow_duplicate_attention = false with attend_across_buckets = true: the
// case whose reference count is defective (lsh.md step 6f). headmix counts
// the slots really attended; the per-round count of the reference differs
// in the first chunk of every round, and these problems show it.
TYPED_TEST(LshTest, NoDuplicatesAcrossBucketsUsesCorrectedCount) {
  using T = TypeParam;
  std::vector<Shape> shapes(3);
  shapes[0].dup = false, shapes[0].T = 32, shapes[0].NH = 2;
  shapes[1].dup = false, shapes[1].T = 24, shapes[1].NH = 4, shapes[1].causal = true, shapes[1].pad_rate = 0.2;
  shapes[2].dup = false, shapes[2].T = 64, shapes[2].bs = 8, shapes[2].NH = 3, shapes[2].per_head = true;
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const auto p = make_problem<T>(shapes[n], 80 + static_cast<unsigned>(n));
    expect_matches_reference(p);
    // The defective count would move the output far beyond the tolerance.
    const headmix_ref::LshRefResult defect = p.reference(false, true);
    const Result<T> got = run(p, false);
    double diff = 0;
    for (Index i = 0; i < got.out.size(); ++i)
      diff = std::max(diff, std::abs(static_cast<double>(got.out[i]) - defect.output[static_cast<std::size_t>(i)]));
    EXPECT_GT(diff, 1e-2) << describe(p.s);
  }
}

TYPED_TEST(LshTest, CustomBucketCount) {
  for (int NB : {2, 4, 6, 16}) {  // Tp / bs = 8 by default
    Shape s;
    s.T = 32, s.NB = NB, s.NH = 2, s.causal = NB == 6;
    expect_matches_reference(make_problem<TypeParam>(s, 90 + static_cast<unsigned>(NB)));
  }
  Shape s;
  s.T = 20, s.NB = 4, s.dup = false, s.across = false, s.NH = 3;  // autopad too
  expect_matches_reference(make_problem<TypeParam>(s, 99));
}

// head_dim != D / H, value dim != head dim, biases on qk and v (so autopad
// rows carry the biases), no output projection, an output without bias.
TYPED_TEST(LshTest, HeadDimsBiasesAndOutputForms) {
  Shape s;
  s.D = 12, s.H = 3, s.dh = 6, s.dv = 5, s.out = 7, s.T = 18, s.qkv_bias = true;
  expect_matches_reference(make_problem<TypeParam>(s, 100));
  s.out_proj = false;
  expect_matches_reference(make_problem<TypeParam>(s, 101));
  s.out_proj = true, s.out_bias = false, s.qkv_bias = false, s.H = 1, s.dh = 16, s.dv = 3;
  expect_matches_reference(make_problem<TypeParam>(s, 102));
}

TYPED_TEST(LshTest, ManyRoundsLongerSequence) {
  Shape s;
  s.B = 1, s.T = 250, s.bs = 8, s.NH = 8, s.H = 2, s.dh = 16, s.dv = 16, s.D = 32, s.causal = true, s.pad_rate = 0.1;
  expect_matches_reference(make_problem<TypeParam>(s, 110));
}

// Zero rows of x give qk = 0: hashed to bucket 0 (all-equal argmax vector),
// key norm clamped at 1e-12 (a zero key, logit 0).
TYPED_TEST(LshTest, ZeroQueryKeyRows) {
  Shape s;
  s.T = 24, s.NH = 2;
  auto p = make_problem<TypeParam>(s, 120);
  for (Index r : {Index(0), Index(5), Index(6), Index(30)}) p.x.row(r).setZero();
  expect_matches_reference(p);
}

// ---------------------------------------------------------------------------
// Documented behaviours

// A sequence of at most 2·bs positions (shorter than one bucket included)
// is one padded length of 2·bs. Every query's windows then cover all
// positions, so with one round, or with duplicates divided out, LSH is
// full shared-QK attention (self −5e4 after the masks). One round: exactly.
// Duplicates divided out: up to the 1e-9 in log(N + 1e-9), which scales
// each weight by 1 − 1e-9 / N, N in [1, 2·NH]: weights move by < 1e-9
// relative, outputs (|v|, |W_o| row sums O(1)) by < ~2e-9. Double: rtol
// and atol 1e-8 for that comparison; float keeps its default.
TYPED_TEST(LshTest, ShortSequenceIsFullAttention) {
  using T = TypeParam;
  const Tolerance vs_full = std::is_same_v<T, float> ? default_tolerance<T>() : Tolerance{1e-8, 1e-8};
  for (int T_ : {1, 3, 8, 11, 16}) {
    for (int variant = 0; variant < 3; ++variant) {
      Shape s;
      s.bs = 8, s.T = T_, s.NH = variant == 0 ? 1 : 3, s.dup = variant == 0;
      s.causal = variant == 2, s.pad_rate = variant == 2 ? 0.3 : 0;
      const auto p = make_problem<T>(s, 130 + static_cast<unsigned>(T_ * 3 + variant));
      SCOPED_TRACE(describe(p.s));
      const headmix_ref::LshRefResult full = p.full_reference();
      const Result<T> got = run(p);
      const Tolerance tol = s.dup ? default_tolerance<T>() : vs_full;
      EXPECT_TRUE(all_close("output vs full attention", got.out, full.output, tol));
      EXPECT_TRUE(all_close("probs vs full attention", got.probs, full.probs, tol));
      expect_matches_reference(p);
    }
  }
}

// A padded query attends only to itself (steps 6b, 6d): a batch item that
// is all padding gives head outputs v_i, weights = identity, nothing NaN.
// (No LSH row is ever fully masked: its own slot always has logit −5e4.)
TYPED_TEST(LshTest, PaddedQueriesAttendOnlyToThemselves) {
  using T = TypeParam;
  Shape s;
  s.B = 2, s.T = 12, s.NH = 3, s.out_proj = false, s.causal = true;
  auto p = make_problem<T>(s, 140);
  p.padding.assign(static_cast<std::size_t>(s.B) * s.T, 0);
  std::fill(p.padding.begin() + s.T, p.padding.end(), 1);  // item 1
  p.padding[3] = 1;
  expect_matches_reference(p);
  const Result<T> got = run(p);
  for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(static_cast<double>(got.out[i])));
  const Matrix<double> v = p.x.template cast<double>() * p.w.v.weight.template cast<double>().transpose();
  const Tolerance tol = default_tolerance<T>();
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.T; ++i) {
      if (!p.padding[static_cast<std::size_t>(b * s.T + i)]) continue;
      for (int c = 0; c < s.H * s.dv; ++c)
        EXPECT_NEAR(got.out[(b * s.T + i) * s.H * s.dv + c], v(b * s.T + i, c), tol.atol + tol.rtol * std::abs(v(b * s.T + i, c)));
      for (int h = 0; h < s.H; ++h)
        for (int j = 0; j < s.T; ++j)
          EXPECT_NEAR(got.probs[((b * s.H + h) * s.T + i) * s.T + j], i == j ? 1.0 : 0.0, tol.atol);
    }
}

// Under causal masking position 0 has no key but itself: weight exactly 1.
TYPED_TEST(LshTest, CausalFirstPositionAttendsToItself) {
  using T = TypeParam;
  Shape s;
  s.causal = true, s.T = 16, s.NH = 2;
  const auto p = make_problem<T>(s, 150);
  const Result<T> got = run(p);
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h) {
      EXPECT_EQ(got.probs[((b * s.H + h) * s.T) * s.T], T(1));
      for (int j = 1; j < s.T; ++j) EXPECT_EQ(got.probs[((b * s.H + h) * s.T) * s.T + j], T(0));
    }
}

// The dense weights: rows sum to 1 and head_h = P_h V_h (section 4).
TYPED_TEST(LshTest, ProbsAreTheEffectiveWeights) {
  using T = TypeParam;
  Shape s;
  s.T = 28, s.NH = 3, s.out_proj = false, s.pad_rate = 0.2;
  const auto p = make_problem<T>(s, 160);
  const Result<T> got = run(p);
  const Matrix<double> v = p.x.template cast<double>() * p.w.v.weight.template cast<double>().transpose();
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h)
      for (int i = 0; i < s.T; ++i) {
        const T* row = got.probs.data() + ((b * s.H + h) * s.T + i) * s.T;
        double sum = 0;
        for (int j = 0; j < s.T; ++j) {
          EXPECT_GE(row[j], T(0));
          sum += row[j];
        }
        EXPECT_NEAR(sum, 1.0, tol);
        for (int e = 0; e < s.dv; ++e) {
          double pv = 0;
          for (int j = 0; j < s.T; ++j) pv += row[j] * v(b * s.T + j, h * s.dv + e);
          EXPECT_NEAR(got.out[(b * s.T + i) * s.H * s.dv + h * s.dv + e], pv, 10 * tol);
        }
      }
}

// ---------------------------------------------------------------------------
// Scale, rotations from a seed, workspace growth (the generic contract tests:
// test_layer_contract.cpp)

// `scale` multiplies the logits q · k̂ and nothing else: with scale
// c / sqrt(dh) the layer is the default layer on qk weights times c (the
// buckets depend only on qk's direction, the unit key not at all). c = 4
// scales every value exactly, so the two agree to rounding at most.
TYPED_TEST(LshTest, ScaleMultipliesTheLogits) {
  using T = TypeParam;
  Shape s;
  s.T = 40, s.NH = 2, s.causal = true, s.pad_rate = 0.2, s.qkv_bias = true;
  const auto p = make_problem<T>(s, 191);
  auto scaled = p;
  scaled.w.qk.weight *= T(4);
  scaled.w.qk.bias *= T(4);
  headmix::LshOptions o = p.options();
  o.scale = 4.0 / std::sqrt(static_cast<double>(p.s.dh));
  headmix::Workspace<T> ws;
  const Tensor<T> want = scaled.layer().forward(scaled.input(), ws);
  EXPECT_TRUE(all_close("output", headmix::Lsh<T>(p.w, o).forward(p.input(), ws), widen(want), default_tolerance<T>()));
  EXPECT_FALSE(all_close("output", p.layer().forward(p.input(), ws), widen(want), default_tolerance<T>()))
      << "the unscaled layer should differ";
}

// A seeded layer uses exactly lsh_rotations(seed, ...) (shared, or one per
// (batch, head) with index b·H + h); another seed draws other rotations.
TYPED_TEST(LshTest, SeededRotationsAreThePublicOnes) {
  using T = TypeParam;
  for (bool per_head : {false, true}) {
    Shape s;
    s.T = 20, s.NH = 3, s.per_head = per_head, s.B = 2, s.H = 2;
    auto explicit_p = make_problem<T>(s, 190);
    auto seeded_p = explicit_p;
    seeded_p.w.rotations = Tensor<T>();
    auto seeded_options = seeded_p.options();
    seeded_options.seed = 1234;
    headmix::Lsh<T> seeded(seeded_p.w, seeded_options);
    explicit_p.w.rotations = headmix::lsh_rotations<T>(1234, per_head ? s.B * s.H : 1, s.dh, s.NH, s.n_buckets());
    EXPECT_EQ(explicit_p.w.rotations.shape(), seeded.rotation_shape(s.B, s.T));
    headmix::Workspace<T> ws;
    const Tensor<T> a = seeded.forward(seeded_p.input(), ws);
    const Tensor<T> b = explicit_p.layer().forward(explicit_p.input(), ws);
    EXPECT_TRUE(bit_identical("seeded vs explicit", a, b)) << "per_head " << per_head;
    seeded_options.seed = 1235;
    seeded.set_options(seeded_options);
    const Tensor<T> c = seeded.forward(seeded_p.input(), ws);
    double diff = 0;
    for (Index i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(double(a[i]) - double(c[i])));
    EXPECT_GT(diff, 1e-3) << "another seed should hash differently";
  }
}

// Attention memory is O(n_hashes · T), never T²: without the dense weights
// a call's workspace grows about linearly with T.
TYPED_TEST(LshTest, WorkspaceGrowsLinearlyWithLength) {
  using T = TypeParam;
  std::vector<double> bytes;
  for (int T_ : {2048, 4096}) {
    Shape s;
    s.B = 1, s.H = 1, s.D = 8, s.dh = 8, s.dv = 8, s.T = T_, s.bs = 32, s.NH = 2, s.out_proj = false;
    s.NB = 64;  // so that the rotation, not the length, sets the hash width
    Rng rng(240);
    headmix::LshWeights<T> w{{normal_matrix<T>(rng, 8, 8, 0.3), {}}, {normal_matrix<T>(rng, 8, 8, 0.3), {}}, {}, {}};
    headmix::LshOptions o;
    o.bucket_size = s.bs, o.n_hashes = s.NH, o.n_buckets = s.NB;
    headmix::Lsh<T> layer(w, o);
    const Matrix<T> x = normal_matrix<T>(rng, T_, 8, 1.0);
    Matrix<T> y(T_, 8);
    headmix::Workspace<T> ws;
    layer.forward(headmix::AttentionInput<T>{headmix::as_batch(x), {}, {}}, headmix::as_batch(y), ws);
    bytes.push_back(double(ws.bytes()));
    EXPECT_LT(ws.bytes(), std::size_t(T_) * T_ * sizeof(T) / 8) << "T = " << T_;
  }
  EXPECT_LT(bytes[1], 2.2 * bytes[0]);
}

// ---------------------------------------------------------------------------
// The seeded generator (variants/lsh/rotations.hpp), checked against an
// independent implementation of its published definition with std::log.

namespace indep {
std::uint64_t splitmix_out(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
struct Xoshiro {
  std::uint64_t s[4];
  explicit Xoshiro(std::uint64_t seed) {
    for (auto& w : s) w = splitmix_out(seed += 0x9E3779B97F4A7C15ULL);
  }
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t next() {  // xoshiro256** 1.0 (Blackman, Vigna)
    const std::uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0], s[3] ^= s[1], s[1] ^= s[2], s[0] ^= s[3], s[2] ^= t, s[3] = rotl(s[3], 45);
    return r;
  }
};
std::vector<double> normals(std::uint64_t seed, std::uint64_t rho, std::size_t n) {
  Xoshiro rng(seed ^ splitmix_out(rho));
  std::vector<double> out;
  while (out.size() < n) {
    const double a = static_cast<std::int32_t>(rng.next() >> 32), b = static_cast<std::int32_t>(rng.next() >> 32);
    const double u = a / 2147483648.0, v = b / 2147483648.0, s = u * u + v * v;  // exact in double
    if (s == 0 || s >= 1) continue;
    const double f = std::sqrt(-2 * std::log(s) / s);
    out.push_back(u * f);
    out.push_back(v * f);
  }
  out.resize(n);
  return out;
}
}  // namespace indep

TEST(LshRotations, MatchIndependentPolarMethod) {
  for (std::uint64_t seed : {0ULL, 1ULL, 0xDEADBEEFULL}) {
    const Tensor<double> rot = headmix::lsh_rotations<double>(seed, 3, 16, 4, 10);  // [3, 16, 4, 5]
    for (Index rho = 0; rho < 3; ++rho) {
      const std::vector<double> want = indep::normals(seed, static_cast<std::uint64_t>(rho), 16 * 4 * 5);
      for (Index i = 0; i < 320; ++i) {
        const double got = rot[rho * 320 + i], w = want[static_cast<std::size_t>(i)];
        ASSERT_NEAR(got, w, 1e-14 * std::max(1.0, std::abs(w))) << "seed " << seed << " rho " << rho << " i " << i;
      }
    }
  }
}

// Within two ulps of the (nearly correctly rounded) std::log: the fixed-point
// result carries ~1e-17 absolute error before its one rounding to double.
TEST(LshRotations, FixedPointLogIsAccurate) {
  std::mt19937_64 rng(7);
  for (int n = 0; n < 200000; ++n) {
    std::uint64_t s = rng() >> (2 + rng() % 62);
    if (s == 0) s = 1;
    const double want = std::log(static_cast<double>(s) * 0x1p-62);
    ASSERT_NEAR(headmix::lsh_detail::fixed_point_log(s), want, 4e-16 * std::max(1.0, std::abs(want))) << s;
  }
  for (int e = 0; e < 62; ++e) {  // powers of two, where the table's rounding is tightest
    const std::uint64_t s = 1ULL << e;
    const double want = (e - 62) * std::log(2.0);
    EXPECT_NEAR(headmix::lsh_detail::fixed_point_log(s), want, 4e-16 * std::max(1.0, std::abs(want))) << e;
  }
}

// Pinned bits: a change of generator would silently change every seeded
// model's hashing. The values are what the definition in rotations.hpp
// gives (MatchIndependentPolarMethod checks the definition itself).
TEST(LshRotations, GoldenValues) {
  const Tensor<double> rot = headmix::lsh_rotations<double>(42, 2, 1, 1, 8);  // [2, 1, 1, 4]
  const std::uint64_t want[8] = {0x3fcbd5495cf025bdULL, 0x3fef71ddd42f1e67ULL, 0xbff42c83334dbefdULL, 0xbfd2fe36613aa36cULL,
                                  0x3fe0250975ab24e2ULL, 0x3fd319b8aa5d8241ULL, 0xbfdde3926ee2e697ULL, 0x3fc6e6971bc169bbULL};
  for (int i = 0; i < 8; ++i) {
    std::uint64_t bits;
    std::memcpy(&bits, &rot[i], sizeof bits);
    EXPECT_EQ(bits, want[i]) << i << ": " << rot[i];
  }
  const Tensor<float> rot_f = headmix::lsh_rotations<float>(42, 2, 1, 1, 8);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(rot_f[i], static_cast<float>(rot[i]));
}

TEST(LshRotations, StandardNormalMoments) {
  const Tensor<double> rot = headmix::lsh_rotations<double>(3, 1, 1000, 1, 400);  // 200k values
  double mean = 0, var = 0, within_one = 0;
  for (Index i = 0; i < rot.size(); ++i) mean += rot[i];
  mean /= double(rot.size());
  for (Index i = 0; i < rot.size(); ++i) {
    var += (rot[i] - mean) * (rot[i] - mean);
    within_one += std::abs(rot[i]) < 1;
  }
  var /= double(rot.size());
  EXPECT_NEAR(mean, 0.0, 0.01);  // 4.5 standard errors
  EXPECT_NEAR(var, 1.0, 0.015);
  EXPECT_NEAR(within_one / double(rot.size()), 0.682689, 0.005);
}

// Rotation rho depends only on (seed, rho): drawn alone or within a larger
// tensor, it is the same.
TEST(LshRotations, StreamDependsOnlyOnSeedAndIndex) {
  const Tensor<double> many = headmix::lsh_rotations<double>(9, 6, 4, 2, 6);
  std::vector<double> one(4 * 2 * 3);
  headmix::lsh_rotation<double>(9, 4, Index(one.size()), one.data());
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], many[4 * 24 + Index(i)]);
  const Tensor<double> other = headmix::lsh_rotations<double>(10, 1, 4, 2, 6);
  EXPECT_NE(other[0], many[0]);
}

// ---------------------------------------------------------------------------
// BadInput: every mismatch throws shape_error whose message names the
// variant, the argument and both shapes.

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN("[lsh]", call, __VA_ARGS__)

// A valid setup (dh != D / H, dv != dh, out != D, explicit rotations); each
// test breaks exactly one thing.
class BadInput : public ::testing::Test {
 protected:
  static constexpr int B = 2, T = 16, D = 12, H = 2, dh = 4, dv = 3, Out = 10, bs = 4, NH = 2;
  static constexpr int NB = 4;  // Tp / bs

  BadInput() {
    Rng rng(99);
    w.qk.weight = normal_matrix<double>(rng, H * dh, D, 0.3);
    w.v.weight = normal_matrix<double>(rng, H * dv, D, 0.3);
    w.o.weight = normal_matrix<double>(rng, Out, H * dv, 0.3);
    w.o.bias = normal_matrix<double>(rng, Out, 1, 0.1);
    w.rotations = Tensor<double>({1, dh, NH, NB / 2});
    w.rotations.set_zero();
    opt.num_heads = H, opt.bucket_size = bs, opt.n_hashes = NH;
    x = normal_matrix<double>(rng, B * T, D, 1.0);
    out.resize(B * T, Out);
  }

  headmix::AttentionInput<double> input() const {
    return {headmix::ConstBatchView<double>(x.data(), B, T, D), {}, headmix::KeyPadding{padding.data(), B, T}};
  }
  headmix::BatchView<double> out_view() { return headmix::BatchView<double>(out.data(), B, T, Out); }
  void build() const { headmix::Lsh<double> layer(w, opt); }
  // build() rejects each of the values `bad` of the option `field`, naming
  // the option, what it wants and the value.
  template <class V>
  void expect_option_rejected(V headmix::LshOptions::*field, std::initializer_list<std::common_type_t<V>> bad,
                              const char* name, const char* want) {
    for (const V v : bad) {
      opt.*field = v;
      EXPECT_SHAPE_ERROR(build(), name, want, "got " + std::to_string(v));
    }
  }
  void forward(const headmix::AttentionInput<double>& in, headmix::BatchView<double> dst) const {
    headmix::Lsh<double> layer(w, opt);
    headmix::Workspace<double> ws;
    layer.forward(in, dst, ws);
  }

  headmix::LshWeights<double> w;
  headmix::LshOptions opt;
  Matrix<double> x, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * T, 0);
};

TEST_F(BadInput, ValidSetupRuns) {  // so that each failure below is the one broken thing
  EXPECT_NO_THROW(forward(input(), out_view()));
  w.rotations = Tensor<double>();
  opt.rotations_per_head = true;
  EXPECT_NO_THROW(forward(input(), out_view()));
}

TEST_F(BadInput, ZeroHeads) {
  expect_option_rejected(&headmix::LshOptions::num_heads, {0}, "num_heads", "expected >= 1");
}

TEST_F(BadInput, QueryKeyRowsNotDivisibleByHeads) {
  opt.num_heads = 3;  // qk has 8 rows
  EXPECT_SHAPE_ERROR(build(), "qk.weight", "num_heads = 3", "got [8, 12]");
}

TEST_F(BadInput, ScaleNotPositiveAndFinite) {
  for (double bad : {0.0, -0.5, std::numeric_limits<double>::infinity()}) {
    opt.scale = bad;
    EXPECT_SHAPE_ERROR(build(), "scale", "expected a finite number > 0");
  }
}

TEST_F(BadInput, NoQueryKeyWeight) {
  w.qk.weight.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "qk.weight", "expected [", "got [0, 0]");
}

TEST_F(BadInput, ValueRowsNotDivisibleByHeads) {
  w.v.weight.conservativeResize(7, D);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "num_heads = 2", "got [7, 12]");
}

TEST_F(BadInput, ValueColumnsNotModelDim) {
  w.v.weight.conservativeResize(H * dv, D - 1);
  EXPECT_SHAPE_ERROR(build(), "v.weight", "expected [6, 12]", "got [6, 11]");
}

TEST_F(BadInput, QueryKeyBiasLength) {
  w.qk.bias = headmix::Vector<double>::Zero(7);
  EXPECT_SHAPE_ERROR(build(), "qk.bias", "expected [8]", "got [7]");
}

TEST_F(BadInput, ValueBiasLength) {
  w.v.bias = headmix::Vector<double>::Zero(5);
  EXPECT_SHAPE_ERROR(build(), "v.bias", "expected [6]", "got [5]");
}



TEST_F(BadInput, OutputBiasWithoutOutputWeight) {
  w.o.weight.resize(0, 0);
  EXPECT_SHAPE_ERROR(build(), "o.weight", "expected [10, 6] (o.bias is given)", "got [0, 0]");
}

TEST_F(BadInput, BucketSizeNotPositive) {
  expect_option_rejected(&headmix::LshOptions::bucket_size, {0, -4}, "bucket_size", "expected >= 1");
}

TEST_F(BadInput, ZeroHashRounds) {
  expect_option_rejected(&headmix::LshOptions::n_hashes, {0}, "n_hashes", "expected >= 1");
}

TEST_F(BadInput, OddBucketCount) {
  w.rotations = Tensor<double>();
  expect_option_rejected(&headmix::LshOptions::n_buckets, {5}, "n_buckets", "an even number >= 2");
}

TEST_F(BadInput, BucketCountTooSmall) {
  w.rotations = Tensor<double>();
  expect_option_rejected(&headmix::LshOptions::n_buckets, {-2, 1}, "n_buckets", "an even number >= 2");
}

TEST_F(BadInput, ZeroThreads) {
  expect_option_rejected(&headmix::LshOptions::threads, {0}, "threads", "expected >= 1");
}

TEST_F(BadInput, RotationsWrongRank) {
  w.rotations = Tensor<double>({1, dh, NH * NB / 2});
  EXPECT_SHAPE_ERROR(build(), "rotations", "got [1, 4, 4]");
}

TEST_F(BadInput, RotationsWrongHeadDim) {
  w.rotations = Tensor<double>({1, dh + 1, NH, NB / 2});
  EXPECT_SHAPE_ERROR(build(), "rotations", "expected [1, 4, 2, ", "got [1, 5, 2, 2]");
}

TEST_F(BadInput, RotationsWrongRoundCount) {
  w.rotations = Tensor<double>({1, dh, NH + 1, NB / 2});
  EXPECT_SHAPE_ERROR(build(), "rotations", "expected [1, 4, 2, ", "got [1, 4, 3, 2]");
}

// With the default n_buckets the last extent follows the length: it is
// checked when the call's T is known. (T = 16 pads to 16, NB = 4.)
TEST_F(BadInput, RotationsWrongBucketCountForLength) {
  w.rotations = Tensor<double>({1, dh, NH, 3});
  EXPECT_SHAPE_ERROR(forward(input(), out_view()), "rotations", "expected [1, 4, 2, 2]", "got [1, 4, 2, 3]");
  w.rotations = Tensor<double>({1, dh, NH, NB / 2});
  auto in = input();
  in.query = headmix::ConstBatchView<double>(x.data(), 1, 2 * T, D);  // NB = 8 now
  in.key_padding = {};
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), 1, 2 * T, Out)), "rotations",
                     "expected [1, 4, 2, 4]", "got [1, 4, 2, 2]");
}

TEST_F(BadInput, RotationsWrongBucketCountForFixedBuckets) {
  opt.n_buckets = 6;
  EXPECT_SHAPE_ERROR(build(), "rotations", "expected [1, 4, 2, 3]", "got [1, 4, 2, 2]");
}

TEST_F(BadInput, SharedRotationWithRotationsPerHead) {
  opt.rotations_per_head = true;
  EXPECT_SHAPE_ERROR(forward(input(), out_view()), "rotations", "expected [4, 4, 2, 2]", "got [1, 4, 2, 2]");
}

TEST_F(BadInput, PerHeadRotationsForAnotherBatch) {
  opt.rotations_per_head = true;
  w.rotations = Tensor<double>({3 * H, dh, NH, NB / 2});
  EXPECT_SHAPE_ERROR(forward(input(), out_view()), "rotations", "expected [4, 4, 2, 2]", "got [6, 4, 2, 2]");
}

TEST_F(BadInput, SharedRotationCountNotOne) {
  w.rotations = Tensor<double>({2, dh, NH, NB / 2});
  EXPECT_SHAPE_ERROR(build(), "rotations", "expected [1, 4, 2, ", "got [2, 4, 2, 2]");
}

TEST_F(BadInput, KeySequenceGiven) {
  auto in = input();
  in.key = headmix::ConstBatchView<double>(x.data(), B, T, D);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key", "expected none", "self-attention", "got [2, 16, 12]");
}

TEST_F(BadInput, QueryWidth) {
  auto in = input();
  in.query = headmix::ConstBatchView<double>(x.data(), B, T, D - 1);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.query", "expected [2, 16, 12]", "got [2, 16, 11]");
}

TEST_F(BadInput, ZeroLength) {
  auto in = input();
  in.query = headmix::ConstBatchView<double>(x.data(), B, 0, D);
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), B, 0, Out)), "input.query", "T >= 1",
                     "got [2, 0, 12]");
}

TEST_F(BadInput, ZeroBatch) {
  auto in = input();
  in.query = headmix::ConstBatchView<double>(x.data(), 0, T, D);
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), 0, T, Out)), "input.query", "B >= 1",
                     "got [0, 16, 12]");
}

TEST_F(BadInput, KeyPaddingMaskShape) {
  auto in = input();
  in.key_padding.keys = T - 1;
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key_padding_mask", "expected [2, 16]", "got [2, 15]");
  in.key_padding = headmix::KeyPadding{padding.data(), 1, T};
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key_padding_mask", "expected [2, 16]", "got [1, 16]");
}

TEST_F(BadInput, OutputBufferShape) {
  EXPECT_SHAPE_ERROR(forward(input(), headmix::BatchView<double>(out.data(), B, T, Out - 1)), "output",
                     "expected [2, 16, 10]", "got [2, 16, 9]");
  EXPECT_SHAPE_ERROR(forward(input(), headmix::BatchView<double>()), "output", "expected [2, 16, 10]", "no buffer");
}

// n_hashes · padded length must fit the 32-bit slot indices: checked before
// any data is read (the view's data is never touched here).
TEST_F(BadInput, SequenceTooLongForSlotIndices) {
  opt.n_hashes = 8;
  w.rotations = Tensor<double>();
  const Index long_T = Index(1) << 28;  // 8 · 2^28 = 2^31 slots
  headmix::AttentionInput<double> in{headmix::ConstBatchView<double>(x.data(), 1, long_T, D), {}, {}};
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), 1, long_T, Out)), "input.query", "< 2^31",
                     "got [1, 268435456, 12]");
}

// set_options() checks like the constructor and leaves the layer as it was
// when it throws.
TEST_F(BadInput, SetOptionsChecksAndKeepsTheOldOptions) {
  headmix::Lsh<double> layer(w, opt);
  headmix::Workspace<double> ws;
  auto changed = [&](auto change) {
    headmix::LshOptions o = opt;
    change(o);
    return o;
  };
  EXPECT_SHAPE_ERROR(layer.set_options(changed([](auto& o) { o.bucket_size = 0; })), "bucket_size", "expected >= 1",
                     "got 0");
  EXPECT_SHAPE_ERROR(layer.set_options(changed([](auto& o) { o.num_heads = 3; })), "qk.weight", "num_heads = 3");
  EXPECT_SHAPE_ERROR(layer.set_options(changed([](auto& o) { o.n_buckets = 3; })), "n_buckets", "got 3");
  EXPECT_EQ(layer.options().bucket_size, opt.bucket_size);
  EXPECT_EQ(layer.options().num_heads, opt.num_heads);
  EXPECT_EQ(layer.options().n_buckets, opt.n_buckets);
  EXPECT_NO_THROW(layer.forward(input(), out_view(), ws));
}

TEST_F(BadInput, FlopsForCrossLengths) {
  headmix::Lsh<double> layer(w, opt);
  EXPECT_SHAPE_ERROR(layer.flops(B, T, T + 1), "keys", "expected 16 (self-attention: S == T)", "got 17");
}

}  // namespace

// ---------------------------------------------------------------------------
// forward_rows(first, count): the query rows [first, first + count) of the
// whole sequence (what one rank of SequenceParallelLsh computes). Each
// range's rows against the naive reference; the range [0, T) is forward()
// bit for bit (the same tiles); other ranges are measured against
// forward()'s rows (only the tile GEMMs' row count differs) and the count
// of bit-identical ranges is printed. flops_rows over a partition adds up
// to flops() plus, per extra part, the hashing every part repeats.
namespace {

HEADMIX_TYPED_OVER_SCALARS(LshRowsTest);

TYPED_TEST(LshRowsTest, ForwardRowsAreTheWholeForwardsRows) {
  using T = TypeParam;
  std::vector<Shape> shapes(3);
  for (Shape& s : shapes) s.dh = 16, s.dv = 16;  // tiles of every row count on Eigen's GEMM (no lazy product)
  shapes[0].T = 23, shapes[0].NH = 3, shapes[0].causal = true, shapes[0].pad_rate = 0.2;
  shapes[1].T = 20, shapes[1].dup = false, shapes[1].across = false, shapes[1].NH = 2, shapes[1].threads = 2;
  shapes[2].T = 18, shapes[2].per_head = true, shapes[2].qkv_bias = true, shapes[2].out_proj = false;
  int ranges = 0, identical = 0;
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const Problem<T> p = make_problem<T>(shapes[n], 150 + static_cast<unsigned>(n));
    SCOPED_TRACE(describe(p.s));
    const headmix::Lsh<T> layer = p.layer();
    const Index B = p.s.B, T_ = p.s.T, W = p.s.out_dim();
    const std::vector<double> want = p.reference().output;  // [B, T, W]
    headmix::Workspace<T> ws;
    const Tensor<T> whole = layer.forward(p.input(), ws);
    const std::vector<std::vector<Index>> partitions = {{0, T_}, {0, 7, 8, T_}, {0, 0, T_ - 1, T_}, {0, 5, 11, 17, T_}};
    for (const auto& cuts : partitions) {
      long long attention = 0, parts = 0;
      for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        const Index first = cuts[k], count = cuts[k + 1] - first;
        SCOPED_TRACE("rows " + std::to_string(first) + " + " + std::to_string(count));
        Tensor<T> got({B, count, W}), rows({B, count, W});
        layer.forward_rows(p.input(), first, count, got.batch(), ws);
        std::vector<double> want_rows;
        for (Index b = 0; b < B; ++b) {
          rows.batch().item(b) = whole.batch().item(b).middleRows(first, count);
          want_rows.insert(want_rows.end(), want.begin() + (b * T_ + first) * W,
                           want.begin() + (b * T_ + first + count) * W);
        }
        EXPECT_TRUE(all_close("rows vs reference", got, want_rows, default_tolerance<T>()));
        EXPECT_TRUE(all_close("rows vs forward()", got, widen(rows), default_tolerance<T>().times(1e-2)));
        if (count == T_) {
          EXPECT_TRUE(bit_identical("rows [0, T) vs forward()", got, rows));
        }
        ranges += count > 0;
        identical += count > 0 && bit_identical("", got, rows);
        attention += layer.flops_rows(B, T_, first, count).attention_macs;
        parts += count > 0;
      }
      const long long Tp = p.s.Tp();
      const long long hashing = 1LL * B * p.s.H * (Tp * p.s.dh + Tp * p.s.dh * p.s.NH * (p.s.n_buckets() / 2));
      EXPECT_EQ(attention, layer.flops(B, T_, T_).attention_macs + (parts - 1) * hashing);
    }
  }
  std::printf("forward_rows vs forward(): %d of %d %s ranges bit-identical\n", identical, ranges,
              std::is_same_v<T, float> ? "float" : "double");
}

TEST(LshRowsBadInput, RangeOutsideTheSequence) {
  const Problem<double> p = make_problem<double>(Shape{}, 160);
  const headmix::Lsh<double> layer = p.layer();
  headmix::Workspace<double> ws;
  const Index T_ = p.s.T;
  Tensor<double> out({p.s.B, 4, p.s.out_dim()});
  EXPECT_SHAPE_ERROR(layer.forward_rows(p.input(), -1, 4, out.batch(), ws), "first row", "got -1");
  EXPECT_SHAPE_ERROR(layer.forward_rows(p.input(), T_ + 1, 0, out.batch(), ws), "first row", "in [0, T = 16]");
  EXPECT_SHAPE_ERROR(layer.forward_rows(p.input(), T_ - 3, 4, out.batch(), ws), "row count", "got 4");
  EXPECT_SHAPE_ERROR(layer.forward_rows(p.input(), 0, 5, out.batch(), ws), "output", "[2, 5, 12]");
  Tensor<double> none({p.s.B, 0, p.s.out_dim()});
  EXPECT_NO_THROW(layer.forward_rows(p.input(), T_, 0, none.batch(), ws));
}

}  // namespace

// ---------------------------------------------------------------------------
// forward_rows(first, count, probs): the range's rows of the dense weights,
// [B, H, count, T] with row p at p − first (what one rank of
// SequenceParallelLsh gathers), against the naive reference's rows and
// forward()'s rows, bit for bit for the range [0, T); an empty range gives
// [B, H, 0, T]. The partitions cut chunks of every kind (see above).
namespace {

TYPED_TEST(LshRowsTest, ForwardRowsProbsAreTheWholeForwardsRows) {
  using T = TypeParam;
  std::vector<Shape> shapes(3);
  for (Shape& s : shapes) s.dh = 16, s.dv = 16;
  shapes[0].T = 23, shapes[0].NH = 3, shapes[0].causal = true, shapes[0].pad_rate = 0.2;
  shapes[1].T = 20, shapes[1].dup = false, shapes[1].across = false, shapes[1].NH = 2, shapes[1].threads = 2;
  shapes[2].T = 18, shapes[2].per_head = true, shapes[2].qkv_bias = true, shapes[2].out_proj = false;
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const Problem<T> p = make_problem<T>(shapes[n], 170 + static_cast<unsigned>(n));
    SCOPED_TRACE(describe(p.s));
    const headmix::Lsh<T> layer = p.layer();
    const Index B = p.s.B, H = p.s.H, T_ = p.s.T, W = p.s.out_dim();
    const std::vector<double> want = p.reference().probs;  // [B, H, T, T]
    headmix::Workspace<T> ws;
    Tensor<T> whole;
    layer.forward(p.input(), ws, &whole);
    const std::vector<std::vector<Index>> partitions = {{0, T_}, {0, 7, 8, T_}, {0, 0, T_ - 1, T_}, {0, 5, 11, 17, T_}};
    for (const auto& cuts : partitions) {
      for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        const Index first = cuts[k], count = cuts[k + 1] - first;
        SCOPED_TRACE("rows " + std::to_string(first) + " + " + std::to_string(count));
        Tensor<T> out({B, count, W}), plain({B, count, W}), got;
        layer.forward_rows(p.input(), first, count, out.batch(), ws, &got);
        layer.forward_rows(p.input(), first, count, plain.batch(), ws);
        ASSERT_EQ(got.shape(), (std::vector<Index>{B, H, count, T_}));
        Tensor<T> rows({B, H, count, T_});
        std::vector<double> want_rows;
        for (Index bh = 0; bh < B * H; ++bh) {
          std::copy_n(whole.data() + (bh * T_ + first) * T_, count * T_, rows.data() + bh * count * T_);
          want_rows.insert(want_rows.end(), want.begin() + (bh * T_ + first) * T_,
                           want.begin() + (bh * T_ + first + count) * T_);
        }
        EXPECT_TRUE(all_close("rows' probs vs reference", got, want_rows, default_tolerance<T>()));
        EXPECT_TRUE(all_close("rows' probs vs forward()", got, widen(rows), default_tolerance<T>().times(1e-2)));
        EXPECT_TRUE(all_close("output with probs vs without", out, widen(plain), default_tolerance<T>().times(1e-2)));
        if (count == T_) {
          EXPECT_TRUE(bit_identical("probs of rows [0, T) vs forward()", got, whole));
        }
      }
    }
  }
}

}  // namespace
