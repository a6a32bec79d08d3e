// Dcmha<T> against the naive double reference (tests/reference/dcmha_reference.hpp),
// DCMHA's own decoding checks (the checks every decoding variant shares are
// typed in test_decoding.cpp), and the layer's argument checks (the DcmhaBadInput suite).
//
// Expectations come from the reference or the conformance files, never from
// headmix itself (except where a test compares two headmix paths that must
// agree: threads, workspace reuse, decoding vs forward). Weights and inputs
// are drawn in T and the reference gets exactly those values widened to
// double, so a comparison measures only the layer's arithmetic error.
//
// Tolerance, element-wise: |got - want| <= atol + rtol * |want| (MHA's bounds)
//   double: rtol 1e-10, atol 1e-12. Every value is a chain of dot products
//           of <= ~60 terms of O(1) values (projections, the dynamic-weight
//           MLP, two compositions of <= 8 heads): a few hundred roundings of
//           1.1e-16 at most. Composed weights can cancel to near 0, hence an
//           atol as well as the relative bound.
//   float:  rtol 2e-4, atol 2e-5. The same chain with unit roundoff 6e-8;
//           the composed scores pass their error through exp. All tests
//           also pass with bounds 4x (float) and 10x (double) tighter, so
//           these leave a margin without hiding a real error.
// Decoding vs forward compares two computations with different summation
// orders: twice the tolerance above.
#include "test_util.hpp"

#include "headmix/headmix.hpp"
#include "reference/dcmha_reference.hpp"

#include "conformance/case_dcmha.hpp"
#include "cases/dcmha.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace dcmha_case;  // Config/Problem/run/expect_matches_reference and the headmix names: cases/dcmha.hpp

template <class T>
using DcmhaTest = ScalarTest<T>;
using Scalars = ::testing::Types<double, float>;
TYPED_TEST_SUITE(DcmhaTest, Scalars, ScalarName);

// ---------------------------------------------------------------------------
// Forward against the reference

TYPED_TEST(DcmhaTest, AllBranchesCausal) {
  Config c;
  for (Index block : {Index(0), Index(1), Index(3), Index(64)}) {
    c.block_rows = block;
    expect_matches_reference(make_problem<TypeParam>(c, 1));
  }
}

// Each branch alone, and each stage alone. The reference output must also
// differ clearly from plain attention (every branch off), so that none of
// these can pass by the branch doing nothing.
TYPED_TEST(DcmhaTest, EachBranchAlone) {
  Config plain;
  plain.use_pre = plain.use_post = false;
  plain.static_w = false;
  const auto base = make_problem<TypeParam>(plain, 2);
  const std::vector<double> plain_out = base.reference().output;
  expect_matches_reference(base);  // no composition at all: MHA with DCMHA's weights

  struct Branch {
    const char* name;
    bool pre, post, qw, kw, sw;
  };
  const Branch branches[] = {
      {"static only", true, true, false, false, true},   {"query-wise only", true, true, true, false, false},
      {"key-wise only", true, true, false, true, false},  {"pre only", true, false, true, true, false},
      {"post only", false, true, true, true, false},      {"pre, query-wise", true, false, true, false, false},
      {"post, key-wise", false, true, false, true, false}, {"all with static", true, true, true, true, true},
  };
  for (const Branch& br : branches) {
    SCOPED_TRACE(br.name);
    Config c = plain;
    c.use_pre = br.pre, c.use_post = br.post, c.query_wise = br.qw, c.key_wise = br.kw, c.static_w = br.sw;
    const auto p = make_problem<TypeParam>(c, 2);  // same seed: same q/k/v/o and inputs as `plain`
    EXPECT_GT(max_abs_diff(p.reference().output, plain_out), 0.05 * max_abs(plain_out)) << "branch has no effect";
    expect_matches_reference(p);
  }
}

// With neither query- nor key-wise terms and no static term, each compose
// is the identity: the layer is plain attention.
TYPED_TEST(DcmhaTest, IdentityComposeIsPlainAttention) {
  Config c;
  c.query_wise = c.key_wise = false;
  const auto p = make_problem<TypeParam>(c, 3);
  expect_matches_reference(p);
  Config off = c;
  off.use_pre = off.use_post = false;
  const auto q = make_problem<TypeParam>(off, 3);
  EXPECT_TRUE(all_close("identity vs off", run(p).out, widen(run(q).out), default_tolerance<TypeParam>()));
}

// Rows long enough for the register-blocked path (whole cache lines of 16
// floats / 8 doubles) plus a tail, and for multi-row blocks to take their
// keys in a chunk and part of a second (the pipeline's mix_chunk), for
// each branch mix and rank, with multi-row tiles (static term by GEMM) and
// single-row tiles (static term in the loop).
TYPED_TEST(DcmhaTest, LongRowsEveryPath) {
  struct Mix {
    bool qw, kw, sw;
  };
  for (const Mix mix : {Mix{true, true, false}, Mix{true, true, true}, Mix{true, false, false}, Mix{false, true, true},
                        Mix{false, false, true}}) {
    for (int R : {1, 2, 3}) {
      for (Index block : {Index(0), Index(1)}) {
        Config c;
        c.B = 1, c.T = headmix::mix_chunk + 22, c.D = 8, c.H = 4, c.dk = c.dv = 2, c.out = 0, c.K = 4, c.R = R;
        c.query_wise = mix.qw, c.key_wise = mix.kw, c.static_w = mix.sw, c.block_rows = block;
        c.causal = R != 2;  // causal rows start at column 0 and end anywhere; non-causal ones cover everything
        expect_matches_reference(make_problem<TypeParam>(c, 16 + static_cast<unsigned>(R)));
      }
    }
  }
}

TYPED_TEST(DcmhaTest, Groups) {
  for (int G : {2, 4}) {
    for (bool sw : {false, true}) {
      Config c;
      c.H = 8, c.dk = 2, c.dv = 3, c.D = 16, c.G = G, c.K = 5, c.static_w = sw;
      expect_matches_reference(make_problem<TypeParam>(c, 10 + G));
    }
  }
  Config c;  // H = 6 in 3 groups of 2, with key padding
  c.H = 6, c.G = 3, c.T = 9, c.pad_rate = 0.25;
  expect_matches_reference(make_problem<TypeParam>(c, 14));
  c.static_w = true, c.block_rows = 1;  // single-row tiles take the static term in the compose loop
  expect_matches_reference(make_problem<TypeParam>(c, 14));
}

