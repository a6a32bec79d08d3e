// One query row (or a few: multiply_few_rows) times stored rows, the
// readout of a decoding step, and how a cache's bfloat16 values become T.
//
// A step multiplies one row of weights by every value row of a head
// ([keys, dv]): a matrix-vector product bound by reading the rows. Read as
// four quarters at once, each into sums of its own (as the bench's read
// yardstick reads), 16 heads' V at S = 8192 (32 MiB) took 0.78-0.87x the
// time of libxsmm's one-row GEMM on the AMD VM of
// docs/bench/reproducibility.md (medians of 300, three alternating rounds,
// twice). The quarters' sums add in a fixed order: a result depends on
// the number of rows only, never on a thread count.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/gemm.hpp"
#include "headmix/core/types.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace headmix {

/// A bfloat16's bits as the float whose top 16 bits they are: widening is a
/// shift, which compilers vectorise (Eigen 3.4's cast converted value by
/// value: steps took twice as long).
inline float bfloat16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t word = std::uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

/// *p as a T, from a T or from bfloat16 bits.
template <class T>
T widened(const T* p) {
  return *p;
}
template <class T>
T widened(const std::uint16_t* p) {
  return static_cast<T>(bfloat16_bits_to_float(*p));
}

inline const std::uint16_t* bfloat16_bits(const Eigen::bfloat16* in) { return reinterpret_cast<const std::uint16_t*>(in); }

/// out[i] = in[i] for n bfloat16 values.
template <class T>
void widen_bfloat16(const Eigen::bfloat16* in, Index n, T* out) {
  const std::uint16_t* bits = bfloat16_bits(in);
  for (Index i = 0; i < n; ++i) out[i] = static_cast<T>(bfloat16_bits_to_float(bits[i]));
}

namespace detail {

/// A hint to fetch the line `bytes` past `p` into the caches. The address
/// is formed as an integer: it may lie past the end of p's array.
inline void prefetch(const void* p, std::uintptr_t bytes) {
#if defined(__GNUC__)
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + bytes));
#else
  (void)p, (void)bytes;
#endif
}

#if defined(__AVX512BW__)
/// accumulate_rows' float kernel for 64 columns of bfloat16 rows: the same
/// four parts, sums and order. A 64-byte load widens by two in-lane unpacks
/// against zero (each bfloat16 lands in the top half of a float), which
/// leaves the columns permuted within 128-bit lanes; the sums keep that
/// order and are put back at the end. Half the instructions of widening
/// 16 values at a time, and four streams in flight instead of one.
inline void add_bfloat16_quarters_64(const float* weights, const std::uint16_t* rows, Index n, Index stride,
                                     float* out, bool accumulate) {
  const __m512i zero = _mm512_setzero_si512();
  __m512 sums[4][4];  // [part][packet]
  for (auto& part : sums)
    for (__m512& s : part) s = _mm512_setzero_ps();
  auto add_row = [&](__m512 (&s)[4], Index r) {
    const std::uint16_t* row = rows + r * stride;
    const __m512 a = _mm512_set1_ps(weights[r]);
    const __m512i left = _mm512_loadu_si512(row), right = _mm512_loadu_si512(row + 32);
    s[0] = _mm512_fmadd_ps(a, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, left)), s[0]);
    s[1] = _mm512_fmadd_ps(a, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, left)), s[1]);
    s[2] = _mm512_fmadd_ps(a, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, right)), s[2]);
    s[3] = _mm512_fmadd_ps(a, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, right)), s[3]);
  };
  const Index q = n / 4;
  for (Index i = 0; i < q; ++i)
    for (int p = 0; p < 4; ++p) add_row(sums[p], p * q + i);
  for (Index r = 4 * q; r < n; ++r) add_row(sums[0], r);
  alignas(64) float total[64];
  for (int k = 0; k < 4; ++k)
    _mm512_store_ps(total + 16 * k, _mm512_add_ps(_mm512_add_ps(sums[0][k], sums[1][k]),
                                                  _mm512_add_ps(sums[2][k], sums[3][k])));
  // Packet k's value e is column 32 (k / 2) + 8 (e / 4) + 4 (k % 2) + e % 4.
  for (int k = 0; k < 4; ++k)
    for (int e = 0; e < 16; ++e) {
      float& o = out[32 * (k / 2) + 8 * (e / 4) + 4 * (k % 2) + e % 4];
      o = accumulate ? o + total[16 * k + e] : total[16 * k + e];
    }
}
#endif

/// 16 bfloat16 values from their bits, widened in registers (a loop of
/// shifts, which compilers vectorise).
template <class T>
Eigen::Array<T, 16, 1> widened_16(const std::uint16_t* p) {
  Eigen::Array<T, 16, 1> v;
  for (int j = 0; j < 16; ++j) v[j] = widened<T>(p + j);
  return v;
}

