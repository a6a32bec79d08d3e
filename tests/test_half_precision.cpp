// MHA's half-precision decoding against naive double loops: a bfloat16
// cache (K and V rounded to nearest even) and bfloat16 weights give the
// loops' results over the rounded values to double's tolerance, a grouped
// cache's K in panels agrees with rows, and a bfloat16 cache stays within
// its stated bound of the full one (MHA and Talking-Heads).
//
// One of the promise tests: its products take other paths with AVX-512
// and AVX2 than in the sanitized build, so the builds users compile run it
// too (tests/CMakeLists.txt).
#include "decoding_util.hpp"
#include "test_util.hpp"
#include "variants.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using headmix::CachePrecision;
using headmix::SequenceCache;
using headmix::Workspace;

// A grouped bfloat16 cache holds K in panels: with AVX-512 a KV group's
// few rows stream over one panel at a time (multiply_few_rows), and more
// rows, or any without AVX-512, run a GEMM over a block of widened panels
// (for dk = 128 in double, one 64-position panel at a time); the layer with
// its K/V heads repeated streams K in rows. Both hold the same rounded keys
// and values, so their steps agree to the last bits, one token at a time
// (a KV group's 2 heads as 2 rows) and in steps of 3, 9 and 5 tokens (as
// many rows a head; 9 take the GEMM), with a window whose first key lies
// inside a panel past the first.
TEST(MhaDecoding, GroupedBfloat16KeysInPanelsAgreeWithRows) {
  mha_case::Shape s;
  s.B = 2, s.T = 150, s.D = 16, s.H = 4, s.Hkv = 2, s.Dk = 128, s.Dv = 5, s.out = 7, s.causal = true, s.window = 70;
  const auto p = mha_case::make_problem<double>(s, 71);
  const headmix::Mha<double> grouped = p.layer();
  auto options = p.options();
  options.num_kv_heads = 0;
  const headmix::Mha<double> expanded(with_repeated_kv(p.w, s.H, s.H, s.Hkv, s.Dk, s.Dv), options);
  const Tensor<double> x = query_tensor<variants::Mha>(p);
  {
    SequenceCache<double> cache(s.B, s.T, CachePrecision::bfloat16);
    Workspace<double> ws;
    Tensor<double> y({s.B, 1, s.out});
    grouped.step(slice(x, 0, 1).batch(), cache, y.batch(), ws);
    EXPECT_EQ(cache.key_layout(), headmix::KeyLayout::panels);
    EXPECT_TRUE(cache.is_half(0));
  }
  for (const std::vector<Index>& chunks : {std::vector<Index>{1}, std::vector<Index>{3, 9, 5}}) {
    const Tensor<double> got = decode(grouped, x, chunks, 0, CachePrecision::bfloat16).out;
    const Tensor<double> want = decode(expanded, x, chunks, 0, CachePrecision::bfloat16).out;
    const std::string what = "first step " + std::to_string(chunks[0]);
    EXPECT_TRUE(all_close(what.c_str(), got, widen(want), Tolerance{1e-13, 1e-13}));
  }
}

constexpr double kBf16Unit = 1.0 / 256;  // u: bfloat16 keeps 8 significant bits

double round_to_bfloat16(double x) { return double(static_cast<float>(Eigen::bfloat16(static_cast<float>(x)))); }

// y = x · Wᵀ + b in double, for one row.
template <class T>
std::vector<double> project_row(const headmix::Linear<T>& lin, const T* x) {
  std::vector<double> y(static_cast<std::size_t>(lin.out_features()));
  for (Index o = 0; o < lin.out_features(); ++o) {
    double s = lin.has_bias() ? double(lin.bias[o]) : 0.0;
    for (Index i = 0; i < lin.in_features(); ++i) s += double(lin.weight(o, i)) * double(x[i]);
    y[static_cast<std::size_t>(o)] = s;
  }
  return y;
}

