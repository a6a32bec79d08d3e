// The score and readout stages of dot-product attention, shared by every
// variant whose scores are Q_a K_aᵀ per head (MHA, Talking-Heads, DCMHA).
//
// Q is a row-major [rows, heads · dim] buffer, batch item b's rows starting
// at row b · queries. K and V are the same, with key_stride rows per item
// (S), or head-major (head_major_kv): K_hᵀ [B, heads, dk, kt_stride] and
// V_h [B, heads, key_stride, dv], as packed() copies them (kt_stride =
// key_stride = S) and a decoding cache stores them (sequence_cache.hpp;
// key_stride = its capacity, kt_stride its padded stride). Grouped-query
// attention maps heads onto fewer stored K/V heads in contiguous groups:
// score head a reads K head a / k_group, value head c reads V head
// c / v_group (groups of 1: one K/V head per head).
//
// A forward call packs K and V once (packed()): K_hᵀ as [dk, keys] per head
// in Panels, the order the GEMM reads it, and V_h as [keys, dv], so that
// every block's product reads contiguous runs. A decoding step reads them
// from the cache (reading()), which stores K_hᵀ row by row (a step appends
// a column to every row) and V_h alike, in bfloat16 when the cache holds
// them so: a step's one query row streams over the stored rows,
// multiplying (and widening, in registers) as it goes (stream_key_rows;
// row_product.hpp for V). From a bfloat16 cache, a few rows (a KV group's
// heads, a few tokens) stream too, each value widened once for all of them
// (multiply_few_rows); many (a prompt) run GEMMs, on blocks widened into
// worker scratch just before their product; from a full cache, more than
// one row runs a GEMM. A cache that a grouped-query layer binds keeps K_hᵀ
// in Panels instead (KeyLayout::panels), as packed() does: its steps score
// a KV group's heads as one product, never one row alone, over contiguous
// panels (from a bfloat16 cache, with AVX-512, up to kFewRows rows stream
// over each panel, widening it in registers; else a GEMM over a block of
// panels widened at a time).
#pragma once

#include "headmix/core/gemm.hpp"
#include "headmix/core/parallel.hpp"
#include "headmix/core/row_product.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace headmix {

template <class T>
struct DotProductStages {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  Index queries = 0, key_stride = 0;
  Index q_heads = 1, k_heads = 1, v_heads = 1;  ///< heads stored in Q, K and V
  Index dk = 0, dv = 0;
  Index k_group = 1, v_group = 1;               ///< score heads per K head, value heads per V head
  bool head_major_kv = false;                   ///< K and V as [B, heads, key_stride, dim]
  const T* kt = nullptr;                        ///< instead of k: K_hᵀ as [B, k_heads, dk, kt_stride]
  Index kt_stride = 0;                          ///< elements between rows of K_hᵀ (>= key_stride)
  bool kt_panels = false;                       ///< each K_hᵀ [dk, kt_stride] stored as Panels (packed())
  using Half = Eigen::bfloat16;
  const Half* k_half = nullptr;                 ///< instead of kt and v, laid out alike in bfloat16 (reading())
  const Half* v_half = nullptr;
  /// Every head is scored over the same keys in turn, then every head's
  /// values are read in turn, from K and V too large for L2: the variants
  /// that mix heads (DCMHA over chunks of keys, detail::mix_in_key_chunks;
  /// Talking-Heads over a block's keys). Each product then fetches the next
  /// head's K_hᵀ or V_h block into L2 while it runs (gemm's next_b), which
  /// the hardware prefetchers, not knowing the order, do not: forwards took
  /// 0.91x (DCMHA) and 0.96x (Talking-Heads) their time at T = 2048 (1
  /// thread, D = 768). Heads that run alone (MHA) keep their own K_h and V_h
  /// in L2 and leave this off.
  bool heads_in_turn = false;

  /// Consecutive heads that read the same K and V, which the pipeline runs
  /// together over each key block (grouped-query attention).
  Index kv_sharing_heads() const { return k_group == v_group ? k_group : 1; }