/// accumulate_rows on rows stored as T or as bfloat16 bits.
template <class T, class Stored>
void accumulate_rows_in_quarters(const T* weights, const Stored* rows, Index n, Index stride, Index width, T* out,
                                 bool accumulate) {
  using Packet = Eigen::Array<T, 16, 1>;
  constexpr int kParts = 4, kPackets = 4;  // 64 columns at a time
  const Index q = n / kParts;
  auto row = [&](Index r, Index j) {
    if constexpr (std::is_same_v<Stored, T>)
      return Eigen::Map<const Packet>(rows + r * stride + j);
    else
      return widened_16<T>(rows + r * stride + j);
  };
  auto finish = [&](Index j, T s0, T s1, T s2, T s3) {
    const T sum = (s0 + s1) + (s2 + s3);
    out[j] = accumulate ? out[j] + sum : sum;
  };
  Index j0 = 0;
  for (; j0 + 16 * kPackets <= width; j0 += 16 * kPackets) {
    Packet sums[kParts][kPackets];
    for (auto& part : sums)
      for (Packet& s : part) s.setZero();
    for (Index i = 0; i < q; ++i)
      for (int p = 0; p < kParts; ++p) {
        const T a = weights[p * q + i];
        for (int k = 0; k < kPackets; ++k) sums[p][k] += a * row(p * q + i, j0 + 16 * k);
      }
    for (Index r = kParts * q; r < n; ++r)
      for (int k = 0; k < kPackets; ++k) sums[0][k] += weights[r] * row(r, j0 + 16 * k);
    for (int k = 0; k < kPackets; ++k)
      for (int j = 0; j < 16; ++j) finish(j0 + 16 * k + j, sums[0][k][j], sums[1][k][j], sums[2][k][j], sums[3][k][j]);
  }
  if (j0 == width) return;
  // The last width mod 64 columns: the same parts and order in one more
  // pass over the rows (a column at a time would reread every row per column).
  const Index m = width - j0;
  T sums[kParts][16 * kPackets] = {};
  for (Index i = 0; i < q; ++i)
    for (int p = 0; p < kParts; ++p) {
      const T a = weights[p * q + i];
      const Stored* r = rows + (p * q + i) * stride + j0;
      for (Index j = 0; j < m; ++j) sums[p][j] += a * widened<T>(r + j);
    }
  for (Index r = kParts * q; r < n; ++r)
    for (Index j = 0; j < m; ++j) sums[0][j] += weights[r] * widened<T>(rows + r * stride + j0 + j);
  for (Index j = 0; j < m; ++j) finish(j0 + j, sums[0][j], sums[1][j], sums[2][j], sums[3][j]);
}
}  // namespace detail

/// out [1, width] (+)= weights [1, n] · rows [n, width], rows `stride`
/// values apart: four quarters of the rows stream at once, each part
/// [p · q, (p + 1) · q), q = n / 4 (part 0 also the last n mod 4), into
/// sums of its own in registers (fixed-size packets: scalar arrays went to
/// the stack, a store and reload per row), which then add as (0 + 1) + (2 + 3).
template <class T>
void accumulate_rows(const T* weights, const T* rows, Index n, Index stride, Index width, T* out, bool accumulate) {
  detail::accumulate_rows_in_quarters(weights, rows, n, stride, width, out, accumulate);
}

/// The same from bfloat16 rows, half the bytes, each row widened in
/// registers as it streams past (widening a block first would write and
/// reread it), in the same four quarters. With AVX-512BW, float sums over
/// full 64-column chunks take detail::add_bfloat16_quarters_64 (half the
/// instructions). The quarters replaced one pass over the rows: on Zen 3
/// (AVX2) one stream kept too few reads in flight, and an MHA step over a
/// bfloat16 cache took 0.89x its time in quarters (0.87x with bfloat16
/// weights, whose one-row projections stream here too); with AVX-512
/// (Zen 5) the AVX-512 kernel took 0.92x the time of one pass.
template <class T>
void accumulate_rows(const T* weights, const Eigen::bfloat16* rows, Index n, Index stride, Index width, T* out,
                     bool accumulate) {
  const std::uint16_t* bits = bfloat16_bits(rows);
  Index j0 = 0;
#if defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, float>)
    for (; j0 + 64 <= width; j0 += 64)
      detail::add_bfloat16_quarters_64(weights, bits + j0, n, stride, out + j0, accumulate);
#endif
  detail::accumulate_rows_in_quarters(weights, bits + j0, n, stride, width - j0, out + j0, accumulate);
}

/// The most rows of weights multiply_few_rows takes: a grouped-query
/// step's heads per KV head, up to 8 ([8, 32] float sums fill 16 AVX-512
/// registers).
constexpr Index kFewRows = 8;

