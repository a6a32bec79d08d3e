// CP decomposition of a 3-way tensor by alternating least squares (CP-ALS).
//
// Finds factors A [I, R], B [J, R], C [K, R] so that
//   T[i, j, k] ≈ T̂[i, j, k] = Σ_r A[i, r] · B[j, r] · C[k, r]
// by updating one factor at a time to its least-squares optimum given the
// other two. For mode n the update is the normal equations
//   F_n · (G_a ⊙ G_b) = MTTKRP_n(T; F_a, F_b),   G_x = F_xᵀ F_x
// (⊙ is the element-wise product, MTTKRP the matricised tensor times the
// Khatri-Rao product of the other factors).
//
// Two representations of T are provided, behind one small interface (Op):
//   * DenseTensor3: any dense [I, J, K] tensor. MTTKRP is a sum over the J
//     slices X_j = T[:, j, :] of GEMMs X_j · C scaled by B[j, :], which is the
//     unfolding × Khatri-Rao product without materialising the Khatri-Rao
//     matrix.
//   * SliceProductTensor: T[:, j, :] = U_jᵀ V_j with thin U_j [p, I], V_j
//     [p, K] (an MHA layer's W_Q,hᵀ W_K,h). Never forms T: every MTTKRP is
//     two GEMMs through the p-dimensional slice factors, so an iteration on a
//     BERT-base layer (I = K = 768, J = 12, p = 64, R = 384) costs ~1.2 G
//     multiply-adds instead of ~8 G for the dense form.
//
// Both expose the tensor through *linear projections* of the factors
// (P_n = L_n(F_n): U·A and V·C for the slice form, the factor itself for the
// dense form). Because they are linear, the line search below extrapolates
// them for free along with the factors.
//
// The algorithm, and why:
//   * Initialisation, CpInit::slice_svd (the default): the thin SVD of every
//     mode-1 slice T[:, j, :] = Σ_k σ_jk u_jk v_jkᵀ, and the R largest σ over
//     all slices become the starting components (u_jk, σ_jk·e_j, v_jk). For an
//     MHA tensor that is "the strongest R singular directions of any head".
//     On the conformance collab_reparam tensors, after 100 sweeps, it gives
//     the lowest error on the random cases (random_d32_h4: 0.440, HOSVD
//     0.445, tensorly's median 0.447; random_d48_h6: 0.496, 0.503, 0.506)
//     and nearly HOSVD's on the planted ones (0.0066 vs 0.0060, 0.010 vs
//     0.0093; tensorly 0.024, 0.061). (HOSVD's random_d32_h4 fit also gives
//     a converted layer whose output error, 0.231, is above tensorly's
//     median, 0.217; the slice start's gives 0.210.)
//     CpInit::hosvd: every mode except the one updated first takes the
//     leading R eigenvectors of its unfolding's Gram matrix T_(n) T_(n)ᵀ (its
//     leading left singular vectors). CpInit::random: every factor uniform
//     on [0, 1) (tensorly's init="random"). Columns the SVDs cannot supply
//     (R above the available rank) are uniform [0, 1) from the seeded
//     generator.
//   * Sweep order: the smallest mode first (the mixing mode [H] of an MHA
//     tensor), then the others in index order. The first update replaces
//     whatever the initialisation put there by its least-squares optimum.
//   * Line search (on by default): after sweep k >= 2 the step from the
//     previous iterate is extrapolated by a factor k^(1/3) (Bro's rule, as
//     tensorly's linesearch) and kept only if it lowers the error. Plain ALS
//     crawls through long "swamps" on these tensors; the extrapolation costs
//     one Gram matrix per large mode and gets through them several times
//     faster (planted_d64_h4 after 100 sweeps: 0.010 with, 0.033 without).
//   * Normal equations: R×R, solved by Cholesky; if it is not positive
//     definite or its condition estimate is worse than 1e-13, by a
//     pseudo-inverse (eigenvalues below R·eps·max dropped) instead.
//   * Error: relative ‖T − T̂‖_F / ‖T‖_F from ‖T‖², ⟨T, T̂⟩ (a by-product of
//     the last MTTKRP) and ‖T̂‖² = Σ (G_A ⊙ G_B ⊙ G_C); below 1e-6, where that
//     difference loses digits, it is recomputed directly from the residual.
//     The final reported error is always the direct one.
//   * Stopping: after sweep k >= 2 when |err_{k-1} − err_k| < tolerance, or
//     at max_iterations sweeps, or when the error is 0.
//   * The returned factors are rebalanced so that column r of A, B and C have
//     the same norm (T̂ is unchanged).
//
// Cost of one sweep on a SliceProductTensor (I = K = D, J = H, p = Dk):
// 4 GEMMs of D·H·Dk·R multiply-adds, two R×R Gram matrices and two
// Cholesky solves with D right-hand sides: ~1.2 G multiply-adds for a
// BERT-base layer at R = 384, ~0.1 s on one core.
//
// Everything is deterministic given the options (seed included): no thread
// count or timing enters the arithmetic.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/types.hpp"

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>
#include <Eigen/SVD>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace headmix::decomp {

