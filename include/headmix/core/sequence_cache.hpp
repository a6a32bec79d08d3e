// A per-layer cache of what incremental decoding needs from past positions.
//
// A layer caches one or more "streams", each a row of fixed width per
// position (MHA: K and V; CollabHead: shared keys and content bias; DCMHA
// also its key-side dynamic factors). Memory is reserved once; steps then
// write new rows in place and allocate nothing.
//
// A stream of per-head rows (K and V) may be stored head-major, as
// [batch][head][capacity][width / heads]: a decoding step then reads each
// head's keys and values as one contiguous run, which the hardware
// prefetchers stream at full bandwidth, instead of a head_dim slice of
// every position's row. The K stream of the dot-product layers is stored
// transposed per head, [batch][head][width / heads][stride]: K_hᵀ, the
// operand a step's score product multiplies untransposed (as a forward's
// packed K_hᵀ), so that it runs as a GEMM over contiguous key runs rather
// than repacking every block of K. Its rows are transposed_stride()
// apart, the capacity padded so that they do not fall in the same cache
// sets (a 4 KiB multiple apart, a step's dk rows would evict each other):
// detail::odd_line_stride. A layer whose steps multiply many rows by K
// (CollabHead: every head against the shared keys; grouped-query MHA: a
// KV group's heads) stores it in Panels of 64 positions instead
// (KeyLayout::panels), as its forward packs it.
//
// Half precision (CachePrecision::bfloat16): the K and V streams of the
// dot-product layers (MHA, Talking-Heads, DCMHA), and DCMHA's key-side
// factors, are stored as bfloat16, rounded to nearest even, and widened
// back to T as a step reads them; every product still accumulates in T.
// That halves the bytes a step streams from its cache. Each stored value
// carries a relative error of at most u = 2^-8, and a step's output
// differs from the full-precision cache's by at most (README,
// "Half-precision caches")
//   ‖W_o‖_∞ · ((e^(2u·A) − 1)(1 + u) + u) · max|v|,
// A = max over keys of Σ_i |q_i k_i| (scaled queries), for MHA.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/gemm.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

namespace headmix {

/// How a cache stores the K and V of the dot-product layers.
enum class CachePrecision { full, bfloat16 };

/// How a cache lays out its transposed K stream (the layer chooses): each
/// head's rows a padded capacity apart (`rows`: a one-row step streams a
/// few rows at a time), or in Panels of 64 positions (`panels`: a step that
/// multiplies many query rows by K runs a GEMM tile over contiguous memory).
enum class KeyLayout { rows, panels };

/// A step would write past a cache's capacity. Nothing was written.
class cache_full_error : public std::length_error {
 public:
  using std::length_error::length_error;
};

template <class T>
class SequenceCache {
 public:
  using Half = Eigen::bfloat16;

  SequenceCache() = default;
  SequenceCache(Index batch, Index capacity, CachePrecision precision = CachePrecision::full)
      : batch_(batch), capacity_(capacity), precision_(precision) {}

  /// Set batch size and capacity (positions), keeping the precision. Streams
  /// are sized by the layer on first use; reserving again drops the contents.
  void reserve(Index batch, Index capacity) {
    batch_ = batch;
    capacity_ = capacity;
    size_ = 0;
    streams_.clear();
    half_streams_.clear();
    widths_ = Shape();
  }
  void reserve(Index batch, Index capacity, CachePrecision precision) {
    reserve(batch, capacity);
    precision_ = precision;
  }
  CachePrecision precision() const { return precision_; }
  /// Forget all positions, keep the memory.
  void reset() { size_ = 0; }
  /// Keep the first n positions only (rolling back rejected draft tokens,
  /// or re-running a step); later steps overwrite the rest.
  void truncate(Index n) {
    if (n < 0 || n > size_)
      detail::throw_shape("cache", "truncate length", "0 <= n <= " + std::to_string(size_), std::to_string(n));
    size_ = n;
  }

  Index batch() const { return batch_; }
  Index capacity() const { return capacity_; }
  Index size() const { return size_; }
  /// Memory held by the streams (0 until a layer binds them).
  std::size_t bytes() const {
    std::size_t n = 0;
    for (std::size_t s = 0; s < streams(); ++s) n += stream_bytes(s);
    return n;
  }
  /// The streams a layer bound, and the memory of stream s.
  std::size_t streams() const { return streams_.size(); }
  std::size_t stream_bytes(std::size_t s) const {
    return is_half(s) ? static_cast<std::size_t>(half_streams_[s].size()) * sizeof(Half)
                      : static_cast<std::size_t>(streams_[s].size()) * sizeof(T);
  }

