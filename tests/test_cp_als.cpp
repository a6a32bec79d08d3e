// CP-ALS (decomp/cp_als.hpp) and the MHA -> CollabHead conversion
// (decomp/mha_to_collab.hpp).
//
// Expected values come from the naive loops in tests/reference/
// (collab_reference.hpp: dense tensors, MTTKRP, Gram matrices,
// reconstruction; mha_reference.hpp: the MHA the conversion must
// reproduce) or from the conformance files (collab_reparam/*), never from
// headmix itself.
//
// Tolerances are stated per test. Exactness claims (the full-rank copy) use
// the mha float64 conformance tolerance, rtol 1e-9 / atol 1e-12.

#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "cases/ref_adapters.hpp"
#include "headmix/decomp/cp_als.hpp"
#include "headmix/decomp/mha_to_collab.hpp"
#include "headmix/io/safetensors.hpp"
#include "reference/collab_reference.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;

namespace decomp = headmix::decomp;

// ---------------------------------------------------------------------------
// Helpers

Tensor<double> to_tensor(const headmix_ref::RefTensor3& t) {
  Tensor<double> out({t.I, t.J, t.K});
  std::copy(t.data.begin(), t.data.end(), out.data());
  return out;
}

headmix_ref::RefTensor3 to_ref(const Tensor<double>& t) {
  return {static_cast<int>(t.dim(0)), static_cast<int>(t.dim(1)), static_cast<int>(t.dim(2)),
          std::vector<double>(t.data(), t.data() + t.size())};
}

// A dense tensor of exact CP rank R (Gaussian factors).
headmix_ref::RefTensor3 low_rank_tensor(Rng& rng, int I, int J, int K, int R) {
  const auto a = normal_matrix<double>(rng, I, R), b = normal_matrix<double>(rng, J, R), c = normal_matrix<double>(rng, K, R);
  return headmix_ref::cp_reconstruct_reference(widen(a), widen(b), widen(c), I, J, K, R);
}

headmix_ref::RefTensor3 reconstruct(const std::array<Matrix<double>, 3>& f) {
  return headmix_ref::cp_reconstruct_reference(widen(f[0]), widen(f[1]), widen(f[2]), static_cast<int>(f[0].rows()),
                                               static_cast<int>(f[1].rows()), static_cast<int>(f[2].rows()),
                                               static_cast<int>(f[0].cols()));
}

// |got - want| <= atol + rtol |want| for every entry.
::testing::AssertionResult all_close(const std::vector<double>& got, const std::vector<double>& want, double rtol,
                                     double atol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i])))
      return ::testing::AssertionFailure() << "index " << i << ": got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// The two tensor representations against naive loops. Tolerance rtol 1e-12,
// atol 1e-12 · max: sums of <= a few hundred O(1) products in double.

// Every quantity a tensor representation `op` computes, held to the naive
// loops on its dense form `ref`: the squared norm, the Gram matrix and the
// MTTKRP of each mode, and the inner product and residual with the CP
// factors f. Gram and MTTKRP tolerance: rtol 1e-12, atol `atol`.
template <class Op>
void expect_ops_match_naive(const Op& op, const headmix_ref::RefTensor3& ref, const std::array<Matrix<double>, 3>& f,
                            double atol) {
  const int R = static_cast<int>(f[0].cols());
  double norm2 = 0;
  for (double x : ref.data) norm2 += x * x;
  EXPECT_NEAR(op.norm_squared(), norm2, 1e-12 * norm2);
  std::array<Matrix<double>, 3> p;
  for (int n = 0; n < 3; ++n) p[n] = op.project(n, f[n]);
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE("mode " + std::to_string(mode));
    EXPECT_TRUE(all_close(widen(op.gram(mode)), headmix_ref::unfolding_gram_reference(ref, mode), 1e-12, atol));
    const auto want = headmix_ref::mttkrp_reference(ref, mode == 0 ? std::vector<double>{} : widen(f[0]),
                                                    mode == 1 ? std::vector<double>{} : widen(f[1]),
                                                    mode == 2 ? std::vector<double>{} : widen(f[2]), R, mode);
    EXPECT_TRUE(all_close(widen(op.mttkrp(mode, p)), want, 1e-12, atol));
  }
  const auto approx = reconstruct(f);
  double inner = 0, resid = 0;
  for (std::size_t i = 0; i < ref.data.size(); ++i) {
    inner += ref.data[i] * approx.data[i];
    resid += (ref.data[i] - approx.data[i]) * (ref.data[i] - approx.data[i]);
  }
  EXPECT_NEAR(op.inner(p), inner, 1e-11 * std::abs(inner) + 1e-11);
  EXPECT_NEAR(op.residual_squared(f), resid, 1e-11 * resid);
}