enum class CpInit {
  slice_svd,  ///< the R strongest singular triplets of the mode-1 slices (default)
  hosvd,      ///< leading eigenvectors of each unfolding's Gram matrix
  random,     ///< uniform [0, 1) entries from the seeded generator
};

/// Defaults: up to 500 sweeps, stop when the relative error changes by less
/// than 1e-8 between sweeps. On the conformance `planted_*` MHA tensors this
/// reaches ~1.6e-3 and ~1.1e-3 (their noise floor is ~1.4e-3); tensors
/// without low-rank structure usually run to the cap (see the cost above).
struct CpAlsOptions {
  Index max_iterations = 500;   ///< cap on ALS sweeps (0: return the initialisation)
  double tolerance = 1e-8;      ///< stop when |Δ relative error| between sweeps is below this
  CpInit init = CpInit::slice_svd;
  std::uint64_t seed = 0;       ///< for random init and for columns an SVD init cannot supply
  bool line_search = true;      ///< extrapolate each sweep (see the file comment)
};

/// Thin SVD of one mode-1 slice: T[:, j, :] = left · diag(values) · rightᵀ.
template <class S>
struct SliceSvd {
  Vector<S> values;  ///< non-increasing
  Matrix<S> left;    ///< [I, m]
  Matrix<S> right;   ///< [K, m]
};

template <class S>
struct CpResult {
  std::array<Matrix<S>, 3> factors;   ///< A [I, R], B [J, R], C [K, R]
  double relative_error = 0;          ///< ‖T − T̂‖_F / ‖T‖_F of the returned factors (0 for a zero tensor)
  Index iterations = 0;               ///< ALS sweeps performed
  bool converged = false;             ///< stopped on the tolerance (or an exact fit), not on the cap
  std::vector<double> error_history;  ///< relative error after each sweep
};

namespace detail {

inline constexpr const char* kCpName = "cp_als";

template <class S>
using ColMatrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;

/// FᵀF, using the symmetric rank update (half the work of a general product).
template <class Derived>
ColMatrix<typename Derived::Scalar> gram_of(const Eigen::MatrixBase<Derived>& f) {
  using S = typename Derived::Scalar;
  ColMatrix<S> g = ColMatrix<S>::Zero(f.cols(), f.cols());
  g.template selfadjointView<Eigen::Lower>().rankUpdate(f.transpose());
  return g.template selfadjointView<Eigen::Lower>();
}

/// Solve F · V = rhs for F, V symmetric positive semi-definite [R, R].
template <class S>
Matrix<S> solve_normal(const ColMatrix<S>& v, const Matrix<S>& rhs) {
  // Cholesky V = L Lᵀ, then two triangular solves from the right, in place:
  // as fast as a GEMM with V⁻¹ and without forming the inverse.
  Eigen::LLT<ColMatrix<S>> llt(v);
  if (llt.info() == Eigen::Success && llt.rcond() > 1e-13) {
    Matrix<S> f = rhs;
    llt.matrixL().transpose().template solveInPlace<Eigen::OnTheRight>(f);  // f · Lᵀ = rhs
    llt.matrixL().template solveInPlace<Eigen::OnTheRight>(f);              // F · L = f
    if (f.allFinite()) return f;
  }
  // Singular or nearly so (a zero column, collinear factors): minimum-norm
  // least-squares solution through the eigen-decomposition.
  Eigen::SelfAdjointEigenSolver<ColMatrix<S>> eig(v);
  const auto& values = eig.eigenvalues();
  const S cutoff = static_cast<S>(v.rows()) * std::numeric_limits<S>::epsilon() * std::max(S(0), values.maxCoeff());
  Eigen::Matrix<S, Eigen::Dynamic, 1> inverse(values.size());
  for (Index i = 0; i < values.size(); ++i) inverse(i) = values(i) > cutoff ? S(1) / values(i) : S(0);
  const ColMatrix<S> pinv = eig.eigenvectors() * inverse.asDiagonal() * eig.eigenvectors().transpose();
  return rhs * pinv;
}

/// Uniform [0, 1) from a 64-bit generator, the same on every platform
/// (std::uniform_real_distribution is implementation-defined).
inline double unit_uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

template <class S>
void fill_uniform(Eigen::Ref<Matrix<S>> m, std::mt19937_64& rng) {
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) m(i, j) = static_cast<S>(unit_uniform(rng));
}

}  // namespace detail

