// The one matrix product of headmix's hot paths: C = A·B or C += A·B on
// row-major blocks (unit inner stride, any row stride).
//
// Built with HEADMIX_USE_LIBXSMM (CMake's default when libxsmm is found),
// products run on libxsmm's JIT kernels, which the GEMM-candidates bench
// measured at 1.3-2.1x Eigen's rate on headmix's shapes (README, "Which GEMM
// library"). Without it, Eigen's own GEMM. libxsmm multiplies untransposed
// column-major operands only, so callers hand `b` as stored [k, n]: K_hᵀ
// is laid out once per call (DotProductStages::packed) and Wᵀ once when a
// layer is built (PackedMatrix, Linear::prepare), both in Panels.
//
// Tiles of C and slices of k are fixed by the shapes (and, once per
// process, the kernels' instruction set), never by a thread count or an
// address, so a product is bit-identical wherever it runs.
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
// buffers as they stand. Tiles of 64 x 64 of C^T, with k in slices
// (gemm_k_slice), stay in L1/L2 and are where the candidates bench found
// libxsmm's rate.
constexpr Index kGemmTileM = 64, kGemmTileN = 64;

#ifdef HEADMIX_USE_LIBXSMM

/// k per slice: each kernel streams a [slice, 64] tile of B, which libxsmm's
/// AVX2 kernels read at full rate only from L1. Measured (1 thread, Wᵀ in
/// panels, k = 768): on Zen 3 (AVX2, 32 KiB L1d) slices of 256 ran the QKV
/// projection at 68 GFLOP/s and the readout at 70, slices of 64 at 90 and
/// 92-94 (OpenBLAS: 90-93); AVX-512 kernels (Zen 5, Sapphire Rapids) were
/// measured with 256. Chosen once per process by the kernels libxsmm
/// generates, so a product's bits still depend on its shapes alone.
inline Index gemm_k_slice() {
  static const Index slice = (libxsmm_init(), libxsmm_get_target_archid() >= LIBXSMM_X86_AVX512) ? 256 : 64;
  return slice;
}

template <class T>
using XsmmKernel = std::conditional_t<std::is_same_v<T, float>, libxsmm_smmfunction, libxsmm_dmmfunction>;

// A kernel that fetches, while it runs, the B tile of the product after it
// into L2 (libxsmm's AL2: its A is our B) takes that tile as a fourth
// argument, and the next A and C (which it leaves alone) as the fifth and sixth.
template <class T>
XsmmKernel<T> xsmm_kernel(Index m, Index n, Index k, Index lda, Index ldb, Index ldc, bool accumulate,
                          bool prefetch) {
  (void)gemm_k_slice();  // libxsmm_init, once, thread-safe
  const libxsmm_blasint im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  const T alpha = 1, beta = accumulate ? 1 : 0;
  const int flags = LIBXSMM_GEMM_FLAG_NONE;
  const int strategy = prefetch ? LIBXSMM_GEMM_PREFETCH_AL2 : LIBXSMM_GEMM_PREFETCH_NONE;
  if constexpr (std::is_same_v<T, float>)
    return libxsmm_smmdispatch(im, in, ik, &ilda, &ildb, &ildc, &alpha, &beta, &flags, &strategy);
  else
    return libxsmm_dmmdispatch(im, in, ik, &ilda, &ildb, &ildc, &alpha, &beta, &flags, &strategy);
}

