// Extreme values, every variant, float and double: logits near the largest
// finite value of T, all-equal logits, a single key, a single query, fully
// masked rows, extreme causal offsets, and a very long row (MHA, S = 65536
// keys in one row block). No NaN may appear where the math has none, and
// each result is compared with what the math says: a closed form where
// there is one (one-hot or uniform weights, an output that is a projected
// value row or a bias), else the naive double reference of tests/reference/.
//
// Tolerances, element-wise |got - want| <= atol + rtol·|want|, unless a test
// derives its own:
//   double: rtol 1e-10, atol 1e-12; float: rtol 2e-4, atol 2e-5 (as the
//   per-variant suites, for O(1) values and dot products of a few terms);
//   DCMHA: double 1e-10 / 1e-11, float 5e-4 / 1e-4 (see test_dcmha.cpp).
// Weights that the math makes exactly 0 or 1 are held to 1e-6 (float) /
// 1e-12 (double) absolute: a clamped exp may leave ~1e-38 where 0 is exact.

#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "cases/ref_adapters.hpp"
#include "reference/collab_reference.hpp"
#include "reference/dcmha_reference.hpp"
#include "reference/lsh_reference.hpp"
#include "reference/mha_reference.hpp"
#include "reference/talking_heads_reference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;

// ---------------------------------------------------------------------------
// Helpers

template <class T>
Tolerance weight_tol() {  // weights the math makes 0 or 1
  return std::is_same_v<T, float> ? Tolerance{0, 1e-6} : Tolerance{0, 1e-12};
}

template <class T>
::testing::AssertionResult all_finite(const char* what, const Tensor<T>& t) {
  for (Index i = 0; i < t.size(); ++i)
    if (!std::isfinite(static_cast<double>(t[i])))
      return ::testing::AssertionFailure() << what << ": " << static_cast<double>(t[i]) << " at " << i;
  return ::testing::AssertionSuccess();
}

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
template <class T>
std::vector<double> row_of(const Matrix<T>& m, Index r) {
  std::vector<double> v(static_cast<std::size_t>(m.cols()));
  for (Index c = 0; c < m.cols(); ++c) v[static_cast<std::size_t>(c)] = static_cast<double>(m(r, c));
  return v;
}

// ---- references -------------------------------------------------------------

template <class T>
headmix_ref::RefMhaResult mha_ref(const headmix::MhaWeights<T>& w, const headmix::MhaOptions& o, const Matrix<T>& xq,
                                  const Matrix<T>* xk, Index B, const std::vector<std::uint8_t>& pad = {}) {
  headmix_ref::RefMhaOptions ro;
  ro.num_heads = static_cast<int>(o.num_heads), ro.causal = o.causal;
  ro.causal_offset = static_cast<long>(o.causal_offset), ro.scale = o.scale.value_or(0);
  const headmix_ref::RefMhaWeights rw{ref_linear(w.q), ref_linear(w.k), ref_linear(w.v), ref_linear(w.o)};
  if (!xk) return headmix_ref::mha_reference(rw, ro, ref_batch(xq, B), nullptr, pad);
  const auto kb = ref_batch(*xk, B);
  return headmix_ref::mha_reference(rw, ro, ref_batch(xq, B), &kb, pad);
}

template <class T>
headmix_ref::RefThResult th_ref(const headmix::TalkingHeadsWeights<T>& w, const headmix::TalkingHeadsOptions& o,
                                const Matrix<T>& xq, const Matrix<T>& xk, Index B,
                                const std::vector<std::uint8_t>& pad = {}) {
  auto lin = [](const headmix::Linear<T>& l) {
    const auto r = ref_linear(l);
    return headmix_ref::RefThLinear{r.out, r.in, r.weight, r.bias};
  };
  auto mix = [](const Matrix<T>& m) {
    headmix_ref::RefMix r;
    if (m.size()) r.rows = static_cast<int>(m.rows()), r.cols = static_cast<int>(m.cols()), r.w = widen(m);
    return r;
  };
  headmix_ref::RefThWeights rw;
  rw.q = lin(w.q), rw.k = lin(w.k), rw.v = lin(w.v), rw.o = lin(w.o), rw.pre = mix(w.pre_softmax);
  rw.post = mix(w.post_softmax);
  headmix_ref::RefThOptions ro;
  ro.heads = static_cast<int>(o.num_heads);
  ro.key_heads = static_cast<int>(o.key_heads ? o.key_heads : o.num_heads);
  ro.value_heads = static_cast<int>(o.value_heads ? o.value_heads : o.num_heads);
  ro.causal = o.causal, ro.causal_offset = static_cast<long>(o.causal_offset), ro.scale = o.scale.value_or(0);
  const headmix_ref::RefThBatch qb{static_cast<int>(B), static_cast<int>(xq.rows() / B), static_cast<int>(xq.cols()),
                                   widen(xq)};
  const headmix_ref::RefThBatch kb{static_cast<int>(B), static_cast<int>(xk.rows() / B), static_cast<int>(xk.cols()),
                                   widen(xk)};
  return headmix_ref::talking_heads_reference(rw, ro, qb, &kb, pad);
}

template <class T>
headmix_ref::RefMhaResult collab_ref(const headmix::CollabHeadWeights<T>& w, const headmix::CollabHeadOptions& o,
                                     const Matrix<T>& xq, const Matrix<T>& xk, Index B,
                                     const std::vector<std::uint8_t>& pad = {}) {
  headmix_ref::RefCollabWeights rw;
  rw.num_heads = static_cast<int>(o.num_heads), rw.shared_dim = static_cast<int>(w.q.rows());
  rw.embed_dim = static_cast<int>(w.q.cols()), rw.key_dim = static_cast<int>(w.k.cols());
  rw.q = widen(w.q), rw.k = widen(w.k), rw.mixing = widen(w.mixing), rw.content_bias = widen(w.content_bias);
  rw.v = ref_linear(w.v), rw.o = ref_linear(w.o);
  if (!w.layer_norm.empty()) {
    rw.ln_weight = widen(w.layer_norm.weight.data(), w.layer_norm.weight.size());
    rw.ln_bias = widen(w.layer_norm.bias.data(), w.layer_norm.bias.size());
    rw.ln_eps = w.layer_norm.eps;
  }
  headmix_ref::RefCollabOptions ro;
  ro.causal = o.causal, ro.causal_offset = static_cast<long>(o.causal_offset), ro.scale = o.scale.value_or(0);
  const auto kb = ref_batch(xk, B);
  return headmix_ref::collab_reference(rw, ro, ref_batch(xq, B), &kb, pad);
}