// Groups are independent: changing group 1's dynamic-weight MLP leaves the
// heads of group 0 bit-for-bit unchanged (and still matches the reference).
TYPED_TEST(DcmhaTest, GroupsDoNotMix) {
  Config c;
  c.H = 4, c.G = 2, c.out = 0;  // output = concatenated heads, so heads can be told apart
  auto p = make_problem<TypeParam>(c, 15);
  const Result<TypeParam> before = run(p);
  const int M = c.M();
  for (Index d = 0; d < c.D; ++d)
    for (Index cc = 0; cc < 4; ++cc)
      for (Index k = 0; k < c.K; ++k) p.w.dw1[((d * c.G + 1) * 4 + cc) * c.K + k] *= TypeParam(-2);
  const Result<TypeParam> after = run(p);
  double group0 = 0, group1 = 0;
  for (Index b = 0; b < c.B; ++b)
    for (Index t = 0; t < c.T; ++t)
      for (Index e = 0; e < c.H * c.dv; ++e) {
        const Index i = (b * c.T + t) * c.H * c.dv + e;
        const double d = std::abs(static_cast<double>(before.out[i] - after.out[i]));
        (e < M * c.dv ? group0 : group1) = std::max(e < M * c.dv ? group0 : group1, d);
      }
  EXPECT_EQ(group0, 0.0);
  EXPECT_GT(group1, 1e-3);
  expect_matches_reference(p);
}

TYPED_TEST(DcmhaTest, Window) {
  for (int W : {1, 3, 20}) {
    for (Index block : {Index(0), Index(2), Index(5)}) {
      Config c;
      c.T = 11, c.window = W, c.block_rows = block;
      expect_matches_reference(make_problem<TypeParam>(c, 20 + W));
    }
  }
  Config c;
  c.T = 10, c.window = 4, c.pad_rate = 0.3, c.G = 2, c.static_w = true;
  expect_matches_reference(make_problem<TypeParam>(c, 24));
}

// Window 1: every query sees only itself, so the softmax is 1 there and
// the pre-compose cannot matter.
TYPED_TEST(DcmhaTest, WindowOneIgnoresPreCompose) {
  Config c;
  c.window = 1;
  const Result<TypeParam> with = run(make_problem<TypeParam>(c, 25));
  c.use_pre = false;
  const Result<TypeParam> without = run(make_problem<TypeParam>(c, 25));
  EXPECT_TRUE(all_close("output", with.out, widen(without.out), default_tolerance<TypeParam>()));
}

// causal_offset shifts the causal (and window) edge: query t sees keys
// s <= t + offset. Negative offsets hide every key from the first rows,
// positive ones show later keys; with windows, padding, groups, every
// branch, small and automatic (0) block sizes, 1 or 3 threads.
TYPED_TEST(DcmhaTest, CausalOffsetMatchesReference) {
  unsigned seed = 600;
  for (long offset : {-2L, 1L, 3L})
    for (int window : {0, 1, 3}) {
      Config c;
      c.T = 9, c.offset = offset, c.window = window;
      c.pad_rate = seed % 2 == 0 ? 0.3 : 0.0, c.G = seed % 3 == 0 ? 2 : 1, c.static_w = seed % 2 == 1;
      c.block_rows = seed % 4 == 0 ? 0 : 2, c.threads = seed % 3 == 1 ? 3 : 1;
      expect_matches_reference(make_problem<TypeParam>(c, seed++));
    }
  Config c;  // offset beyond T: every key visible, as without causal
  c.T = 6, c.offset = 50;
  expect_matches_reference(make_problem<TypeParam>(c, seed));
}

TYPED_TEST(DcmhaTest, NonCausal) {
  Config c;
  c.causal = false, c.T = 9;
  expect_matches_reference(make_problem<TypeParam>(c, 30));
  c.block_rows = 4, c.static_w = true, c.pad_rate = 0.3;
  expect_matches_reference(make_problem<TypeParam>(c, 31));
}

TYPED_TEST(DcmhaTest, Ranks) {
  for (int R : {1, 2, 3}) {
    Config c;
    c.R = R;
    expect_matches_reference(make_problem<TypeParam>(c, 40 + R));
  }
}

TYPED_TEST(DcmhaTest, GeluTanh) {
  Config c;
  c.gelu_tanh = true;
  const auto p = make_problem<TypeParam>(c, 45);
  expect_matches_reference(p);
  Config e = c;  // and it is not the erf form
  e.gelu_tanh = false;
  EXPECT_GT(max_abs_diff(p.reference().output, make_problem<TypeParam>(e, 45).reference().output), 1e-5);
}

// W1 rows far below the RMSNorm epsilon (the reference's own init does
// this): eps then dominates the norm, and leaving it out changes the result.
TYPED_TEST(DcmhaTest, TinyW1MakesEpsilonMatter) {
  Config c;
  auto p = make_problem<TypeParam>(c, 46);
  // Only the W1 rows (j < R of the 2R axis) shrink, so that mean(F²) ~ 1e-8 << eps while W2 keeps the
  // low-rank terms large.
  const Index M = c.M(), R = c.R;
  for (Index i = 0; i < p.w.qkw.size(); ++i)
    if ((i / M) % (2 * R) < R) p.w.qkw[i] *= TypeParam(2e-4);
  expect_matches_reference(p);
  auto ref_options = p.ref_options();
  ref_options.eps = 1e-12;
  const auto without_eps =
      headmix_ref::dcmha_reference(p.ref_weights(), ref_options, c.B, c.T, widen(p.x), p.padding);
  const auto want = p.reference();
  EXPECT_GT(max_abs_diff(want.output, without_eps.output), 1e-3 * max_abs(want.output));
}

// Biases, no output projection, dk != dv, out != D, batch of 3.
TYPED_TEST(DcmhaTest, BiasesAndHeadWidths) {
  Config c;
  c.bias = true, c.dk = 5, c.dv = 2, c.out = 7, c.B = 3;
  expect_matches_reference(make_problem<TypeParam>(c, 50));
  c.out = 0;
  expect_matches_reference(make_problem<TypeParam>(c, 51));
}

TYPED_TEST(DcmhaTest, SingleHeadAndSinglePosition) {
  Config c;
  c.H = 1, c.dk = c.dv = 4;
  expect_matches_reference(make_problem<TypeParam>(c, 52));
  Config one;
  one.T = 1;
  expect_matches_reference(make_problem<TypeParam>(one, 53));
}

TYPED_TEST(DcmhaTest, KeyPadding) {
  Config c;
  c.pad_rate = 0.3, c.T = 10;
  expect_matches_reference(make_problem<TypeParam>(c, 55));
  c.causal = false;
  expect_matches_reference(make_problem<TypeParam>(c, 56));
}

// A fully masked row (every key padded) has zero weights after both
// composes and zero attention output, never NaN.
TYPED_TEST(DcmhaTest, FullyMaskedRowsGiveZeros) {
  Config c;
  c.pad_all_of_last = true, c.out = 0, c.static_w = true;
  for (bool causal : {true, false}) {
    c.causal = causal;
    const auto p = make_problem<TypeParam>(c, 57);
    expect_matches_reference(p);
    const Result<TypeParam> r = run(p);
    const Index b = c.B - 1, per_item_probs = Index(c.H) * c.T * c.T, per_item_out = Index(c.T) * c.out_dim();
    for (Index i = 0; i < per_item_probs; ++i) ASSERT_EQ(r.probs[b * per_item_probs + i], TypeParam(0)) << i;
    for (Index i = 0; i < per_item_out; ++i) ASSERT_EQ(r.out[b * per_item_out + i], TypeParam(0)) << i;
    for (Index i = 0; i < r.out.size(); ++i) ASSERT_FALSE(std::isnan(r.out[i]));
  }
}