namespace detail {

/// Columns [0, M) of out's R rows (M = 0: m columns, m <= 32, known only
/// when run) over all n stored rows, the sums in registers. Each row is
/// prefetched two cache lines ahead: walking a 32-column chunk down the
/// rows of K_hᵀ touches a line in each of dk rows, a pattern the hardware
/// prefetchers do not follow (a grouped-query step took 0.85-1.0x its
/// former time without the prefetch, 0.62-0.70x with it).
template <int R, Index M, class T, class Stored>
void add_few_rows(const T* weights, Index weight_stride, const Stored* rows, Index n, Index stride, Index m, T* out,
                  Index out_stride) {
  constexpr Index kMax = M > 0 ? M : 32;
  constexpr std::uintptr_t kAhead = 128;  // bytes
  const Index width = M > 0 ? M : m;
  T sum[R][kMax];
  for (int r = 0; r < R; ++r)
    for (Index j = 0; j < width; ++j) sum[r][j] = out[r * out_stride + j];
  for (Index i = 0; i < n; ++i) {
    T value[kMax];
    prefetch(rows + i * stride, kAhead);
    for (Index j = 0; j < width; ++j) value[j] = widened<T>(rows + i * stride + j);
    for (int r = 0; r < R; ++r) {
      const T a = weights[r * weight_stride + i];
      for (Index j = 0; j < width; ++j) sum[r][j] += a * value[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (Index j = 0; j < width; ++j) out[r * out_stride + j] = sum[r][j];
}

template <int R, class T, class Stored>
void multiply_few_rows(const T* weights, Index weight_stride, const Stored* rows, Index n, Index stride, Index width,
                       T* out, Index out_stride) {
  constexpr Index kColumns = 32;
  Index j0 = 0;
  for (; j0 + kColumns <= width; j0 += kColumns)
    add_few_rows<R, kColumns>(weights, weight_stride, rows + j0, n, stride, kColumns, out + j0, out_stride);
  if (j0 < width) add_few_rows<R, 0>(weights, weight_stride, rows + j0, n, stride, width - j0, out + j0, out_stride);
}

}  // namespace detail

/// out [R, width] (+)= weights [R, n] · rows [n, width] for R <= kFewRows
/// rows of weights (weight_stride apart; out's rows out_stride apart) and
/// n bfloat16 rows (`stride` apart): a step's few query rows against a
/// head's keys in rows (a few tokens) or its values (those, or a KV
/// group's heads, or with AVX-512 its keys, one panel at a time). Each
/// stored value is widened in registers once for all R rows, 32 columns at
/// a time down all n rows, where a GEMM would first widen the rows into a
/// buffer and then read them again: a grouped-query step (8 heads per KV
/// head, S = 8192) over a bfloat16 cache with K in rows took 0.62-0.70x the
/// time. Over a float cache the GEMM stays: this order took 1.8x its time
/// there. Every sum adds its n products in the order i = 0, 1, ..., whatever R.
template <class T>
void multiply_few_rows(Index R, const T* weights, Index weight_stride, const Eigen::bfloat16* rows, Index n,
                       Index stride, Index width, T* out, Index out_stride, bool accumulate) {
  HEADMIX_ASSERT(R >= 0 && R <= kFewRows);
  if (!accumulate)
    for (Index r = 0; r < R; ++r) std::fill_n(out + r * out_stride, width, T(0));
  auto run = [&](auto rows_known) {
    detail::multiply_few_rows<decltype(rows_known)::value>(weights, weight_stride, bfloat16_bits(rows), n, stride,
                                                           width, out, out_stride);
  };
  switch (R) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 5: return run(std::integral_constant<int, 5>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 7: return run(std::integral_constant<int, 7>{});
    case 8: return run(std::integral_constant<int, 8>{});
    default: return;  // no rows (or, past the assertion, too many: nothing written)
  }
}

/// out (+)= weights · values: one row of weights streams over the value
/// rows (accumulate_rows), several run a GEMM (`next_values` as gemm()'s next_b).
template <class Weights, class Values, class Out>
void multiply_rows(const Weights& weights, const Values& values, Out&& out, bool accumulate,
                   const typename std::decay_t<Out>::Scalar* next_values = nullptr) {
  if constexpr (detail::row_major_direct<Weights>() && detail::row_major_direct<Values>() &&
                detail::row_major_direct<std::decay_t<Out>>()) {
    if (weights.rows() == 1 && weights.innerStride() == 1 && values.innerStride() == 1 && out.innerStride() == 1)
      return accumulate_rows(weights.data(), values.data(), values.rows(), values.outerStride(), values.cols(),
                             out.data(), accumulate);
  }
  gemm(weights, values, out, accumulate, next_values);
}

}  // namespace headmix