template <class T>
headmix_ref::LshRefResult lsh_ref(const headmix::LshWeights<T>& w, const headmix::LshOptions& o, const Matrix<T>& x,
                                  Index B, const std::vector<std::uint8_t>& pad = {}) {
  auto lin = [](const headmix::Linear<T>& l) {
    const auto r = ref_linear(l);
    return headmix_ref::LshRefLinear{r.out, r.in, r.weight, r.bias};
  };
  const headmix_ref::LshRefWeights rw{lin(w.qk), lin(w.v), lin(w.o), widen(w.rotations.data(), w.rotations.size())};
  headmix_ref::LshRefOptions ro;
  ro.num_heads = static_cast<int>(o.num_heads), ro.bucket_size = static_cast<int>(o.bucket_size);
  ro.n_hashes = static_cast<int>(o.n_hashes), ro.n_buckets = static_cast<int>(o.n_buckets), ro.causal = o.causal;
  ro.attend_across_buckets = o.attend_across_buckets, ro.allow_duplicate_attention = o.allow_duplicate_attention;
  ro.rotations_per_head = o.rotations_per_head;
  return headmix_ref::lsh_reference(rw, ro, static_cast<int>(B), static_cast<int>(x.rows() / B),
                                    static_cast<int>(x.cols()), widen(x), pad);
}

template <class T>
headmix_ref::RefDcmhaResult dcmha_ref(const headmix::DcmhaWeights<T>& w, const headmix::DcmhaOptions& o,
                                      const Matrix<T>& x, Index B, const std::vector<std::uint8_t>& pad = {}) {
  const auto rw = ref_dcmha_weights(w, x.cols(), o.num_heads, o.groups, o.rank);
  headmix_ref::RefDcmhaOptions ro;
  ro.use_pre = o.use_pre, ro.use_post = o.use_post, ro.query_wise = o.query_wise, ro.key_wise = o.key_wise;
  ro.static_w = o.static_w, ro.causal = o.causal, ro.window = static_cast<int>(o.window);
  ro.gelu_tanh = o.gelu == headmix::DcmhaGelu::tanh, ro.scale = o.scale.value_or(0);
  return headmix_ref::dcmha_reference(rw, ro, static_cast<int>(B), static_cast<int>(x.rows() / B), widen(x), pad);
}

// A DCMHA weight set (bounds as test_dcmha.cpp: dynamic terms comparable to the identity).
template <class T>
headmix::DcmhaWeights<T> dcmha_weights(Rng& rng, Index D, Index H, Index G, Index R, Index K, Index dk, Index dv,
                                       Index out, bool static_w) {
  const Index M = H / G;
  headmix::DcmhaWeights<T> w;
  w.q = random_linear<T>(rng, H * dk, D), w.k = random_linear<T>(rng, H * dk, D), w.v = random_linear<T>(rng, H * dv, D);
  w.o = random_linear<T>(rng, out, H * dv);
  w.dw1 = random_tensor<T>(rng, {D, G, 4, K}, 2.0 / std::sqrt(double(D)));
  w.qkw = random_tensor<T>(rng, {G, 4, K, 2 * R, M}, 1.0 / std::sqrt(double(K)));
  w.dd = random_tensor<T>(rng, {D, G, 4 * M}, 2.0 / std::sqrt(double(D)));
  if (static_w) w.pre_w = random_tensor<T>(rng, {G, M, M}, 0.5), w.post_w = random_tensor<T>(rng, {G, M, M}, 0.5);
  return w;
}

// LSH rotations [1, dh, NH, NB / 2] drawn until every argmax of the
// reference has a safe margin (as test_lsh.cpp), so float hashes as double.
template <class T>
void safe_rotations(Rng& rng, headmix::LshWeights<T>& w, const headmix::LshOptions& o, const Matrix<T>& x, Index B,
                    const std::vector<std::uint8_t>& pad, Index NB) {
  const double margin = std::is_same_v<T, float> ? 1e-5 : 1e-10;
  auto lin = [](const headmix::Linear<T>& l) {
    const auto r = ref_linear(l);
    return headmix_ref::LshRefLinear{r.out, r.in, r.weight, r.bias};
  };
  headmix_ref::LshRefOptions ro;
  ro.num_heads = static_cast<int>(o.num_heads), ro.bucket_size = static_cast<int>(o.bucket_size);
  ro.n_hashes = static_cast<int>(o.n_hashes), ro.causal = o.causal;
  for (int attempt = 0; attempt < 200; ++attempt) {
    w.rotations = random_tensor<T>(rng, {1, w.qk.out_features() / o.num_heads, o.n_hashes, NB / 2}, 1.0);
    const headmix_ref::LshRefWeights rw{lin(w.qk), lin(w.v), lin(w.o), widen(w.rotations.data(), w.rotations.size())};
    if (headmix_ref::lsh_reference(rw, ro, static_cast<int>(B), static_cast<int>(x.rows() / B),
                                   static_cast<int>(x.cols()), widen(x), pad, true)
            .min_hash_margin >= margin)
      return;
  }
  FAIL() << "no rotation with a safe hash margin";
}

HEADMIX_TYPED_OVER_SCALARS(Extremes);

// The largest logit magnitude used: 3e38 in float (max 3.4e38), 1e308 in double.
template <class T>
double logit_limit() {
  return std::is_same_v<T, float> ? 3e38 : 1e308;
}

// ---------------------------------------------------------------------------
// Logits near the largest finite value
//
// One-dimensional heads: q_i = a·x_i, k_j = a·y_j with a² = L, scale 1, so
// logit(i, j) = L·x_i·y_j with |x|, |y| <= 1. Adjacent logits of a row
// differ by at least L·0.5·0.05 (~1e36 in float), and the difference of the
// extreme ones, up to 2L, overflows to -inf: the math's weights are one-hot
// at the row's argmax key, and nothing may be NaN. Item 2's keys are all
// equal: its rows' logits are equal (±L·x_i), the weights uniform.

struct LimitInputs {
  static constexpr Index B = 3, Tq = 5, S = 7;
  std::vector<double> x{1.0, -1.0, 0.5, -0.75, 0.9};
  std::vector<std::vector<double>> y{{-0.9, -0.5, -0.2, 0.1, 0.3, 0.6, 0.95},
                                     {0.3, 0.95, -0.9, 0.6, -0.2, 0.1, -0.5},
                                     {1, 1, 1, 1, 1, 1, 1}};
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * S, 0);
  LimitInputs() {
    padding[1 * S + 1] = 1;  // item 1: its largest key (0.95) is padded
    padding[1 * S + 6] = 1;
  }
  template <class T>
  Matrix<T> queries() const {
    Matrix<T> m(B * Tq, 1);
    for (Index b = 0; b < B; ++b)
      for (Index i = 0; i < Tq; ++i) m(b * Tq + i, 0) = static_cast<T>(x[static_cast<std::size_t>(i)]);
    return m;
  }
  template <class T>
  Matrix<T> keys() const {
    Matrix<T> m(B * S, 1);
    for (Index b = 0; b < B; ++b)
      for (Index j = 0; j < S; ++j) m(b * S + j, 0) = static_cast<T>(y[static_cast<std::size_t>(b)][static_cast<std::size_t>(j)]);
    return m;
  }
  // The visible key with the largest sign·x_i·y_j (sign = -1: smallest).
  Index argmax(Index b, Index i, double sign) const {
    Index best = -1;
    double top = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < S; ++j) {
      if (padding[static_cast<std::size_t>(b * S + j)]) continue;
      const double l = sign * x[static_cast<std::size_t>(i)] * y[static_cast<std::size_t>(b)][static_cast<std::size_t>(j)];
      if (l > top) top = l, best = j;
    }
    return best;
  }
  Index visible(Index b) const {
    Index n = 0;
    for (Index j = 0; j < S; ++j) n += padding[static_cast<std::size_t>(b * S + j)] == 0;
    return n;
  }
};