// Large scores (raw logits beyond ±100, composed further): the softmax
// stays finite (max-subtracted, no clamping) and matches the reference.
TYPED_TEST(DcmhaTest, LargeScores) {
  Config c;
  c.weight_gain = 20, c.T = 9;
  const auto p = make_problem<TypeParam>(c, 58);
  // The largest raw score scale · q·k, in double, to show the test is what it says.
  const Matrix<double> x = p.x.template cast<double>();
  const Matrix<double> q = x * p.w.q.weight.template cast<double>().transpose();
  const Matrix<double> k = x * p.w.k.weight.template cast<double>().transpose();
  double largest = 0;
  for (int h = 0; h < c.H; ++h)
    largest = std::max(largest, (q.middleCols(h * c.dk, c.dk) * k.middleCols(h * c.dk, c.dk).transpose())
                                        .cwiseAbs().maxCoeff() / std::sqrt(double(c.dk)));
  EXPECT_GT(largest, 100.0);
  const auto want = p.reference();
  const Result<TypeParam> got = run(p);
  for (Index i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(got.out[i])) << i;
  EXPECT_TRUE(all_close("output", got.out, want.output, default_tolerance<TypeParam>()));
  EXPECT_TRUE(all_close("probs", got.probs, want.probs, default_tolerance<TypeParam>()));
}

// ---------------------------------------------------------------------------
// Accessors (threads, workspace and API forms: test_layer_contract.cpp)

TYPED_TEST(DcmhaTest, Accessors) {
  Config c;
  c.B = 1, c.T = 6;
  const Dcmha<TypeParam> layer = make_problem<TypeParam>(c, 75).layer();
  EXPECT_EQ(layer.group_heads(), c.H);
  EXPECT_EQ(layer.dw_hidden_dim(), c.K);
  EXPECT_EQ(layer.rank(), c.R);
}

// ---------------------------------------------------------------------------
// Incremental decoding: DCMHA's own (the shared checks: test_decoding.cpp)

// p's sequences decoded by steps of `first` tokens, then of one: the
// outputs [B, T, out].
template <class T>
Tensor<T> decode_tokens(const Problem<T>& p, CachePrecision precision = CachePrecision::full, Index first = 1) {
  const Dcmha<T> layer = p.layer();
  const Index B = p.c.B, TT = p.c.T, D = p.c.D, out_dim = p.c.out_dim();
  SequenceCache<T> cache(B, TT, precision);
  headmix::Workspace<T> ws;
  Tensor<T> out({B, TT, out_dim});
  for (Index t = 0, n = first; t < TT; t += n, n = 1) {
    Tensor<T> x({B, n, D}), y({B, n, out_dim});
    for (Index b = 0; b < B; ++b) std::copy_n(&p.x(b * TT + t, 0), n * D, x.data() + b * n * D);
    layer.step(x.batch(), cache, y.batch(), ws);
    for (Index b = 0; b < B; ++b)
      std::copy_n(y.data() + b * n * out_dim, n * out_dim, out.data() + (b * TT + t) * out_dim);
  }
  return out;
}

double round_to_bfloat16(double x) { return double(static_cast<float>(Eigen::bfloat16(static_cast<float>(x)))); }

// A bfloat16 cache stores K, V and the key-side factors rounded to nearest
// even (DCMHA's factor streams are half precision as well): steps equal the
// reference whose k, v and key-side factors are so rounded, to double's
// tolerance, token by token and after a first step of 9 tokens on 2
// threads. 40 keys take the compose's line kernel (lines of 8 doubles) and
// its generic tail; R = 3 the generic kernel alone; the static term with 4
// heads, the kernel that holds them in registers.
TEST(DcmhaHalfCache, StepsEqualTheReferenceOverRoundedKeysValuesAndKeyFactors) {
  std::vector<Config> cases(3);
  cases[1].R = 3, cases[1].G = 2, cases[1].H = 6;
  cases[2].static_w = true, cases[2].R = 1;
  unsigned seed = 760;
  for (Config& c : cases) {
    c.T = 40;
    const auto p = make_problem<double>(c, seed++);
    SCOPED_TRACE(describe(c));
    headmix_ref::RefDcmhaOptions rounded = p.ref_options();
    rounded.store = round_to_bfloat16;
    const auto want = headmix_ref::dcmha_reference(p.ref_weights(), rounded, c.B, c.T, widen(p.x), p.padding);
    const auto unrounded = p.reference();
    double visible = 0;
    for (std::size_t i = 0; i < want.output.size(); ++i)
      visible = std::max(visible, std::abs(want.output[i] - unrounded.output[i]));
    EXPECT_GT(visible, 1e-6) << "the rounding must be visible for this test to mean anything";
    EXPECT_TRUE(all_close("token by token", decode_tokens(p, CachePrecision::bfloat16), want.output,
                          default_tolerance<double>().times(2)));
    Problem<double> two = p;
    two.c.threads = 2;
    EXPECT_TRUE(all_close("first step of 9, 2 threads", decode_tokens(two, CachePrecision::bfloat16, 9),
                          want.output, default_tolerance<double>().times(2)));
    // Streams 2 and 3, the pre and post key-side factors, are bfloat16.
    SequenceCache<double> half(c.B, c.T, CachePrecision::bfloat16), full(c.B, c.T);
    headmix::Workspace<double> ws;
    Tensor<double> y({c.B, c.T, c.out_dim()});
    p.layer().step(p.input().query, half, y.batch(), ws);
    p.layer().step(p.input().query, full, y.batch(), ws);
    ASSERT_EQ(half.streams(), 4u);
    for (std::size_t s : {2, 3}) {
      EXPECT_TRUE(half.is_half(s)) << "stream " << s;
      EXPECT_LT(half.stream_bytes(s), full.stream_bytes(s)) << "stream " << s;
    }
  }
}

