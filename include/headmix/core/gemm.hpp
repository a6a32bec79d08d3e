// The one matrix product of headmix's hot paths: C = A·B or C += A·B on
// row-major blocks (unit inner stride, any row stride).
//
// Built with HEADMIX_USE_LIBXSMM (CMake's default when libxsmm is found),
// products run on libxsmm's JIT kernels, which the GEMM-candidates bench
// measured at 1.3-2.1x Eigen's rate on headmix's shapes (README, "Which GEMM
// library"). Without it, Eigen's own GEMM. libxsmm multiplies untransposed
// column-major operands only, so callers hand `b` as stored [k, n]: K_hᵀ
// and Wᵀ are laid out once (DotProductStages::packed, Linear::prepare).
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

#ifdef HEADMIX_USE_LIBXSMM
// C^T = B^T·A^T in column-major terms: the row-major buffers as they stand.
// Tiles of 64 x 64 of C^T with k in slices of 256 stay in L1/L2 and are
// where the candidates bench found libxsmm's rate.
constexpr Index kGemmTileM = 64, kGemmTileN = 64, kGemmTileK = 256;

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

/// Row-major C[m, n] (+)= A[m, k]·B[k, n]. A tile libxsmm has no kernel for
/// (it never happened on the shapes headmix makes) runs on Eigen.
template <class T>
void xsmm_gemm(Index m, Index n, Index k, const T* a, Index lda, const T* b, Index ldb, T* c, Index ldc,
               bool accumulate) {
  // Within one call only the last tile of each dimension differs, so at most
  // 16 kernels: looked up once each rather than per tile.
  std::array<XsmmKernel<T>, 16> kernels{};
  std::array<bool, 16> looked_up{};
  for (Index j0 = 0; j0 < m; j0 += kGemmTileN) {
    const Index nj = std::min(kGemmTileN, m - j0);
    for (Index i0 = 0; i0 < n; i0 += kGemmTileM) {
      const Index mi = std::min(kGemmTileM, n - i0);
      for (Index p0 = 0; p0 < k; p0 += kGemmTileK) {
        const Index kp = std::min(kGemmTileK, k - p0);
        const bool acc = accumulate || p0 > 0;
        const int key = int(mi == kGemmTileM) | int(nj == kGemmTileN) << 1 | int(kp == kGemmTileK) << 2 | int(acc) << 3;
        if (!looked_up[key]) kernels[key] = xsmm_kernel<T>(mi, nj, kp, ldb, lda, ldc, acc), looked_up[key] = true;
        const T* bt = b + p0 * ldb + i0;
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
#ifdef HEADMIX_USE_LIBXSMM
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (c.rows() == 0 || c.cols() == 0) return;
    if (a.cols() == 0) {
      if (!accumulate) c.setZero();
      return;
    }
    if constexpr (detail::row_major_direct<A>() && detail::row_major_direct<B>() && detail::row_major_direct<C>()) {
      if (a.innerStride() == 1 && b.innerStride() == 1 && c.innerStride() == 1) {
        detail::xsmm_gemm<T>(c.rows(), c.cols(), a.cols(), a.derived().data(), a.outerStride(), b.derived().data(),
                             b.outerStride(), c.derived().data(), c.outerStride(), accumulate);
        return;
      }
    }
  }
#endif
  if (accumulate)
    c.noalias() += a * b;
  else
    c.noalias() = a * b;
}

}  // namespace headmix