// Expected weights [B, heads, T, S] of the construction: one-hot at the
// argmax for items 0 and 1 (times `mass`), uniform over the visible keys
// for item 2.
std::vector<double> limit_weights(const LimitInputs& in, Index heads, double sign, double mass) {
  const Index B = in.B, T = in.Tq, S = in.S;
  std::vector<double> p(static_cast<std::size_t>(B * heads * T * S), 0.0);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < heads; ++h)
      for (Index i = 0; i < T; ++i) {
        double* row = &p[static_cast<std::size_t>(((b * heads + h) * T + i) * S)];
        if (b < 2) {
          row[in.argmax(b, i, sign)] = mass;
        } else {
          for (Index j = 0; j < S; ++j)
            if (!in.padding[static_cast<std::size_t>(b * S + j)]) row[j] = mass / static_cast<double>(in.visible(b));
        }
      }
  return p;
}
// Expected outputs [B, T, out]: out(mass · V[argmax]) for items 0 and 1,
// out(mass · mean V) for item 2 (its keys, so its values, are all equal).
template <class T>
std::vector<double> limit_outputs(const LimitInputs& in, const headmix::Linear<T>& v, const headmix::Linear<T>& o,
                                  double sign, double mass) {
  std::vector<double> y;
  for (Index b = 0; b < in.B; ++b)
    for (Index i = 0; i < in.Tq; ++i) {
      const Index j = b < 2 ? in.argmax(b, i, sign) : 0;
      std::vector<double> val = affine(v, {in.y[static_cast<std::size_t>(b)][static_cast<std::size_t>(j)]});
      for (double& e : val) e *= mass;
      const std::vector<double> out = affine(o, val);
      y.insert(y.end(), out.begin(), out.end());
    }
  return y;
}

TYPED_TEST(Extremes, MhaLogitsNearTheLargestFiniteValue) {
  using T = TypeParam;
  const LimitInputs in;
  Rng rng(1);
  const double a = std::sqrt(logit_limit<T>());
  headmix::MhaWeights<T> w;
  w.q.weight = Matrix<T>::Constant(1, 1, static_cast<T>(a));
  w.k.weight = Matrix<T>::Constant(1, 1, static_cast<T>(a));
  w.v = random_linear<T>(rng, 3, 1), w.o = random_linear<T>(rng, 4, 3);
  headmix::MhaOptions o;
  o.scale = 1.0;
  const Matrix<T> xq = in.queries<T>(), xk = in.keys<T>();
  for (int threads : {1, 2}) {
    o.threads = threads, o.block_rows = threads;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::Mha<T>(w, o).forward(
        {{xq.data(), in.B, in.Tq, 1}, {xk.data(), in.B, in.S, 1}, {in.padding.data(), in.B, in.S}}, ws, &probs);
    EXPECT_TRUE(all_finite("output", y));
    EXPECT_TRUE(all_finite("weights", probs));
    EXPECT_TRUE(all_close("weights", probs, limit_weights(in, 1, 1, 1), weight_tol<T>()));
    EXPECT_TRUE(all_close("output", y, limit_outputs(in, w.v, w.o, 1, 1), default_tolerance<T>()));
    EXPECT_TRUE(all_close("output vs reference", y, mha_ref(w, o, xq, &xk, in.B, in.padding).output, default_tolerance<T>()));
  }
}

// Talking-Heads: a negative pre mix (-0.9) makes the argmin the winner, and
// the post mix (1.5) scales the one-hot weights: U = 1.5 · e_argmin.
TYPED_TEST(Extremes, TalkingHeadsLogitsNearTheLargestFiniteValue) {
  using T = TypeParam;
  const LimitInputs in;
  Rng rng(2);
  const double a = std::sqrt(logit_limit<T>());
  headmix::TalkingHeadsWeights<T> w;
  w.q.weight = Matrix<T>::Constant(1, 1, static_cast<T>(a));
  w.k.weight = Matrix<T>::Constant(1, 1, static_cast<T>(a));
  w.v = random_linear<T>(rng, 3, 1), w.o = random_linear<T>(rng, 4, 3);
  w.pre_softmax = Matrix<T>::Constant(1, 1, T(-0.9));
  w.post_softmax = Matrix<T>::Constant(1, 1, T(1.5));
  headmix::TalkingHeadsOptions o;
  o.scale = 1.0, o.block_rows = 2;
  const Matrix<T> xq = in.queries<T>(), xk = in.keys<T>();
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::TalkingHeads<T>(w, o).forward(
      {{xq.data(), in.B, in.Tq, 1}, {xk.data(), in.B, in.S, 1}, {in.padding.data(), in.B, in.S}}, ws, &probs);
  EXPECT_TRUE(all_finite("output", y));
  EXPECT_TRUE(all_close("weights", probs, limit_weights(in, 1, -1, 1.5), weight_tol<T>()));
  EXPECT_TRUE(all_close("output", y, limit_outputs(in, w.v, w.o, -1, 1.5), default_tolerance<T>()));
  EXPECT_TRUE(all_close("output vs reference", y, th_ref(w, o, xq, xk, in.B, in.padding).output, default_tolerance<T>()));
}

TYPED_TEST(Extremes, CollabHeadLogitsNearTheLargestFiniteValue) {
  using T = TypeParam;
  const LimitInputs in;
  Rng rng(3);
  const double a = std::sqrt(logit_limit<T>());
  headmix::CollabHeadWeights<T> w;
  w.q = Matrix<T>::Constant(1, 1, static_cast<T>(a));
  w.k = Matrix<T>::Constant(1, 1, static_cast<T>(a));
  w.mixing = Matrix<T>::Constant(1, 1, T(1));
  w.v = random_linear<T>(rng, 3, 1), w.o = random_linear<T>(rng, 4, 3);
  headmix::CollabHeadOptions o;
  o.scale = 1.0, o.block_rows = 3;
  const Matrix<T> xq = in.queries<T>(), xk = in.keys<T>();
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::CollabHead<T>(w, o).forward(
      {{xq.data(), in.B, in.Tq, 1}, {xk.data(), in.B, in.S, 1}, {in.padding.data(), in.B, in.S}}, ws, &probs);
  EXPECT_TRUE(all_finite("output", y));
  EXPECT_TRUE(all_close("weights", probs, limit_weights(in, 1, 1, 1), weight_tol<T>()));
  EXPECT_TRUE(all_close("output", y, limit_outputs(in, w.v, w.o, 1, 1), default_tolerance<T>()));
  EXPECT_TRUE(all_close("output vs reference", y, collab_ref(w, o, xq, xk, in.B, in.padding).output, default_tolerance<T>()));
}

