// The mask + softmax stage, over each row of an attention tensor.
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/mask.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace headmix {

/// Additive key bias for a tile's columns: -inf where the key is padded,
/// else 0. `padding` is one batch item's row of the key padding mask.
template <class T>
void key_padding_bias(const std::uint8_t* padding, Index first_key, Index cols, T* bias) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (Index c = 0; c < cols; ++c) bias[c] = padding[first_key + c] ? neg_inf : T(0);
}

namespace detail {
/// Zero the columns of tile row r that query `query` may not see (the tile
/// starts at key `first_key` of `num_keys`); return the ones it may see,
/// [lo, hi), before padding.
template <class T>
std::pair<Index, Index> zero_hidden_keys(Eigen::Map<Matrix<T>>& tile, Index r, Index query, Index first_key,
                                         Index num_keys, const PositionMask& mask) {
  const Index cols = tile.cols();
  auto [lo, hi] = mask.key_range(query, num_keys);
  lo = std::clamp<Index>(lo - first_key, 0, cols);
  hi = std::clamp<Index>(hi - first_key, lo, cols);
  tile.row(r).head(lo).setZero();
  tile.row(r).tail(cols - hi).setZero();
  return {lo, hi};
}
}  // namespace detail

/// Mask and softmax one head of a tile in place, row by row.
///
/// A row's visible keys are those of `mask.key_range` (relative to the
/// tile's columns) that `key_bias` (nullable, from key_padding_bias) leaves
/// finite. The row max is subtracted before exp, so logits of any finite
/// size are safe. Masked entries come out exactly 0, and a row with no
/// visible key comes out all zeros: its attention output is then zero, never
/// NaN.
template <class T>
void masked_softmax_head(Eigen::Map<Matrix<T>> scores, Index first_query, Index first_key, Index num_keys,
                         const PositionMask& mask, const T* key_bias) {
  for (Index r = 0; r < scores.rows(); ++r) {
    const auto [lo, hi] = detail::zero_hidden_keys(scores, r, first_query + r, first_key, num_keys, mask);
    auto seg = scores.row(r).array().segment(lo, hi - lo);
    const Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>> bias(key_bias ? key_bias + lo : nullptr, hi - lo);
    if (key_bias) seg += bias;
    const T m = hi > lo ? seg.maxCoeff() : -std::numeric_limits<T>::infinity();
    if (!(m > -std::numeric_limits<T>::infinity())) {  // nothing visible, or a NaN to pass on
      if (m != m) seg = std::numeric_limits<T>::quiet_NaN(); else seg.setZero();
      continue;
    }
    seg = (seg - m).exp();
    // Vectorised exp clamps its argument, so exp(-inf) is ~1e-38, not 0:
    // padded keys are zeroed explicitly.
    if (key_bias) seg = (bias == T(0)).select(seg, T(0));
    seg *= T(1) / seg.sum();
  }
}

/// Mask and softmax every head of a tile in place.
template <class T>
void masked_softmax(const AttentionTensor<T>& a, Index num_keys, const PositionMask& mask, const T* key_bias) {
  for (Index h = 0; h < a.heads(); ++h)
    masked_softmax_head<T>(a.head(h), a.first_query(), a.first_key(), num_keys, mask, key_bias);
}

}  // namespace headmix
