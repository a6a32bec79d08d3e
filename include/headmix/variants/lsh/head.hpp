// The per-(batch, head) work of LSH attention: hash, sort, and attend in
// chunks. Internal to variants/lsh.hpp; the math is shared/conformance/lsh.md
// section 3, whose step numbers the comments below use.
//
// The attention tensor of one head has the bucketed layout
// [rounds · chunks, bs, 2·bs]: chunk c's bs query slots against the 2·bs key
// slots of chunks c and c − 1. It goes through the same stages as the dense
// pipeline, one chunk at a time:
//
//   score (one GEMM)  ──►  mask + softmax  ──►  readout (one GEMM)  ──►  merge rounds
//
// so memory is O(bs²) per chunk, plus O(n_hashes · Tp) integers for the
// sort. Only when the dense weights are asked for are all chunks' tiles
// kept ([rounds · chunks, bs, 2·bs], O(n_hashes · Tp · bs)), to be scattered
// into [T, T] at the end (for a row range, below: its rows, [rows, T]).
//
// Query rows. A call may compute only the query rows of positions
// [row_begin, row_end) (what one rank of a sequence-parallel layer owns):
// every position is still hashed, sorted and read as a key, but each
// chunk's tile has only the rows of its queries in the range (none: the
// chunk is skipped). The whole sequence is the range [0, T). A range that
// ends at T also takes the autopad queries, computed and then discarded as
// the whole-sequence call always has, so that ranges partitioning [0, T)
// compute exactly the whole call's tile rows, and the whole call is
// unchanged (every chunk's tile has all bs rows).
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/error.hpp"
#include "headmix/core/gemm.hpp"
#include "headmix/core/softmax.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace headmix {

/// The bucketed layout of one call: lengths, buckets and chunks.
struct LshLayout {
  Index length = 0;            ///< T
  Index padded_length = 0;     ///< Tp: T rounded up to a multiple of 2 · bucket_size
  Index bucket_size = 0;       ///< bs: the chunk length after sorting
  Index n_buckets = 0;         ///< NB (even)
  Index n_hashes = 0;          ///< NH: hash rounds
  Index chunks_per_round = 0;  ///< Tp / bs (even, >= 2)
  Index chunks = 0;            ///< NH · Tp / bs

  Index slots() const { return n_hashes * padded_length; }
  Index rotation_width() const { return n_hashes * (n_buckets / 2); }
};