// DCMHA is self-attention: logit(i, j) = ±L·x_i·x_j per head (head 1's query
// weight is negated). The pre-compose would mix logits of ~L across heads
// and overflow T itself, so it is off; the post-compose (all dynamic terms
// and a static one) acts on the one-hot weights. Against the reference.
TYPED_TEST(Extremes, DcmhaLogitsNearTheLargestFiniteValue) {
  using T = TypeParam;
  Rng rng(4);
  const Index B = 2, T_ = 6, D = 1, H = 2;
  const double a = std::sqrt(logit_limit<T>());
  headmix::DcmhaWeights<T> w = dcmha_weights<T>(rng, D, H, 1, 1, 3, 1, 2, 3, true);
  w.q.weight << static_cast<T>(a), static_cast<T>(-a);
  w.k.weight << static_cast<T>(a), static_cast<T>(a);
  w.q.bias.setZero(), w.k.bias.setZero();
  headmix::DcmhaOptions o;
  o.num_heads = H, o.groups = 1, o.rank = 1, o.use_pre = false, o.static_w = true, o.scale = 1.0, o.block_rows = 4;
  w.pre_w = Tensor<T>();
  Matrix<T> x(B * T_, 1);
  const double values[] = {0.9, -0.4, 0.25, -1.0, 0.6, 0.05, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0};  // item 1: all equal
  for (Index i = 0; i < x.rows(); ++i) x(i, 0) = static_cast<T>(values[i]);
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::Dcmha<T>(w, o).forward({{x.data(), B, T_, D}, {}, {}}, ws, &probs);
  const auto want = dcmha_ref(w, o, x, B);
  EXPECT_TRUE(all_finite("output", y));
  EXPECT_TRUE(all_finite("weights", probs));
  // The reference's softmax (before the post-compose) is one-hot or uniform.
  for (std::size_t r = 0; r < want.softmax.size() / T_; ++r) {
    const double top = *std::max_element(want.softmax.begin() + r * T_, want.softmax.begin() + (r + 1) * T_);
    EXPECT_TRUE(top == 1.0 || std::abs(top - 1.0 / T_) < 1e-15) << "row " << r;
  }
  EXPECT_TRUE(all_close("weights", probs, want.probs, dcmha_tolerance<T>()));
  EXPECT_TRUE(all_close("output", y, want.output, dcmha_tolerance<T>()));
}

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
struct LshAtMagnitude {
  Tensor<T> out, probs;
  headmix_ref::LshRefResult want;
};
template <class T>
LshAtMagnitude<T> lsh_at_magnitude(double magnitude) {
  Rng rng(5);
  const Index B = 2, T_ = 16, D = 2, H = 1;
  headmix::LshWeights<T> w;
  w.qk.weight = Matrix<T>::Identity(2, 2) * static_cast<T>(magnitude);
  w.v = random_linear<T>(rng, 3, D, false), w.o = random_linear<T>(rng, 4, 3);
  headmix::LshOptions o;
  o.num_heads = H, o.bucket_size = 4, o.n_hashes = 1;
  Matrix<T> x = random_matrix<T>(rng, B * T_, D, 1.0);
  safe_rotations(rng, w, o, x, B, {}, 4);  // T = 16 pads to 16, NB = 4
  headmix::Workspace<T> ws;
  LshAtMagnitude<T> r;
  r.out = headmix::Lsh<T>(w, o).forward({{x.data(), B, T_, D}, {}, {}}, ws, &r.probs);
  r.want = lsh_ref(w, o, x, B);
  return r;
}
template <class T>
double safe_magnitude() {
  return std::is_same_v<T, float> ? 1e15 : 1e150;
}

TYPED_TEST(Extremes, LshLargeQueryKeyNorms) {
  using T = TypeParam;
  const auto r = lsh_at_magnitude<T>(safe_magnitude<T>());
  EXPECT_TRUE(all_finite("output", r.out));
  EXPECT_TRUE(all_close("weights", r.probs, r.want.probs, weight_tol<T>()));
  EXPECT_TRUE(all_close("output", r.out, r.want.output, default_tolerance<T>()));
}

// Beyond sqrt(max) the squared norm ‖qk‖² overflows, while the logits
// (|logit| <= ‖qk‖ ~ 1e30 in float, 1e300 in double) are still finite: the
// result must still be the one-hot one of the safe magnitude. (The naive
// reference squares too, so in double it shares the overflow and is not
// the judge here.)
TYPED_TEST(Extremes, LshQueryKeyNormsBeyondTheSquareRootOfTheLimit) {
  using T = TypeParam;
  const auto safe = lsh_at_magnitude<T>(safe_magnitude<T>());
  const auto big = lsh_at_magnitude<T>(std::is_same_v<T, float> ? 1e30 : 1e300);
  EXPECT_TRUE(all_finite("output", big.out));
  EXPECT_TRUE(all_close("weights", big.probs, widen(safe.probs.data(), safe.probs.size()), weight_tol<T>()));
  EXPECT_TRUE(all_close("output", big.out, widen(safe.out.data(), safe.out.size()), default_tolerance<T>()));
}

// ---------------------------------------------------------------------------
// All-equal logits: keys that are all the same (k.weight 0, k.bias a
// constant) give every visible key of a row the same logit, so the weights
// are exactly fl(1 / visible) and the attention output is the mean of the
// visible values. With causal offset 1 and padding, each row has its own
// count of visible keys.

TYPED_TEST(Extremes, MhaAllEqualLogitsGiveUniformWeights) {
  using T = TypeParam;
  Rng rng(7);
  const Index B = 2, T_ = 6, S = 9, D = 5, Dkv = 4, H = 2, Dk = 3, Dv = 2, Out = 3;
  headmix::MhaWeights<T> w{random_linear<T>(rng, H * Dk, D), random_linear<T>(rng, H * Dk, Dkv),
                           random_linear<T>(rng, H * Dv, Dkv), random_linear<T>(rng, Out, H * Dv)};
  w.k.weight.setZero();
  w.k.bias.setConstant(T(2.5));
  w.q.weight *= T(40);  // large, different logits per row: only their equality along the row matters
  headmix::MhaOptions o;
  o.num_heads = H, o.causal = true, o.causal_offset = 1, o.block_rows = 4;
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  std::vector<std::uint8_t> pad(B * S, 0);
  pad[2] = pad[S + 0] = pad[S + 7] = 1;
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::Mha<T>(w, o).forward({{xq.data(), B, T_, D}, {xk.data(), B, S, Dkv}, {pad.data(), B, S}},
                                                    ws, &probs);
  std::vector<double> want_out;
  for (Index b = 0; b < B; ++b)
    for (Index i = 0; i < T_; ++i) {
      std::vector<Index> seen;
      for (Index j = 0; j < S; ++j)
        if (j <= i + 1 && !pad[static_cast<std::size_t>(b * S + j)]) seen.push_back(j);
      const T uniform = T(1) / static_cast<T>(seen.size());
      for (Index h = 0; h < H; ++h)
        for (Index j = 0; j < S; ++j) {
          const bool visible = std::find(seen.begin(), seen.end(), j) != seen.end();
          EXPECT_EQ(probs[((b * H + h) * T_ + i) * S + j], visible ? uniform : T(0)) << b << "," << h << "," << i << "," << j;
        }
      std::vector<double> mean(static_cast<std::size_t>(H * Dv), 0.0);
      for (Index j : seen) {
        const auto v = affine(w.v, row_of(xk, b * S + j));
        for (std::size_t e = 0; e < mean.size(); ++e) mean[e] += v[e] / static_cast<double>(seen.size());
      }
      const auto out = affine(w.o, mean);
      want_out.insert(want_out.end(), out.begin(), out.end());
    }
  EXPECT_TRUE(all_close("output", y, want_out, default_tolerance<T>()));
}