TEST(CpTensorOps, DenseTensorMatchesNaiveLoops) {
  Rng rng(1);
  const int I = 5, J = 4, K = 6, R = 3;
  headmix_ref::RefTensor3 ref{I, J, K, widen(normal_matrix<double>(rng, 1, I * J * K))};
  const Tensor<double> t = to_tensor(ref);
  const decomp::DenseTensor3<double> op(t);
  std::array<Matrix<double>, 3> f = {normal_matrix<double>(rng, I, R), normal_matrix<double>(rng, J, R),
                                     normal_matrix<double>(rng, K, R)};
  expect_ops_match_naive(op, ref, f, 1e-11);
  EXPECT_TRUE(all_close(to_ref(decomp::cp_reconstruct(f)).data, reconstruct(f).data, 1e-12, 1e-12));
}

// SliceProductTensor never forms T; every quantity must still equal the
// naive one computed from the dense T[q, h, k] = Σ_d WQ[h·Dk+d, q] WK[h·Dk+d, k].
TEST(CpTensorOps, SliceProductTensorMatchesItsDenseForm) {
  Rng rng(2);
  const int D = 7, Dkv = 5, H = 3, Dk = 2, R = 4;
  const Matrix<double> wq = normal_matrix<double>(rng, H * Dk, D), wk = normal_matrix<double>(rng, H * Dk, Dkv);
  const decomp::SliceProductTensor<double> op(wq, wk, H);
  EXPECT_EQ(op.dim(0), D);
  EXPECT_EQ(op.dim(1), H);
  EXPECT_EQ(op.dim(2), Dkv);
  EXPECT_EQ(op.slice_rank(), Dk);
  const auto ref = headmix_ref::mha_bilinear_tensor(widen(wq), widen(wk), H, Dk, D, Dkv);
  std::array<Matrix<double>, 3> f = {normal_matrix<double>(rng, D, R), normal_matrix<double>(rng, H, R),
                                     normal_matrix<double>(rng, Dkv, R)};
  expect_ops_match_naive(op, ref, f, 1e-10);
}

// slice_svd(j) of both representations: slice j = left · diag(values) · rightᵀ
// (against the naive dense slice), orthonormal columns, values non-increasing.
// Tolerance 1e-12 relative: one SVD of a small matrix.
TEST(CpTensorOps, SliceSvdOfBothForms) {
  Rng rng(21);
  const int D = 7, Dkv = 5, H = 3, Dk = 3;
  const Matrix<double> wq = normal_matrix<double>(rng, H * Dk, D), wk = normal_matrix<double>(rng, H * Dk, Dkv);
  const auto ref = headmix_ref::mha_bilinear_tensor(widen(wq), widen(wk), H, Dk, D, Dkv);
  const Tensor<double> dense_t = to_tensor(ref);
  const decomp::SliceProductTensor<double> sliced(wq, wk, H);
  const decomp::DenseTensor3<double> dense(dense_t);
  for (int h = 0; h < H; ++h) {
    std::vector<double> want;
    for (int q = 0; q < D; ++q)
      for (int k = 0; k < Dkv; ++k) want.push_back(ref.at(q, h, k));
    for (const auto& svd : {sliced.slice_svd(h), dense.slice_svd(h)}) {
      ASSERT_EQ(svd.left.rows(), D);
      ASSERT_EQ(svd.right.rows(), Dkv);
      const Matrix<double> rebuilt = svd.left * svd.values.asDiagonal() * svd.right.transpose();
      EXPECT_TRUE(all_close(widen(rebuilt), want, 1e-12, 1e-12));
      EXPECT_TRUE((svd.left.transpose() * svd.left).isIdentity(1e-12));
      EXPECT_TRUE((svd.right.transpose() * svd.right).isIdentity(1e-12));
      for (Index k = 1; k < svd.values.size(); ++k) EXPECT_LE(svd.values(k), svd.values(k - 1));
    }
    EXPECT_NEAR(sliced.slice_svd(h).values(0), dense.slice_svd(h).values(0), 1e-12 * dense.slice_svd(h).values(0));
  }
}

// ---------------------------------------------------------------------------
// CP-ALS behaviour

// An exactly rank-R tensor is fitted to round-off. Bound 1e-8: ALS from the
// HOSVD start converges linearly to the unique decomposition of a generic
// rank-3 tensor; 1e-8 is far above round-off (1e-15) and far below any
// non-fit.
TEST(CpAls, RecoversAnExactlyLowRankTensor) {
  Rng rng(3);
  for (const auto& dims : std::vector<std::array<int, 3>>{{6, 5, 7}, {4, 9, 3}, {8, 2, 8}}) {
    SCOPED_TRACE(std::to_string(dims[0]) + "x" + std::to_string(dims[1]) + "x" + std::to_string(dims[2]));
    const int R = 2;
    const auto ref = low_rank_tensor(rng, dims[0], dims[1], dims[2], R);
    for (auto init : {decomp::CpInit::slice_svd, decomp::CpInit::hosvd, decomp::CpInit::random}) {
      decomp::CpAlsOptions o;
      o.tolerance = 1e-14, o.init = init, o.max_iterations = 2000;
      const auto result = decomp::cp_als(to_tensor(ref), R, o);
      EXPECT_LT(result.relative_error, 1e-8) << "init " << static_cast<int>(init);
      EXPECT_LT(headmix_ref::relative_difference(ref.data, reconstruct(result.factors).data), 1e-8);
      EXPECT_TRUE(result.converged);
    }
  }
}