  /// out [rows, cols] = Q_a[q0 .. q0 + rows) · K_{a / k_group}[k0 .. k0 + cols)ᵀ of batch item b.
  void score(Index b, Index a, Eigen::Map<Matrix<T>> out, Index q0, Index k0, Workspace<T>& ws, int w) const {
    const ConstStridedMap<T> qa(q + (b * queries + q0) * q_heads * dk + a * dk, out.rows(), dk,
                                Eigen::OuterStride<>(q_heads * dk));
    Index next = -1;  // the next head's K head, when heads are scored in turn and it is another
    if (heads_in_turn && a + 1 < q_heads && (a + 1) / k_group != a / k_group) next = (a + 1) / k_group;
    multiply_by_keys(qa, b, a / k_group, k0, out, ws, w, next);
  }
  /// out [count, cols]: row i = Q_{a0 + i}[q0] · K_{a0 / k_group}[k0 .. k0 + cols)ᵀ, the scores of
  /// `count` heads that share a K head, for one query: one product where
  /// per-head scores would be `count` matrix-vector products.
  void score_group(Index b, Index a0, Index count, Eigen::Map<Matrix<T>> out, Index q0, Index k0, Workspace<T>& ws,
                   int w) const {
    const ConstStridedMap<T> qs(q + (b * queries + q0) * q_heads * dk + a0 * dk, count, dk, Eigen::OuterStride<>(dk));
    multiply_by_keys(qs, b, a0 / k_group, k0, out, ws, w);
  }
  /// These stages with K_hᵀ and V_h copied once into the head-major shared
  /// Workspace slots (slot::packed_key, slot::packed_value), for `batch`
  /// items of `keys` rows: a forward call's many query blocks then multiply
  /// contiguous runs, not every interleaved row. K_hᵀ goes in Panels, the
  /// order the GEMM reads it. Stages already head-major (a cache's) are used
  /// as they are.
  DotProductStages packed(Index batch, Index keys, Workspace<T>& ws, int threads) const {
    if (head_major_kv) return *this;
    DotProductStages p = *this;
    T* kp = ws.shared(slot::packed_key, batch * k_heads * dk * keys);
    T* vp = ws.shared(slot::packed_value, batch * v_heads * keys * dv);
    parallel_for(batch * (k_heads + v_heads), threads, [&](Index task, int) {
      const Index b = task / (k_heads + v_heads), h = task % (k_heads + v_heads);
      if (h < k_heads)
        Panels<T>::write_transposed(kv_rows(k, k_heads, dk, b, h, 0, keys), kp + (b * k_heads + h) * dk * keys);
      else
        MatrixMap<T>(vp + (b * v_heads + h - k_heads) * keys * dv, keys, dv) =
            kv_rows(v, v_heads, dv, b, h - k_heads, 0, keys);
    });
    p.k = nullptr, p.kt = kp, p.v = vp, p.key_stride = p.kt_stride = keys, p.head_major_kv = p.kt_panels = true;
    return p;
  }

  /// These stages reading K_hᵀ and V_h from streams 0 and 1 of a decoding
  /// cache (laid out as packed() lays them out, `key_stride` = its capacity,
  /// K_hᵀ in rows or in panels), full or bfloat16.
  /// For a bfloat16 cache, sizes every worker's widening
  /// scratch for a full cache now, outside the parallel region, so that
  /// steps allocate nothing.
  DotProductStages reading(const SequenceCache<T>& cache, Workspace<T>& ws, int threads) const {
    HEADMIX_ASSERT(cache.transposed(0));
    DotProductStages p = *this;
    p.kt_panels = cache.key_layout() == KeyLayout::panels;
    p.key_stride = cache.capacity(), p.kt_stride = p.kt_panels ? cache.capacity() : cache.transposed_stride();
    p.head_major_kv = true;
    p.k = p.kt = p.v = nullptr;
    if (cache.is_half(0)) {
      p.k_half = cache.half_stream(0), p.v_half = cache.half_stream(1);
      ws.reserve_local(std::max(1, threads), slot::widened_key, cache.capacity() * dk);
      ws.reserve_local(std::max(1, threads), slot::widened_value, cache.capacity() * dv);
    } else {
      p.kt = cache.stream_data(0), p.v = cache.stream_data(1);
    }
    return p;
  }