// Talking-Heads: equal logits stay equal through the pre mix, so each
// softmax head is uniform and U_c = (Σ_g post[c, g]) / visible.
TYPED_TEST(Extremes, TalkingHeadsAllEqualLogits) {
  using T = TypeParam;
  Rng rng(8);
  const Index B = 2, T_ = 5, S = 7, D = 4, Dkv = 3, hk = 2, h = 3, hv = 2;
  headmix::TalkingHeadsWeights<T> w;
  w.q = random_linear<T>(rng, hk * 2, D), w.k = random_linear<T>(rng, hk * 2, Dkv), w.v = random_linear<T>(rng, hv * 2, Dkv);
  w.o = random_linear<T>(rng, 3, hv * 2);
  w.k.weight.setZero();
  w.pre_softmax = random_matrix<T>(rng, h, hk, 1.0), w.post_softmax = random_matrix<T>(rng, hv, h, 1.0);
  headmix::TalkingHeadsOptions o;
  o.num_heads = h, o.key_heads = hk, o.value_heads = hv;
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  std::vector<std::uint8_t> pad(B * S, 0);
  pad[S + 3] = 1;
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::TalkingHeads<T>(w, o).forward(
      {{xq.data(), B, T_, D}, {xk.data(), B, S, Dkv}, {pad.data(), B, S}}, ws, &probs);
  std::vector<double> want(static_cast<std::size_t>(B * hv * T_ * S), 0.0);
  for (Index b = 0; b < B; ++b)
    for (Index c = 0; c < hv; ++c)
      for (Index i = 0; i < T_; ++i)
        for (Index j = 0; j < S; ++j) {
          if (pad[static_cast<std::size_t>(b * S + j)]) continue;
          double mass = 0;
          for (Index g = 0; g < h; ++g) mass += static_cast<double>(w.post_softmax(c, g));
          want[static_cast<std::size_t>(((b * hv + c) * T_ + i) * S + j)] = mass / static_cast<double>(b == 0 ? S : S - 1);
        }
  EXPECT_TRUE(all_close("weights", probs, want, default_tolerance<T>()));
  EXPECT_TRUE(all_close("output", y, th_ref(w, o, xq, xk, B, pad).output, default_tolerance<T>()));
}

// CollabHead: K̃ = 0 and no content bias make every logit 0.
TYPED_TEST(Extremes, CollabHeadAllEqualLogits) {
  using T = TypeParam;
  Rng rng(9);
  const Index B = 2, T_ = 5, S = 6, D = 4, Dkv = 3, H = 2, R = 4;
  headmix::CollabHeadWeights<T> w;
  w.q = random_matrix<T>(rng, R, D, 1.0), w.k = Matrix<T>::Zero(R, Dkv), w.mixing = random_matrix<T>(rng, H, R, 1.0);
  w.v = random_linear<T>(rng, H * 2, Dkv), w.o = random_linear<T>(rng, 3, H * 2);
  headmix::CollabHeadOptions o;
  o.num_heads = H;
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::CollabHead<T>(w, o).forward({{xq.data(), B, T_, D}, {xk.data(), B, S, Dkv}, {}}, ws,
                                                           &probs);
  for (Index i = 0; i < probs.size(); ++i) ASSERT_EQ(probs[i], T(1) / T(S)) << i;
  EXPECT_TRUE(all_close("output", y, collab_ref(w, o, xq, xk, B).output, default_tolerance<T>()));
}

// LSH and DCMHA: all positions equal (identical rows of x). LSH: every key
// has the same value, so every output row is o(v) whatever the weights.
// DCMHA: every visible key of a row carries the same composed weight.
TYPED_TEST(Extremes, LshAllPositionsEqual) {
  using T = TypeParam;
  Rng rng(10);
  const Index B = 2, T_ = 12, D = 4;
  headmix::LshWeights<T> w;
  w.qk = random_linear<T>(rng, 2 * 3, D, false), w.v = random_linear<T>(rng, 2 * 2, D), w.o = random_linear<T>(rng, 3, 4);
  headmix::LshOptions o;
  o.num_heads = 2, o.bucket_size = 3, o.n_hashes = 2, o.causal = true, o.seed = 5;
  Matrix<T> x(B * T_, D);
  const Matrix<T> row = random_matrix<T>(rng, 1, D, 1.0);
  for (Index i = 0; i < x.rows(); ++i) x.row(i) = row;
  headmix::Workspace<T> ws;
  const Tensor<T> y = headmix::Lsh<T>(w, o).forward({{x.data(), B, T_, D}, {}, {}}, ws);
  const auto want = affine(w.o, affine(w.v, row_of(row, 0)));
  std::vector<double> all;
  for (Index i = 0; i < B * T_; ++i) all.insert(all.end(), want.begin(), want.end());
  EXPECT_TRUE(all_close("output", y, all, default_tolerance<T>()));
}

TYPED_TEST(Extremes, DcmhaAllPositionsEqual) {
  using T = TypeParam;
  Rng rng(11);
  const Index B = 2, T_ = 7, D = 4, H = 4;
  const headmix::DcmhaWeights<T> w = dcmha_weights<T>(rng, D, H, 2, 2, 3, 2, 2, 3, false);
  headmix::DcmhaOptions o;
  o.num_heads = H, o.groups = 2, o.rank = 2, o.causal = true, o.window = 4;
  Matrix<T> x(B * T_, D);
  const Matrix<T> row = random_matrix<T>(rng, 1, D, 1.0);
  for (Index i = 0; i < x.rows(); ++i) x.row(i) = row;
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::Dcmha<T>(w, o).forward({{x.data(), B, T_, D}, {}, {}}, ws, &probs);
  const auto want = dcmha_ref(w, o, x, B);
  EXPECT_TRUE(all_close("output", y, want.output, dcmha_tolerance<T>()));
  EXPECT_TRUE(all_close("weights", probs, want.probs, dcmha_tolerance<T>()));
  for (Index r = 0; r < B * H * T_; ++r) {  // row r is query i = r % T_: keys i-3 .. i visible
    const Index i = r % T_, lo = std::max<Index>(0, i - 3);
    for (Index j = lo; j <= i; ++j) EXPECT_NEAR(probs[r * T_ + j], probs[r * T_ + i], 1e-6) << r << "," << j;
  }
}

// ---------------------------------------------------------------------------
// A single key, a single query