/// A dense tensor T[i, j, k], stored row-major (k fastest) as a rank-3
/// headmix::Tensor, held by reference: the tensor must outlive this object.
template <class S>
class DenseTensor3 {
 public:
  using Scalar = S;

  explicit DenseTensor3(const Tensor<S>& t) : t_(t) {
    if (t.rank() != 3) detail_throw("tensor", "a rank-3 tensor [I, J, K]", headmix::detail::format_shape(t.shape()));
    for (int n = 0; n < 3; ++n)
      if (t.dim(static_cast<std::size_t>(n)) < 1)
        detail_throw("tensor", "[I >= 1, J >= 1, K >= 1]", headmix::detail::format_shape(t.shape()));
  }

  Index dim(int mode) const { return t_.dim(static_cast<std::size_t>(mode)); }

  double norm_squared() const {
    return static_cast<double>(ConstMatrixMap<S>(t_.data(), 1, t_.size()).squaredNorm());
  }

  /// T_(n) T_(n)ᵀ, [dim(n), dim(n)].
  detail::ColMatrix<S> gram(int mode) const {
    const Index I = dim(0), J = dim(1), K = dim(2);
    if (mode == 0) {
      const ConstMatrixMap<S> unfolded(t_.data(), I, J * K);
      return detail::gram_of(unfolded.transpose());
    }
    detail::ColMatrix<S> g = detail::ColMatrix<S>::Zero(mode == 1 ? J : K, mode == 1 ? J : K);
    for (Index i = 0; i < I; ++i) {  // X_i = T[i, :, :] is a contiguous [J, K] block
      const ConstMatrixMap<S> xi(t_.data() + i * J * K, J, K);
      if (mode == 1)
        g.noalias() += xi * xi.transpose();
      else
        g.noalias() += xi.transpose() * xi;
    }
    return g;
  }

  /// The dense form has nothing to precompute: the projection is the factor.
  Matrix<S> project(int, const Matrix<S>& f) const { return f; }

  /// MTTKRP of `mode` from the other two modes' projections (= factors).
  Matrix<S> mttkrp(int mode, const std::array<Matrix<S>, 3>& p) const {
    const Index J = dim(1), R = p[mode == 0 ? 1 : 0].cols();
    Matrix<S> out = Matrix<S>::Zero(dim(mode), R);
    Matrix<S> tmp;
    for (Index j = 0; j < J; ++j) {
      const auto xj = slice(j);  // [I, K]
      if (mode == 0) {           // Σ_j X_j C diag(B[j, :])
        tmp.noalias() = xj * p[2];
        out.noalias() += tmp * p[1].row(j).transpose().asDiagonal();
      } else if (mode == 1) {    // row j: column sums of A ⊙ X_j C
        tmp.noalias() = xj * p[2];
        out.row(j) = p[0].cwiseProduct(tmp).colwise().sum();
      } else {                   // Σ_j X_jᵀ A diag(B[j, :])
        tmp.noalias() = xj.transpose() * p[0];
        out.noalias() += tmp * p[1].row(j).transpose().asDiagonal();
      }
    }
    return out;
  }