// relative_error is ‖T − T̂‖/‖T‖ of the factors returned, and the returned
// columns are balanced (same norm in all three factors).
TEST(CpAls, ReportsTheErrorOfTheFactorsItReturns) {
  Rng rng(4);
  headmix_ref::RefTensor3 ref{6, 4, 5, widen(normal_matrix<double>(rng, 1, 120))};
  for (bool line_search : {true, false})
    for (auto init : {decomp::CpInit::slice_svd, decomp::CpInit::hosvd, decomp::CpInit::random}) {
      decomp::CpAlsOptions o;
      o.max_iterations = 30, o.line_search = line_search, o.init = init;
      const auto result = decomp::cp_als(to_tensor(ref), 3, o);
      const double want = headmix_ref::relative_difference(ref.data, reconstruct(result.factors).data);
      EXPECT_NEAR(result.relative_error, want, 1e-12);
      ASSERT_EQ(result.error_history.size(), static_cast<std::size_t>(result.iterations));
      EXPECT_NEAR(result.error_history.back(), want, 1e-9);  // the in-loop formula, before balancing
      for (Index r = 0; r < 3; ++r) {
        EXPECT_NEAR(result.factors[0].col(r).norm(), result.factors[1].col(r).norm(), 1e-10);
        EXPECT_NEAR(result.factors[0].col(r).norm(), result.factors[2].col(r).norm(), 1e-10);
      }
    }
}

// Each ALS update is a least-squares optimum and the line search only
// accepts improvements, so the error never goes up (up to round-off).
TEST(CpAls, ErrorNeverIncreases) {
  Rng rng(5);
  headmix_ref::RefTensor3 ref{8, 5, 7, widen(normal_matrix<double>(rng, 1, 280))};
  for (bool line_search : {true, false}) {
    decomp::CpAlsOptions o;
    o.max_iterations = 200, o.tolerance = 0, o.line_search = line_search;
    const auto result = decomp::cp_als(to_tensor(ref), 4, o);
    EXPECT_EQ(result.iterations, 200);
    EXPECT_FALSE(result.converged);
    for (std::size_t k = 1; k < result.error_history.size(); ++k)
      EXPECT_LE(result.error_history[k], result.error_history[k - 1] + 1e-13) << "sweep " << k + 1;
  }
}

TEST(CpAls, DeterministicGivenTheSeed) {
  Rng rng(6);
  headmix_ref::RefTensor3 ref{5, 3, 4, widen(normal_matrix<double>(rng, 1, 60))};
  const Tensor<double> t = to_tensor(ref);
  decomp::CpAlsOptions o;
  o.max_iterations = 25, o.init = decomp::CpInit::random, o.seed = 11;
  const auto a = decomp::cp_als(t, 3, o), b = decomp::cp_als(t, 3, o);
  for (int n = 0; n < 3; ++n)
    EXPECT_EQ(std::memcmp(a.factors[n].data(), b.factors[n].data(), sizeof(double) * a.factors[n].size()), 0);
  EXPECT_EQ(a.error_history, b.error_history);
  o.seed = 12;
  const auto c = decomp::cp_als(t, 3, o);
  EXPECT_NE(a.error_history, c.error_history);
  // The SVD starts pad with seeded columns when R exceeds what they supply
  // (HOSVD: a mode's size; slice SVD: 3 slices of rank 4 = 12 triplets).
  for (auto init : {decomp::CpInit::hosvd, decomp::CpInit::slice_svd}) {
    o.init = init, o.seed = 1;
    const auto d = decomp::cp_als(t, 14, o), e = decomp::cp_als(t, 14, o);
    EXPECT_EQ(d.error_history, e.error_history);
    EXPECT_TRUE(std::isfinite(d.relative_error));
    o.seed = 2;
    EXPECT_NE(decomp::cp_als(t, 14, o).error_history, d.error_history);
  }
  o.seed = 3;  // R within what the slices supply: the seed plays no part
  EXPECT_EQ(decomp::cp_als(t, 5, o).error_history, [&] {
    o.seed = 4;
    return decomp::cp_als(t, 5, o).error_history;
  }());
}