  /// The layer declares its streams' widths and, optionally, how many heads
  /// each splits into (stored head-major; none given: 1 per stream); a cache
  /// set up for other widths or heads, or for another layer, is an error
  /// naming both. `kv_streams`: how many leading streams are K and V (0, or
  /// 2: K then V), K stored transposed per head (transposed()), laid out
  /// as `key_layout` says.
  /// `half_streams`: how many leading streams a bfloat16 cache stores in
  /// half precision, the layer's steps reading them so: K and V (through
  /// DotProductStages) and any after them (DCMHA's key-side factors); 0 for
  /// a layer that reads none so (CollabHead). A bfloat16 cache is refused,
  /// naming why, by a layer with no K/V streams or none it reads in bfloat16.
  void bind(const char* variant, const Shape& widths, const Shape& heads = {}, std::size_t kv_streams = 0,
            std::size_t half_streams = 2, KeyLayout key_layout = KeyLayout::rows) {
    HEADMIX_ASSERT(kv_streams == 0 || kv_streams == 2);
    HEADMIX_ASSERT(half_streams == 0 || (half_streams >= kv_streams && half_streams <= widths.rank()));
    HEADMIX_ASSERT(heads.rank() == 0 || heads.rank() == widths.rank());
    auto heads_of = [&](std::size_t s) { return heads.rank() == 0 ? Index(1) : heads[s]; };
    if (precision_ == CachePrecision::bfloat16 && (kv_streams == 0 || half_streams == 0))
      detail::throw_shape(variant, "cache precision",
                          kv_streams == 0 ? "CachePrecision::full (this layer's steps read no K/V streams)"
                                          : "CachePrecision::full (this layer's steps read no bfloat16 streams)",
                          "CachePrecision::bfloat16");
    if (streams_.empty() && half_streams_.empty() && size_ == 0) {
      widths_ = widths;
      kv_count_ = kv_streams;
      key_layout_ = key_layout;
      half_count_ = precision_ == CachePrecision::bfloat16 ? half_streams : 0;
      streams_.resize(widths.rank());
      half_streams_.resize(half_count_);
      for (std::size_t s = 0; s < widths.rank(); ++s) {
        heads_[s] = heads_of(s);
        const Index size = batch_ * extent(s) * widths[s];
        if (is_half(s))
          half_streams_[s].resize(size);
        else
          streams_[s].resize(size);
      }
      return;
    }
    check_shape(variant, "cache stream widths", widths, widths_);
    if (kv_streams != kv_count_)
      detail::throw_shape(variant, "cache K/V streams", std::to_string(kv_count_), std::to_string(kv_streams));
    if (key_layout != key_layout_)
      detail::throw_shape(variant, "cache key layout", key_layout_ == KeyLayout::rows ? "rows" : "panels",
                          key_layout == KeyLayout::rows ? "rows" : "panels");
    for (std::size_t s = 0; s < widths.rank(); ++s)
      if (heads_of(s) != heads_[s])
        detail::throw_shape(variant, "cache stream " + std::to_string(s) + " heads", std::to_string(heads_[s]),
                            std::to_string(heads_of(s)));
  }
  /// Throws cache_full_error if n more positions do not fit.
  void check_room(const char* variant, Index n) const {
    if (size_ + n > capacity_)
      throw cache_full_error(std::string("[") + variant + "] cache: " + std::to_string(n) + " new positions do not fit (" +
                             std::to_string(size_) + " of " + std::to_string(capacity_) + " used)");
  }
  /// Whether stream s is stored in bfloat16.
  bool is_half(std::size_t s) const { return s < half_count_; }
  /// Whether stream s holds each head transposed, [width / heads, capacity]
  /// (the K stream of the dot-product layers).
  bool transposed(std::size_t s) const { return s == 0 && kv_count_ > 0; }
  /// Elements between rows laid along the positions (a transposed stream's
  /// rows; DCMHA's key-side factor rows) in a cache of `capacity` positions
  /// storing T or (`half`) bfloat16: the capacity padded to an odd number of
  /// cache lines of the stored type.
  static Index position_stride(Index capacity, bool half) {
    return half ? detail::odd_line_stride<Half>(capacity) : detail::odd_line_stride<T>(capacity);
  }
  /// Elements between the rows of a transposed stream's heads.
  Index transposed_stride() const { return position_stride(capacity_, is_half(0)); }
  /// The transposed K stream's layout.
  KeyLayout key_layout() const { return key_layout_; }
  /// Stream s of batch item b, all `capacity` rows ([capacity, width]), for
  /// a full-precision stream bound with one head.
  MatrixMap<T> stream(std::size_t s, Index b) {
    HEADMIX_ASSERT(heads_[s] == 1 && !is_half(s));
    return MatrixMap<T>(streams_[s].data() + b * capacity_ * widths_[s], capacity_, widths_[s]);
  }
  /// Head h of full-precision stream s for batch item b: [capacity, width /
  /// heads], position p in row p whatever the layout (not one in panels).
  Eigen::Map<Matrix<T>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> head(std::size_t s, Index b, Index h) {
    HEADMIX_ASSERT(!is_half(s) && !in_panels(s));
    const Index dim = widths_[s] / heads_[s];
    using Strides = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
    const Index rows = extent(s);
    return {streams_[s].data() + (b * heads_[s] + h) * rows * dim, capacity_, dim,
            transposed(s) ? Strides(1, rows) : Strides(dim, 1)};
  }
  /// Write `rows` [n, width] (a projection's rows, heads side by side) at
  /// positions [at, at + n) of stream s of batch item b, in the stream's
  /// layout and precision (bfloat16: rounded to nearest even).
  template <class Rows>
  void write(std::size_t s, Index b, Index at, const Rows& rows) {
    const Index dim = widths_[s] / heads_[s];
    for (Index h = 0; h < heads_[s]; ++h) {
      const auto head = rows.middleCols(h * dim, dim);
      const Index head_start = (b * heads_[s] + h) * extent(s) * dim;
      if (is_half(s))
        write_head(head.template cast<Half>(), half_streams_[s].data() + head_start, s, at);
      else
        write_head(head, streams_[s].data() + head_start, s, at);
    }
  }
  /// Full-precision stream s for all batch items as one [batch * capacity,
  /// width] block of memory (head-major streams: in head-major order; a
  /// transposed one: [batch * transposed_stride(), width], or in panels
  /// [batch * capacity, width]).
  MatrixMap<T> stream(std::size_t s) {
    HEADMIX_ASSERT(!is_half(s));
    return MatrixMap<T>(streams_[s].data(), batch_ * extent(s), widths_[s]);
  }
  /// Stream s's memory, laid out as stream(s), read-only: full precision
  /// (stream_data) or bfloat16 (half_stream).
  const T* stream_data(std::size_t s) const {
    HEADMIX_ASSERT(!is_half(s));
    return streams_[s].data();
  }
  const Half* half_stream(std::size_t s) const {
    HEADMIX_ASSERT(is_half(s));
    return half_streams_[s].data();
  }
  /// A bfloat16 stream's memory, laid out as stream(s), to write in place.
  Half* half_stream(std::size_t s) {
    HEADMIX_ASSERT(is_half(s));
    return half_streams_[s].data();
  }
  /// Mark n written positions as cached.
  void advance(Index n) { size_ += n; }

