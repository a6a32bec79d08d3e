// The score and readout stages of dot-product attention, shared by every
// variant whose scores are Q_a K_aᵀ per head (MHA, Talking-Heads, DCMHA).
//
// Q, K and V are row-major [rows, heads · dim] buffers, batch item b's rows
// starting at row b · queries (Q) and b · key_stride (K and V: a cache's
// capacity, or S). Grouped-query attention maps heads onto fewer stored K/V
// heads in contiguous groups: score head a reads K head a / k_group, value
// head c reads V head c / v_group (groups of 1: one K/V head per head).
#pragma once

#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"

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

  /// out [rows, cols] = Q_a[q0 .. q0 + rows) · K_{a / k_group}[k0 .. k0 + cols)ᵀ of batch item b.
  void score(Index b, Index a, Eigen::Map<Matrix<T>> out, Index q0, Index k0, Workspace<T>&, int) const {
    const ConstStridedMap<T> qa(q + (b * queries + q0) * q_heads * dk + a * dk, out.rows(), dk,
                                Eigen::OuterStride<>(q_heads * dk));
    const ConstStridedMap<T> ka(k + (b * key_stride + k0) * k_heads * dk + a / k_group * dk, out.cols(), dk,
                                Eigen::OuterStride<>(k_heads * dk));
    out.noalias() = qa * ka.transpose();
  }
  /// Rows [k0, k0 + count) of V_{c / v_group} of batch item b: [count, dv].
  ConstStridedMap<T> values(Index b, Index c, Index k0, Index count) const {
    return ConstStridedMap<T>(v + (b * key_stride + k0) * v_heads * dv + c / v_group * dv, count, dv,
                              Eigen::OuterStride<>(v_heads * dv));
  }
};

}  // namespace headmix
