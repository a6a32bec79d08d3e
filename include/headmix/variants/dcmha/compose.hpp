// DCMHA's Compose on one segment of tile rows (the same columns of
// consecutive rows) of one head group: the M head values z_m at each key
// column s become
//
//   out_n = Σ_m P[m,n] z_m  +  z_n (1 + ddq_n + ddk_n(s))
//         + Σ_i W2q[i,n] a_i  +  Σ_i W2k[i,n](s) b_i,
//   a_i = Σ_m W1q[i,m] z_m,   b_i = Σ_m W1k[i,m](s) z_m,
//
// (the query-wise factors are constants along the row, the key-wise ones
// coefficient rows along the columns; see variants/dcmha.hpp; the static
// term P is optional). Two kernels compute it: compose_lines, a line of
// every head at a time with the rank projections in registers (R = 1 or 2:
// the layer's fast path; with P, the heads too, for the group sizes that
// fit the register file),
// and compose_generic, plain vector loops for any R, which the layer runs
// on what compose_lines leaves (the row's tail, other ranks) and which is
// the reference the fast one is tested against.
#pragma once

#include "headmix/core/row_product.hpp"
#include "headmix/core/types.hpp"

#include <algorithm>
#include <type_traits>
#include <utility>

namespace headmix::detail {

/// One row segment's operands. The key-wise factors are stored as T or, from
/// a bfloat16 cache, as bfloat16 bits (K = std::uint16_t), widened as read.
/// `z` and `o` may be the same values (the layer composes in place): every
/// kernel reads a column's heads before it writes any of them.
template <class T, class K = T>
struct ComposeSegment {
  const T* z;           ///< head m's values at z + m·plane
  T* o;                 ///< head n's output at o + n·plane
  Index plane;
  const T* qf;          ///< query-wise factors of the row and group: W1 [R, M], W2 [R, M], dd [M]; or null
  const K* kf;          ///< key-wise factor row j at kf + j·rs; or null
  Index rs;
  const Matrix<T>* mix; ///< (I + P)ᵀ of the group, when static_loop
  Index M, R;
  bool static_loop;     ///< apply I + P here (else it is absent, or a GEMM's, in `base`)
  const T* base;        ///< head n's static GEMM term, (I + P) applied, to add at base + n·plane; or null
  T identity;           ///< 1, or 0 when I is part of the static term
  T* scratch;           ///< compose_scratch<T>(M, R) values
  /// Consecutive tile rows over the same columns: row p's z, o and base
  /// lie p·row_stride further, its query-wise factors p·qf_stride further;
  /// the key-wise factors are the same for all.
  Index rows = 1, row_stride = 0, qf_stride = 0;