// S = 1: the weight is exactly 1 (MHA, CollabHead; Talking-Heads: the post
// mix's row sum), so every query row of an item has the same output, and
// MHA's is o(v(key)).
TYPED_TEST(Extremes, SingleKey) {
  using T = TypeParam;
  Rng rng(12);
  const Index B = 2, T_ = 5, D = 4, Dkv = 3;
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B, Dkv, 1.0);
  headmix::AttentionInput<T> in{{xq.data(), B, T_, D}, {xk.data(), B, 1, Dkv}, {}};
  auto same_rows = [&](const char* name, const Tensor<T>& y) {
    const Index out = y.dim(2);
    for (Index b = 0; b < B; ++b)
      for (Index i = 1; i < T_; ++i)
        for (Index c = 0; c < out; ++c) EXPECT_EQ(y[(b * T_ + i) * out + c], y[(b * T_) * out + c]) << name;
  };
  {
    headmix::MhaWeights<T> w{random_linear<T>(rng, 6, D), random_linear<T>(rng, 6, Dkv), random_linear<T>(rng, 4, Dkv),
                             random_linear<T>(rng, 3, 4)};
    headmix::MhaOptions o;
    o.num_heads = 2;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::Mha<T>(w, o).forward(in, ws, &probs);
    for (Index i = 0; i < probs.size(); ++i) EXPECT_EQ(probs[i], T(1));
    same_rows("mha", y);
    std::vector<double> want;
    for (Index b = 0; b < B; ++b)
      for (Index i = 0; i < T_; ++i) {
        const auto out = affine(w.o, affine(w.v, row_of(xk, b)));
        want.insert(want.end(), out.begin(), out.end());
      }
    EXPECT_TRUE(all_close("mha output", y, want, default_tolerance<T>()));
  }
  {
    headmix::TalkingHeadsWeights<T> w;
    w.q = random_linear<T>(rng, 4, D), w.k = random_linear<T>(rng, 4, Dkv), w.v = random_linear<T>(rng, 6, Dkv);
    w.pre_softmax = random_matrix<T>(rng, 3, 2, 1.0), w.post_softmax = random_matrix<T>(rng, 3, 3, 1.0);
    headmix::TalkingHeadsOptions o;
    o.num_heads = 3, o.key_heads = 2;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::TalkingHeads<T>(w, o).forward(in, ws, &probs);
    for (Index b = 0; b < B; ++b)
      for (Index c = 0; c < 3; ++c)
        for (Index i = 0; i < T_; ++i)
          EXPECT_NEAR(probs[(b * 3 + c) * T_ + i], w.post_softmax.row(c).sum(), 1e-6) << b << c << i;
    same_rows("talking_heads", y);
    EXPECT_TRUE(all_close("talking_heads output", y, th_ref(w, o, xq, xk, B).output, default_tolerance<T>()));
  }
  {
    headmix::CollabHeadWeights<T> w;
    w.q = random_matrix<T>(rng, 4, D, 1.0), w.k = random_matrix<T>(rng, 4, Dkv, 1.0), w.mixing = random_matrix<T>(rng, 2, 4, 1.0);
    w.content_bias = random_matrix<T>(rng, 2, Dkv, 1.0);
    w.v = random_linear<T>(rng, 4, Dkv), w.o = random_linear<T>(rng, 3, 4);
    headmix::CollabHeadOptions o;
    o.num_heads = 2;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::CollabHead<T>(w, o).forward(in, ws, &probs);
    for (Index i = 0; i < probs.size(); ++i) EXPECT_EQ(probs[i], T(1));
    same_rows("collab", y);
    EXPECT_TRUE(all_close("collab output", y, collab_ref(w, o, xq, xk, B).output, default_tolerance<T>()));
  }
}