TEST(CpAls, IterationCapAndTolerance) {
  Rng rng(7);
  headmix_ref::RefTensor3 ref{7, 6, 5, widen(normal_matrix<double>(rng, 1, 210))};
  const Tensor<double> t = to_tensor(ref);
  decomp::CpAlsOptions o;
  o.max_iterations = 7, o.tolerance = 0;
  auto r = decomp::cp_als(t, 3, o);
  EXPECT_EQ(r.iterations, 7);
  EXPECT_EQ(r.error_history.size(), 7u);
  EXPECT_FALSE(r.converged);
  o.max_iterations = 500, o.tolerance = 1.0;  // any change is below 1: stops after the second sweep
  r = decomp::cp_als(t, 3, o);
  EXPECT_EQ(r.iterations, 2);
  EXPECT_TRUE(r.converged);
  o.tolerance = 1e-6;
  r = decomp::cp_als(t, 3, o);
  ASSERT_GE(r.iterations, 2);
  if (r.converged) {
    const auto& h = r.error_history;
    EXPECT_LT(std::abs(h[h.size() - 2] - h.back()), 1e-6);
  }
  o.max_iterations = 0, o.init = decomp::CpInit::random;  // the initialisation itself
  r = decomp::cp_als(t, 3, o);
  EXPECT_EQ(r.iterations, 0);
  EXPECT_NEAR(r.relative_error, headmix_ref::relative_difference(ref.data, reconstruct(r.factors).data), 1e-12);
}

TEST(CpAls, ZeroTensorGivesZeroFactors) {
  const Tensor<double> t({3, 4, 5});
  Tensor<double> zero = t;
  zero.set_zero();
  const auto r = decomp::cp_als(zero, 2);
  EXPECT_EQ(r.relative_error, 0.0);
  EXPECT_TRUE(r.converged);
  for (int n = 0; n < 3; ++n) EXPECT_TRUE(r.factors[n].isZero(0));
  EXPECT_EQ(r.factors[1].rows(), 4);
}

// Rank beyond every mode's size: the normal equations become singular and
// the pseudo-inverse path keeps everything finite, and the fit is at least
// as good as at a lower rank.
TEST(CpAls, RankLargerThanTheModes) {
  Rng rng(8);
  headmix_ref::RefTensor3 ref{3, 2, 4, widen(normal_matrix<double>(rng, 1, 24))};
  decomp::CpAlsOptions o;
  o.max_iterations = 300;
  const auto low = decomp::cp_als(to_tensor(ref), 2, o);
  const auto high = decomp::cp_als(to_tensor(ref), 7, o);
  for (int n = 0; n < 3; ++n) EXPECT_TRUE(high.factors[n].allFinite());
  EXPECT_LE(high.relative_error, low.relative_error + 1e-12);
}

TEST(CpAls, SliceProductAndDenseFormsGiveTheSameFit) {
  Rng rng(9);
  const int D = 6, H = 3, Dk = 2, R = 3;
  const Matrix<double> wq = normal_matrix<double>(rng, H * Dk, D), wk = normal_matrix<double>(rng, H * Dk, D);
  const auto ref = headmix_ref::mha_bilinear_tensor(widen(wq), widen(wk), H, Dk, D, D);
  decomp::CpAlsOptions o;
  o.max_iterations = 40;
  const auto sliced = decomp::cp_als(decomp::SliceProductTensor<double>(wq, wk, H), R, o);
  const auto dense = decomp::cp_als(to_tensor(ref), R, o);
  // Same algorithm on the same tensor; only the summation order differs.
  EXPECT_NEAR(sliced.relative_error, dense.relative_error, 1e-8);
  EXPECT_EQ(sliced.iterations, dense.iterations);
}

// ---------------------------------------------------------------------------
// CP-ALS argument checks

// The shape_error message of `call` contains every further argument.
#define EXPECT_MESSAGE(call, ...) EXPECT_TRUE(mentions(shape_error_message([&] { call; }), {__VA_ARGS__}))

TEST(CpAlsBadInput, Arguments) {
  const Tensor<double> t({3, 4, 5});
  decomp::CpAlsOptions o;
  EXPECT_MESSAGE(decomp::cp_als(t, 0, o), "[cp_als] rank", "expected >= 1", "got 0");
  o.max_iterations = -1;
  EXPECT_MESSAGE(decomp::cp_als(t, 2, o), "[cp_als] max_iterations", "expected >= 0", "got -1");
  o.max_iterations = 10, o.tolerance = std::nan("");
  EXPECT_MESSAGE(decomp::cp_als(t, 2, o), "[cp_als] tolerance", "expected a finite number >= 0", "got nan");
  o.tolerance = -1;
  EXPECT_MESSAGE(decomp::cp_als(t, 2, o), "[cp_als] tolerance", "got -1");
  EXPECT_MESSAGE(decomp::cp_als(Tensor<double>({3, 4}), 2), "[cp_als] tensor", "expected a rank-3 tensor",
                 "got [3, 4]");
  EXPECT_MESSAGE(decomp::cp_als(Tensor<double>({3, 0, 5}), 2), "[cp_als] tensor", "got [3, 0, 5]");
  const Matrix<double> u = Matrix<double>::Ones(6, 4), v = Matrix<double>::Ones(6, 5);
  EXPECT_MESSAGE(decomp::SliceProductTensor<double>(u, v, 4), "[cp_als] u", "slices = 4", "got [6, 4]");
  EXPECT_MESSAGE(decomp::SliceProductTensor<double>(u, Matrix<double>::Ones(5, 5), 3), "[cp_als] v",
                 "expected [6, 5]", "got [5, 5]");
  EXPECT_MESSAGE(decomp::SliceProductTensor<double>(u, v, 0), "[cp_als] slices", "expected >= 1", "got 0");
  EXPECT_MESSAGE(decomp::SliceProductTensor<double>(u, Matrix<double>(6, 0), 3), "[cp_als] v", "K >= 1",
                 "got [6, 0]");
}