  /// The same rows from column `x` on.
  ComposeSegment from(Index x) const {
    ComposeSegment s = *this;
    s.z += x, s.o += x;
    if (s.kf) s.kf += x;
    if (s.base) s.base += x;
    return s;
  }
  /// `count` of the rows from row p on.
  ComposeSegment rows_from(Index p, Index count) const {
    ComposeSegment s = *this;
    s.z += p * row_stride, s.o += p * row_stride;
    if (s.qf) s.qf += p * qf_stride;
    if (s.base) s.base += p * row_stride;
    s.rows = count;
    return s;
  }
};

/// Columns per generic segment: 1 KiB of one head's row, so that the
/// gathered heads stay in L1 and a chunk's key-wise rows in L2.
template <class T>
inline constexpr Index compose_chunk = 1024 / static_cast<Index>(sizeof(T));
/// Scratch values a segment needs: the gathered heads, the 2R rank
/// projections and one widened coefficient row, compose_chunk<T> each.
template <class T>
constexpr Index compose_scratch(Index M, Index R) {
  return (M + 2 * R + 1) * compose_chunk<T>;
}
/// Columns per step of compose_lines through scratch: one cache line of T.
template <class T>
inline constexpr Index compose_line = 64 / static_cast<Index>(sizeof(T));
/// Columns per step of compose_lines with the heads held: one vector register.
template <class T>
inline constexpr Index compose_register = Eigen::internal::packet_traits<T>::size;
/// Rows compose_lines takes at once where rows share their columns (no
/// static term in the kernel): each line of key-wise factors, loaded once,
/// serves them all, where one row at a time spent more on loading the
/// (2R + 1)·M factor lines than on its multiply-adds. On Zen 5 (M = 12,
/// R = 2, a [12, 64, 128] chunk in L2), a probe of this loop took 29 ns a
/// line of 16 columns and row with 4 rows at once, 35 with 2, 50 with one;
/// in DCMHA's forward the kernel's share of the time fell by 15%.
inline constexpr Index compose_rows = 4;
static_assert(compose_rows * compose_line<float> <= compose_chunk<float> &&
                  compose_rows * compose_line<double> <= compose_chunk<double>,
              "compose_lines keeps its rows' heads in compose_scratch");

/// Group sizes M for which compose_lines keeps every head's line in a
/// register: as many as leave room for the 2R rank projections and the
/// output in the register file (32 vector registers with AVX-512, else 16).
#ifdef EIGEN_VECTORIZE_AVX512
using ComposeHeldHeads = std::integer_sequence<int, 4, 8, 12, 16>;
#else
using ComposeHeldHeads = std::integer_sequence<int, 4, 8>;
#endif
template <int... Ms>
constexpr bool holds_heads(Index M, std::integer_sequence<int, Ms...>) {
  return ((M == Ms) || ...);
}
/// Whether compose_lines holds a group of M heads in registers.
constexpr bool compose_holds_heads(Index M) { return holds_heads(M, ComposeHeldHeads{}); }

/// The first (len / L) · L columns of the segment's P_ = s.rows rows, L
/// columns of every head at a time, with the 2R rank projections in
/// registers. With M_ = s.M heads known at compile time (compose_holds_heads;
/// one row) the heads' lines stay in registers as well (L =
/// compose_register<T>): the segment is read once and written once, and the
/// static term costs one broadcast per multiply-add. With M_ = 0 (any M)
/// they go through scratch, which stays in L1 (L = compose_line<T>, which
/// ran faster than a register's width with AVX2). R_ must equal s.R, QW and
/// KW whether s has query-wise and key-wise factors. Every row's arithmetic
/// is the same whatever P_. Returns the number of columns done.
template <int P_, int M_, int R_, bool QW, bool KW, class T, class K>
Index compose_lines(const ComposeSegment<T, K>& s, Index len) {
  static_assert(P_ == 1 || M_ == 0, "rows together keep their heads in scratch");
  constexpr Index L = M_ > 0 ? compose_register<T> : compose_line<T>;
  using Line = Eigen::Array<T, L, 1>;
  using CLine = Eigen::Map<const Line>;
  using WLine = Eigen::Map<Line>;
  // A line of key-wise factors, widened when stored as bfloat16 (a loop of
  // shifts, which compilers vectorise).
  const auto coefficients = [](const K* p) -> Line {
    if constexpr (std::is_same_v<K, T>) {
      return CLine(p);
    } else {
      Line v;
      for (Index j = 0; j < L; ++j) v[j] = widened<T>(p + j);
      return v;
    }
  };
  // The segment's fields as locals: the kernel's stores go through T*, which
  // could alias `s`, so the compiler would reload every field on every line.
  const Index M = M_ > 0 ? M_ : s.M, RM = R_ * M, plane = s.plane, rs = s.rs;
  const Index row_stride = s.row_stride, qf_stride = s.qf_stride;
  const T* const qf = s.qf;
  T* const scratch = s.scratch;
  const T* const mix = s.static_loop ? s.mix->data() : nullptr;  // (I + P)ᵀ: row n holds what head n takes
  const T* const base = s.base;
  const T identity = s.identity;
  // The (2R + 1)·M key-wise rows are more streams than the hardware
  // prefetchers follow, and a decoding step reads them from memory, so each
  // is prefetched a few lines ahead. Measured on AVX2 (M = 16, R = 2, 8192
  // cached keys): one compose took 0.6-0.7x its time; a step over a bfloat16
  // cache 0.84-0.88x, over a float cache within the noise; forwards, whose
  // rows come from L2, unchanged; 512 to 2048 bytes ahead gained no more.
  constexpr std::uintptr_t kFactorsAhead = 256;  // bytes
  Line held[M_ > 0 ? M_ : 1];
  auto keep = [&](Index p, Index m, const Line& v) {
    if constexpr (M_ > 0) held[m] = v; else WLine(scratch + (m * P_ + p) * L) = v;
  };
  auto head = [&](Index p, Index m) -> Line {
    if constexpr (M_ > 0) return held[m]; else return CLine(scratch + (m * P_ + p) * L);
  };
  Index x = 0;
  for (; x + L <= len; x += L) {
    const K* kf = KW ? s.kf + x : nullptr;
    Line qa[P_][R_], kb[P_][R_];
    for (int p = 0; p < P_; ++p)
      for (int i = 0; i < R_; ++i) qa[p][i].setZero(), kb[p][i].setZero();
    for (Index m = 0; m < M; ++m) {
      Line w1k[R_];  // this head's key-wise W1 lines, for every row
      if constexpr (KW) {
        for (int i = 0; i < R_; ++i) {
          prefetch(kf + (i * M + m) * rs, kFactorsAhead);
          prefetch(kf + (RM + i * M + m) * rs, kFactorsAhead);
          w1k[i] = coefficients(kf + (i * M + m) * rs);
        }
        prefetch(kf + (2 * RM + m) * rs, kFactorsAhead);
      }
      // Unrolled (GCC kept the rows' loop, and the accumulators on the stack).
#pragma GCC unroll 8
      for (int p = 0; p < P_; ++p) {
        const Line zm = CLine(s.z + p * row_stride + x + m * plane);
        keep(p, m, zm);
        for (int i = 0; i < R_; ++i) {
          if constexpr (QW) qa[p][i] += qf[p * qf_stride + i * M + m] * zm;
          if constexpr (KW) kb[p][i] += w1k[i] * zm;
        }
      }
    }
    for (Index n = 0; n < M; ++n) {
      Line ddk, w2k[R_];  // head n's key-wise diagonal and W2 lines, for every row
      if constexpr (KW) {
        ddk = coefficients(kf + (2 * RM + n) * rs);
        for (int i = 0; i < R_; ++i) w2k[i] = coefficients(kf + (RM + i * M + n) * rs);
      }
#pragma GCC unroll 8
      for (int p = 0; p < P_; ++p) {
        const T* const qfp = qf + p * qf_stride;
        T diag = identity;
        if constexpr (QW) diag += qfp[2 * RM + n];
        Line on;
        if constexpr (KW)
          on = (ddk + diag) * head(p, n);
        else
          on = diag * head(p, n);
        if (mix) {
          for (Index m = 0; m < M; ++m) on += mix[n * M + m] * head(p, m);
        } else if (base) {
          on += CLine(base + p * row_stride + x + n * plane);
        }
        for (int i = 0; i < R_; ++i) {
          if constexpr (QW) on += qfp[RM + i * M + n] * qa[p][i];
          if constexpr (KW) on += w2k[i] * kb[p][i];
        }
        WLine(s.o + p * row_stride + x + n * plane) = on;
      }
    }
  }
  return x;
}

/// compose_lines for s's factors, on P_ rows, at rank R_ and M_ heads.
template <int P_, int M_, int R_, class T, class K>
Index compose_lines_with(const ComposeSegment<T, K>& s, Index len) {
  if (s.qf && s.kf) return compose_lines<P_, M_, R_, true, true>(s, len);
  if (s.qf) return compose_lines<P_, M_, R_, true, false>(s, len);
  if (s.kf) return compose_lines<P_, M_, R_, false, true>(s, len);
  return compose_lines<P_, M_, R_, false, false>(s, len);
}

/// compose_lines at rank R_ on one row, with its heads in registers when the
/// kernel applies the static term and can hold them. Without the static
/// term, holding them measured no faster (forward and decoding, M = 12 and 16).
template <int R_, class T, class K, int... Ms>
Index compose_row_of_rank(const ComposeSegment<T, K>& s, Index len, std::integer_sequence<int, Ms...>) {
  Index done = 0;
  const bool held = s.static_loop && ((s.M == Ms && (done = compose_lines_with<1, Ms, R_>(s, len), true)) || ...);
  return held ? done : compose_lines_with<1, 0, R_>(s, len);
}

/// All `len` columns of the segment (any R), compose_chunk<T> at a time:
/// gather the heads into scratch, form the rank projections a_i and b_i,
/// then each output head.
template <class T, class K>
void compose_generic(const ComposeSegment<T, K>& s, Index len) {
  using Arr = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
  using CArr = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
  constexpr Index CH = compose_chunk<T>;
  const Index M = s.M, R = s.R, RM = R * M;
  const bool qw = s.qf != nullptr, kw = s.kf != nullptr, sw = s.static_loop || s.base;
  T* zbuf = s.scratch;
  T* acc = zbuf + M * CH;  // a_i at acc + i·CH (query-wise), b_i at acc + (R + i)·CH (key-wise)
  T* wide = acc + 2 * R * CH;
  // n key-wise factors from p; stored as bfloat16, widened into `wide` (a
  // loop of shifts, which compilers vectorise), which each use below reads
  // before the next widening.
  const auto coefficients = [&](const K* p, Index n) {
    if constexpr (!std::is_same_v<K, T>) {
      for (Index j = 0; j < n; ++j) wide[j] = widened<T>(p + j);
      return CArr(wide, n);
    } else {
      return CArr(p, n);
    }
  };
  for (Index x0 = 0; x0 < len; x0 += CH) {
    const Index n_cols = std::min(CH, len - x0);
    const T* z = s.z + x0;
    T* o = s.o + x0;
    const K* kf = kw ? s.kf + x0 : nullptr;
    for (Index m = 0; m < M; ++m) {
      Arr zm(zbuf + m * CH, n_cols);
      zm = CArr(z + m * s.plane, n_cols);
      for (Index i = 0; i < R; ++i) {
        if (qw) {
          Arr a(acc + i * CH, n_cols);
          if (m == 0) a = s.qf[i * M + m] * zm; else a += s.qf[i * M + m] * zm;
        }
        if (kw) {
          Arr b(acc + (R + i) * CH, n_cols);
          const auto c = coefficients(kf + (i * M + m) * s.rs, n_cols);
          if (m == 0) b = c * zm; else b += c * zm;
        }
      }
    }
    for (Index n = 0; n < M; ++n) {
      const CArr zn(zbuf + n * CH, n_cols);
      Arr on(o + n * s.plane, n_cols);
      if (s.static_loop) {
        on = (*s.mix)(n, 0) * CArr(zbuf, n_cols);
        for (Index m = 1; m < M; ++m) on += (*s.mix)(n, m) * CArr(zbuf + m * CH, n_cols);
      } else if (s.base) {
        on = CArr(s.base + x0 + n * s.plane, n_cols);
      }
      const T diag = s.identity + (qw ? s.qf[2 * RM + n] : T(0));
      if (kw) {
        const auto ddk = coefficients(kf + (2 * RM + n) * s.rs, n_cols);
        if (sw) on += (ddk + diag) * zn; else on = (ddk + diag) * zn;
      } else {
        if (sw) on += diag * zn; else on = diag * zn;
      }
      for (Index i = 0; i < R; ++i) {
        if (qw) on += s.qf[RM + i * M + n] * CArr(acc + i * CH, n_cols);
        if (kw) on += coefficients(kf + (RM + i * M + n) * s.rs, n_cols) * CArr(acc + (R + i) * CH, n_cols);
      }
    }
  }
}

/// The whole segment, every row: compose_lines where it applies (without a
/// static term in the kernel, compose_rows rows at a time), compose_generic
/// on the rest (`generic_only`: all of it, the reference path).
template <class T, class K>
void compose_segment(const ComposeSegment<T, K>& s, Index len, bool generic_only = false) {
  const bool fast = !generic_only && (s.R == 1 || s.R == 2);
  Index p = 0;
  if (fast && !s.static_loop)
    for (; p + compose_rows <= s.rows; p += compose_rows) {
      const ComposeSegment<T, K> rows = s.rows_from(p, compose_rows);
      const Index done = s.R == 2 ? compose_lines_with<compose_rows, 0, 2>(rows, len)
                                  : compose_lines_with<compose_rows, 0, 1>(rows, len);
      for (Index i = 0; i < compose_rows && done < len; ++i)
        compose_generic(rows.rows_from(i, 1).from(done), len - done);
    }
  for (; p < s.rows; ++p) {
    const ComposeSegment<T, K> row = s.rows_from(p, 1);
    const Index done = !fast      ? 0
                       : s.R == 2 ? compose_row_of_rank<2>(row, len, ComposeHeldHeads{})
                                  : compose_row_of_rank<1>(row, len, ComposeHeldHeads{});
    if (done < len) compose_generic(row.from(done), len - done);
  }
}

}  // namespace headmix::detail