  /// Rows [k0, k0 + count) of V_{c / v_group} of batch item b: [count, dv]
  /// (from a bfloat16 cache: widened into worker w's scratch).
  ConstStridedMap<T> values(Index b, Index c, Index k0, Index count, Workspace<T>& ws, int w) const {
    if (v_half) {
      T* out = ws.local(w, slot::widened_value, count * dv);
      widen_bfloat16(v_half + ((b * v_heads + c / v_group) * key_stride + k0) * dv, count * dv, out);
      return {out, count, dv, Eigen::OuterStride<>(dv)};
    }
    return kv_rows(v, v_heads, dv, b, c / v_group, k0, count);
  }

  /// out (+)= weights · V_{c / v_group}[k0 .. k0 + weights.cols()) of batch
  /// item b (multiply_rows over values()), or, for up to kFewRows rows of
  /// weights over a bfloat16 cache (a decoding step), one streaming pass
  /// over the stored rows.
  template <class Weights, class Out>
  void multiply_values(const Weights& weights, Index b, Index c, Index k0, Out&& out, bool accumulate,
                       Workspace<T>& ws, int w) const {
    if (v_half && weights.rows() == 1 && weights.innerStride() == 1 && out.innerStride() == 1)
      return accumulate_rows(weights.data(), v_half + ((b * v_heads + c / v_group) * key_stride + k0) * dv,
                             weights.cols(), dv, dv, out.data(), accumulate);
    if constexpr (detail::row_major_direct<Weights>() && detail::row_major_direct<std::decay_t<Out>>()) {
      if (v_half && weights.rows() <= kFewRows && weights.innerStride() == 1 && out.innerStride() == 1)
        return multiply_few_rows(weights.rows(), weights.data(), weights.outerStride(),
                                 v_half + ((b * v_heads + c / v_group) * key_stride + k0) * dv, weights.cols(), dv,
                                 dv, out.data(), out.outerStride(), accumulate);
    }
    const T* next_values = nullptr;  // the next head's V rows, when heads are read in turn and it has others
    if (heads_in_turn && v && c + 1 < v_heads * v_group && (c + 1) / v_group != c / v_group)
      next_values = kv_rows(v, v_heads, dv, b, (c + 1) / v_group, k0, 0).data();
    multiply_rows(weights, values(b, c, k0, weights.cols(), ws, w), out, accumulate, next_values);
  }

