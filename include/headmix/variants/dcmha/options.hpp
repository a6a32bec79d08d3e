// DCMHA's options, parameters and multiply-add counts (the layer:
// variants/dcmha.hpp).
#pragma once

#include "headmix/core/flops.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/options.hpp"
#include "headmix/core/types.hpp"

#include <cstdint>

namespace headmix {

/// GELU of the dynamic-weight MLP: the exact erf form (PyTorch reference)
/// or the tanh approximation (flax default, which the JAX training used).
enum class DcmhaGelu { erf, tanh };

struct DcmhaOptions : DenseOptions {
  Index num_heads = 1;
  Index groups = 1;          ///< G: heads compose only within contiguous groups of M = H/G
  Index num_kv_heads = 0;    ///< heads of K and V, a divisor of num_heads (grouped-query attention); 0 = num_heads
  Index rank = 2;            ///< R of each dynamic low-rank term (the reference hard-codes 2)
  bool use_pre = true;       ///< compose the scores before the softmax
  bool use_post = true;      ///< compose the weights after the softmax
  bool query_wise = true;    ///< the W1q/W2q/ddq terms, indexed by the query
  bool key_wise = true;      ///< the W1k/W2k/ddk terms, indexed by the key
  bool static_w = false;     ///< the static term P (dc.pre_w / dc.post_w); C then holds I + P
  double dw_norm_eps = 1e-6; ///< epsilon of the scale-free RMSNorm on W1
  DcmhaGelu gelu = DcmhaGelu::erf;
};

/// Parameters. q, k, v, o in PyTorch layout (o may be empty: the output is
/// then the concatenated heads); the dc.* tensors in the reference's raw
/// layout, where the size-4 slot axis is 0 pre/query, 1 pre/key,
/// 2 post/query, 3 post/key.
template <class T>
struct DcmhaWeights {
  Linear<T> q;      ///< [H·dk, D]
  Linear<T> k;      ///< [H·dk, D]
  Linear<T> v;      ///< [H·dv, D]
  Linear<T> o;      ///< [out_dim, H·dv], optional
  Tensor<T> dw1;    ///< dc.dw1 [D, G, 4, K]
  Tensor<T> qkw;    ///< dc.qkw [G, 4, K, 2R, M]; rows 0..R-1 of the 2R axis make W1, R..2R-1 make W2
  Tensor<T> dd;     ///< dc.dd  [D, G, 4·M]
  Tensor<T> pre_w;  ///< dc.pre_w  [G, M, M], only with static_w
  Tensor<T> post_w; ///< dc.post_w [G, M, M], only with static_w
};

/// Multiply-adds of one call, by kind.
struct DcmhaFlops {
  std::int64_t projection_macs = 0;  ///< q, k, v and o projections
  std::int64_t dynamic_macs = 0;     ///< dynamic weights: dw1, qkw, the RMS sums of squares, dd
  std::int64_t score_macs = 0;       ///< q·k and P·v over visible pairs
  std::int64_t compose_macs = 0;     ///< pre- and post-compose over visible pairs
  /// Per-position work counts as projection, per-pair work as attention.
  FlopCount total() const { return {projection_macs + dynamic_macs, score_macs + compose_macs}; }
};

}  // namespace headmix