// A non-default dw_norm_eps reaches the layer, forward and decoding. The
// W1 rows shrink to a mean square ~1e-4, so that eps = 1e-3 sets their norm;
// the reference takes its eps from the Config, not from the layer. The
// check can fail: a reference with the default eps, or with twice this
// one, is far from the layer's output.
TYPED_TEST(DcmhaTest, NonDefaultEpsilonReachesTheLayer) {
  Config c;
  c.dw_norm_eps = 1e-3;
  auto p = make_problem<TypeParam>(c, 47);
  const Index M = c.M(), R = c.R;
  for (Index i = 0; i < p.w.qkw.size(); ++i)
    if ((i / M) % (2 * R) < R) p.w.qkw[i] *= TypeParam(0.05);
  expect_matches_reference(p);
  const auto want = p.reference();
  EXPECT_TRUE(all_close("decoded output", decode_tokens(p), want.output,
                        default_tolerance<TypeParam>().times(2)));
  const Result<TypeParam> got = run(p);
  for (double wrong : {1e-6, 2e-3}) {
    auto ro = p.ref_options();
    ro.eps = wrong;
    const auto other = headmix_ref::dcmha_reference(p.ref_weights(), ro, c.B, c.T, widen(p.x), p.padding);
    EXPECT_FALSE(all_close("output", got.out, other.output, default_tolerance<TypeParam>())) << "eps " << wrong;
    EXPECT_GT(max_abs_diff(want.output, other.output), 1e-2 * max_abs(want.output)) << "eps " << wrong;
  }
}

// Step cost is O(S) per token: flops of a one-token step grow linearly in
// the cache length, and a window caps them.
TYPED_TEST(DcmhaTest, StepFlopsAreLinearInCacheLength) {
  Config c;
  const auto p = make_problem<TypeParam>(c, 103);
  const Dcmha<TypeParam> layer = p.layer();
  const auto a = layer.step_flop_breakdown(1, 1, 99), b = layer.step_flop_breakdown(1, 1, 199);
  EXPECT_EQ(2 * a.score_macs, b.score_macs);
  EXPECT_EQ(2 * a.compose_macs, b.compose_macs);
  EXPECT_EQ(a.dynamic_macs, b.dynamic_macs);
  c.window = 16;
  const Dcmha<TypeParam> windowed = make_problem<TypeParam>(c, 103).layer();
  EXPECT_EQ(windowed.step_flop_breakdown(1, 1, 99).score_macs, windowed.step_flop_breakdown(1, 1, 999).score_macs);
}

// ---------------------------------------------------------------------------
// DcmhaBadInput: every mismatch throws shape_error naming "[dcmha]", the
// argument and both shapes.

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN("[dcmha]", call, __VA_ARGS__)

// A valid layer (D 16, H 4 in G 2 groups of M 2, R 2, K 5, static terms);
// each test breaks exactly one thing.
class DcmhaBadInput : public ::testing::Test {
 protected:
  static constexpr int B = 2, T = 5, D = 16, H = 4, G = 2, M = 2, R = 2, K = 5, dk = 3, dv = 2, Out = 7;

  DcmhaBadInput() {
    Config c;
    c.B = B, c.T = T, c.D = D, c.H = H, c.G = G, c.R = R, c.K = K, c.dk = dk, c.dv = dv, c.out = Out;
    c.static_w = true, c.pad_rate = 0.2;
    p = make_problem<double>(c, 110);
    out.resize(B * T, Out);
  }
  headmix::BatchView<double> out_view() { return headmix::BatchView<double>(out.data(), B, T, Out); }
  void build() const { Dcmha<double> layer(p.w, p.options()); }
  void build(const DcmhaOptions& o) const { Dcmha<double> layer(p.w, o); }
  // build() with p's options changed by `edit` throws a shape_error naming `parts`.
  template <class Edit, class... Parts>
  void expect_option_error(Edit edit, const Parts&... parts) const {
    DcmhaOptions o = p.options();
    edit(o);
    EXPECT_SHAPE_ERROR(build(o), parts...);
  }
  // build() with p's weights changed by `edit` throws a shape_error naming `parts`.
  template <class Edit, class... Parts>
  void expect_weight_error(Edit edit, const Parts&... parts) {
    edit(p.w);
    EXPECT_SHAPE_ERROR(build(), parts...);
  }
  void forward(const headmix::AttentionInput<double>& in, headmix::BatchView<double> dst) const {
    Dcmha<double> layer(p.w, p.options());
    headmix::Workspace<double> ws;
    layer.forward(in, dst, ws);
  }

  Problem<double> p;
  Matrix<double> out;
};

TEST_F(DcmhaBadInput, ValidSetupRuns) {
  EXPECT_NO_THROW(forward(p.input(), out_view()));
  SequenceCache<double> cache(B, T);
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(p.layer().step(headmix::ConstBatchView<double>(p.x.data(), B, T, D), cache, out_view(), ws));
}

TEST_F(DcmhaBadInput, ZeroHeads) {
  expect_option_error([](auto& o) { o.num_heads = 0; }, "num_heads", "expected >= 1", "got 0");
}
TEST_F(DcmhaBadInput, ZeroGroups) {
  expect_option_error([](auto& o) { o.groups = 0; }, "groups", "expected >= 1", "got 0");
}
TEST_F(DcmhaBadInput, HeadsNotDivisibleByGroups) {
  expect_option_error([](auto& o) { o.groups = 3; }, "groups", "expected a divisor of num_heads = 4", "got 3");
}
TEST_F(DcmhaBadInput, ZeroRank) {
  expect_option_error([](auto& o) { o.rank = 0; }, "rank", "expected >= 1", "got 0");
}
TEST_F(DcmhaBadInput, RankNotMatchingQkw) {
  expect_option_error([](auto& o) { o.rank = 1; }, "dc.qkw", "expected [2, 4, 5, 2, 2]", "got [2, 4, 5, 4, 2]");
}
TEST_F(DcmhaBadInput, NegativeBlockRows) {
  expect_option_error([](auto& o) { o.block_rows = -1; }, "block_rows", "expected >= 0", "got -1");
}
TEST_F(DcmhaBadInput, ZeroThreads) {
  expect_option_error([](auto& o) { o.threads = 0; }, "threads", "expected >= 1", "got 0");
}
TEST_F(DcmhaBadInput, NegativeWindow) {
  expect_option_error([](auto& o) { o.window = -2; }, "window", "expected >= 0", "got -2");
}
TEST_F(DcmhaBadInput, WindowWithoutCausal) {
  expect_option_error([](auto& o) { o.causal = false, o.window = 3; }, "window", "a window needs causal = true",
                      "got 3");
}
TEST_F(DcmhaBadInput, NonPositiveEps) {
  expect_option_error([](auto& o) { o.dw_norm_eps = 0; }, "dw_norm_eps", "expected a finite number > 0", "got 0");
}
TEST_F(DcmhaBadInput, NonFiniteScale) {
  expect_option_error([](auto& o) { o.scale = std::numeric_limits<double>::infinity(); }, "scale",
                      "expected a finite number", "got inf");
}