  /// ⟨T, [[F0, F1, F2]]⟩ from the projections.
  double inner(const std::array<Matrix<S>, 3>& p) const {
    return static_cast<double>(mttkrp(1, p).cwiseProduct(p[1]).sum());
  }

  SliceSvd<S> slice_svd(Index j) const {
    const Eigen::BDCSVD<detail::ColMatrix<S>> svd(detail::ColMatrix<S>(slice(j)),
                                                   Eigen::ComputeThinU | Eigen::ComputeThinV);
    return {svd.singularValues(), svd.matrixU(), svd.matrixV()};
  }

  /// ‖T − [[F0, F1, F2]]‖², computed slice by slice from the residual itself.
  double residual_squared(const std::array<Matrix<S>, 3>& f) const {
    double sum = 0;
    Matrix<S> approx;
    for (Index j = 0; j < dim(1); ++j) {
      approx.noalias() = f[0] * f[1].row(j).transpose().asDiagonal() * f[2].transpose();
      sum += static_cast<double>((slice(j) - approx).squaredNorm());
    }
    return sum;
  }

 private:
  [[noreturn]] static void detail_throw(const std::string& arg, const std::string& expected, const std::string& got) {
    headmix::detail::throw_shape(detail::kCpName, arg, expected, got);
  }
  /// T[:, j, :] as an [I, K] matrix inside the row-major storage.
  ConstStridedMap<S> slice(Index j) const {
    const Index J = dim(1), K = dim(2);
    return ConstStridedMap<S>(t_.data() + j * K, dim(0), K, Eigen::OuterStride<>(J * K));
  }

  const Tensor<S>& t_;
};

/// The tensor whose mode-1 slices are products of thin factors:
///   T[i, j, k] = Σ_{d < p} U[j·p + d, i] · V[j·p + d, k],   i.e. T[:, j, :] = U_jᵀ V_j,
/// with U [J·p, I] and V [J·p, K] split into J blocks of p rows. For an MHA
/// layer, U = W_Q and V = W_K in PyTorch layout, J = heads and p = head_dim,
/// so that T[:, h, :] = W_Q,hᵀ W_K,h: the [D, H, Dkv] tensor of the
/// bilinear forms the heads' logits use. Holds its own copy of U and V.
template <class S>
class SliceProductTensor {
 public:
  using Scalar = S;

  SliceProductTensor(Matrix<S> u, Matrix<S> v, Index slices) : u_(std::move(u)), v_(std::move(v)), j_(slices) {
    if (j_ < 1) headmix::detail::throw_shape(detail::kCpName, "slices", ">= 1", std::to_string(j_));
    if (u_.rows() < 1 || u_.cols() < 1 || u_.rows() % j_ != 0)
      headmix::detail::throw_shape(detail::kCpName, "u",
                                   "[slices * p, I] with slices = " + std::to_string(j_) + ", p >= 1, I >= 1",
                                   headmix::detail::format_shape(shape_of(u_)));
    if (v_.cols() < 1)
      headmix::detail::throw_shape(detail::kCpName, "v", "[" + std::to_string(u_.rows()) + ", K >= 1]",
                                   headmix::detail::format_shape(shape_of(v_)));
    check_shape(detail::kCpName, "v", {u_.rows(), -1}, shape_of(v_));
    p_ = u_.rows() / j_;
  }

  Index dim(int mode) const { return mode == 0 ? u_.cols() : mode == 1 ? j_ : v_.cols(); }
  Index slice_rank() const { return p_; }
  const Matrix<S>& u() const { return u_; }
  const Matrix<S>& v() const { return v_; }

  /// Σ_j ‖U_jᵀ V_j‖² = Σ_j Σ (U_j U_jᵀ ⊙ V_j V_jᵀ), without forming any slice.
  double norm_squared() const {
    double sum = 0;
    for (Index j = 0; j < j_; ++j) {
      const auto uj = u_.middleRows(j * p_, p_);
      const auto vj = v_.middleRows(j * p_, p_);
      const Matrix<S> uu = uj * uj.transpose(), vv = vj * vj.transpose();
      sum += static_cast<double>(uu.cwiseProduct(vv).sum());
    }
    return sum;
  }