// Causal grouped-query MHA over one sequence x [T, D] in double loops, with
// the projected keys and values passed through `store` (the cache's
// rounding); returns the outputs [T, out] and, per head, A = the largest
// Σ_i |q_i k_i| over visible pairs (scaled queries) and max |v|.
struct NaiveDecode {
  std::vector<double> y;
  double a_max = 0, v_max = 0;
};
template <class T, class Store>
NaiveDecode naive_causal_mha(const headmix::Mha<T>& layer, const T* x, Index T_, Store store) {
  const auto& w = layer.weights();
  const Index H = layer.num_heads(), Hkv = layer.num_kv_heads(), dk = layer.head_dim(), dv = layer.v_head_dim();
  const Index D = layer.embed_dim(), out = layer.out_dim();
  const double scale = double(layer.scale());
  std::vector<std::vector<double>> q, k, v;
  for (Index t = 0; t < T_; ++t) {
    q.push_back(project_row(w.q, x + t * D));
    k.push_back(project_row(w.k, x + t * D));
    v.push_back(project_row(w.v, x + t * D));
    for (double& e : k.back()) e = store(e);
    for (double& e : v.back()) e = store(e);
  }
  NaiveDecode r;
  r.y.assign(static_cast<std::size_t>(T_ * out), 0.0);
  for (Index t = 0; t < T_; ++t) {
    std::vector<double> ctx(static_cast<std::size_t>(H * dv), 0.0);
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / Hkv);
      std::vector<double> s(static_cast<std::size_t>(t + 1));
      double top = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j <= t; ++j) {
        double dot = 0, abs_dot = 0;
        for (Index i = 0; i < dk; ++i) {
          const double qi = scale * q[t][h * dk + i], ki = k[j][g * dk + i];
          dot += qi * ki;
          abs_dot += std::abs(qi * ki);
        }
        s[j] = dot;
        top = std::max(top, dot);
        r.a_max = std::max(r.a_max, abs_dot);
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - top));
      for (Index j = 0; j <= t; ++j)
        for (Index c = 0; c < dv; ++c) {
          ctx[h * dv + c] += s[j] / sum * v[j][g * dv + c];
          r.v_max = std::max(r.v_max, std::abs(v[j][g * dv + c]));
        }
    }
    const std::vector<double> y = project_row(w.o, ctx.data());
    std::copy(y.begin(), y.end(), r.y.begin() + t * out);
  }
  return r;
}

Tensor<double> to_double(const Tensor<float>& x) {
  Tensor<double> d(x.shape());
  for (Index i = 0; i < x.size(); ++i) d[i] = x[i];
  return d;
}

// ‖W‖_∞: the largest row sum of |W|.
template <class T>
double inf_norm(const Matrix<T>& w) {
  return w.template cast<double>().cwiseAbs().rowwise().sum().maxCoeff();
}