/// Row-major C[m, n] (+)= A[m, k]·B[k, n], where `b_tile(p0, i0)` gives
/// the tile of B at rows p0.., columns i0.. and its row stride (B as it
/// stands, or packed). With `next_b`, the first B tile of the product that
/// follows, every tile's kernel fetches the B tile after it into L2 (the
/// last one: next_b's), which the arithmetic does not see. A tile libxsmm
/// has no kernel for (it never happened on the shapes headmix makes) runs
/// on Eigen.
template <class T, class BTile>
void xsmm_gemm(Index m, Index n, Index k, const T* a, Index lda, BTile b_tile, T* c, Index ldc, bool accumulate,
               const T* next_b = nullptr) {
  // Within one call only the last tile of each dimension differs, so at most
  // 16 kernels: looked up once each rather than per tile. Full-width tiles
  // share one B stride, and the narrower ones are a single column of tiles,
  // so every use of a kernel has the stride it was made for.
  std::array<XsmmKernel<T>, 16> kernels{};
  std::array<bool, 16> looked_up{};
  const Index slice = gemm_k_slice();
  for (Index j0 = 0; j0 < m; j0 += kGemmTileN) {
    const Index nj = std::min(kGemmTileN, m - j0);
    for (Index i0 = 0; i0 < n; i0 += kGemmTileM) {
      const Index mi = std::min(kGemmTileM, n - i0);
      for (Index p0 = 0; p0 < k; p0 += slice) {
        const Index kp = std::min(slice, k - p0);
        const bool acc = accumulate || p0 > 0;
        const auto [bt, ldb] = b_tile(p0, i0);
        const int key = int(mi == kGemmTileM) | int(nj == kGemmTileN) << 1 | int(kp == slice) << 2 | int(acc) << 3;
        if (!looked_up[key])
          kernels[key] = xsmm_kernel<T>(mi, nj, kp, ldb, lda, ldc, acc, next_b != nullptr), looked_up[key] = true;
        const T* at = a + j0 * lda + p0;
        T* ct = c + j0 * ldc + i0;
        if (kernels[key]) {
          if (next_b) {
            const T* after = p0 + slice < k        ? b_tile(p0 + slice, i0).first
                             : i0 + kGemmTileM < n ? b_tile(0, i0 + kGemmTileM).first
                             : j0 + kGemmTileN < m ? b_tile(0, 0).first
                                                   : next_b;  // the loops' next tile, or the next product's
            kernels[key](bt, at, ct, after, at, ct);
          } else {
            kernels[key](bt, at, ct);
          }
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
bool xsmm_product(const Eigen::MatrixBase<A>& a, const BTile& b_tile, Eigen::MatrixBase<C>& c, bool accumulate,
                  const typename C::Scalar* next_b = nullptr) {
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
                 c.outerStride(), accumulate, next_b);
    return true;
  }
#endif
  (void)a, (void)b_tile, (void)c, (void)accumulate, (void)next_b;
  return false;
}

}  // namespace detail

/// `c = a·b`, or `c += a·b` when `accumulate`: row-major Eigen blocks or
/// maps (libxsmm takes them with unit inner stride; anything else, e.g. a
/// transposed expression, runs on Eigen: lay such operands out once instead).
/// `next_b`: where the right-hand operand of the product the caller runs
/// next starts, when it is not in cache yet. libxsmm's kernels then fetch it
/// into L2 while this product runs; the result is the same bits either way.
template <class A, class B, class C>
void gemm(const Eigen::MatrixBase<A>& a, const Eigen::MatrixBase<B>& b, const Eigen::MatrixBase<C>& c_,
          bool accumulate = false, const typename C::Scalar* next_b = nullptr) {
  auto& c = const_cast<Eigen::MatrixBase<C>&>(c_);
  using T = typename C::Scalar;
  static_assert(std::is_same_v<typename A::Scalar, T> && std::is_same_v<typename B::Scalar, T>);
  eigen_assert(a.rows() == c.rows() && b.cols() == c.cols() && a.cols() == b.rows());
  if constexpr (detail::row_major_direct<B>()) {
    if (b.innerStride() == 1) {
      const T* bd = b.derived().data();
      const Index ldb = b.outerStride();
      const auto tile = [&](Index p0, Index i0) { return std::pair(bd + p0 * ldb + i0, ldb); };
      if (detail::xsmm_product(a, tile, c, accumulate, next_b)) return;
    }
  }
  (void)next_b;
  if (accumulate)
    c.noalias() += a * b;
  else
    c.noalias() = a * b;
}

// GCC warns that a packet type's alignment attribute is dropped when it is a
// template argument (PacketBlock<Packet, L>), which is what Eigen intends.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
namespace detail {
/// out[c · ld + r] = a(r, c), or += with `accumulate`: `a`ᵀ, row-major with
/// rows `ld` apart, for a row-major `a` with unit inner stride. L x L blocks
/// (L values to a packet) go through registers: L loads, Eigen's in-register
/// transpose, L stores; the edges element by element.
template <class A, class T>
void transpose_into(const A& a, T* out, Index ld, bool accumulate = false) {
  static_assert(A::IsRowMajor && A::InnerStrideAtCompileTime == 1, "a row-major view with contiguous rows");
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  constexpr Index L = Eigen::internal::packet_traits<T>::size;
  const Index rows = a.rows(), cols = a.cols(), stride = a.outerStride();
  const T* src = a.data();
  auto put = [accumulate](T& to, T x) { to = accumulate ? to + x : x; };
  Index r0 = 0;
  if constexpr (L > 1) {
    for (; r0 + L <= rows; r0 += L) {
      Index c0 = 0;
      for (; c0 + L <= cols; c0 += L) {
        Eigen::internal::PacketBlock<Packet, L> block;
        for (Index i = 0; i < L; ++i) block.packet[i] = Eigen::internal::ploadu<Packet>(src + (r0 + i) * stride + c0);
        Eigen::internal::ptranspose(block);
        for (Index i = 0; i < L; ++i) {
          T* to = out + (c0 + i) * ld + r0;
          if (accumulate) block.packet[i] = Eigen::internal::padd(Eigen::internal::ploadu<Packet>(to), block.packet[i]);
          Eigen::internal::pstoreu(to, block.packet[i]);
        }
      }
      for (; c0 < cols; ++c0)
        for (Index r = r0; r < r0 + L; ++r) put(out[c0 * ld + r], src[r * stride + c0]);
    }
  }
  for (; r0 < rows; ++r0)
    for (Index c = 0; c < cols; ++c) put(out[c * ld + r0], src[r0 * stride + c]);
}
}  // namespace detail
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// A right-hand operand B [k, n] in the order gemm() reads it: panels of
/// 64 columns (the last one narrower), each stored row-major on its own.
/// A tile of B as it stands is 64-float pieces a whole row of B apart,
/// which libxsmm's kernels read at 0.6x the rate of a panel on an Intel
/// core, and which alias in L1 when the row is a power of two long (README,
/// "Which GEMM library"). The kernels, tiles and k slices are those of
/// gemm() on B itself, so the results are its bits (for a view from a
/// panel boundary: see gemm() on Panels).
///
/// Panels is a view of such storage: rows [first_row, first_row + rows) and
/// the columns from `offset` on within the panel `data` points at (a
/// block's visible keys, a head's span of shared dimensions). PackedMatrix
/// owns such storage; a forward call lays out K_hᵀ so
/// (DotProductStages::packed, CollabHead).
template <class T>
class Panels {
 public:
  static constexpr Index kWidth = detail::kGemmTileM;

  /// Storage of [rows, stored_cols] at `data`, viewed whole.
  Panels(const T* data, Index rows, Index stored_cols)
      : data_(data), stored_rows_(rows), rows_(rows), cols_(stored_cols), stored_cols_(stored_cols) {}

  /// Lay `b` out as panels in `out` (b.size() elements).
  template <class B>
  static void write(const Eigen::MatrixBase<B>& b, T* out) {
    write_columns(b, out, b.cols(), 0);
  }

  /// Write `b` as columns [c0, c0 + b.cols()) of the panels of a [b.rows(),
  /// stored_cols] matrix at `out`, leaving its other columns alone: column
  /// c lies in the panel at p0 = 64·⌊c / 64⌋, [rows, min(64, stored_cols -
  /// p0)] row-major from out + p0 · rows (a decoding cache appends keys so).
  template <class B>
  static void write_columns(const Eigen::MatrixBase<B>& b, T* out, Index stored_cols, Index c0) {
    const Index rows = b.rows();
    for (Index c = c0, end = c0 + b.cols(); c < end;) {
      const Index p0 = c / kWidth * kWidth, width = std::min(kWidth, stored_cols - p0);
      const Index n = std::min(end, p0 + width) - c;
      Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>(out + p0 * rows + (c - p0), rows, n, Eigen::OuterStride<>(width)) =
          b.middleCols(c - c0, n);
      c += n;
    }
  }

  /// Lay `a`ᵀ out as panels in `out` (a.size() elements), for a strided
  /// row-major `a` (K [keys, dk] for K_hᵀ): what write(a.transpose(), out)
  /// lays out, but transposed in registers, not one element at a time.
  template <class A>
  static void write_transposed(const A& a, T* out) {
    for (Index i0 = 0; i0 < a.rows(); i0 += kWidth) {
      const Index w = std::min(kWidth, a.rows() - i0);
      detail::transpose_into(a.middleRows(i0, w), out + i0 * a.cols(), w);
    }
  }

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  /// Columns from the panel boundary at or before the view's start.
  Index offset() const { return offset_; }

  /// Rows [r0, r0 + n) of this view.
  Panels middle_rows(Index r0, Index n) const {
    eigen_assert(r0 >= 0 && n >= 0 && r0 + n <= rows_);
    Panels v = *this;
    v.first_row_ += r0, v.rows_ = n;
    return v;
  }
  /// Columns [c0, c0 + n) of this view.
  Panels middle_cols(Index c0, Index n) const {
    eigen_assert(c0 >= 0 && n >= 0 && c0 + n <= cols_);
    const Index at = offset_ + c0, first = at / kWidth * kWidth;
    Panels v = *this;
    v.data_ += first * stored_rows_, v.stored_cols_ -= first, v.offset_ = at - first, v.cols_ = n;
    return v;
  }
  /// The view's rows of the stored panel holding its columns [i0, ...), the
  /// view aligned (offset() == 0) and i0 a multiple of 64: [rows, panel_cols(i0)].
  ConstMatrixMap<T> panel(Index i0) const {
    const Index w = panel_cols(i0);
    return {data_ + i0 * stored_rows_ + first_row_ * w, rows_, w};
  }
  Index panel_cols(Index i0) const { return std::min(kWidth, stored_cols_ - i0); }
  /// Where the view's first stored panel starts, at the view's first row.
  const T* start() const { return data_ + first_row_ * panel_cols(0); }
  /// The view's first columns up to the next panel boundary, as a strided
  /// block of the panel that holds them (empty when the view is aligned).
  ConstStridedMap<T> lead() const {
    const Index w = offset_ == 0 ? 0 : std::min(cols_, kWidth - offset_), ld = panel_cols(0);
    return {data_ + first_row_ * ld + offset_, rows_, w, Eigen::OuterStride<>(ld)};
  }

 private:
  const T* data_;       ///< the stored panel holding the view's first column
  Index stored_rows_;   ///< rows of every stored panel
  Index first_row_ = 0, rows_;
  Index cols_;
  Index stored_cols_;   ///< columns stored from data_ on, which fixes the last panel's width
  Index offset_ = 0;
};

/// B laid out once as Panels: for operands multiplied many times, the
/// projections' Wᵀ (Linear::prepare).
template <class T>
class PackedMatrix {
 public:
  PackedMatrix() = default;
  template <class B>
  explicit PackedMatrix(const Eigen::MatrixBase<B>& b) : rows_(b.rows()), cols_(b.cols()), data_(b.size()) {
    Panels<T>::write(b, data_.data());
  }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  Panels<T> panels() const { return {data_.data(), rows_, cols_}; }

 private:
  Index rows_ = 0, cols_ = 0;
  Vector<T> data_;
};

namespace detail {
// c (+)= a·b for a view b that starts at a panel boundary.
template <class A, class T, class C>
void gemm_aligned_panels(const Eigen::MatrixBase<A>& a, const Panels<T>& b, C&& c, bool accumulate,
                         const T* next_b) {
  eigen_assert(b.offset() == 0);
  const auto tile = [&](Index p0, Index i0) {
    const Index ld = b.panel_cols(i0);
    return std::pair(b.panel(i0).data() + p0 * ld, ld);
  };
  if (xsmm_product(a, tile, c, accumulate, next_b)) return;
  for (Index i0 = 0; i0 < b.cols(); i0 += Panels<T>::kWidth) {
    const Index w = std::min(Panels<T>::kWidth, b.cols() - i0);
    auto ci = c.middleCols(i0, w);
    if (accumulate)
      ci.noalias() += a * b.panel(i0).leftCols(w);
    else
      ci.noalias() = a * b.panel(i0).leftCols(w);
  }
}
}  // namespace detail

/// `c = a·b` (or `c += a·b`) with b in panels: under libxsmm the bits of
/// gemm() on b as it stands when the view starts at a panel boundary;
/// panel by panel on Eigen's GEMM. A view that starts inside a panel takes
/// its first columns as a strided block (a narrower kernel, which may sum
/// in another order), then the rest panel-aligned. `next_b` as for gemm().
template <class A, class T, class C>
void gemm(const Eigen::MatrixBase<A>& a, const Panels<T>& b, const Eigen::MatrixBase<C>& c_, bool accumulate = false,
          const T* next_b = nullptr) {
  auto& c = const_cast<Eigen::MatrixBase<C>&>(c_);
  static_assert(std::is_same_v<typename A::Scalar, T> && std::is_same_v<typename C::Scalar, T>);
  eigen_assert(a.rows() == c.rows() && b.cols() == c.cols() && a.cols() == b.rows());
  if (b.offset() == 0) return detail::gemm_aligned_panels(a, b, c, accumulate, next_b);
  const ConstStridedMap<T> lead = b.lead();
  gemm(a, lead, c.leftCols(lead.cols()), accumulate);
  const Index rest = b.cols() - lead.cols();
  if (rest > 0)
    detail::gemm_aligned_panels(a, b.middle_cols(lead.cols(), rest), c.rightCols(rest), accumulate, next_b);
}

template <class A, class T, class C>
void gemm(const Eigen::MatrixBase<A>& a, const PackedMatrix<T>& b, const Eigen::MatrixBase<C>& c, bool accumulate = false) {
  gemm(a, b.panels(), c, accumulate);
}

}  // namespace headmix
