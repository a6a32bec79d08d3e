// Static head mixing: out[g, i, j] = Σ_a weight[g, a] · in[a, i, j].
// One matrix product over the head axis on the whole tile.
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/error.hpp"

namespace headmix {

/// `weight` is [out_heads, in_heads] (PyTorch [out, in] orientation).
template <class T, class Derived>
void mix_heads(const Eigen::MatrixBase<Derived>& weight, const AttentionTensor<T>& in, const AttentionTensor<T>& out) {
  HEADMIX_ASSERT(weight.cols() == in.heads() && weight.rows() == out.heads());
  HEADMIX_ASSERT(in.rows() == out.rows() && in.cols() == out.cols());
  out.heads_by_entries().noalias() = weight * in.heads_by_entries();
}

}  // namespace headmix