// A bfloat16 cache stores K and V rounded to nearest even and computes the
// rest as a full-precision cache does: steps equal naive double loops whose
// K and V are so rounded, to double's tolerance (a full cache: the loops
// as they stand). The head sizes reach every branch of a one-row step:
// dk = 3 and 11 (key rows eight at a time, and the rows left over), dv = 5
// and 70 (a bfloat16 readout's full 64-column chunk, and a narrower one).
// With a KV head per head (12), K lies in rows: one-token steps stream
// them, steps of 3, 9 and 5 tokens run them as few rows and as a GEMM.
// Grouped caches (4, 2, 1 KV heads) keep K in panels: one-token steps stack
// a KV group's 3, 6 or 12 heads as the rows of one product over them (up
// to 8 rows streaming over each panel with AVX-512, else a GEMM), and read
// V with the few-row product up to 8 rows, a GEMM past it. 70 positions
// pass 32-column chunks and fill a 64-position panel and part of the next.
TEST(HalfCache, StepsEqualNaiveLoopsOverRoundedKeysAndValues) {
  const Index T_ = 70;
  const auto identity = [](double e) { return e; };
  for (auto [dk, dv] : {std::pair{3, 5}, std::pair{11, 70}})
    for (int kv_heads : {12, 4, 2, 1}) {
      const auto p = gqa_problem<double>(kv_heads, 1, T_, 12, dk, dv, 7, 61, 12, 16);
      const headmix::Mha<double> layer = p.layer();
      const Tensor<double> x = query_tensor<variants::Mha>(p);
      const NaiveDecode unrounded = naive_causal_mha(layer, x.data(), T_, identity);
      for (const std::vector<Index>& chunks : {std::vector<Index>{1}, std::vector<Index>{3, 9, 5}})
        for (CachePrecision precision : {CachePrecision::full, CachePrecision::bfloat16}) {
          const bool half = precision == CachePrecision::bfloat16;
          const Tensor<double> y = decode(layer, x, chunks, 0, precision).out;
          const NaiveDecode want = half ? naive_causal_mha(layer, x.data(), T_, round_to_bfloat16) : unrounded;
          double worst = 0, rounding = 0;
          for (Index i = 0; i < y.size(); ++i) {
            worst = std::max(worst, std::abs(y[i] - want.y[i]) / (1 + std::abs(want.y[i])));
            rounding = std::max(rounding, std::abs(want.y[i] - unrounded.y[i]));
          }
          const std::string what = "dk " + std::to_string(dk) + " dv " + std::to_string(dv) + " kv_heads " +
                                   std::to_string(kv_heads) + (half ? " bfloat16" : " full") + " first step " +
                                   std::to_string(chunks[0]);
          EXPECT_LE(worst, 1e-12) << what;
          if (half) {
            EXPECT_GT(rounding, 1e-6) << what << ": the rounding must be visible for this test to mean anything";
          }
        }
    }
}

// With bfloat16 weights, MHA's steps (B = 1, one token: the weights read as
// bfloat16) equal naive double loops over the layer's weights, which are
// now bfloat16 values, over a full cache and over a bfloat16 one (its K and
// V rounded as well), to double's tolerance.
TEST(HalfWeights, StepsEqualNaiveLoopsOverTheRoundedWeights) {
  const Index T_ = 11;
  const auto identity = [](double e) { return e; };
  for (int kv_heads : {4, 1}) {
    const auto p = gqa_problem<double>(kv_heads, 1, T_, 12, 11, 70, 7, 62);
    headmix::Mha<double> layer = p.layer();
    const Tensor<double> x = query_tensor<variants::Mha>(p);
    const NaiveDecode unrounded = naive_causal_mha(layer, x.data(), T_, identity);
    auto options = layer.options();
    options.bfloat16_weights = true;
    layer.set_options(options);
    const auto& w = layer.weights();
    for (const auto* lin : {&w.q, &w.k, &w.v, &w.o})
      for (Index i = 0; i < lin->weight.size(); ++i)
        ASSERT_EQ(lin->weight.data()[i], round_to_bfloat16(lin->weight.data()[i])) << "weight " << i;
    for (CachePrecision precision : {CachePrecision::full, CachePrecision::bfloat16}) {
      const bool half = precision == CachePrecision::bfloat16;
      const Tensor<double> y = decode(layer, x, {1}, 0, precision).out;
      const NaiveDecode want = half ? naive_causal_mha(layer, x.data(), T_, round_to_bfloat16)
                                    : naive_causal_mha(layer, x.data(), T_, identity);
      double worst = 0, rounding = 0;
      for (Index i = 0; i < y.size(); ++i) {
        worst = std::max(worst, std::abs(y[i] - want.y[i]) / (1 + std::abs(want.y[i])));
        rounding = std::max(rounding, std::abs(want.y[i] - unrounded.y[i]));
      }
      EXPECT_LE(worst, 1e-12) << "kv_heads " << kv_heads << (half ? " bfloat16 cache" : " full cache");
      EXPECT_GT(rounding, 1e-6) << "the rounding must be visible for this test to mean anything";
    }
  }
}