  detail::ColMatrix<S> gram(int mode) const {
    if (mode == 1) {  // G[j, j'] = ⟨T_j, T_j'⟩ = Σ (U_j U_j'ᵀ ⊙ V_j V_j'ᵀ)
      const Matrix<S> uu = u_ * u_.transpose(), vv = v_ * v_.transpose();
      const Matrix<S> both = uu.cwiseProduct(vv);
      detail::ColMatrix<S> g(j_, j_);
      for (Index a = 0; a < j_; ++a)
        for (Index b = 0; b < j_; ++b) g(a, b) = both.block(a * p_, b * p_, p_, p_).sum();
      return g;
    }
    // Mode 0: Σ_j U_jᵀ (V_j V_jᵀ) U_j; mode 2 swaps the roles of U and V.
    const Matrix<S>& outer = mode == 0 ? u_ : v_;
    const Matrix<S>& inner_f = mode == 0 ? v_ : u_;
    Matrix<S> weighted(outer.rows(), outer.cols());
    for (Index j = 0; j < j_; ++j) {
      const auto in = inner_f.middleRows(j * p_, p_);
      const Matrix<S> w = in * in.transpose();
      weighted.middleRows(j * p_, p_).noalias() = w * outer.middleRows(j * p_, p_);
    }
    detail::ColMatrix<S> g = outer.transpose() * weighted;
    return (g + g.transpose()) * S(0.5);  // symmetric up to rounding; make it exactly so
  }

  /// P_0 = U·A [J·p, R], P_1 = B, P_2 = V·C [J·p, R]: the factors seen
  /// through the slice factors, which is all the MTTKRPs need.
  Matrix<S> project(int mode, const Matrix<S>& f) const {
    if (mode == 0) return u_ * f;
    if (mode == 2) return v_ * f;
    return f;
  }

  Matrix<S> mttkrp(int mode, const std::array<Matrix<S>, 3>& p) const {
    if (mode == 1) {  // [j, r] = Σ_d (U_j A)[d, r] · (V_j C)[d, r]
      const Index R = p[0].cols();
      Matrix<S> out(j_, R);
      for (Index j = 0; j < j_; ++j)
        out.row(j) = p[0].middleRows(j * p_, p_).cwiseProduct(p[2].middleRows(j * p_, p_)).colwise().sum();
      return out;
    }
    // Mode 0: Uᵀ (V C ⊙ B expanded to the p rows of each slice); mode 2: Vᵀ (U A ⊙ ...).
    Matrix<S> scaled = mode == 0 ? p[2] : p[0];
    for (Index j = 0; j < j_; ++j) scaled.middleRows(j * p_, p_).array().rowwise() *= p[1].row(j).array();
    return (mode == 0 ? u_ : v_).transpose() * scaled;
  }

  double inner(const std::array<Matrix<S>, 3>& p) const {
    return static_cast<double>(mttkrp(1, p).cwiseProduct(p[1]).sum());
  }

  /// U_jᵀ V_j = (Q_u R_u)(Q_v R_v)ᵀ = Q_u (R_u R_vᵀ) Q_vᵀ: the SVD of a p×p core.
  SliceSvd<S> slice_svd(Index j) const {
    using CM = detail::ColMatrix<S>;
    const CM ut = u_.middleRows(j * p_, p_).transpose(), vt = v_.middleRows(j * p_, p_).transpose();
    const Eigen::HouseholderQR<CM> qu(ut), qv(vt);
    const Index mu = std::min(ut.rows(), p_), mv = std::min(vt.rows(), p_);
    const CM q_u = qu.householderQ() * CM::Identity(ut.rows(), mu);
    const CM q_v = qv.householderQ() * CM::Identity(vt.rows(), mv);
    const CM r_u = qu.matrixQR().topRows(mu).template triangularView<Eigen::Upper>();
    const CM r_v = qv.matrixQR().topRows(mv).template triangularView<Eigen::Upper>();
    const Eigen::JacobiSVD<CM> svd(r_u * r_v.transpose(), Eigen::ComputeThinU | Eigen::ComputeThinV);
    return {svd.singularValues(), q_u * svd.matrixU(), q_v * svd.matrixV()};
  }