 private:
  // out = lhs · K_h[k0 .. k0 + out.cols())ᵀ, from K_hᵀ (packed, cached, or
  // a bfloat16 cache's widened block) when there is one; K head `next`'s
  // same columns fetched meanwhile (packed, when next >= 0).
  template <class Lhs>
  void multiply_by_keys(const Lhs& lhs, Index b, Index h, Index k0, Eigen::Map<Matrix<T>> out, Workspace<T>& ws,
                        int w, Index next = -1) const {
    const Index cols = out.cols();
    if (kt && kt_panels) {
      const auto keys_of = [&](Index head) {
        return Panels<T>(kt + (b * k_heads + head) * dk * kt_stride, dk, kt_stride).middle_cols(k0, cols);
      };
      gemm(lhs, keys_of(h), out, false, next >= 0 ? keys_of(next).start() : nullptr);
    } else if (k_half && kt_panels && kFewRowsOverPanels && lhs.rows() <= kFewRows) {
      const Panels<Half> keys(k_half + (b * k_heads + h) * dk * kt_stride, dk, kt_stride);
      for (Index c = k0, end = k0 + cols; c < end;) {  // a panel at a time: [dk, width] rows `width` apart
        const Index p0 = c / Panels<Half>::kWidth * Panels<Half>::kWidth, width = keys.panel_cols(p0);
        const Index stop = std::min(end, p0 + width);  // one past this panel's last column, or the view's end
        multiply_few_rows(lhs.rows(), lhs.data(), lhs.outerStride(), keys.panel(p0).data() + (c - p0), dk, width,
                          stop - c, out.data() + (c - k0), cols, false);
        c = stop;
      }
    } else if (k_half && kt_panels) {  // whole panels widened ~64 KiB at a time, read by the GEMM from L2
      const Half* head = k_half + (b * k_heads + h) * dk * kt_stride;
      for (Index c0 = 0; c0 < cols;) {
        // Panels [p0, p1) hold columns k0 + c0 onwards; widened, they are
        // Panels of p1 - p0 columns (p1 a panel boundary or the capacity).
        const Index p0 = (k0 + c0) / Panels<T>::kWidth * Panels<T>::kWidth;
        const Index p1 = std::min(kt_stride, p0 + widening_chunk()), n = std::min(cols - c0, p1 - (k0 + c0));
        T* keys_t = ws.local(w, slot::widened_key, dk * (p1 - p0));
        widen_bfloat16(head + p0 * dk, (p1 - p0) * dk, keys_t);
        gemm(lhs, Panels<T>(keys_t, dk, p1 - p0).middle_cols(k0 + c0 - p0, n), out.middleCols(c0, n));
        c0 += n;
      }
    } else if (kt && lhs.rows() == 1) {
      stream_key_rows(lhs, kt + (b * k_heads + h) * dk * kt_stride + k0, cols, out.data());
    } else if (kt) {
      gemm(lhs, ConstStridedMap<T>(kt + (b * k_heads + h) * dk * kt_stride + k0, dk, cols,
                                   Eigen::OuterStride<>(kt_stride)),
           out);
    } else if (k_half && lhs.rows() == 1) {
      stream_key_rows(lhs, bfloat16_bits(k_half + (b * k_heads + h) * dk * kt_stride + k0), cols, out.data());
    } else if (k_half && lhs.rows() <= kFewRows) {
      multiply_few_rows(lhs.rows(), lhs.data(), lhs.outerStride(), k_half + (b * k_heads + h) * dk * kt_stride + k0,
                        dk, kt_stride, cols, out.data(), cols, false);
    } else if (k_half) {  // many rows reuse each widened block: widened ~64 KiB at a time, read by the GEMM from L2
      const Index chunk = widening_chunk();
      T* keys_t = ws.local(w, slot::widened_key, dk * std::min(chunk, cols));
      const Half* from = k_half + (b * k_heads + h) * dk * kt_stride + k0;
      for (Index c0 = 0; c0 < cols; c0 += chunk) {
        const Index n = std::min(chunk, cols - c0);
        for (Index d = 0; d < dk; ++d) widen_bfloat16(from + d * kt_stride + c0, n, keys_t + d * n);
        gemm(lhs, ConstStridedMap<T>(keys_t, dk, n, Eigen::OuterStride<>(n)), out.middleCols(c0, n));
      }
    } else {
      out.noalias() = lhs * kv_rows(k, k_heads, dk, b, h, k0, cols).transpose();
    }
  }

  // Whether a KV group's few rows stream over a bfloat16 cache's panels
  // (multiply_few_rows) instead of a GEMM over widened panels. With AVX-512
  // its [8, 32] sums take half the registers, and a grouped-query step took
  // 0.84-0.94x the GEMM's time (Zen 5, S = 2048 and 8192, the same bits).
  // With AVX2 they would take all 32 of 16, and the GEMM was the faster
  // there (Zen 3: 0.85-0.95x the few-row product over rows).
  static constexpr bool kFewRowsOverPanels =
#if defined EIGEN_VECTORIZE_AVX512
      true;
#else
      false;
#endif