TEST_F(DcmhaBadInput, QueryRowsNotDivisibleByHeads) {
  expect_weight_error([](auto& w) { w.q.weight.conservativeResize(11, D); }, "q.weight", "num_heads = 4",
                      "got [11, 16]");
}
TEST_F(DcmhaBadInput, KeyWeightShape) {
  expect_weight_error([](auto& w) { w.k.weight.conservativeResize(H * dk, D - 1); }, "k.weight", "expected [12, 16]",
                      "got [12, 15]");
}
TEST_F(DcmhaBadInput, ValueWeightColumns) {
  expect_weight_error([](auto& w) { w.v.weight.conservativeResize(H * dv, D + 1); }, "v.weight", "expected [8, 16]",
                      "got [8, 17]");
}
TEST_F(DcmhaBadInput, ValueRowsNotDivisibleByHeads) {
  expect_weight_error([](auto& w) { w.v.weight.conservativeResize(7, D); }, "v.weight", "num_heads = 4", "got [7, 16]");
}
TEST_F(DcmhaBadInput, OutputBiasWithoutWeight) {
  expect_weight_error([](auto& w) { w.o.weight.resize(0, 0); w.o.bias = headmix::Vector<double>::Zero(Out); },
                      "o.weight", "o.bias is given", "got [0, 0]");
}
TEST_F(DcmhaBadInput, QueryBiasLength) {
  expect_weight_error([](auto& w) { w.q.bias = headmix::Vector<double>::Zero(5); }, "q.bias", "expected [12]",
                      "got [5]");
}

TEST_F(DcmhaBadInput, Dw1InputWidth) {
  expect_weight_error([](auto& w) { w.dw1 = Tensor<double>({D + 1, G, 4, K}); }, "dc.dw1", "expected [16, 2, 4, 5]",
                      "got [17, 2, 4, 5]");
}
TEST_F(DcmhaBadInput, Dw1Groups) {
  expect_weight_error([](auto& w) { w.dw1 = Tensor<double>({D, 1, 4, K}); }, "dc.dw1", "expected [16, 2, 4, 5]",
                      "got [16, 1, 4, 5]");
}
TEST_F(DcmhaBadInput, Dw1Slots) {
  expect_weight_error([](auto& w) { w.dw1 = Tensor<double>({D, G, 2, K}); }, "dc.dw1", "expected [16, 2, 4, 5]",
                      "got [16, 2, 2, 5]");
}
TEST_F(DcmhaBadInput, Dw1Rank) {
  expect_weight_error([](auto& w) { w.dw1 = Tensor<double>({D, G * 4, K}); }, "dc.dw1", "expected [16, 2, 4, K >= 1]",
                      "got [16, 8, 5]");
}
TEST_F(DcmhaBadInput, Dw1Missing) {
  expect_weight_error([](auto& w) { w.dw1 = Tensor<double>(); }, "dc.dw1", "expected [16, 2, 4, K >= 1]", "got []");
}
TEST_F(DcmhaBadInput, QkwHiddenWidthNotDw1) {
  expect_weight_error([](auto& w) { w.qkw = Tensor<double>({G, 4, K + 1, 2 * R, M}); }, "dc.qkw",
                      "expected [2, 4, 5, 4, 2]", "got [2, 4, 6, 4, 2]");
}
TEST_F(DcmhaBadInput, QkwGroupHeads) {
  expect_weight_error([](auto& w) { w.qkw = Tensor<double>({G, 4, K, 2 * R, H}); }, "dc.qkw",
                      "expected [2, 4, 5, 4, 2]", "got [2, 4, 5, 4, 4]");
}
TEST_F(DcmhaBadInput, QkwGroups) {
  expect_weight_error([](auto& w) { w.qkw = Tensor<double>({1, 4, K, 2 * R, M}); }, "dc.qkw",
                      "expected [2, 4, 5, 4, 2]", "got [1, 4, 5, 4, 2]");
}
TEST_F(DcmhaBadInput, QkwSlots) {
  expect_weight_error([](auto& w) { w.qkw = Tensor<double>({G, 2, K, 2 * R, M}); }, "dc.qkw",
                      "expected [2, 4, 5, 4, 2]", "got [2, 2, 5, 4, 2]");
}
TEST_F(DcmhaBadInput, QkwMissing) {
  expect_weight_error([](auto& w) { w.qkw = Tensor<double>(); }, "dc.qkw", "expected [2, 4, 5, 4, 2]", "got []");
}
TEST_F(DcmhaBadInput, DdInputWidth) {
  expect_weight_error([](auto& w) { w.dd = Tensor<double>({D - 1, G, 4 * M}); }, "dc.dd", "expected [16, 2, 8]",
                      "got [15, 2, 8]");
}
TEST_F(DcmhaBadInput, DdGateWidth) {
  expect_weight_error([](auto& w) { w.dd = Tensor<double>({D, G, 4 * H}); }, "dc.dd", "expected [16, 2, 8]",
                      "got [16, 2, 16]");
}
TEST_F(DcmhaBadInput, DdGroups) {
  expect_weight_error([](auto& w) { w.dd = Tensor<double>({D, 1, 4 * M}); }, "dc.dd", "expected [16, 2, 8]",
                      "got [16, 1, 8]");
}
TEST_F(DcmhaBadInput, DdMissing) {
  expect_weight_error([](auto& w) { w.dd = Tensor<double>(); }, "dc.dd", "expected [16, 2, 8]", "got []");
}
TEST_F(DcmhaBadInput, PreStaticShape) {
  expect_weight_error([](auto& w) { w.pre_w = Tensor<double>({G, M, M + 1}); }, "dc.pre_w", "expected [2, 2, 2]",
                      "got [2, 2, 3]");
}
TEST_F(DcmhaBadInput, PostStaticShape) {
  expect_weight_error([](auto& w) { w.post_w = Tensor<double>({1, H, H}); }, "dc.post_w", "expected [2, 2, 2]",
                      "got [1, 4, 4]");
}
TEST_F(DcmhaBadInput, StaticMissing) {
  expect_weight_error([](auto& w) { w.post_w = Tensor<double>(); }, "dc.post_w", "expected [2, 2, 2]", "got []");
}
// A static tensor the options would ignore is an error, not silently dropped.
TEST_F(DcmhaBadInput, StaticGivenWithoutStaticOption) {
  expect_option_error([](auto& o) { o.static_w = false; }, "dc.pre_w", "expected none (static_w is false)",
                      "got [2, 2, 2]");
}

TEST_F(DcmhaBadInput, QueryWidth) {
  auto in = p.input();
  in.query = headmix::ConstBatchView<double>(p.x.data(), B, T, D - 1);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.query", "expected [2, 5, 16]", "got [2, 5, 15]");
}
TEST_F(DcmhaBadInput, KeyWidth) {
  auto in = p.input();
  in.key = headmix::ConstBatchView<double>(p.x.data(), B, T, D - 1);
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key", "expected [2, 5, 16]", "got [2, 5, 15]");
}
TEST_F(DcmhaBadInput, KeyPaddingMaskShape) {
  auto in = p.input();
  in.key_padding.keys = T + 1;
  EXPECT_SHAPE_ERROR(forward(in, out_view()), "input.key_padding_mask", "expected [2, 5]", "got [2, 6]");
}
TEST_F(DcmhaBadInput, OutputBufferShape) {
  EXPECT_SHAPE_ERROR(forward(p.input(), headmix::BatchView<double>(out.data(), B, T, Out - 1)), "output",
                     "expected [2, 5, 7]", "got [2, 5, 6]");
  EXPECT_SHAPE_ERROR(forward(p.input(), headmix::BatchView<double>()), "output", "expected [2, 5, 7]", "no buffer");
}
TEST_F(DcmhaBadInput, ZeroLengthQuery) {
  auto in = p.input();
  in.query = headmix::ConstBatchView<double>(p.x.data(), B, 0, D);
  in.key_padding = {};
  EXPECT_SHAPE_ERROR(forward(in, headmix::BatchView<double>(out.data(), B, 0, Out)), "input.query", "T >= 1",
                     "got [2, 0, 16]");
}