// ---------------------------------------------------------------------------
// MHA -> CollabHead

template <class Sc>
struct MhaSetup {
  int B = 2, T = 6, S = 6, D = 12, Dkv = 12, H = 3, Dk = 4, Dv = 3, out = 9;
  bool cross = false, causal = false;
  double scale = 0;  // 0: MHA default 1/sqrt(Dk)
  headmix::MhaWeights<Sc> w;
  Matrix<Sc> xq, xk;
  std::vector<std::uint8_t> padding;

  headmix::MhaOptions options() const {
    headmix::MhaOptions o;
    o.num_heads = H;
    o.causal = causal;
    if (scale != 0) o.scale = scale;
    return o;
  }
  headmix::AttentionInput<Sc> input() const {
    headmix::AttentionInput<Sc> in;
    in.query = headmix::ConstBatchView<Sc>(xq.data(), B, T, D);
    if (cross) in.key = headmix::ConstBatchView<Sc>(xk.data(), B, S, Dkv);
    if (!padding.empty()) in.key_padding = {padding.data(), B, S};
    return in;
  }
  headmix_ref::RefMhaResult reference() const {
    headmix_ref::RefMhaWeights rw{ref_linear(w.q), ref_linear(w.k), ref_linear(w.v), ref_linear(w.o)};
    headmix_ref::RefMhaOptions ro;
    ro.num_heads = H, ro.causal = causal, ro.scale = scale;
    const auto q = ref_batch(xq, B);
    if (!cross) return headmix_ref::mha_reference(rw, ro, q, nullptr, padding);
    const auto k = ref_batch(xk, B);
    return headmix_ref::mha_reference(rw, ro, q, &k, padding);
  }
  Tensor<Sc> collab_output(const decomp::MhaToCollabResult<Sc>& c, Tensor<Sc>* probs = nullptr) const {
    const headmix::CollabHead<Sc> layer(c.weights, c.options);
    headmix::Workspace<Sc> ws;
    return layer.forward(input(), ws, probs);
  }
};

template <class T>
headmix::Linear<T> linear(Rng& rng, int out, int in, bool bias) {
  headmix::Linear<T> lin{normal_matrix<T>(rng, out, in, 1.0 / std::sqrt(double(in))), {}};
  if (bias) lin.bias = normal_matrix<T>(rng, out, 1, 0.5);
  return lin;
}

template <class T>
MhaSetup<T> random_mha(unsigned seed, MhaSetup<T> s = {}) {
  if (!s.cross) s.S = s.T, s.Dkv = s.D;
  Rng rng(seed);
  s.w.q = linear<T>(rng, s.H * s.Dk, s.D, true);
  s.w.k = linear<T>(rng, s.H * s.Dk, s.Dkv, true);
  s.w.v = linear<T>(rng, s.H * s.Dv, s.Dkv, true);
  s.w.o = linear<T>(rng, s.out, s.H * s.Dv, true);
  s.xq = normal_matrix<T>(rng, s.B * s.T, s.D);
  if (s.cross) s.xk = normal_matrix<T>(rng, s.B * s.S, s.Dkv);
  return s;
}

// R = H·Dk copies the layer: the converted CollabHead gives the MHA's output
// and weights within the mha float64 tolerance (rtol 1e-9, atol 1e-12), and
// float within the float test tolerance (rtol 2e-4, atol 2e-5).
HEADMIX_TYPED_OVER_SCALARS(MhaToCollabTyped);

TYPED_TEST(MhaToCollabTyped, FullRankCopyMatchesTheMha) {
  using T = TypeParam;
  const double rtol = std::is_same_v<T, double> ? 1e-9 : 2e-4, atol = std::is_same_v<T, double> ? 1e-12 : 2e-5;
  std::vector<MhaSetup<T>> setups(4);
  setups[1].cross = true, setups[1].S = 9, setups[1].Dkv = 7, setups[1].causal = true;
  setups[2].scale = 0.7;  // a custom MHA scale is kept too
  setups[3].H = 4, setups[3].Dk = 5, setups[3].D = 10, setups[3].T = 7;  // H·Dk = 20 != D
  for (std::size_t n = 0; n < setups.size(); ++n) {
    SCOPED_TRACE("setup " + std::to_string(n));
    auto s = random_mha<T>(100 + static_cast<unsigned>(n), setups[n]);
    if (n == 1) s.padding = {0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0};
    const auto c = decomp::mha_to_collab(s.w, s.options(), s.H * s.Dk);
    EXPECT_TRUE(c.exact);
    EXPECT_EQ(c.relative_error, 0.0);
    EXPECT_EQ(c.iterations, 0);
    Tensor<T> probs;
    const Tensor<T> out = s.collab_output(c, &probs);
    const auto want = s.reference();
    EXPECT_TRUE(all_close(std::vector<double>(out.data(), out.data() + out.size()), want.output, rtol, atol));
    EXPECT_TRUE(all_close(std::vector<double>(probs.data(), probs.data() + probs.size()), want.probs, rtol, atol));
  }
}

