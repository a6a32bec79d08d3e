// The one matrix product of headmix's hot paths: C = A·B or C += A·B on
// row-major blocks (unit inner stride, any row stride).
//
// Built with HEADMIX_USE_LIBXSMM (CMake's default when libxsmm is found),
// products run on libxsmm's JIT kernels, which the GEMM-candidates bench
// measured at 1.3-2.1x Eigen's rate on headmix's shapes (README, "Which GEMM
// library"). Without it, Eigen's own GEMM. libxsmm multiplies untransposed
// column-major operands only, so callers hand `b` as stored [k, n]: K_hᵀ
// is laid out once per call (DotProductStages::packed), and Wᵀ once, in
// panels, when a layer is built (PackedMatrix, Linear::prepare).
//
// Tiles of C and slices of k are fixed by the shapes alone, never by a
// thread count or an address, so a product is bit-identical wherever it runs.
#pragma once

#include "headmix/core/types.hpp"

#ifdef HEADMIX_USE_LIBXSMM
#include <libxsmm.h>
#endif

#include <algorithm>
#include <array>
#include <utility>

namespace headmix {

/// The library that multiplies: "libxsmm" or "eigen".
inline constexpr const char* gemm_backend() {
#ifdef HEADMIX_USE_LIBXSMM
  return "libxsmm";
#else
  return "eigen";
#endif
}

namespace detail {

// libxsmm computes C^T = B^T·A^T in column-major terms: the row-major
// buffers as they stand. Tiles of 64 x 64 of C^T with k in slices of 256
// stay in L1/L2 and are where the candidates bench found libxsmm's rate.
constexpr Index kGemmTileM = 64, kGemmTileN = 64, kGemmTileK = 256;

#ifdef HEADMIX_USE_LIBXSMM

template <class T>
using XsmmKernel = std::conditional_t<std::is_same_v<T, float>, libxsmm_smmfunction, libxsmm_dmmfunction>;

template <class T>
XsmmKernel<T> xsmm_kernel(Index m, Index n, Index k, Index lda, Index ldb, Index ldc, bool accumulate) {
  static const bool initialised = (libxsmm_init(), true);  // once, thread-safe
  (void)initialised;
  const libxsmm_blasint im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  const T alpha = 1, beta = accumulate ? 1 : 0;
  const int flags = LIBXSMM_GEMM_FLAG_NONE;
  if constexpr (std::is_same_v<T, float>)
    return libxsmm_smmdispatch(im, in, ik, &ilda, &ildb, &ildc, &alpha, &beta, &flags, nullptr);
  else
    return libxsmm_dmmdispatch(im, in, ik, &ilda, &ildb, &ildc, &alpha, &beta, &flags, nullptr);
}

/// Row-major C[m, n] (+)= A[m, k]·B[k, n], where `b_tile(p0, i0)` gives
/// the tile of B at rows p0.., columns i0.. and its row stride (B as it
/// stands, or packed). A tile libxsmm has no kernel for (it never happened
/// on the shapes headmix makes) runs on Eigen.
template <class T, class BTile>
void xsmm_gemm(Index m, Index n, Index k, const T* a, Index lda, BTile b_tile, T* c, Index ldc, bool accumulate) {
  // Within one call only the last tile of each dimension differs, so at most
  // 16 kernels: looked up once each rather than per tile. A tile's B stride
  // depends on its width alone, so it is the same for every use of a kernel.
  std::array<XsmmKernel<T>, 16> kernels{};
  std::array<bool, 16> looked_up{};
  for (Index j0 = 0; j0 < m; j0 += kGemmTileN) {
    const Index nj = std::min(kGemmTileN, m - j0);
    for (Index i0 = 0; i0 < n; i0 += kGemmTileM) {
      const Index mi = std::min(kGemmTileM, n - i0);
      for (Index p0 = 0; p0 < k; p0 += kGemmTileK) {
        const Index kp = std::min(kGemmTileK, k - p0);
        const bool acc = accumulate || p0 > 0;
        const auto [bt, ldb] = b_tile(p0, i0);
        const int key = int(mi == kGemmTileM) | int(nj == kGemmTileN) << 1 | int(kp == kGemmTileK) << 2 | int(acc) << 3;
        if (!looked_up[key]) kernels[key] = xsmm_kernel<T>(mi, nj, kp, ldb, lda, ldc, acc), looked_up[key] = true;
        const T* at = a + j0 * lda + p0;
        T* ct = c + j0 * ldc + i0;
        if (kernels[key]) {
          kernels[key](bt, at, ct);
          continue;
        }
        StridedMap<T> cm(ct, nj, mi, Eigen::OuterStride<>(ldc));
        const ConstStridedMap<T> am(at, nj, kp, Eigen::OuterStride<>(lda)), bm(bt, kp, mi, Eigen::OuterStride<>(ldb));
        if (acc)
          cm.noalias() += am * bm;
        else
          cm.noalias() = am * bm;
      }
    }
  }
}
#endif

/// Operands libxsmm can read as they stand: row-major with direct access.
template <class X>
constexpr bool row_major_direct() {
  return bool(X::Flags & Eigen::RowMajorBit) && bool(X::Flags & Eigen::DirectAccessBit);
}

/// `c (+)= a·B` on libxsmm, B given by its tiles (see xsmm_gemm), when
/// libxsmm can take `a` and `c` as they stand (float or double, row-major,
/// unit inner stride): then true. Otherwise false, and the caller runs Eigen.
template <class A, class C, class BTile>
bool xsmm_product(const Eigen::MatrixBase<A>& a, const BTile& b_tile, Eigen::MatrixBase<C>& c, bool accumulate) {
#ifdef HEADMIX_USE_LIBXSMM
  using T = typename C::Scalar;
  if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, double>) && row_major_direct<A>() &&
                row_major_direct<C>()) {
    if (a.innerStride() != 1 || c.innerStride() != 1) return false;
    if (c.rows() == 0 || c.cols() == 0) return true;
    if (a.cols() == 0) {
      if (!accumulate) c.setZero();
      return true;
    }
    xsmm_gemm<T>(c.rows(), c.cols(), a.cols(), a.derived().data(), a.outerStride(), b_tile, c.derived().data(),
                 c.outerStride(), accumulate);
    return true;
  }
#endif
  (void)a, (void)b_tile, (void)c, (void)accumulate;
  return false;
}

}  // namespace detail