  // Keys per block of a bfloat16 K_hᵀ widened for a GEMM: ~64 KiB of T, a
  // whole number of panels.
  Index widening_chunk() const {
    constexpr Index kWidth = Panels<T>::kWidth;
    return std::max(kWidth, 65536 / static_cast<Index>(sizeof(T)) / std::max<Index>(1, dk) / kWidth * kWidth);
  }

  // o [cols] = one query's scores over a cache's K_hᵀ rows at `from`, read
  // whole eight rows at a time (widened in registers if bfloat16), the
  // scores in L1 meanwhile. Eight streams keep more reads in flight than
  // one row at a time (a step took 0.76-0.91x its time, float and
  // bfloat16; sixteen, as a loop over the rows, ran slower on float), and
  // each score still adds its products in the order d = 0, 1, ..., the
  // arithmetic of one row at a time.
  // A GEMM tile would read 64 rows at once, more streams than the hardware
  // prefetchers follow, and a step is bound by this read. (Several query
  // rows of a float cache, a KV group's heads, stay on the GEMM: streaming
  // them was slower, 0.53-0.55 of the read yardstick against 0.69-0.78.)
  // bfloat16 rows are also prefetched 2 KiB ahead: widening doubles the
  // instructions per cache line, so the out-of-order window alone keeps half
  // as many lines in flight (a step took 0.89-0.95x its time, Zen 5; float
  // rows gain nothing from it).
  template <class Lhs, class Stored>
  void stream_key_rows(const Lhs& lhs, const Stored* from, Index cols, T* o) const {
    constexpr bool kPrefetch = !std::is_same_v<Stored, T>;
    constexpr Index kSpan = 4 * 64 / sizeof(Stored);  // columns per round of prefetches: 4 lines a row
    constexpr std::uintptr_t kAhead = 2048;          // bytes
    std::fill_n(o, cols, T(0));
    Index d = 0;
    for (; d + 8 <= dk; d += 8) {
      T a[8];
      const Stored* row[8];
      for (int i = 0; i < 8; ++i) a[i] = lhs(0, d + i), row[i] = from + (d + i) * kt_stride;
      auto add = [&](Index c0, Index c1) {
        for (Index c = c0; c < c1; ++c) {  // written out: GCC vectorised a loop over i worse
          T sum = o[c];
          sum += a[0] * widened<T>(row[0] + c);
          sum += a[1] * widened<T>(row[1] + c);
          sum += a[2] * widened<T>(row[2] + c);
          sum += a[3] * widened<T>(row[3] + c);
          sum += a[4] * widened<T>(row[4] + c);
          sum += a[5] * widened<T>(row[5] + c);
          sum += a[6] * widened<T>(row[6] + c);
          sum += a[7] * widened<T>(row[7] + c);
          o[c] = sum;
        }
      };
      if constexpr (kPrefetch) {
        for (Index c0 = 0; c0 < cols; c0 += kSpan) {
          for (int i = 0; i < 8; ++i)
            for (std::uintptr_t line = 0; line < 4; ++line) detail::prefetch(row[i] + c0, kAhead + 64 * line);
          add(c0, std::min(cols, c0 + kSpan));
        }
      } else {
        add(0, cols);
      }
    }
    for (; d < dk; ++d) {
      const T a = lhs(0, d);
      const Stored* keys = from + d * kt_stride;
      for (Index c = 0; c < cols; ++c) o[c] += a * widened<T>(keys + c);
    }
  }

  ConstStridedMap<T> kv_rows(const T* base, Index heads, Index dim, Index b, Index h, Index k0, Index count) const {
    if (head_major_kv)
      return {base + ((b * heads + h) * key_stride + k0) * dim, count, dim, Eigen::OuterStride<>(dim)};
    return {base + (b * key_stride + k0) * heads * dim + h * dim, count, dim, Eigen::OuterStride<>(heads * dim)};
  }
};

}  // namespace headmix