// The copy's weights: q, k as in the MHA, block mixing (times the scale
// compensation), content_bias[h] = bQ_hᵀ WK_h, values and output unchanged;
// each head reads only its own Dk shared columns.
TEST(MhaToCollab, FullRankCopyWeights) {
  auto s = random_mha<double>(110);
  s.scale = 0.3;
  const auto c = decomp::mha_to_collab(s.w, s.options(), s.H * s.Dk);
  const double comp = 0.3 * std::sqrt(double(s.Dk));  // s_mha / (1/sqrt(R/H)), R/H = Dk
  EXPECT_NEAR(c.scale_compensation, comp, 1e-15);
  EXPECT_FALSE(c.options.scale.has_value());
  EXPECT_EQ(c.weights.q, s.w.q.weight);
  EXPECT_EQ(c.weights.k, s.w.k.weight);
  for (int h = 0; h < s.H; ++h)
    for (int r = 0; r < s.H * s.Dk; ++r) EXPECT_EQ(c.weights.mixing(h, r), r / s.Dk == h ? comp : 0.0);
  for (int h = 0; h < s.H; ++h)
    for (int k = 0; k < s.Dkv; ++k) {
      double want = 0;
      for (int d = 0; d < s.Dk; ++d) want += s.w.q.bias(h * s.Dk + d) * s.w.k.weight(h * s.Dk + d, k);
      EXPECT_NEAR(c.weights.content_bias(h, k), comp * want, 1e-14);
    }
  EXPECT_EQ(c.weights.v.weight, s.w.v.weight);
  EXPECT_EQ(c.weights.v.bias, s.w.v.bias);
  EXPECT_EQ(c.weights.o.weight, s.w.o.weight);
  EXPECT_EQ(c.weights.o.bias, s.w.o.bias);
  const headmix::CollabHead<double> layer(c.weights, c.options);
  for (int h = 0; h < s.H; ++h) EXPECT_EQ(layer.head_span(h), std::make_pair(Index(h * s.Dk), Index(s.Dk)));
  EXPECT_EQ(decomp::query_key_parameters(s.w), 2 * (s.H * s.Dk * s.D + s.H * s.Dk));
  EXPECT_EQ(decomp::query_key_parameters(c.weights), 2 * s.H * s.Dk * s.D + s.H * s.H * s.Dk + s.H * s.D);
}

// An MHA whose heads share R = H·Dk/2 directions exactly (each head a window
// of Dk of them): its bilinear tensor has CP rank R, so a good CP-ALS fits
// it to round-off and the converted layer reproduces the MHA. This is also
// the test of the scale compensation: left at epfml's uncompensated
// 1/sqrt(R/H) the same weights miss by percents.
//
// Bounds: rec_err < 1e-7 (an exact fit, ALS converges linearly); output
// relative error < 1e-6 (logits move by ~rec_err·|logit|).
TEST(MhaToCollab, ExactlySharedHeadsAreRecovered) {
  Rng rng(120);
  const int D = 16, H = 4, Dk = 4, R = H * Dk / 2, B = 2, T = 6, Dv = 4;
  const Matrix<double> a0 = normal_matrix<double>(rng, D, R, 0.5), b0 = normal_matrix<double>(rng, D, R, 0.5);
  const Matrix<double> m0 = normal_matrix<double>(rng, H, R);
  MhaSetup<double> s;
  s.B = B, s.T = s.S = T, s.D = s.Dkv = D, s.H = H, s.Dk = Dk, s.Dv = Dv, s.out = D;
  s.w.q.weight.resize(H * Dk, D);
  s.w.k.weight.resize(H * Dk, D);
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < Dk; ++d) {
      const int r = (h * Dk / 2 + d) % R;  // head h uses a window of Dk of the R shared directions
      s.w.q.weight.row(h * Dk + d) = m0(h, r) * a0.col(r).transpose();
      s.w.k.weight.row(h * Dk + d) = b0.col(r).transpose();
    }
  s.w.q.bias = normal_matrix<double>(rng, H * Dk, 1, 0.5);
  s.w.k.bias = normal_matrix<double>(rng, H * Dk, 1, 0.5);
  s.w.v = linear<double>(rng, H * Dv, D, true);
  s.w.o = linear<double>(rng, D, H * Dv, true);
  s.xq = normal_matrix<double>(rng, B * T, D);

  decomp::CpAlsOptions o;
  o.max_iterations = 3000, o.tolerance = 1e-15;
  const auto c = decomp::mha_to_collab(s.w, s.options(), R, o);
  EXPECT_FALSE(c.exact);
  EXPECT_LT(c.relative_error, 1e-7) << "after " << c.iterations << " sweeps";
  EXPECT_NEAR(c.scale_compensation, std::sqrt((double(R) / H) / Dk), 1e-15);

  const auto want = s.reference();
  const Tensor<double> got = s.collab_output(c);
  const double err = headmix_ref::relative_difference(want.output, std::vector<double>(got.data(), got.data() + got.size()));
  EXPECT_LT(err, 1e-6);

  auto as_is = c;  // epfml's swap.py: no compensation
  as_is.weights.mixing /= c.scale_compensation;
  as_is.weights.content_bias /= c.scale_compensation;
  const Tensor<double> wrong = s.collab_output(as_is);
  EXPECT_GT(headmix_ref::relative_difference(want.output, std::vector<double>(wrong.data(), wrong.data() + wrong.size())),
            1e-3);
}