namespace lsh_detail {

using Int = std::int32_t;  // positions and slots: n_hashes · Tp < 2^31 is checked at the entry

/// The logit of a query's own position (step 6d), and the masked value.
template <class T>
constexpr T self_logit() {
  return T(-5e4);
}
template <class T>
constexpr T masked_logit() {
  return -std::numeric_limits<T>::infinity();  // same results as -max (lsh.md section 5)
}

/// Which of steps 6b-6f apply.
struct Rules {
  bool pair_mask = false;  ///< 6b: some position is invalid (key padding or autopad)
  bool causal = false;     ///< 6c
  bool across = true;      ///< attend_across_buckets (6e when false)
  bool duplicates = true;  ///< allow_duplicate_attention (6f when false)
  double scale = 1;        ///< 6a's logit scale (1/sqrt(dh) by default)
};

/// One (batch item, head): where its inputs are and where its outputs go.
template <class T>
struct HeadJob {
  const T* qk = nullptr;  ///< row p < T at qk + p · qk_stride, head_dim values
  Index qk_stride = 0;
  const T* v = nullptr;   ///< row p < T at v + p · v_stride, value_dim values
  Index v_stride = 0;
  const T* qk_pad = nullptr;  ///< qk and v of every autopad position (x = 0)
  const T* v_pad = nullptr;
  const T* rotation = nullptr;        ///< [dh, NH · NB/2] row-major
  const std::uint8_t* padding = nullptr;  ///< [T], 1 = padded; or null
  T* context = nullptr;  ///< out: row p < T at context + p · context_stride
  Index context_stride = 0;
  /// out, optional: the computed rows' weights [row_end − row_begin, T],
  /// row p at (p − row_begin) · T ([T, T] for the whole sequence), zeroed by the caller
  T* probs = nullptr;
  /// The query rows computed: positions [row_begin, row_end) (see the file
  /// comment); row p's output is at context + (p − row_begin) · context_stride.
  Index row_begin = 0, row_end = 0;
  Index head_dim = 0, value_dim = 0;
};

/// Reinterpret a workspace slot as integer scratch. (The Workspace holds
/// T; the bytes are only ever read back as Int.)
template <class T>
Int* local_ints(Workspace<T>& ws, int worker, std::size_t slot, Index count) {
  static_assert(sizeof(T) >= sizeof(Int) && alignof(T) >= alignof(Int), "Int must fit in T's storage");
  const Index n = (count * Index(sizeof(Int)) + Index(sizeof(T)) - 1) / Index(sizeof(T));
  return reinterpret_cast<Int*>(ws.local(worker, slot, std::max<Index>(n, 1)));
}

/// Per-worker slots, after the pipeline's own local slots.
enum : std::size_t {
  s_hash = slot::local_variant, s_kscale, s_query, s_key, s_value, s_logits, s_weights, s_out, s_row_stats, s_run_stats, s_pad_rows,
  s_rotation, s_qk_rows, s_v_rows, s_context_rows, s_log_count, s_bucket, s_pos, s_chunk_of, s_counts, s_valid, s_key_meta, s_query_meta, s_query_rows
};

/// Step 2's argmax over the NB-vector [u, −u], ties to the lowest index.
template <class T>
Int signed_argmax(const T* u, Index half) {
  const Eigen::Map<const Vector<T>> seg(u, half);
  const T hi = seg.maxCoeff(), lo = seg.minCoeff();
  if (hi >= -lo) {  // the max of the first half is the max overall; the first half wins ties
    for (Index k = 0; k < half; ++k)
      if (u[k] == hi) return static_cast<Int>(k);
  } else {
    for (Index k = 0; k < half; ++k)
      if (u[k] == lo) return static_cast<Int>(half + k);
  }
  return 0;  // only with NaN input
}

/// Step 2 for one head: bucket[r · Tp + p] in [0, NB) for every round r and
/// position p < Tp. The rotations are applied as GEMMs on blocks of rows;
/// autopad positions share one hash (their qk is the same row).
template <class T>
void hash_head(const HeadJob<T>& job, const LshLayout& L, Workspace<T>& ws, int worker, Int* bucket) {
  constexpr Index kRows = 128;
  const Index dh = job.head_dim, half = L.n_buckets / 2, width = L.rotation_width();
  const Index T_ = L.length, Tp = L.padded_length;
  const ConstMatrixMap<T> A(job.rotation, dh, width);
  MatrixMap<T> U(ws.local(worker, s_hash, kRows * width), kRows, width);
  auto assign = [&](Index row, Index p) {
    for (Index r = 0; r < L.n_hashes; ++r) bucket[r * Tp + p] = signed_argmax(&U(row, r * half), half);
  };
  for (Index p0 = 0; p0 < T_; p0 += kRows) {
    const Index rows = std::min(kRows, T_ - p0);
    const ConstStridedMap<T> qk(job.qk + p0 * job.qk_stride, rows, dh, Eigen::OuterStride<>(job.qk_stride));
    gemm(qk, A, U.topRows(rows));
    for (Index q = 0; q < rows; ++q) assign(q, p0 + q);
  }
  if (Tp > T_) {
    gemm(ConstMatrixMap<T>(job.qk_pad, 1, dh), A, U.topRows(1));
    assign(0, T_);
    for (Index r = 0; r < L.n_hashes; ++r) std::fill(bucket + r * Tp + T_ + 1, bucket + (r + 1) * Tp, bucket[r * Tp + T_]);
  }
}

/// Step 3: per round, positions ordered by (bucket, position) into slots
/// r · Tp ...; a counting sort, stable in the position. With `chunk_of`,
/// also the chunk of every (round, position).
inline void sort_rounds(const LshLayout& L, const Int* bucket, Int* counts, Int* pos, Int* chunk_of) {
  const Index Tp = L.padded_length, NB = L.n_buckets, bs = L.bucket_size;
  for (Index r = 0; r < L.n_hashes; ++r) {
    const Int* b = bucket + r * Tp;
    std::fill(counts, counts + NB + 1, Int(0));
    for (Index p = 0; p < Tp; ++p) ++counts[b[p] + 1];
    for (Index k = 0; k < NB; ++k) counts[k + 1] += counts[k];
    for (Index p = 0; p < Tp; ++p) {
      const Index s = r * Tp + counts[b[p]]++;
      pos[s] = static_cast<Int>(p);
      if (chunk_of) chunk_of[r * Tp + p] = static_cast<Int>(s / bs);
    }
  }
}

/// Steps 1-8 for one (batch item, head): writes the head's output rows, and
/// its dense weights when job.probs is set.
template <class T>
void attend_head(const HeadJob<T>& job, const LshLayout& L, const Rules& rules, Workspace<T>& ws, int worker) {
  const Index T_ = L.length, Tp = L.padded_length, bs = L.bucket_size, NB = L.n_buckets, NH = L.n_hashes;
  const Index NC = L.chunks, cpr = L.chunks_per_round, dh = job.head_dim, dv = job.value_dim;
  const T neg = masked_logit<T>();
  const bool keep_tiles = job.probs != nullptr;
  const Index r0 = job.row_begin, r1 = job.row_end;
  const bool autopad_rows = r1 == T_ && r1 > r0;  // see the file comment
  HEADMIX_ASSERT(0 <= r0 && r0 <= r1 && r1 <= T_);
  auto computed = [&](Index p) { return (p >= r0 && p < r1) || (autopad_rows && p >= T_); };
  auto context_row = [&](Index p) {
    return Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(job.context + (p - r0) * job.context_stride, dv);
  };

  // Steps 2-3: hash and sort.
  Int* bucket = local_ints(ws, worker, s_bucket, NH * Tp);
  Int* pos = local_ints(ws, worker, s_pos, NH * Tp);
  Int* chunk_of = rules.duplicates ? nullptr : local_ints(ws, worker, s_chunk_of, NH * Tp);
  hash_head(job, L, ws, worker, bucket);
  sort_rounds(L, bucket, local_ints(ws, worker, s_counts, NB + 1), pos, chunk_of);

  // Step 0 validity, and step 4's key scale: the logit scale / max(‖qk‖, 1e-12)
  // folded into one factor per position.
  Int* valid = local_ints(ws, worker, s_valid, Tp);
  T* kscale = ws.local(worker, s_kscale, Tp);
  const T logit_scale = static_cast<T>(rules.scale);
  auto key_scale = [&](const T* row) {
    const Eigen::Map<const Vector<T>> qk(row, dh);
    T norm = qk.norm();
    // ‖qk‖² overflows (or underflows) long before ‖qk‖ does: rescale then.
    if (!(norm < std::numeric_limits<T>::max()) || norm < std::sqrt(std::numeric_limits<T>::min()))
      norm = qk.stableNorm();
    return logit_scale / std::max(norm, T(1e-12));
  };
  for (Index p = 0; p < T_; ++p) {
    valid[p] = !(job.padding && job.padding[p]);
    kscale[p] = key_scale(job.qk + p * job.qk_stride);
  }
  if (Tp > T_) {
    const T pad_scale = key_scale(job.qk_pad);
    std::fill(valid + T_, valid + Tp, Int(0));
    std::fill(kscale + T_, kscale + Tp, pad_scale);
  }

  // Chunk buffers: key slots [0, bs) hold chunk c, [bs, 2bs) chunk c − 1,
  // as the columns of Kᵀ (the layout the GEMM multiplies) and the rows of V;
  // Q holds the computed queries of chunk c, whose slots are query_rows[0, n).
  MatrixMap<T> Q(ws.local(worker, s_query, bs * dh), bs, dh);
  MatrixMap<T> Kt(ws.local(worker, s_key, dh * 2 * bs), dh, 2 * bs);
  MatrixMap<T> V(ws.local(worker, s_value, 2 * bs * dv), 2 * bs, dv);
  Int* key_meta = local_ints(ws, worker, s_key_meta, 6 * bs);
  Int* key_pos = key_meta;             // position of each key slot
  Int* key_bucket = key_meta + 2 * bs;  // its global bucket r · NB + bucket
  Int* key_valid = key_meta + 4 * bs;
  const Index tiles = keep_tiles ? NC : 1;
  const AttentionTensor<T> logits(ws.local(worker, s_logits, bs * 2 * bs), 1, bs, 2 * bs);
  const AttentionTensor<T> weights(ws.local(worker, s_weights, tiles * bs * 2 * bs), tiles, bs, 2 * bs);
  T* row_stats = ws.local(worker, s_row_stats, 2 * tiles * bs);  // per query slot: max, then sum
  T* run_stats = ws.local(worker, s_run_stats, 2 * Tp);          // per position: running max, running sum
  MatrixMap<T> O(ws.local(worker, s_out, bs * dv), bs, dv);
  Int* query_meta = rules.duplicates ? nullptr : local_ints(ws, worker, s_query_meta, 4 * NH);
  Int* query_rows = local_ints(ws, worker, s_query_rows, bs);

  using Row = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
  auto qk_row = [&](Index p) { return Row(p < T_ ? job.qk + p * job.qk_stride : job.qk_pad, dh); };
  auto gather = [&](Index c, Index off) {
    for (Index q = 0; q < bs; ++q) {
      const Index s = c * bs + q, p = pos[s], r = s / Tp;
      const T* v = p < T_ ? job.v + p * job.v_stride : job.v_pad;
      Kt.col(off + q) = (qk_row(p) * kscale[p]).transpose();
      V.row(off + q) = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(v, dv);
      key_pos[off + q] = static_cast<Int>(p);
      key_bucket[off + q] = static_cast<Int>(r * NB + bucket[r * Tp + p]);
      key_valid[off + q] = valid[p];
    }
  };
  // The previous chunk becomes the look-back half.
  auto shift = [&] {
    for (Index d = 0; d < dh; ++d) std::copy_n(&Kt(d, 0), bs, &Kt(d, bs));
    std::copy_n(V.data(), bs * dv, V.data() + bs * dv);
    for (Int* meta : {key_pos, key_bucket, key_valid}) std::copy_n(meta, bs, meta + bs);
  };

  // Step 6f's count N(i, j): over rounds r, the slots of query i's round-r
  // window (its chunk and the one before it, cyclic over all NC chunks)
  // that hold j, in i's bucket unless attending across buckets.
  T* log_count = rules.duplicates ? nullptr : ws.local(worker, s_log_count, 2 * NH + 1);
  if (log_count)
    for (Index n = 0; n <= 2 * NH; ++n) log_count[n] = static_cast<T>(std::log(double(n) + 1e-9));
  auto duplicate_count = [&](Index j) {
    Int n = 0;
    for (Index r = 0; r < NH; ++r) {
      const Int ci = query_meta[r], pc = query_meta[NH + r], rr = query_meta[2 * NH + r], bi = query_meta[3 * NH + r];
      n += chunk_of[r * Tp + j] == ci && (rules.across || bucket[r * Tp + j] == bi);
      n += chunk_of[rr * Tp + j] == pc && (rules.across || (rr == r && bucket[r * Tp + j] == bi));
    }
    return n;
  };

  // Step 6: logits of chunk c's n computed queries in place, rules in the spec's order.
  auto mask = [&](Eigen::Map<Matrix<T>> tile, Index n) {
    const Index cols = 2 * bs;
    for (Index k = 0; k < n; ++k) {
      const Index q = query_rows[k];
      T* row = &tile(k, 0);
      const Int i = key_pos[q], gi = key_bucket[q];
      if (rules.pair_mask) {  // b
        if (!key_valid[q]) std::fill(row, row + cols, neg);
        else
          for (Index t = 0; t < cols; ++t) row[t] = key_valid[t] ? row[t] : neg;
      }
      if (rules.causal)  // c
        for (Index t = 0; t < cols; ++t) row[t] = key_pos[t] > i ? neg : row[t];
      for (Index t = 0; t < cols; ++t) row[t] = key_pos[t] == i ? self_logit<T>() : row[t];  // d
      if (!rules.across)  // e
        for (Index t = 0; t < cols; ++t) row[t] = key_bucket[t] != gi ? neg : row[t];
      if (!rules.duplicates) {  // f
        for (Index r = 0; r < NH; ++r) {
          const Int ci = chunk_of[r * Tp + i], pc = static_cast<Int>((ci + NC - 1) % NC);
          query_meta[r] = ci;
          query_meta[NH + r] = pc;
          query_meta[2 * NH + r] = static_cast<Int>(pc / cpr);
          query_meta[3 * NH + r] = bucket[r * Tp + i];
        }
        for (Index t = 0; t < cols; ++t)
          if (row[t] != neg) row[t] -= log_count[duplicate_count(key_pos[t])];
      }
    }
  };
  const bool has_masked = rules.pair_mask || rules.causal || !rules.across;

  // Step 7: max-subtracted softmax per row, normalised as e / Σe (in float
  // the exp(x − logsumexp) form loses ~ulp(5e4) in self-only rows). The row
  // max and sum are kept: step 8 weighs the rounds by them.
  auto softmax = [&](Eigen::Map<Matrix<T>> in, Eigen::Map<Matrix<T>> out, T* row_max, T* row_sum, Index n) {
    for (Index q = 0; q < n; ++q) {
      const T m = in.row(q).maxCoeff();
      if (m != m) {  // a NaN logit: poison the row and, through step 8, its position
        out.row(q).setConstant(m);
        row_max[q] = m, row_sum[q] = m;
        continue;
      }
      if (!(m > neg)) {  // no admissible key: cannot happen (6d), but never NaN
        out.row(q).setZero();
        row_max[q] = neg, row_sum[q] = 0;
        continue;
      }
      out.row(q) = softmax_exp(in.row(q).array() - m).matrix();
      if (has_masked) {  // Eigen's exp (double) clamps its argument: exp(-inf) comes out ~1e-308, not 0
        const T* l = &in(q, 0);
        T* e = &out(q, 0);
        for (Index t = 0; t < 2 * bs; ++t) e[t] = l[t] == neg ? T(0) : e[t];
      }
      const T s = out.row(q).sum();
      out.row(q) *= T(1) / s;
      row_max[q] = m, row_sum[q] = s;
    }
  };

  // Step 8, online over the rounds: per position, acc = Σ_r s_r e^{m_r − M} o_r
  // and S = Σ_r s_r e^{m_r − M} with M the largest row max so far, i.e. the
  // rounds weighted by exp(lse_r) without ever forming lse_r = m_r + log s_r
  // (which rounds to ulp(5e4) in float).
  T* run_max = run_stats;
  T* run_sum = run_stats + Tp;
  std::fill(run_max, run_max + Tp, neg);
  std::fill(run_sum, run_sum + Tp, T(0));
  for (Index p = r0; p < r1; ++p) context_row(p).setZero();
  auto merge = [&](const T* row_max, const T* row_sum, Index n) {
    for (Index q = 0; q < n; ++q) {
      const Index i = key_pos[query_rows[q]];
      if (i >= T_ || row_sum[q] == T(0)) continue;  // autopad queries are sliced off
      auto acc = context_row(i);
      const T m = row_max[q];
      if (m > run_max[i]) {
        const T a = std::exp(run_max[i] - m);
        acc *= a;
        run_sum[i] *= a;
        run_max[i] = m;
      }
      const T w = row_sum[q] * std::exp(m - run_max[i]);
      acc += w * O.row(q);
      run_sum[i] += w;
    }
  };

  Index loaded = -1;  // the chunk in key rows [0, bs), if any
  for (Index c = 0; c < NC; ++c) {
    Index n = 0;
    for (Index q = 0; q < bs; ++q)
      if (computed(pos[c * bs + q])) query_rows[n++] = static_cast<Int>(q);
    if (n == 0) continue;  // no query of this chunk is computed
    if (loaded >= 0 && loaded == c - 1)
      shift();
    else
      gather((c + NC - 1) % NC, bs);  // chunk 0 looks back at the last chunk of the last round
    gather(c, 0);
    loaded = c;
    for (Index k = 0; k < n; ++k) Q.row(k) = qk_row(key_pos[query_rows[k]]);
    // The tile's first n rows (all bs of them for the whole sequence). One
    // row would go to a matrix-vector kernel on Eigen's GEMM (gemm.hpp),
    // which sums in another order than the tile GEMM: then a copy of it
    // rides along as row 2.
    const Index m = std::min(bs, std::max<Index>(n, 2));
    if (m > n) Q.row(1) = Q.row(0);
    const Index tile = keep_tiles ? c : 0;
    T* row_max = row_stats + 2 * tile * bs;
    T* row_sum = row_max + bs;
    MatrixMap<T> scores(logits.head(0).data(), m, 2 * bs), tile_weights(weights.head(tile).data(), m, 2 * bs);
    gemm(MatrixMap<T>(Q.data(), m, dh), Kt, scores);  // score
    mask(scores, n);
    softmax(scores, tile_weights, row_max, row_sum, n);
    if (m > n) tile_weights.row(1) = tile_weights.row(0);
    gemm(tile_weights, V, MatrixMap<T>(O.data(), m, dv));  // readout
    merge(row_max, row_sum, n);
  }
  for (Index p = r0; p < r1; ++p) context_row(p) *= T(1) / run_sum[p];

  if (!keep_tiles) return;
  // Section 4: P[i, j] = Σ_r w_r(i) Σ_{slots t of row (r, i) holding j} p_t,
  // for the computed rows. A tile's row k is its chunk's k-th computed query
  // slot (k = q for the whole sequence); a chunk without one was skipped.
  for (Index c = 0; c < NC; ++c) {
    const Index prev = (c + NC - 1) % NC;
    const auto tile = weights.head(c);
    const T* row_max = row_stats + 2 * c * bs;
    const T* row_sum = row_max + bs;
    Index k = 0;
    for (Index q = 0; q < bs; ++q) {
      const Index i = pos[c * bs + q];
      if (!computed(i)) continue;
      const Index row = k++;
      if (i >= T_ || row_sum[row] == T(0)) continue;
      const T f = row_sum[row] * std::exp(row_max[row] - run_max[i]) / run_sum[i];
      T* out = job.probs + (i - r0) * T_;
      for (Index t = 0; t < bs; ++t) {
        const Index j = pos[c * bs + t];
        if (j < T_) out[j] += f * tile(row, t);
      }
      for (Index t = 0; t < bs; ++t) {
        const Index j = pos[prev * bs + t];
        if (j < T_) out[j] += f * tile(row, bs + t);
      }
    }
  }
}

}  // namespace lsh_detail
}  // namespace headmix
