// The attention tensor: scores or weights A[head, query, key] of one batch
// item and one block of query rows, row-major. Every variant's stages read
// and write this one object.
#pragma once

#include "headmix/core/types.hpp"

namespace headmix {

template <class T>
class AttentionTensor {
 public:
  using HeadMap = Eigen::Map<Matrix<T>>;
  using AcrossHeads = Eigen::Map<Vector<T>, Eigen::Unaligned, Eigen::InnerStride<>>;

  /// `data` holds heads * rows * cols values. Row r is query position
  /// first_query + r, column c is key position first_key + c.
  AttentionTensor(T* data, Index heads, Index rows, Index cols, Index first_query = 0, Index first_key = 0)
      : data_(data), heads_(heads), rows_(rows), cols_(cols), first_query_(first_query), first_key_(first_key) {}

  Index heads() const { return heads_; }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  Index first_query() const { return first_query_; }
  Index first_key() const { return first_key_; }
  T* data() const { return data_; }

  /// Head h as a [rows, cols] matrix.
  HeadMap head(Index h) const { return HeadMap(data_ + h * plane(), rows_, cols_); }
  /// The H values at one (row, col): what head mixing combines.
  AcrossHeads across_heads(Index row, Index col) const {
    return AcrossHeads(data_ + row * cols_ + col, heads_, Eigen::InnerStride<>(plane()));
  }
  /// All heads as a [heads, rows * cols] matrix, so that a mix over heads
  /// is one matrix product on the whole tile.
  HeadMap heads_by_entries() const { return HeadMap(data_, heads_, plane()); }

  /// The same positions with another head count and buffer.
  AttentionTensor like(T* data, Index heads) const {
    return AttentionTensor(data, heads, rows_, cols_, first_query_, first_key_);
  }

 private:
  Index plane() const { return rows_ * cols_; }

  T* data_;
  Index heads_, rows_, cols_, first_query_, first_key_;
};

}  // namespace headmix