// For R < H·Dk the converted q, mixing / c and k rebuild the CP of T whose
// error the result reports.
TEST(MhaToCollab, ConvertedWeightsAreTheDecomposition) {
  const auto s = random_mha<double>(130);
  decomp::CpAlsOptions o;
  o.max_iterations = 50;
  const int R = 5;
  const auto c = decomp::mha_to_collab(s.w, s.options(), R, o);
  EXPECT_EQ(c.iterations, 50);
  EXPECT_EQ(c.error_history.size(), 50u);
  const auto T_ref = headmix_ref::mha_bilinear_tensor(widen(s.w.q.weight), widen(s.w.k.weight), s.H, s.Dk, s.D, s.Dkv);
  const Matrix<double> a = c.weights.q.transpose(), m = c.weights.mixing / c.scale_compensation,
                       b = c.weights.k.transpose();
  const auto approx = headmix_ref::cp_reconstruct_reference(widen(a), widen(m), widen(b), s.D, s.H, s.Dkv, R);
  EXPECT_NEAR(headmix_ref::relative_difference(T_ref.data, approx.data), c.relative_error, 1e-10);
  EXPECT_GT(c.relative_error, 0.0);
  EXPECT_LT(c.relative_error, 1.0);
  EXPECT_EQ(c.weights.q.rows(), R);
  EXPECT_EQ(c.weights.k.rows(), R);
  EXPECT_EQ(c.weights.mixing.rows(), s.H);
}

// A float MHA converts through a double decomposition: its weights are the
// double conversion's rounded to float (rtol 1e-6: float rounding only).
TEST(MhaToCollab, FloatLayerConvertsInDouble) {
  const auto sd = random_mha<double>(140);
  headmix::MhaWeights<float> wf{sd.w.q.template cast<float>(), sd.w.k.template cast<float>(),
                                sd.w.v.template cast<float>(), sd.w.o.template cast<float>()};
  headmix::MhaWeights<double> wd{wf.q.cast<double>(), wf.k.cast<double>(), wf.v.cast<double>(), wf.o.cast<double>()};
  decomp::CpAlsOptions o;
  o.max_iterations = 20;
  const auto cf = decomp::mha_to_collab(wf, sd.options(), 6, o);
  const auto cd = decomp::mha_to_collab(wd, sd.options(), 6, o);
  EXPECT_EQ(cf.relative_error, cd.relative_error);
  EXPECT_TRUE(cf.weights.q.cast<double>().isApprox(cd.weights.q, 1e-6));
  EXPECT_TRUE(cf.weights.mixing.cast<double>().isApprox(cd.weights.mixing, 1e-6));
}

TEST(MhaToCollab, SharedDimOutOfRange) {
  const auto s = random_mha<double>(150);
  EXPECT_MESSAGE(decomp::mha_to_collab(s.w, s.options(), 0), "[mha_to_collab] shared_dim",
                 "expected 1 <= R <= num_heads * head_dim = 12", "got 0");
  EXPECT_MESSAGE(decomp::mha_to_collab(s.w, s.options(), 13), "[mha_to_collab] shared_dim", "got 13");
  auto broken = s.w;
  broken.k.weight.conservativeResize(11, s.D);
  EXPECT_MESSAGE(decomp::mha_to_collab(broken, s.options(), 6), "[mha]", "k.weight");
}

// ---------------------------------------------------------------------------
// The bars of conformance/collab_reparam.md on the shipped cases.