TEST_F(DcmhaBadInput, StepBatchNotCacheBatch) {
  SequenceCache<double> cache(1, T);
  headmix::Workspace<double> ws;
  EXPECT_SHAPE_ERROR(p.layer().step(headmix::ConstBatchView<double>(p.x.data(), B, 1, D), cache, ws), "cache batch",
                     "expected [2]", "got [1]");
}
TEST_F(DcmhaBadInput, StepQueryWidth) {
  SequenceCache<double> cache(B, T);
  headmix::Workspace<double> ws;
  EXPECT_SHAPE_ERROR(p.layer().step(headmix::ConstBatchView<double>(p.x.data(), B, 1, D - 1), cache, ws),
                     "input.query", "expected [2, 1, 16]", "got [2, 1, 15]");
}
TEST_F(DcmhaBadInput, StepOutputShape) {
  SequenceCache<double> cache(B, T);
  headmix::Workspace<double> ws;
  EXPECT_SHAPE_ERROR(p.layer().step(headmix::ConstBatchView<double>(p.x.data(), B, 1, D), cache,
                                    headmix::BatchView<double>(out.data(), B, 2, Out), ws),
                     "output", "expected [2, 1, 7]", "got [2, 2, 7]");
}
// A full cache is not a shape error: cache_full_error (a std::length_error).
TEST_F(DcmhaBadInput, StepCacheFull) {
  SequenceCache<double> cache(B, 2);
  headmix::Workspace<double> ws;
  EXPECT_THROW(p.layer().step(headmix::ConstBatchView<double>(p.x.data(), B, 3, D), cache, ws),
               headmix::cache_full_error);
  EXPECT_EQ(cache.size(), 0);
}
TEST_F(DcmhaBadInput, StepCacheOfAnotherLayer) {
  Config c = p.c;
  c.dv = 3;
  const auto other = make_problem<double>(c, 111);
  SequenceCache<double> cache(B, T);
  headmix::Workspace<double> ws;
  other.layer().step(headmix::ConstBatchView<double>(other.x.data(), B, 1, D), cache, ws);
  EXPECT_SHAPE_ERROR(p.layer().step(headmix::ConstBatchView<double>(p.x.data(), B, 1, D), cache, ws),
                     "cache stream widths", "expected [12, 8,", "got [12, 12,");
}

// ---------------------------------------------------------------------------
// Separate key sequence (issue 17: the forward sequence parallelism needs).
// Queries are rows [q0, q0 + T) and keys rows [k0, k0 + S) of each sequence
// of a problem's x; the reference gets exactly those rows (and the key
// padding of the key rows). The query rows are never the key rows, so
// factors taken from the wrong side (query-wise from the key rows or the
// reverse) change the result.

/// Which rows of a problem's sequences are queries and keys, and the
/// layer's K/V heads (0: num_heads).
struct KeyRows {
  Index q0, T, k0, S;
  Index kv_heads = 0;
};

// Rows [first, first + n) of every sequence of p.x, as [B·n, D].
template <class T>
Matrix<T> sequence_rows(const Problem<T>& p, Index first, Index n) {
  Matrix<T> r(p.c.B * n, p.c.D);
  for (Index b = 0; b < p.c.B; ++b) r.middleRows(b * n, n) = p.x.middleRows(b * p.c.T + first, n);
  return r;
}

// p's weights with K and V cut to `kv` heads (the first kv·dk / kv·dv rows)
// for the layer, and the same heads repeated for the reference, which has
// one K/V head per query head: head h reads KV head h / (H / kv).
template <class T>
void cut_kv_heads(const Problem<T>& p, Index kv, DcmhaWeights<T>& w, headmix_ref::RefDcmhaWeights& ref) {
  const Index H = p.c.H, per = H / kv;
  const auto cut = [&](const headmix::Linear<T>& full, Index width, headmix::Linear<T>& layer_lin,
                       std::vector<double>& ref_w, std::vector<double>& ref_b) {
    layer_lin.weight = full.weight.topRows(kv * width);
    if (full.bias.size() > 0) layer_lin.bias = full.bias.head(kv * width);
    Matrix<T> wide(H * width, full.weight.cols());
    for (Index h = 0; h < H; ++h) wide.middleRows(h * width, width) = full.weight.middleRows(h / per * width, width);
    ref_w = widen(wide);
    if (full.bias.size() > 0) {
      ref_b.clear();
      for (Index h = 0; h < H; ++h)
        for (Index e = 0; e < width; ++e) ref_b.push_back(static_cast<double>(full.bias[h / per * width + e]));
    }
  };
  cut(p.w.k, p.c.dk, w.k, ref.wk, ref.bk);
  cut(p.w.v, p.c.dv, w.v, ref.wv, ref.bv);
}

// The rows `r` of p's sequences, the padding of the key rows, and the
// layer's forward on them.
template <class T>
struct KeyInput {
  Index B, T_, S, D;
  Matrix<T> xq, xk;
  std::vector<std::uint8_t> padding;  // [B, S] or empty

  KeyInput(const Problem<T>& p, const KeyRows& r)
      : B(p.c.B), T_(r.T), S(r.S), D(p.c.D), xq(sequence_rows(p, r.q0, r.T)), xk(sequence_rows(p, r.k0, r.S)) {
    for (Index b = 0; b < B && !p.padding.empty(); ++b)
      for (Index s = 0; s < S; ++s) padding.push_back(p.padding[static_cast<std::size_t>(b * p.c.T + r.k0 + s)]);
  }
  Result<T> forward(const Dcmha<T>& layer) const {
    headmix::AttentionInput<T> in;
    in.query = headmix::ConstBatchView<T>(xq.data(), B, T_, D);
    in.key = headmix::ConstBatchView<T>(xk.data(), B, S, D);
    if (!padding.empty()) in.key_padding = headmix::KeyPadding{padding.data(), B, S};
    Result<T> r;
    r.out = Tensor<T>({B, T_, layer.out_dim()});
    headmix::Workspace<T> ws;
    layer.forward(in, r.out.batch(), ws, &r.probs);
    return r;
  }
};