  double residual_squared(const std::array<Matrix<S>, 3>& f) const {
    double sum = 0;
    Matrix<S> diff;
    for (Index j = 0; j < j_; ++j) {
      diff.noalias() = u_.middleRows(j * p_, p_).transpose() * v_.middleRows(j * p_, p_);
      diff.noalias() -= f[0] * f[1].row(j).transpose().asDiagonal() * f[2].transpose();
      sum += static_cast<double>(diff.squaredNorm());
    }
    return sum;
  }

 private:
  Matrix<S> u_, v_;
  Index j_, p_ = 0;
};

/// Rank-`rank` CP decomposition of the tensor behind `op` (DenseTensor3,
/// SliceProductTensor, or any type with the same members).
template <class Op>
CpResult<typename Op::Scalar> cp_als(const Op& op, Index rank, const CpAlsOptions& options = {}) {
  using S = typename Op::Scalar;
  using detail::ColMatrix;
  check_value(rank >= 1, detail::kCpName, "rank", ">= 1", rank);
  check_value(options.max_iterations >= 0, detail::kCpName, "max_iterations", ">= 0", options.max_iterations);
  if (!(options.tolerance >= 0) || !std::isfinite(options.tolerance))
    headmix::detail::throw_shape(detail::kCpName, "tolerance", "a finite number >= 0",
                                 std::to_string(options.tolerance));

  const Index R = rank;
  const std::array<Index, 3> dims = {op.dim(0), op.dim(1), op.dim(2)};
  std::array<int, 3> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return dims[a] < dims[b]; });

  CpResult<S> result;
  for (int n = 0; n < 3; ++n) result.factors[n] = Matrix<S>::Zero(dims[n], R);
  const double norm2 = op.norm_squared();
  if (!(norm2 > 0)) {  // the zero tensor: zero factors are exact
    result.converged = true;
    return result;
  }
  const double norm = std::sqrt(norm2);

  std::array<Matrix<S>, 3>& f = result.factors;
  std::mt19937_64 rng(options.seed);
  if (options.init == CpInit::random) {
    for (int n = 0; n < 3; ++n) detail::fill_uniform<S>(f[n], rng);
  } else if (options.init == CpInit::slice_svd) {
    struct Triplet {
      S value;
      Index slice, k;
    };
    std::vector<SliceSvd<S>> svds;
    std::vector<Triplet> all;
    for (Index j = 0; j < dims[1]; ++j) {
      svds.push_back(op.slice_svd(j));
      for (Index k = 0; k < svds.back().values.size(); ++k) all.push_back({svds.back().values(k), j, k});
    }
    // Stable: ties keep (slice, k) order, so the start is deterministic.
    std::stable_sort(all.begin(), all.end(), [](const Triplet& a, const Triplet& b) { return a.value > b.value; });
    const Index take = std::min<Index>(R, static_cast<Index>(all.size()));
    for (Index r = 0; r < take; ++r) {
      const Triplet& t = all[static_cast<std::size_t>(r)];
      const SliceSvd<S>& svd = svds[static_cast<std::size_t>(t.slice)];
      f[0].col(r) = svd.left.col(t.k);
      f[1](t.slice, r) = t.value;
      f[2].col(r) = svd.right.col(t.k);
    }
    for (int n = 0; n < 3 && take < R; ++n) detail::fill_uniform<S>(f[n].rightCols(R - take), rng);
  } else {
    for (int k = 1; k < 3; ++k) {  // order[0] is set by the first update
      const int n = order[k];
      Eigen::SelfAdjointEigenSolver<ColMatrix<S>> eig(op.gram(n));
      const Index lead = std::min(R, dims[n]);
      for (Index c = 0; c < lead; ++c) f[n].col(c) = eig.eigenvectors().col(dims[n] - 1 - c);
      if (R > dims[n]) detail::fill_uniform<S>(f[n].rightCols(R - dims[n]), rng);
    }
  }

  std::array<Matrix<S>, 3> p;
  std::array<ColMatrix<S>, 3> g;
  for (int n = 0; n < 3; ++n) {
    p[n] = op.project(n, f[n]);
    g[n] = detail::gram_of(f[n]);
  }
  auto relative_error = [&](double inner, const std::array<ColMatrix<S>, 3>& grams) {
    const double model2 = static_cast<double>(grams[0].cwiseProduct(grams[1]).cwiseProduct(grams[2]).sum());
    return std::sqrt(std::max(0.0, norm2 - 2 * inner + model2)) / norm;
  };

  std::array<Matrix<S>, 3> f_prev, p_prev;
  double previous = std::numeric_limits<double>::quiet_NaN();
  for (Index it = 1; it <= options.max_iterations; ++it) {
    if (options.line_search) f_prev = f, p_prev = p;
    double inner = 0;
    for (int k = 0; k < 3; ++k) {
      const int n = order[k];
      const int a = (n + 1) % 3, b = (n + 2) % 3;
      const ColMatrix<S> v = g[a].cwiseProduct(g[b]);
      const Matrix<S> m = op.mttkrp(n, p);
      f[n] = detail::solve_normal<S>(v, m);
      p[n] = op.project(n, f[n]);
      g[n] = detail::gram_of(f[n]);
      if (k == 2) inner = static_cast<double>(m.cwiseProduct(f[n]).sum());  // ⟨T, T̂⟩ with the new factors
    }
    double err = relative_error(inner, g);

    if (options.line_search && it >= 2) {
      const S jump = static_cast<S>(std::cbrt(static_cast<double>(it)));
      std::array<Matrix<S>, 3> f_ls, p_ls;
      std::array<ColMatrix<S>, 3> g_ls;
      for (int n = 0; n < 3; ++n) {
        f_ls[n] = f_prev[n] + jump * (f[n] - f_prev[n]);
        p_ls[n] = p_prev[n] + jump * (p[n] - p_prev[n]);  // projections are linear in the factors
        g_ls[n] = detail::gram_of(f_ls[n]);
      }
      const double err_ls = relative_error(op.inner(p_ls), g_ls);
      if (err_ls < err) {
        f = std::move(f_ls), p = std::move(p_ls), g = std::move(g_ls);
        err = err_ls;
      }
    }
    if (err < 1e-6) err = std::sqrt(std::max(0.0, op.residual_squared(f))) / norm;

    result.error_history.push_back(err);
    result.iterations = it;
    if (err == 0 || (it >= 2 && std::abs(previous - err) < options.tolerance)) {
      result.converged = true;
      break;
    }
    previous = err;
  }

  // Balance the columns: ‖A[:, r]‖ = ‖B[:, r]‖ = ‖C[:, r]‖, same product.
  for (Index r = 0; r < R; ++r) {
    const double n0 = static_cast<double>(f[0].col(r).norm()), n1 = static_cast<double>(f[1].col(r).norm()),
                 n2 = static_cast<double>(f[2].col(r).norm());
    if (!(n0 > 0 && n1 > 0 && n2 > 0)) {
      for (int n = 0; n < 3; ++n) f[n].col(r).setZero();
      continue;
    }
    const double target = std::cbrt(n0 * n1 * n2);
    f[0].col(r) *= static_cast<S>(target / n0);
    f[1].col(r) *= static_cast<S>(target / n1);
    f[2].col(r) *= static_cast<S>(target / n2);
  }
  result.relative_error = std::sqrt(std::max(0.0, op.residual_squared(f))) / norm;
  return result;
}

/// CP-ALS of a dense rank-3 tensor [I, J, K].
template <class S>
CpResult<S> cp_als(const Tensor<S>& tensor, Index rank, const CpAlsOptions& options = {}) {
  return cp_als(DenseTensor3<S>(tensor), rank, options);
}

/// T̂[i, j, k] = Σ_r A[i, r] B[j, r] C[k, r] as a dense [I, J, K] tensor.
template <class S>
Tensor<S> cp_reconstruct(const std::array<Matrix<S>, 3>& f) {
  const Index I = f[0].rows(), J = f[1].rows(), K = f[2].rows();
  Tensor<S> t({I, J, K});
  for (Index j = 0; j < J; ++j) {
    StridedMap<S> slice(t.data() + j * K, I, K, Eigen::OuterStride<>(J * K));
    slice.noalias() = f[0] * f[1].row(j).transpose().asDiagonal() * f[2].transpose();
  }
  return t;
}

}  // namespace headmix::decomp