// Against the full-precision cache, in float: within the stated bound
// ‖W_o‖_∞ · ((e^(2u·A) − 1)(1 + u) + u) · max|v| (core/sequence_cache.hpp),
// plus the float tolerance of the other decoding tests. Talking-Heads: the
// same with A scaled by ‖pre‖_∞ and the whole by ‖post‖_∞ (the mixes are
// linear maps over heads).
TEST(HalfCache, StepsStayWithinTheirBoundOfTheFullCache) {
  const Index T_ = 24, D = 16;
  const double u = kBf16Unit, float_tol = variants::VariantBase::step_tolerance<float>().rtol;
  auto bound_of = [&](double a, double v_max, double wo, double pre, double post) {
    return wo * post * ((std::exp(2 * u * pre * a) - 1) * (1 + u) + u) * v_max;
  };
  auto check = [&](const auto& layer, double bound, const Tensor<float>& x, const std::string& what) {
    const Tensor<float> full = decode(layer, x, {1}).out;
    const Tensor<float> half = decode(layer, x, {1}, 0, CachePrecision::bfloat16).out;
    double worst = 0, excess = 0;
    for (Index i = 0; i < full.size(); ++i) {
      const double diff = std::abs(double(half[i]) - double(full[i]));
      worst = std::max(worst, diff);
      excess = std::max(excess, diff - bound - float_tol * (1 + std::abs(double(full[i]))));
    }
    EXPECT_LE(excess, 0.0) << what << ": worst difference " << worst << ", bound " << bound;
    EXPECT_GT(worst, 0.0) << what << ": the half-precision cache changed nothing";
  };
  for (int kv_heads : {4, 1}) {
    const auto p = gqa_problem<float>(kv_heads, 1, T_, D, 8, 8, 8, 62);
    const headmix::Mha<float> layer = p.layer();
    const Tensor<float> x = query_tensor<variants::Mha>(p);
    const auto& w = layer.weights();
    const headmix::Mha<double> exact(
        headmix::MhaWeights<double>{w.q.cast<double>(), w.k.cast<double>(), w.v.cast<double>(), w.o.cast<double>()},
        layer.options());
    const NaiveDecode r = naive_causal_mha(exact, to_double(x).data(), T_, [](double e) { return e; });
    check(layer, bound_of(r.a_max, r.v_max, inf_norm(w.o.weight), 1, 1), x, "mha kv_heads=" + std::to_string(kv_heads));
  }
  // Talking-Heads: A and max|v| of the key heads, from an MHA over the same
  // q/k (value heads: v); the mixes' norms scale them.
  th_case::Shape s;
  s.B = 1, s.T = T_, s.D = D, s.Hk = 4, s.H = 3, s.Hv = 4, s.Dk = 8, s.Dv = 8, s.out = 8, s.causal = true;
  const auto p = th_case::make_problem<float>(s, 63);
  const headmix::TalkingHeads<float> th = p.layer();
  const auto& w = th.weights();
  headmix::MhaOptions mo;
  mo.num_heads = 4;
  mo.causal = true;
  const headmix::Mha<double> qk(
      headmix::MhaWeights<double>{w.q.cast<double>(), w.k.cast<double>(), w.v.cast<double>(), w.o.cast<double>()}, mo);
  const Tensor<float> x = query_tensor<variants::TalkingHeads>(p);
  const NaiveDecode r = naive_causal_mha(qk, to_double(x).data(), T_, [](double e) { return e; });
  check(th, bound_of(r.a_max, r.v_max, inf_norm(w.o.weight), inf_norm(w.pre_softmax), inf_norm(w.post_softmax)), x,
        "talking_heads");
}

}  // namespace