// T = 1. Dense variants: one query over 9 keys, causal offset 0 (it sees key
// 0 only: weight exactly 1) and 8 (all). LSH and DCMHA (self-attention): one
// position attends to itself alone, weight 1, so LSH gives o(v(x)) and
// DCMHA the reference's (post-composed) result, forward and step().
TYPED_TEST(Extremes, SingleQuery) {
  using T = TypeParam;
  Rng rng(13);
  const Index B = 2, S = 9, D = 4, Dkv = 3;
  const Matrix<T> xq = random_matrix<T>(rng, B, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  std::vector<std::uint8_t> pad(B * S, 0);
  pad[S + 4] = 1;
  const headmix::AttentionInput<T> in{{xq.data(), B, 1, D}, {xk.data(), B, S, Dkv}, {pad.data(), B, S}};
  for (Index offset : {Index(0), Index(8)}) {
    SCOPED_TRACE("causal offset " + std::to_string(offset));
    {
      headmix::MhaWeights<T> w{random_linear<T>(rng, 6, D), random_linear<T>(rng, 6, Dkv), random_linear<T>(rng, 4, Dkv),
                               random_linear<T>(rng, 3, 4)};
      headmix::MhaOptions o;
      o.num_heads = 2, o.causal = true, o.causal_offset = offset;
      headmix::Workspace<T> ws;
      Tensor<T> probs;
      const Tensor<T> y = headmix::Mha<T>(w, o).forward(in, ws, &probs);
      const auto want = mha_ref(w, o, xq, &xk, B, pad);
      EXPECT_TRUE(all_close("mha output", y, want.output, default_tolerance<T>()));
      EXPECT_TRUE(all_close("mha weights", probs, want.probs, default_tolerance<T>()));
      if (offset == 0) {
        for (Index r = 0; r < B * 2; ++r) EXPECT_EQ(probs[r * S], T(1));
      }
    }
    {
      headmix::TalkingHeadsWeights<T> w;
      w.q = random_linear<T>(rng, 4, D), w.k = random_linear<T>(rng, 4, Dkv), w.v = random_linear<T>(rng, 4, Dkv);
      w.o = random_linear<T>(rng, 3, 4), w.pre_softmax = random_matrix<T>(rng, 2, 2, 1.0), w.post_softmax = random_matrix<T>(rng, 2, 2, 1.0);
      headmix::TalkingHeadsOptions o;
      o.num_heads = 2, o.causal = true, o.causal_offset = offset;
      headmix::Workspace<T> ws;
      const Tensor<T> y = headmix::TalkingHeads<T>(w, o).forward(in, ws);
      EXPECT_TRUE(all_close("talking_heads output", y, th_ref(w, o, xq, xk, B, pad).output, default_tolerance<T>()));
    }
    {
      headmix::CollabHeadWeights<T> w;
      w.q = random_matrix<T>(rng, 4, D, 1.0), w.k = random_matrix<T>(rng, 4, Dkv, 1.0), w.mixing = random_matrix<T>(rng, 2, 4, 1.0);
      w.v = random_linear<T>(rng, 4, Dkv), w.o = random_linear<T>(rng, 3, 4);
      headmix::CollabHeadOptions o;
      o.num_heads = 2, o.causal = true, o.causal_offset = offset;
      headmix::Workspace<T> ws;
      const Tensor<T> y = headmix::CollabHead<T>(w, o).forward(in, ws);
      EXPECT_TRUE(all_close("collab output", y, collab_ref(w, o, xq, xk, B, pad).output, default_tolerance<T>()));
    }
  }
  {
    headmix::LshWeights<T> w;
    w.qk = random_linear<T>(rng, 4, D, false), w.v = random_linear<T>(rng, 4, D), w.o = random_linear<T>(rng, 3, 4);
    headmix::LshOptions o;
    o.num_heads = 2, o.bucket_size = 2, o.n_hashes = 3, o.seed = 3;
    headmix::Workspace<T> ws;
    const Tensor<T> y = headmix::Lsh<T>(w, o).forward({{xq.data(), B, 1, D}, {}, {}}, ws);
    std::vector<double> want;
    for (Index b = 0; b < B; ++b) {
      const auto out = affine(w.o, affine(w.v, row_of(xq, b)));
      want.insert(want.end(), out.begin(), out.end());
    }
    EXPECT_TRUE(all_close("lsh output", y, want, default_tolerance<T>()));
  }
  {
    const headmix::DcmhaWeights<T> w = dcmha_weights<T>(rng, D, 4, 2, 1, 3, 2, 2, 3, true);
    headmix::DcmhaOptions o;
    o.num_heads = 4, o.groups = 2, o.rank = 1, o.static_w = true, o.causal = true;
    const headmix::Dcmha<T> layer(w, o);
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = layer.forward({{xq.data(), B, 1, D}, {}, {}}, ws, &probs);
    const auto want = dcmha_ref(w, o, xq, B);
    EXPECT_TRUE(all_close("dcmha output", y, want.output, dcmha_tolerance<T>()));
    EXPECT_TRUE(all_close("dcmha weights", probs, want.probs, dcmha_tolerance<T>()));
    headmix::SequenceCache<T> cache(B, 1);
    const Tensor<T> stepped = layer.step({xq.data(), B, 1, D}, cache, ws);
    EXPECT_TRUE(all_close("dcmha step", stepped, want.output, dcmha_tolerance<T>()));
  }
}

// ---------------------------------------------------------------------------
// Fully masked rows: every key of item 1 padded, and (dense variants) a
// causal offset that hides every key from the first rows. The weights are
// exactly 0, the attention output 0, so the layer output is o.bias exactly
// (CollabHead with LayerNorm: LayerNorm(xq + o.bias)). LSH masks with finite
// values (lsh.md): its rows follow the reference, finite.

TYPED_TEST(Extremes, FullyMaskedRows) {
  using T = TypeParam;
  Rng rng(14);
  const Index B = 3, T_ = 6, S = 5, D = 4, Dkv = 3, Out = 4;
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  std::vector<std::uint8_t> pad(B * S, 0);
  std::fill(pad.begin() + S, pad.begin() + 2 * S, 1);
  const headmix::AttentionInput<T> in{{xq.data(), B, T_, D}, {xk.data(), B, S, Dkv}, {pad.data(), B, S}};
  // Rows (b, i) that see no key: item 1, and rows i < 2 under offset -2.
  auto masked = [&](Index b, Index i) { return b == 1 || i < 2; };
  auto expect_bias_rows = [&](const char* name, const Tensor<T>& y, const Tensor<T>& probs,
                              const headmix::Vector<T>& bias, Index heads) {
    EXPECT_TRUE(all_finite(name, y));
    for (Index b = 0; b < B; ++b)
      for (Index i = 0; i < T_; ++i) {
        if (!masked(b, i)) continue;
        for (Index c = 0; c < Out; ++c) EXPECT_EQ(y[(b * T_ + i) * Out + c], bias(c)) << name << " " << b << "," << i;
        for (Index h = 0; h < heads; ++h)
          for (Index j = 0; j < S; ++j) EXPECT_EQ(probs[((b * heads + h) * T_ + i) * S + j], T(0)) << name;
      }
  };
  {
    headmix::MhaWeights<T> w{random_linear<T>(rng, 6, D), random_linear<T>(rng, 6, Dkv), random_linear<T>(rng, 4, Dkv),
                             random_linear<T>(rng, Out, 4)};
    headmix::MhaOptions o;
    o.num_heads = 2, o.causal = true, o.causal_offset = -2, o.block_rows = 4, o.threads = 2;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::Mha<T>(w, o).forward(in, ws, &probs);
    expect_bias_rows("mha", y, probs, w.o.bias, 2);
    EXPECT_TRUE(all_close("mha output", y, mha_ref(w, o, xq, &xk, B, pad).output, default_tolerance<T>()));
  }
  {
    headmix::TalkingHeadsWeights<T> w;
    w.q = random_linear<T>(rng, 4, D), w.k = random_linear<T>(rng, 4, Dkv), w.v = random_linear<T>(rng, 6, Dkv);
    w.o = random_linear<T>(rng, Out, 6), w.pre_softmax = random_matrix<T>(rng, 3, 2, 1.0), w.post_softmax = random_matrix<T>(rng, 3, 3, 1.0);
    headmix::TalkingHeadsOptions o;
    o.num_heads = 3, o.key_heads = 2, o.causal = true, o.causal_offset = -2, o.block_rows = 4;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::TalkingHeads<T>(w, o).forward(in, ws, &probs);
    expect_bias_rows("talking_heads", y, probs, w.o.bias, 3);
    EXPECT_TRUE(all_close("talking_heads output", y, th_ref(w, o, xq, xk, B, pad).output, default_tolerance<T>()));
  }
  {
    headmix::CollabHeadWeights<T> w;
    w.q = random_matrix<T>(rng, 4, D, 1.0), w.k = random_matrix<T>(rng, 4, Dkv, 1.0), w.mixing = random_matrix<T>(rng, 2, 4, 1.0);
    w.content_bias = random_matrix<T>(rng, 2, Dkv, 1.0);
    w.v = random_linear<T>(rng, 4, Dkv), w.o = random_linear<T>(rng, Out, 4);
    headmix::CollabHeadOptions o;
    o.num_heads = 2, o.causal = true, o.causal_offset = -2, o.block_rows = 4;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::CollabHead<T>(w, o).forward(in, ws, &probs);
    expect_bias_rows("collab", y, probs, w.o.bias, 2);
    w.layer_norm.weight = random_matrix<T>(rng, D, 1, 1.0), w.layer_norm.bias = random_matrix<T>(rng, D, 1, 1.0);
    const Tensor<T> ln = headmix::CollabHead<T>(w, o).forward(in, ws);
    EXPECT_TRUE(all_finite("collab layer_norm", ln));
    EXPECT_TRUE(all_close("collab layer_norm output", ln, collab_ref(w, o, xq, xk, B, pad).output, default_tolerance<T>()));
  }
  {  // DCMHA, self-attention: item 1 fully padded
    const Index Tq = 5;
    const Matrix<T> x = random_matrix<T>(rng, B * Tq, D, 1.0);
    std::vector<std::uint8_t> p(B * Tq, 0);
    std::fill(p.begin() + Tq, p.begin() + 2 * Tq, 1);
    const headmix::DcmhaWeights<T> w = dcmha_weights<T>(rng, D, 4, 2, 2, 3, 2, 2, Out, true);
    headmix::DcmhaOptions o;
    o.num_heads = 4, o.groups = 2, o.rank = 2, o.static_w = true, o.causal = true, o.block_rows = 2;
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> y = headmix::Dcmha<T>(w, o).forward({{x.data(), B, Tq, D}, {}, {p.data(), B, Tq}}, ws, &probs);
    EXPECT_TRUE(all_finite("dcmha", y));
    for (Index i = 0; i < Tq; ++i)
      for (Index c = 0; c < Out; ++c) EXPECT_EQ(y[(1 * Tq + i) * Out + c], w.o.bias(c)) << "dcmha row " << i;
    for (Index h = 0; h < 4; ++h)
      for (Index e = 0; e < Tq * Tq; ++e) EXPECT_EQ(probs[(1 * 4 + h) * Tq * Tq + e], T(0));
    EXPECT_TRUE(all_close("dcmha output", y, dcmha_ref(w, o, x, B, p).output, dcmha_tolerance<T>()));
  }
  {  // LSH, item 1 fully padded
    const Index Tq = 8;
    const Matrix<T> x = random_matrix<T>(rng, B * Tq, D, 1.0);
    std::vector<std::uint8_t> p(B * Tq, 0);
    std::fill(p.begin() + Tq, p.begin() + 2 * Tq, 1);
    headmix::LshWeights<T> w;
    w.qk = random_linear<T>(rng, 4, D, false), w.v = random_linear<T>(rng, 4, D, false), w.o = random_linear<T>(rng, Out, 4);
    headmix::LshOptions o;
    o.num_heads = 2, o.bucket_size = 2, o.n_hashes = 2;
    safe_rotations(rng, w, o, x, B, p, 4);
    headmix::Workspace<T> ws;
    const Tensor<T> y = headmix::Lsh<T>(w, o).forward({{x.data(), B, Tq, D}, {}, {p.data(), B, Tq}}, ws);
    EXPECT_TRUE(all_finite("lsh", y));
    EXPECT_TRUE(all_close("lsh output", y, lsh_ref(w, o, x, B, p).output, default_tolerance<T>()));
  }
}

// Causal offsets at the ends of Index's range: the largest shows every key
// (the non-causal result), the smallest none (o.bias everywhere); also in
// flops(). Offsets this large are what "no limit" / "nothing" look like in
// code that computes them, e.g. from a cache position.
TYPED_TEST(Extremes, CausalOffsetsAtTheEndsOfTheRange) {
  using T = TypeParam;
  Rng rng(15);
  const Index B = 2, T_ = 5, S = 6, D = 4, Dkv = 3, Out = 3;
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  const headmix::AttentionInput<T> in{{xq.data(), B, T_, D}, {xk.data(), B, S, Dkv}, {}};
  const headmix::MhaWeights<T> w{random_linear<T>(rng, 4, D), random_linear<T>(rng, 4, Dkv), random_linear<T>(rng, 4, Dkv),
                                 random_linear<T>(rng, Out, 4)};
  headmix::MhaOptions o;
  o.num_heads = 2, o.block_rows = 2;
  headmix::Workspace<T> ws;
  const Tensor<T> open = headmix::Mha<T>(w, o).forward(in, ws);
  const auto open_flops = headmix::Mha<T>(w, o).flops(B, T_, S);
  o.causal = true;
  o.causal_offset = std::numeric_limits<Index>::max();
  const Tensor<T> all_visible = headmix::Mha<T>(w, o).forward(in, ws);
  EXPECT_TRUE(all_close("offset max", all_visible, widen(open.data(), open.size()), default_tolerance<T>()));
  EXPECT_EQ(headmix::Mha<T>(w, o).flops(B, T_, S).attention_macs, open_flops.attention_macs);
  o.causal_offset = std::numeric_limits<Index>::min();
  const Tensor<T> none_visible = headmix::Mha<T>(w, o).forward(in, ws);
  for (Index r = 0; r < B * T_; ++r)
    for (Index c = 0; c < Out; ++c) EXPECT_EQ(none_visible[r * Out + c], w.o.bias(c)) << r;
  EXPECT_EQ(headmix::Mha<T>(w, o).flops(B, T_, S).attention_macs, 0);
}

// ---------------------------------------------------------------------------
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

TYPED_TEST(Extremes, MhaRowOf65536Keys) {
  using T = TypeParam;
  Rng rng(16);
  const Index B = 1, T_ = 4, S = 65536, D = 4, Dkv = 4, H = 2, Out = 3;
  headmix::MhaWeights<T> w{random_linear<T>(rng, H * 2, D), random_linear<T>(rng, H * 2, Dkv), random_linear<T>(rng, H * 2, Dkv),
                           random_linear<T>(rng, Out, H * 2)};
  w.q.weight *= T(8);  // logits spread over about ±30: the max subtraction matters
  const Matrix<T> xq = random_matrix<T>(rng, B * T_, D, 1.0), xk = random_matrix<T>(rng, B * S, Dkv, 1.0);
  std::vector<std::uint8_t> pad(B * S, 0);
  for (Index j = 0; j < S; j += 5) pad[static_cast<std::size_t>(j)] = 1;
  headmix::MhaOptions o;
  // Decoder-like: row i sees keys j <= S - T - 1001 + i, and its last one is never padded.
  o.num_heads = H, o.causal = true, o.causal_offset = S - T_ - 1001;
  o.block_rows = T_;  // one block: every row's tile spans all 65536 keys
  const headmix::AttentionInput<T> in{{xq.data(), B, T_, D}, {xk.data(), B, S, Dkv}, {pad.data(), B, S}};
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = headmix::Mha<T>(w, o).forward(in, ws, &probs);
  const auto want = mha_ref(w, o, xq, &xk, B, pad);
  EXPECT_TRUE(all_finite("output", y));
  EXPECT_TRUE(all_close("weights", probs, want.probs, long_weight_tol<T>));
  EXPECT_TRUE(all_close("output", y, want.output, long_output_tol<T>));
  for (Index r = 0; r < B * H * T_; ++r) {
    double sum = 0;
    for (Index j = 0; j < S; ++j) sum += static_cast<double>(probs[r * S + j]);
    EXPECT_NEAR(sum, 1.0, (std::is_same_v<T, float> ? 1e-4 : 1e-12)) << "row " << r;
  }

  // All-equal logits over the whole row: weights exactly fl(1 / visible),
  // output o(mean of the visible values).
  w.k.weight.setZero();
  const Tensor<T> yu = headmix::Mha<T>(w, o).forward(in, ws, &probs);
  std::vector<double> want_u;
  for (Index i = 0; i < T_; ++i) {
    std::vector<double> mean(static_cast<std::size_t>(H * 2), 0.0);
    Index n = 0;
    for (Index j = 0; j <= i + o.causal_offset; ++j)
      if (!pad[static_cast<std::size_t>(j)]) {
        const auto v = affine(w.v, row_of(xk, j));
        for (std::size_t e = 0; e < mean.size(); ++e) mean[e] += v[e];
        ++n;
      }
    for (double& e : mean) e /= static_cast<double>(n);
    for (Index h = 0; h < H; ++h) {
      const T* row = probs.data() + (h * T_ + i) * S;
      EXPECT_EQ(row[0], T(0));  // padded
      EXPECT_EQ(row[1], T(1) / static_cast<T>(n));
      EXPECT_EQ(row[i + o.causal_offset], T(1) / static_cast<T>(n));
      EXPECT_EQ(row[i + o.causal_offset + 1], T(0));  // causally hidden
    }
    const auto out = affine(w.o, mean);
    want_u.insert(want_u.end(), out.begin(), out.end());
  }
  EXPECT_TRUE(all_close("uniform output", yu, want_u, long_output_tol<T>));
}

}  // namespace