// The layer on p's options and the rows `r` against the reference.
template <class T>
void expect_keys_match_reference(const Problem<T>& p, const KeyRows& r, Tolerance tol = default_tolerance<T>()) {
  SCOPED_TRACE(describe(p.c) + " queries [" + std::to_string(r.q0) + ", +" + std::to_string(r.T) + ") keys [" +
               std::to_string(r.k0) + ", +" + std::to_string(r.S) + ") kv_heads=" + std::to_string(r.kv_heads));
  DcmhaWeights<T> w = p.w;
  auto ref_w = p.ref_weights();
  DcmhaOptions o = p.options();
  if (r.kv_heads > 0) cut_kv_heads(p, r.kv_heads, w, ref_w), o.num_kv_heads = r.kv_heads;
  const KeyInput<T> x(p, r);
  const Result<T> got = x.forward(Dcmha<T>(w, o));

  const auto want = headmix_ref::dcmha_reference(ref_w, p.ref_options(), p.c.B, static_cast<int>(r.T), widen(x.xq),
                                                  static_cast<int>(r.S), widen(x.xk), x.padding);
  EXPECT_EQ(got.probs.shape(), (std::vector<Index>{p.c.B, p.c.H, r.T, r.S}));
  EXPECT_TRUE(all_close("output", got.out, want.output, tol));
  EXPECT_TRUE(all_close("probs", got.probs, want.probs, tol));
}

