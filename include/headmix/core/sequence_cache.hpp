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
// every position's row.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

namespace headmix {

/// A step would write past a cache's capacity. Nothing was written.
class cache_full_error : public std::length_error {
 public:
  using std::length_error::length_error;
};

template <class T>
class SequenceCache {
 public:
  SequenceCache() = default;
  SequenceCache(Index batch, Index capacity) : batch_(batch), capacity_(capacity) {}

  /// Set batch size and capacity (positions). Streams are sized by the layer
  /// on first use; reserving again drops the contents.
  void reserve(Index batch, Index capacity) {
    batch_ = batch;
    capacity_ = capacity;
    size_ = 0;
    streams_.clear();
    widths_ = Shape();
  }
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
    for (const auto& s : streams_) n += static_cast<std::size_t>(s.size()) * sizeof(T);
    return n;
  }

  /// The layer declares its streams' widths and, optionally, how many heads
  /// each splits into (stored head-major; none given: 1 per stream); a cache
  /// set up for other widths or heads, or for another layer, is an error
  /// naming both.
  void bind(const char* variant, const Shape& widths, const Shape& heads = {}) {
    HEADMIX_ASSERT(heads.rank() == 0 || heads.rank() == widths.rank());
    auto heads_of = [&](std::size_t s) { return heads.rank() == 0 ? Index(1) : heads[s]; };
    if (streams_.empty() && size_ == 0) {
      widths_ = widths;
      streams_.resize(widths.rank());
      for (std::size_t s = 0; s < widths.rank(); ++s) {
        heads_[s] = heads_of(s);
        streams_[s].resize(batch_ * capacity_ * widths[s]);
      }
      return;
    }
    check_shape(variant, "cache stream widths", widths, widths_);
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
  /// Stream s of batch item b, all `capacity` rows ([capacity, width]), for
  /// a stream bound with one head.
  MatrixMap<T> stream(std::size_t s, Index b) {
    HEADMIX_ASSERT(heads_[s] == 1);
    return MatrixMap<T>(streams_[s].data() + b * capacity_ * widths_[s], capacity_, widths_[s]);
  }
  /// Head h of stream s for batch item b: [capacity, width / heads].
  MatrixMap<T> head(std::size_t s, Index b, Index h) {
    const Index dim = widths_[s] / heads_[s];
    return MatrixMap<T>(streams_[s].data() + (b * heads_[s] + h) * capacity_ * dim, capacity_, dim);
  }
  /// Write `rows` [n, width] (a projection's rows, heads side by side) at
  /// positions [at, at + n) of stream s of batch item b, in the stream's
  /// layout.
  template <class Rows>
  void write(std::size_t s, Index b, Index at, const Rows& rows) {
    const Index dim = widths_[s] / heads_[s];
    for (Index h = 0; h < heads_[s]; ++h) head(s, b, h).middleRows(at, rows.rows()) = rows.middleCols(h * dim, dim);
  }
  /// Stream s for all batch items as one [batch * capacity, width] block of
  /// memory (head-major streams: in head-major order).
  MatrixMap<T> stream(std::size_t s) {
    return MatrixMap<T>(streams_[s].data(), batch_ * capacity_, widths_[s]);
  }
  /// Mark n written positions as cached.
  void advance(Index n) { size_ += n; }

 private:
  Index batch_ = 0, capacity_ = 0, size_ = 0;
  Shape widths_;
  std::array<Index, Shape::kMaxRank> heads_{};  ///< per stream: heads, stored head-major
  std::vector<Vector<T>> streams_;
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