/// `c = a·b`, or `c += a·b` when `accumulate`: row-major Eigen blocks or
/// maps (libxsmm takes them with unit inner stride; anything else, e.g. a
/// transposed expression, runs on Eigen: lay such operands out once instead).
template <class A, class B, class C>
void gemm(const Eigen::MatrixBase<A>& a, const Eigen::MatrixBase<B>& b, const Eigen::MatrixBase<C>& c_,
          bool accumulate = false) {
  auto& c = const_cast<Eigen::MatrixBase<C>&>(c_);
  using T = typename C::Scalar;
  static_assert(std::is_same_v<typename A::Scalar, T> && std::is_same_v<typename B::Scalar, T>);
  eigen_assert(a.rows() == c.rows() && b.cols() == c.cols() && a.cols() == b.rows());
  if constexpr (detail::row_major_direct<B>()) {
    if (b.innerStride() == 1) {
      const T* bd = b.derived().data();
      const Index ldb = b.outerStride();
      const auto tile = [&](Index p0, Index i0) { return std::pair(bd + p0 * ldb + i0, ldb); };
      if (detail::xsmm_product(a, tile, c, accumulate)) return;
    }
  }
  if (accumulate)
    c.noalias() += a * b;
  else
    c.noalias() = a * b;
}

/// A right-hand operand B [k, n] laid out once in the order gemm() reads
/// it: panels of 64 columns (the last one narrower), each stored row-major
/// on its own. For operands multiplied many times, the projections' Wᵀ: a
/// tile of B as it stands is 64-float pieces one whole row of B apart,
/// which libxsmm's kernels read at 0.6x the rate of a packed panel on an
/// Intel core (README, "Which GEMM library"). The kernels, tiles and k
/// slices are those of gemm() on B itself, so the results are its bits.
template <class T>
class PackedMatrix {
 public:
  PackedMatrix() = default;
  template <class B>
  explicit PackedMatrix(const Eigen::MatrixBase<B>& b) : rows_(b.rows()), cols_(b.cols()), data_(b.size()) {
    for (Index i0 = 0; i0 < cols_; i0 += detail::kGemmTileM) {
      const Index w = panel_cols(i0);
      MatrixMap<T>(data_.data() + i0 * rows_, rows_, w) = b.middleCols(i0, w);
    }
  }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  /// The panel holding columns [i0, i0 + panel_cols(i0)), i0 a multiple of 64.
  ConstMatrixMap<T> panel(Index i0) const { return {data_.data() + i0 * rows_, rows_, panel_cols(i0)}; }
  Index panel_cols(Index i0) const { return std::min(detail::kGemmTileM, cols_ - i0); }

 private:
  Index rows_ = 0, cols_ = 0;
  Vector<T> data_;
};

/// `c = a·b` (or `c += a·b`) with b packed: the same bits as gemm() on the
/// unpacked b under libxsmm; panel by panel on Eigen's GEMM otherwise.
template <class A, class T, class C>
void gemm(const Eigen::MatrixBase<A>& a, const PackedMatrix<T>& b, const Eigen::MatrixBase<C>& c_,
          bool accumulate = false) {
  auto& c = const_cast<Eigen::MatrixBase<C>&>(c_);
  static_assert(std::is_same_v<typename A::Scalar, T> && std::is_same_v<typename C::Scalar, T>);
  eigen_assert(a.rows() == c.rows() && b.cols() == c.cols() && a.cols() == b.rows());
  const auto tile = [&](Index p0, Index i0) {
    const auto panel = b.panel(i0);
    return std::pair(panel.data() + p0 * panel.cols(), panel.cols());
  };
  if (detail::xsmm_product(a, tile, c, accumulate)) return;
  for (Index i0 = 0; i0 < b.cols(); i0 += detail::kGemmTileM) {
    auto ci = c.middleCols(i0, b.panel_cols(i0));
    if (accumulate)
      ci.noalias() += a * b.panel(i0);
    else
      ci.noalias() = a * b.panel(i0);
  }
}

}  // namespace headmix