TYPED_TEST(DcmhaTest, SeparateKeysMatchReference) {
  Config base;
  base.T = 14;
  unsigned seed = 700;
  struct Case {
    const char* what;
    KeyRows rows;
    void (*adjust)(Config&);
  };
  const Case cases[] = {
      {"non-causal, more keys", {2, 5, 4, 9}, [](Config& c) { c.causal = false; }},
      {"non-causal, fewer keys than queries", {0, 7, 8, 4}, [](Config& c) { c.causal = false, c.static_w = true; }},
      {"non-causal, as many keys, other rows", {0, 6, 7, 6}, [](Config& c) { c.causal = false, c.G = 2; }},
      {"causal, offset", {6, 4, 0, 10}, [](Config& c) { c.offset = 6; }},
      {"causal, negative offset", {3, 6, 5, 7}, [](Config& c) { c.offset = -1, c.block_rows = 2; }},
      {"causal, offset and window", {5, 5, 1, 9}, [](Config& c) { c.offset = 4, c.window = 3, c.G = 2; }},
      {"key padding", {4, 5, 0, 9}, [](Config& c) { c.offset = 4, c.pad_rate = 0.3, c.static_w = true; }},
      {"non-causal key padding", {9, 5, 0, 8}, [](Config& c) { c.causal = false, c.pad_rate = 0.4; }},
      {"grouped-query K/V", {4, 6, 0, 10, 2}, [](Config& c) { c.offset = 4, c.G = 2, c.bias = true; }},
      {"multi-query K/V", {0, 5, 5, 9, 1}, [](Config& c) { c.causal = false, c.static_w = true; }},
      {"no pre-compose", {6, 4, 0, 10}, [](Config& c) { c.offset = 6, c.use_pre = false; }},
      {"no post-compose", {6, 4, 0, 10}, [](Config& c) { c.offset = 6, c.use_post = false; }},
      {"no query-wise terms", {6, 4, 0, 10}, [](Config& c) { c.offset = 6, c.query_wise = false; }},
      {"no key-wise terms", {6, 4, 0, 10}, [](Config& c) { c.offset = 6, c.key_wise = false; }},
      {"three threads, rank 3", {3, 8, 2, 12}, [](Config& c) { c.causal = false, c.threads = 3, c.R = 3; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    Config c = base;
    k.adjust(c);
    expect_keys_match_reference(make_problem<TypeParam>(c, seed++), k.rows);
  }
}

// The row split sequence parallelism relies on: rows [g, g + n) of the
// causal self-attention equal forward(queries = x[g, g + n), keys =
// x[0, g + n), causal_offset = g), both held to the reference of the whole
// sequence (with a window, padding and groups too).
TYPED_TEST(DcmhaTest, CausalRowsEqualOffsetForwardOverPrefix) {
  unsigned seed = 730;
  for (int variant = 0; variant < 3; ++variant) {
    Config c;
    c.T = 11;
    if (variant == 1) c.window = 3, c.pad_rate = 0.3, c.G = 2;
    if (variant == 2) c.static_w = true, c.block_rows = 2, c.threads = 2;
    const auto p = make_problem<TypeParam>(c, seed++);
    SCOPED_TRACE(describe(c));
    const auto full = p.reference();
    const Index B = c.B, H = c.H, T = c.T, W = c.out_dim();
    for (const auto& [g, n] : {std::pair<Index, Index>{0, 4}, {4, 3}, {7, 4}, {10, 1}}) {
      SCOPED_TRACE("rows " + std::to_string(g) + " + " + std::to_string(n));
      DcmhaOptions o = p.options();
      o.causal_offset = g;
      const Result<TypeParam> got = KeyInput<TypeParam>(p, KeyRows{g, n, 0, g + n}).forward(Dcmha<TypeParam>(p.w, o));
      std::vector<double> want_out, want_probs;
      for (Index b = 0; b < B; ++b)
        for (Index t = g; t < g + n; ++t)
          for (Index e = 0; e < W; ++e) want_out.push_back(full.output[static_cast<std::size_t>((b * T + t) * W + e)]);
      for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
          for (Index t = g; t < g + n; ++t)
            for (Index s = 0; s < g + n; ++s) want_probs.push_back(full.prob_at(b, h, t, s));
      EXPECT_TRUE(all_close("output rows", got.out, want_out, default_tolerance<TypeParam>()));
      EXPECT_TRUE(all_close("probs rows", got.probs, want_probs, default_tolerance<TypeParam>()));
    }
  }
}

// flops(B, T, S) is one forward of T queries against S keys: equal to the
// reference's multiply-adds for separate keys, with an offset and a window.
TYPED_TEST(DcmhaTest, SeparateKeysFlopsEqualReferenceCount) {
  std::vector<std::pair<Config, KeyRows>> cases(3);
  cases[0].first.causal = false;
  cases[0].second = {0, 7, 7, 4};  // fewer keys than queries
  cases[1].first.offset = 5, cases[1].first.window = 3, cases[1].first.G = 2;
  cases[1].second = {5, 4, 0, 9};
  cases[2].first.offset = 2, cases[2].first.static_w = true, cases[2].first.key_wise = false;
  cases[2].second = {3, 5, 1, 7};
  unsigned seed = 740;
  for (auto& [c, r] : cases) {
    c.T = 14;
    const auto p = make_problem<TypeParam>(c, seed++);
    SCOPED_TRACE(describe(c));
    const KeyInput<TypeParam> x(p, r);
    const auto want = headmix_ref::dcmha_reference(p.ref_weights(), p.ref_options(), c.B, static_cast<int>(r.T),
                                                   widen(x.xq), static_cast<int>(r.S), widen(x.xk));
    const headmix::DcmhaFlops got = p.layer().flop_breakdown(c.B, r.T, r.S);
    EXPECT_EQ(got.projection_macs, want.projection_macs);
    EXPECT_EQ(got.dynamic_macs, want.dynamic_macs);
    EXPECT_EQ(got.score_macs, want.score_macs);
    EXPECT_EQ(got.compose_macs, want.compose_macs);
  }
}

}  // namespace

// ---- Compose kernels: the fast one against the reference one ---------------
// detail::compose_lines (rank projections in registers; for the group
// sizes of detail::ComposeHeldHeads with a static term, every head's line
// too; without one, detail::compose_rows rows at a time) and
// detail::compose_generic (plain loops, any R) on a segment of one or more
// rows, both held to the Compose formula evaluated here in double, with the
// key-wise factors in T and in bfloat16 (a bfloat16 cache's).

namespace {

template <class T>
using DcmhaComposeKernels = ScalarTest<T>;
TYPED_TEST_SUITE(DcmhaComposeKernels, Scalars, ScalarName);

TYPED_TEST(DcmhaComposeKernels, FastAndReferenceMatchTheFormula) {
  using T = TypeParam;
  std::mt19937 rng(42);
  std::normal_distribution<double> nd(0.0, 1.0);
  const Index plane_pad = 5;
  // 6 rows: one group of compose_rows, then two alone.
  static_assert(headmix::detail::compose_rows == 4, "6 rows no longer mix the two paths");
  for (Index rows : {1, 6})
    for (Index M : {3, 4, 8, 12, 16})
      for (Index R : {1, 2, 3})
        for (Index len : {7, 37, 300})
          for (int flags = 0; flags < 32; ++flags) {
            // The static term in the kernel (static_loop) or a GEMM's, added from `base` (gemm_term).
            const bool qw = flags & 1, kw = flags & 2, static_loop = flags & 4, gemm_term = flags & 8;
            const bool half = flags & 16;  // key-wise factors stored as bfloat16 bits (a bfloat16 cache's)
            if ((half && !kw) || (static_loop && gemm_term)) continue;
            // Head m's row p at z[m·plane + p·row_stride]; row p's query-wise factors at qf[p·qf_stride].
            const Index RM = R * M, row_stride = len + 2, plane = rows * row_stride + plane_pad, rs = len + 3;
            const Index qf_stride = (2 * R + 1) * M + 1;
            auto random = [&](Index n) {
              std::vector<T> v(static_cast<std::size_t>(n));
              for (T& e : v) e = static_cast<T>(nd(rng));
              return v;
            };
            const std::vector<T> z = random(M * plane), qf = random(rows * qf_stride);
            std::vector<T> kf = random((2 * R + 1) * M * rs);
            std::vector<Eigen::bfloat16> kf_half(kf.size());
            if (half)
              for (std::size_t i = 0; i < kf.size(); ++i) {
                kf_half[i] = Eigen::bfloat16(static_cast<float>(kf[i]));
                kf[i] = static_cast<T>(static_cast<float>(kf_half[i]));  // the values the kernels must read
              }
            const std::vector<T> term = random(M * plane);  // a static GEMM's output, for gemm_term
            headmix::Matrix<T> mix(M, M);
            for (Index i = 0; i < M * M; ++i) mix.data()[i] = static_cast<T>(nd(rng));
            const T identity = static_loop || gemm_term ? T(0) : T(1);
            std::vector<T> scratch(static_cast<std::size_t>(headmix::detail::compose_scratch<T>(M, R)));

            // The formula, in double.
            std::vector<double> expect(static_cast<std::size_t>(M * plane));
            for (Index p = 0; p < rows; ++p)
              for (Index x = 0; x < len; ++x) {
                const Index at = p * row_stride + x;
                const T* q = qf.data() + p * qf_stride;
                auto zm = [&](Index m) { return double(z[m * plane + at]); };
                auto kfr = [&](Index j) { return double(kf[j * rs + x]); };
                for (Index n = 0; n < M; ++n) {
                  double o = 0;
                  if (static_loop)
                    for (Index m = 0; m < M; ++m) o += double(mix(n, m)) * zm(m);
                  else if (gemm_term)
                    o = term[n * plane + at];
                  double diag = identity + (qw ? q[2 * RM + n] : 0.0) + (kw ? kfr(2 * RM + n) : 0.0);
                  o += diag * zm(n);
                  for (Index i = 0; i < R; ++i) {
                    double a = 0, b = 0;
                    for (Index m = 0; m < M; ++m) {
                      if (qw) a += double(q[i * M + m]) * zm(m);
                      if (kw) b += kfr(i * M + m) * zm(m);
                    }
                    if (qw) o += double(q[RM + i * M + n]) * a;
                    if (kw) o += kfr(RM + i * M + n) * b;
                  }
                  expect[n * plane + at] = o;
                }
              }
            // Into a separate output and in place (z and o the same values, as
            // the layer runs them).
            for (int pass = 0; pass < 4; ++pass) {
              const bool generic_only = pass & 1, in_place = pass & 2;
              std::vector<T> out = in_place ? z : random(M * plane);
              const std::vector<T> untouched = out;
              const auto compose = [&](const auto* kf_stored) {
                using Stored = std::remove_const_t<std::remove_pointer_t<decltype(kf_stored)>>;
                headmix::detail::ComposeSegment<T, Stored> s{in_place ? out.data() : z.data(), out.data(), plane,
                                                             qw ? qf.data() : nullptr,
                                                             kw ? kf_stored : nullptr, rs, &mix, M, R,
                                                             static_loop, gemm_term ? term.data() : nullptr,
                                                             identity, scratch.data()};
                s.rows = rows, s.row_stride = row_stride, s.qf_stride = qf_stride;
                headmix::detail::compose_segment(s, len, generic_only);
              };
              if (half)
                compose(headmix::bfloat16_bits(kf_half.data()));
              else
                compose(kf.data());
              const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-13;
              for (Index n = 0; n < M; ++n)
                for (Index at = 0; at < plane; ++at) {
                  const std::size_t i = static_cast<std::size_t>(n * plane + at);
                  if (at >= rows * row_stride || at % row_stride >= len) {  // outside the segment: untouched
                    ASSERT_EQ(out[i], untouched[i]) << "wrote outside the segment";
                    continue;
                  }
                  ASSERT_NEAR(out[i], expect[i], tol * (1 + std::abs(expect[i])))
                      << (generic_only ? "reference" : "fast") << " kernel" << (in_place ? " in place" : "")
                      << ", rows " << rows << " M " << M << " R " << R << " len " << len
                      << (half ? " bfloat16 factors" : "") << " flags " << flags << " head " << n << " row "
                      << at / row_stride << " column " << at % row_stride;
                }
            }
          }
}

}  // namespace
