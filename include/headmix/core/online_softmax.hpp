// The masked softmax and readout of one head, a block of keys at a time
// (Milakov & Gimelshein's online normaliser, as in FlashAttention): the
// working set is [rows, key_block] scores plus [rows, dv] output, whatever
// the number of keys, so a head's tile stays in L1/L2 at any length.
//
// Each row keeps its running maximum m and the running sum l of
// exp(score - m) over the keys seen so far. A new block's scores become
// exp(score - m'), with m' the new maximum, and the output and l already
// accumulated are rescaled by exp(m - m'). After the last block the output
// row is divided by l. Against the two-pass softmax (max, then exp and sum,
// then readout) this adds one rounding per block in which a row's maximum
// grows: on a row whose output is a convex combination of value rows, the
// difference is at most about (2 + blocks) · ε · max|v| (ε of T), tested
// in tests/test_pipeline.cpp.
#pragma once

#include "headmix/core/mask.hpp"
#include "headmix/core/softmax.hpp"
#include "headmix/core/types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace headmix {

template <class T>
class OnlineSoftmax {
 public:
  /// A view of `stats`, 2 · rows values: the running maxima, then the sums.
  OnlineSoftmax(T* stats, Index rows) : max_(stats, rows), sum_(stats + rows, rows) {}

  /// Forget every key: call before a row's first block.
  void start() {
    max_.setConstant(-std::numeric_limits<T>::infinity());
    sum_.setZero();
  }

  /// Turn one block of raw scores into unnormalised weights, in place:
  /// exp(score + bias - m) on the keys a row sees, exactly 0 elsewhere, with
  /// m the row's new running maximum. Rows of `out` (the readout so far) are
  /// rescaled to that maximum, so that `out += tile · V_block` stays
  /// consistent. `first_key`: the block's first key among `num_keys`;
  /// `key_bias` (nullable): the block's padding bias.
  /// `query_stride`: row r is query first_query + r · query_stride (0:
  /// every row the same query, as when the rows are heads).
  template <class Out>
  void absorb(Eigen::Map<Matrix<T>> tile, Index first_query, Index first_key, Index num_keys,
              const PositionMask& mask, const T* key_bias, Out& out, Index query_stride = 1) {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    for (Index r = 0; r < tile.rows(); ++r) {
      const Index query = first_query + r * query_stride;
      const auto [lo, hi] = detail::zero_hidden_keys(tile, r, query, first_key, num_keys, mask);
      if (hi == lo) continue;
      auto seg = tile.row(r).array().segment(lo, hi - lo);
      const RowArray bias(key_bias ? key_bias + lo : nullptr, hi - lo);
      if (key_bias) seg += bias;
      const T block_max = seg.maxCoeff();
      if (block_max == neg_inf) {  // every key this row sees in the block is padded
        seg.setZero();
        continue;
      }
      // A NaN score leaves the maximum alone and reaches the sum through
      // exp, so the row's output comes out NaN, as with the two-pass softmax.
      const T old_max = max_(r), new_max = std::max(old_max, block_max);
      if (new_max > old_max && old_max != neg_inf) {
        const T shrink = std::exp(old_max - new_max);
        sum_(r) *= shrink;
        out.row(r) *= shrink;
      }
      max_(r) = new_max;
      seg = softmax_exp(seg - new_max);
      // Eigen's exp (double) clamps its argument, so exp(-inf) is ~1e-308,
      // not 0: padded keys are zeroed explicitly.
      if (key_bias) seg = (bias == T(0)).select(seg, T(0));
      sum_(r) += seg.sum();
    }
  }

  /// Row r's running maximum (-inf before its first visible key).
  T max(Index r) const { return max_(r); }

  /// After the last block: turn one block's unnormalised weights, which
  /// absorb() took against the running maxima `max_then` (one per row, as
  /// max() read them right after that block), into final weights, in place.
  /// A row that saw no key comes out 0; a NaN sum passes on.
  void rescale(Eigen::Map<Matrix<T>> tile, const T* max_then) const {
    for (Index r = 0; r < tile.rows(); ++r)
      tile.row(r) *= sum_(r) == T(0) ? T(0) : std::exp(max_then[r] - max_(r)) / sum_(r);
  }

  /// Divide each output row by its sum; a row that saw no key stays 0.
  template <class Out>
  void finish(Out& out) const {
    for (Index r = 0; r < out.rows(); ++r)
      if (sum_(r) != T(0)) out.row(r) *= T(1) / sum_(r);
  }

  /// After the last block: the final weights of one block of raw scores, in
  /// place (to export them), from the rows' final maxima and sums.
  void weights(Eigen::Map<Matrix<T>> tile, Index first_query, Index first_key, Index num_keys,
               const PositionMask& mask, const T* key_bias, Index query_stride = 1) const {
    for (Index r = 0; r < tile.rows(); ++r) {
      const Index query = first_query + r * query_stride;
      const auto [lo, hi] = detail::zero_hidden_keys(tile, r, query, first_key, num_keys, mask);
      auto seg = tile.row(r).array().segment(lo, hi - lo);
      if (sum_(r) == T(0)) {
        seg.setZero();
        continue;
      }
      const RowArray bias(key_bias ? key_bias + lo : nullptr, hi - lo);
      if (key_bias) seg += bias;
      seg = softmax_exp(seg - max_(r)) * (T(1) / sum_(r));
      if (key_bias) seg = (bias == T(0)).select(seg, T(0));
    }
  }

 private:
  using RowArray = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>;

  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> max_, sum_;
};

}  // namespace headmix
