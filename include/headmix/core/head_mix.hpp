// Static head mixing: out[g, i, j] = Σ_a weight[g, a] · in[a, i, j], the
// same [out_heads, in_heads] matrix at every (query, key) entry. It never
// combines different entries, so it can run on a whole tile or on any slice
// of its entries.
//
//   mix_heads          one GEMM over a whole tile (out = W · in, or out += W · in)
//   mix_heads_strided  the same product on raw head rows `stride` apart, in
//                      panels of entries that stay in L1; allocates nothing
//   mix_softmax_mix    pre mix -> mask + softmax -> post mix on a tile in place,
//                      a few query rows at a time, so that the tile is read
//                      and written once between the score and readout stages
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/error.hpp"
#include "headmix/core/gemm.hpp"
#include "headmix/core/mask.hpp"
#include "headmix/core/softmax.hpp"

#include <algorithm>

namespace headmix {

/// out = weight · in over the head axis. `weight` is [out_heads, in_heads]
/// (PyTorch [out, in] orientation); `in` and `out` must not overlap.
template <class T, class Derived>
void mix_heads(const Eigen::MatrixBase<Derived>& weight, const AttentionTensor<T>& in, const AttentionTensor<T>& out) {
  HEADMIX_ASSERT(weight.cols() == in.heads() && weight.rows() == out.heads());
  HEADMIX_ASSERT(in.rows() == out.rows() && in.cols() == out.cols());
  gemm(weight, in.heads_by_entries(), out.heads_by_entries());
}

/// out += weight · in over the head axis (a static term added to others).
template <class T, class Derived>
void mix_heads_add(const Eigen::MatrixBase<Derived>& weight, const AttentionTensor<T>& in,
                   const AttentionTensor<T>& out) {
  HEADMIX_ASSERT(weight.cols() == in.heads() && weight.rows() == out.heads());
  HEADMIX_ASSERT(in.rows() == out.rows() && in.cols() == out.cols());
  gemm(weight, in.heads_by_entries(), out.heads_by_entries(), true);
}

/// out[g, e] = Σ_a weight[g, a] · in[a, e] for e < entries, where head a's
/// entries start at in + a·in_stride and head g's at out + g·out_stride.
/// `in` and `out` must not overlap. One small GEMM per panel of entries, so
/// the operands stay in L1 (and Eigen, without libxsmm, packs them on the
/// stack, not the heap).
template <class T, class Derived>
void mix_heads_strided(const Eigen::MatrixBase<Derived>& weight, const T* in, Index in_stride, T* out,
                       Index out_stride, Index entries) {
  const Index in_heads = weight.cols(), out_heads = weight.rows();
  HEADMIX_ASSERT(in_stride >= entries && out_stride >= entries);
  // ~32 KiB of input per panel (a multiple of 16 entries, at least 64 bytes
  // per head): it stays in L1, and Eigen packs it on the stack, not the heap.
  const Index panel = std::max<Index>(
      64 / static_cast<Index>(sizeof(T)),
      (32768 / static_cast<Index>(sizeof(T)) / std::max<Index>(1, in_heads)) & ~Index(15));
  for (Index e0 = 0; e0 < entries; e0 += panel) {
    const Index n = std::min(panel, entries - e0);
    const ConstStridedMap<T> src(in + e0, in_heads, n, Eigen::OuterStride<>(in_stride));
    StridedMap<T> dst(out + e0, out_heads, n, Eigen::OuterStride<>(out_stride));
    gemm(weight, src, dst);
  }
}

/// The static talking-heads stage, in place on one tile:
///
///   L = pre · J      (no pre: L = J)        mix the score heads into logit heads
///   W = softmax(L)   with the mask applied AFTER the mix (masked entries exactly 0)
///   U = post · W     (no post: U = W)       mix the softmax heads into value heads
///
/// On entry `scores` holds J; its buffer must have room for
/// max(J heads, U heads) planes. On return the same buffer holds U, as the
/// returned tensor. The tile is walked `chunk_rows` query rows at a time:
/// each chunk's L and W live in `scratch` (logit heads · chunk_rows · cols
/// values), which stays in cache, so the tile itself is read once and
/// written once. A row with no visible key comes out all zeros.
template <class T>
AttentionTensor<T> mix_softmax_mix(const Matrix<T>* pre, const Matrix<T>* post, const AttentionTensor<T>& scores,
                                   Index num_keys, const PositionMask& mask, const T* key_bias, T* scratch,
                                   Index chunk_rows) {
  const Index rows = scores.rows(), cols = scores.cols(), plane = rows * cols;
  const Index in_heads = scores.heads();
  const Index mid_heads = pre ? pre->rows() : in_heads;
  const Index out_heads = post ? post->rows() : mid_heads;
  HEADMIX_ASSERT(!pre || pre->cols() == in_heads);
  HEADMIX_ASSERT(!post || post->cols() == mid_heads);
  const Index chunk = std::max<Index>(1, chunk_rows);
  T* tile = scores.data();

  for (Index r0 = 0; r0 < rows; r0 += chunk) {
    const Index n = std::min(chunk, rows - r0), entries = n * cols;
    T* at = tile + r0 * cols;  // row r0 of head 0; head a is plane values further
    if (pre) {
      mix_heads_strided(*pre, at, plane, scratch, entries, entries);
    } else {
      for (Index a = 0; a < in_heads; ++a) std::copy_n(at + a * plane, entries, scratch + a * entries);
    }
    masked_softmax(AttentionTensor<T>(scratch, mid_heads, n, cols, scores.first_query() + r0, scores.first_key()),
                   num_keys, mask, key_bias);
    // This chunk's J is consumed, so U may overwrite the same rows.
    if (post) {
      mix_heads_strided(*post, scratch, entries, at, plane, entries);
    } else {
      for (Index c = 0; c < out_heads; ++c) std::copy_n(scratch + c * entries, entries, at + c * plane);
    }
  }
  return scores.like(tile, out_heads);
}

}  // namespace headmix