 private:
  // One head's rows `head` [n, dim] at positions [at, at + n) of its storage
  // `to` in stream s: in panels (Panels' layout of [dim, capacity]), as
  // columns of a transposed stream, or as rows.
  template <class Head, class Stored>
  void write_head(const Head& head, Stored* to, std::size_t s, Index at) {
    using Strided = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
    const Index n = head.rows(), dim = head.cols();
    if (in_panels(s))
      Panels<Stored>::write_columns(head.transpose(), to, capacity_, at);
    else if (transposed(s))
      Eigen::Map<Matrix<Stored>, 0, Strided>(to + at, n, dim, Strided(1, extent(s))) = head;
    else
      Eigen::Map<Matrix<Stored>, 0, Strided>(to + at * dim, n, dim, Strided(dim, 1)) = head;
  }

  bool in_panels(std::size_t s) const { return transposed(s) && key_layout_ == KeyLayout::panels; }
  /// Elements per head and per row of its width: the positions' span.
  Index extent(std::size_t s) const { return transposed(s) && !in_panels(s) ? transposed_stride() : capacity_; }

  Index batch_ = 0, capacity_ = 0, size_ = 0;
  CachePrecision precision_ = CachePrecision::full;
  Shape widths_;
  std::array<Index, Shape::kMaxRank> heads_{};  ///< per stream: heads, stored head-major
  std::size_t kv_count_ = 0;                    ///< streams [0, kv_count_) are K and V (K transposed)
  KeyLayout key_layout_ = KeyLayout::rows;      ///< the transposed K stream's layout
  std::size_t half_count_ = 0;                  ///< streams [0, half_count_) are stored in bfloat16
  std::vector<Vector<T>> streams_;              ///< the full-precision streams (empty where half)
  std::vector<Eigen::Matrix<Half, Eigen::Dynamic, 1>> half_streams_;
};

/// A decoding step's first stage for the dot-product variants: project the
/// n new positions `x` [B, n, D] with `k` and `v` (into Workspace scratch,
/// heads side by side) and store them at position `past` of the cache's
/// streams 0 and 1, in their layout (head-major for MHA, Talking-Heads and
/// DCMHA).
template <class T>
void append_kv(const Linear<T>& k, const Linear<T>& v, ConstBatchView<T> x, SequenceCache<T>& cache, Index past,
               Workspace<T>& ws) {
  const Index n = x.length();
  MatrixMap<T> k_rows = ws.shared_matrix(slot::key, n, k.out_features());
  MatrixMap<T> v_rows = ws.shared_matrix(slot::value, n, v.out_features());
  for (Index b = 0; b < x.batch(); ++b) {
    k.apply(x.item(b), k_rows);
    v.apply(x.item(b), v_rows);
    cache.write(0, b, past, k_rows);
    cache.write(1, b, past, v_rows);
  }
}

}  // namespace headmix