#ifndef HEADMIX_CONFORMANCE_DIR
#define HEADMIX_CONFORMANCE_DIR ""
#endif

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct ReparamCase {
  std::string name;
  headmix::MhaWeights<double> w;
  headmix::MhaOptions options;
  Tensor<double> query, expected;
  nlohmann::json reparam;
  Index H = 0, Dk = 0;
  double rtol = 1e-9, atol = 1e-12;

  double output_error(const decomp::MhaToCollabResult<double>& c) const {
    const headmix::CollabHead<double> layer(c.weights, c.options);
    headmix::Workspace<double> ws;
    const Tensor<double> out = layer.forward({query.batch(), {}, {}}, ws);
    return headmix_ref::relative_difference(std::vector<double>(expected.data(), expected.data() + expected.size()),
                                            std::vector<double>(out.data(), out.data() + out.size()));
  }
};

std::vector<ReparamCase> load_reparam_cases() {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(HEADMIX_CONFORMANCE_DIR) / "collab_reparam";
  std::vector<ReparamCase> cases;
  if (!fs::is_directory(dir)) return cases;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& path : files) {
    const auto f = headmix::io::load_safetensors(path.string());
    const auto config = nlohmann::json::parse(f.metadata.at("config"));
    ReparamCase c;
    c.name = path.stem().string();
    auto lin = [&](const std::string& n) {
      headmix::Linear<double> l{f.matrix<double>(n + ".weight"), {}};
      if (f.contains(n + ".bias")) l.bias = f.vector<double>(n + ".bias");
      return l;
    };
    c.w = {lin("q"), lin("k"), lin("v"), lin("o")};
    c.H = config.at("num_heads").get<Index>();
    c.Dk = config.at("head_dim").get<Index>();
    c.options.num_heads = c.H;
    c.query = f.get<double>("input.query");
    c.expected = f.get<double>("expected.output");
    c.reparam = nlohmann::json::parse(f.metadata.at("reparam"));
    c.rtol = std::stod(f.metadata.at("rtol"));
    c.atol = std::stod(f.metadata.at("atol"));
    cases.push_back(std::move(c));
  }
  return cases;
}

// Full rank: the copy path reproduces the torch MHA output of each case
// within the case's own float64 tolerance.
TEST(CollabReparamCases, FullRankCopyIsExact) {
  const auto cases = load_reparam_cases();
  if (cases.empty()) HEADMIX_CONFORMANCE_MISSING() << "no collab_reparam cases under " << HEADMIX_CONFORMANCE_DIR;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto conv = decomp::mha_to_collab(c.w, c.options, c.H * c.Dk);
    ASSERT_TRUE(conv.exact);
    const headmix::CollabHead<double> layer(conv.weights, conv.options);
    headmix::Workspace<double> ws;
    const Tensor<double> out = layer.forward({c.query.batch(), {}, {}}, ws);
    EXPECT_TRUE(all_close(std::vector<double>(out.data(), out.data() + out.size()),
                          std::vector<double>(c.expected.data(), c.expected.data() + c.expected.size()), c.rtol,
                          c.atol));
  }
}

// Half rank, at most 100 ALS sweeps, seeds 0..4: the median rec_err and the
// median output error (our layer keeps the MHA's scale, so it is compared
// with out_err_scale_fixed) are no worse than the reference's medians. With
// the default settings the planted cases reach <= 3e-3.
TEST(CollabReparamCases, HalfRankBeatsTheReference) {
  const auto cases = load_reparam_cases();
  if (cases.empty()) HEADMIX_CONFORMANCE_MISSING() << "no collab_reparam cases under " << HEADMIX_CONFORMANCE_DIR;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto& half = c.reparam.at("half");
    const Index R = half.at("shared_dim").get<Index>();
    ASSERT_EQ(R, c.H * c.Dk / 2);
    std::vector<double> rec, out;
    for (std::uint64_t seed = 0; seed < 5; ++seed) {
      decomp::CpAlsOptions o;
      o.max_iterations = 100;
      o.seed = seed;
      const auto conv = decomp::mha_to_collab(c.w, c.options, R, o);
      EXPECT_LE(conv.iterations, 100);
      rec.push_back(conv.relative_error);
      out.push_back(c.output_error(conv));
    }
    const double ref_rec = half.at("median_rec_err").get<double>();
    const double ref_out = half.at("median_out_err_scale_fixed").get<double>();
    EXPECT_LE(median(rec), ref_rec);
    EXPECT_LE(median(out), ref_out);
    std::cout << "[collab_reparam] " << c.name << " R=" << R << " (100 sweeps) median rec_err " << median(rec)
              << " (reference " << ref_rec << "), median out_err " << median(out) << " (reference scale-fixed "
              << ref_out << ")";
    if (c.name.rfind("planted", 0) == 0) {
      const auto conv = decomp::mha_to_collab(c.w, c.options, R);  // default settings
      EXPECT_LE(conv.relative_error, 3e-3);
      std::cout << "; defaults: rec_err " << conv.relative_error << " after " << conv.iterations
                << " sweeps, out_err " << c.output_error(conv) << " (floor "
                << half.at("planted_floor_rec_err").get<double>() << ")";
    }
    std::cout << "\n";
  }
}

}  // namespace
