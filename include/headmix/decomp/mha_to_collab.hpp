// Re-parameterise a trained MHA layer as a CollabHead layer with shared
// query/key width R (Cordonnier et al. 2020, sec. 4; epfml swap.py).
//
// Head h's logits are  s_mha · (x WQ_hᵀ + bQ_h)(x' WK_hᵀ + bK_h)ᵀ. Expanded,
//   x (WQ_hᵀ WK_h) x'ᵀ   + bQ_h WK_h x'ᵀ   + (terms constant over keys)
// and the softmax cancels the last group (q_i·bK_h and bQ_h·bK_h), so bK is
// dropped. The first term is slice h of the [D, H, Dkv] tensor
// T[:, h, :] = WQ_hᵀ WK_h; the second is the content bias bQ_hᵀ WK_h.
//
//   * R == H·Dk: exact. q.weight = WQ, k.weight = WK, block (CONCATENATE)
//     mixing: mixing[h, h·Dk : (h+1)·Dk] = 1. The converted layer computes the
//     MHA's logits up to rounding, and each head only touches its own Dk
//     shared columns (see collab_head.hpp), so it also costs what MHA costs.
//   * R < H·Dk: rank-R CP decomposition T ≈ Σ_r A[:, r] ⊗ M[:, r] ⊗ B[:, r]
//     (decomp/cp_als.hpp, on the factored tensor: T is never formed), then
//     q.weight = Aᵀ, k.weight = Bᵀ, mixing = M. Always computed in double.
//   * content_bias.weight[h] = bQ_hᵀ WK_h (zeros without q.bias); v, o are
//     copied. MHA layers carry no LayerNorm; a surrounding LayerNorm(x + y)
//     can be attached to the result's weights.layer_norm.
//
// The logit scale is KEPT. CollabHead's default scale is s_c = 1/sqrt(R/H);
// the MHA used s_mha (1/sqrt(Dk) unless its options say otherwise). Unlike
// epfml's swap.py, which leaves s_c in place and so multiplies every logit by
// sqrt(H·Dk/R) (√2 at half rank: the out_err_as_is column of
// conformance/collab_reparam.md), the mixing and the content bias are
// multiplied by c = s_mha / s_c (= sqrt((R/H)/Dk) for the default MHA scale)
// and the result's options leave `scale` unset. The weights therefore give
// the MHA's logits under the standard 1/sqrt(R/H) scale that any CollabHead
// implementation (epfml included) applies: do not also set scale = 1/sqrt(Dk).
#pragma once

#include "headmix/decomp/cp_als.hpp"
#include "headmix/variants/collab_head.hpp"
#include "headmix/variants/mha.hpp"

#include <cmath>
#include <string>

namespace headmix::decomp {

template <class T>
struct MhaToCollabResult {
  CollabHeadWeights<T> weights;
  CollabHeadOptions options;        ///< the MHA's heads and dense options (masking, window, block size, threads); scale unset (see above)
  bool exact = false;               ///< R == H·Dk: the copy path, no decomposition
  double relative_error = 0;        ///< ‖T − T̂‖_F / ‖T‖_F of the bilinear forms (0 when exact)
  Index iterations = 0;             ///< CP-ALS sweeps (0 when exact)
  bool converged = true;            ///< CP-ALS met its tolerance (true when exact)
  double scale_compensation = 1;    ///< c = s_mha / s_c, applied to mixing and content bias
  std::vector<double> error_history;  ///< CP-ALS relative error per sweep
};

/// `mha`'s weights with K and V repeated per query-head group (rows of KV
/// head g copied to every query head of its group): the same layer as a
/// standard MHA with num_kv_heads = num_heads.
template <class T>
MhaWeights<T> expand_kv_heads(const Mha<T>& mha) {
  MhaWeights<T> w = mha.weights();
  const Index H = mha.num_heads(), group = H / mha.num_kv_heads();
  if (group == 1) return w;
  auto repeat = [&](const Linear<T>& in, Index width) {
    Linear<T> out;
    out.weight.resize(H * width, in.weight.cols());
    if (in.has_bias()) out.bias.resize(H * width);
    for (Index h = 0; h < H; ++h) {
      out.weight.middleRows(h * width, width) = in.weight.middleRows(h / group * width, width);
      if (in.has_bias()) out.bias.segment(h * width, width) = in.bias.segment(h / group * width, width);
    }
    return out;
  };
  w.k = repeat(w.k, mha.head_dim());
  w.v = repeat(w.v, mha.v_head_dim());
  return w;
}

/// Convert `mha` to a CollabHead layer of shared width `shared_dim`
/// (1 <= R <= H·Dk). `cp` controls the decomposition when R < H·Dk.
template <class T>
MhaToCollabResult<T> mha_to_collab(const Mha<T>& mha, Index shared_dim, const CpAlsOptions& cp = {}) {
  constexpr const char* kName = "mha_to_collab";
  // CollabHead has one value head per query head: a grouped-query layer's
  // K and V are first repeated per group, which is exact.
  const MhaWeights<T> w = expand_kv_heads(mha);
  const Index H = mha.num_heads(), dk = mha.head_dim(), R = shared_dim, Dkv = mha.key_dim();
  if (R < 1 || R > H * dk)
    headmix::detail::throw_shape(kName, "shared_dim", "1 <= R <= num_heads * head_dim = " + std::to_string(H * dk),
                                 std::to_string(R));

  const double s_mha = mha.options().scale.value_or(1.0 / std::sqrt(static_cast<double>(dk)));
  const double s_collab = 1.0 / std::sqrt(static_cast<double>(R) / static_cast<double>(H));
  const double c = s_mha / s_collab;

  MhaToCollabResult<T> out;
  out.scale_compensation = c;
  CollabHeadWeights<T>& cw = out.weights;
  if (R == H * dk) {
    out.exact = true;
    cw.q = w.q.weight;
    cw.k = w.k.weight;
    cw.mixing = Matrix<T>::Zero(H, R);
    for (Index h = 0; h < H; ++h) cw.mixing.block(h, h * dk, 1, dk).setConstant(static_cast<T>(c));
  } else {
    const SliceProductTensor<double> t(w.q.weight.template cast<double>(), w.k.weight.template cast<double>(), H);
    CpResult<double> fit = cp_als(t, R, cp);
    cw.q = fit.factors[0].transpose().template cast<T>();
    cw.k = fit.factors[2].transpose().template cast<T>();
    cw.mixing = (c * fit.factors[1]).template cast<T>();
    out.relative_error = fit.relative_error;
    out.iterations = fit.iterations;
    out.converged = fit.converged;
    out.error_history = std::move(fit.error_history);
  }

  // content_bias[h] = bQ_hᵀ WK_h, accumulated in double.
  Matrix<double> cb = Matrix<double>::Zero(H, Dkv);
  if (w.q.has_bias())
    for (Index h = 0; h < H; ++h)
      cb.row(h) = w.q.bias.segment(h * dk, dk).template cast<double>().transpose() *
                  w.k.weight.middleRows(h * dk, dk).template cast<double>();
  cw.content_bias = (c * cb).template cast<T>();
  cw.v = w.v;
  cw.o = w.o;

  static_cast<DenseOptions&>(out.options) = mha.options();
  out.options.scale.reset();  // folded into the mixing and content bias through c
  out.options.num_heads = H;
  return out;
}

/// Same, from MHA weights and options (validated as Mha's constructor does).
template <class T>
MhaToCollabResult<T> mha_to_collab(const MhaWeights<T>& weights, const MhaOptions& options, Index shared_dim,
                                   const CpAlsOptions& cp = {}) {
  return mha_to_collab(Mha<T>(weights, options), shared_dim, cp);
}

/// Parameter count of the attention's query/key side: MHA 2·D·H·Dk (+ biases),
/// CollabHead 2·D·R + H·R + H·Dkv. (Values and output are the same in both.)
template <class T>
Index query_key_parameters(const MhaWeights<T>& w) {
  return w.q.weight.size() + w.q.bias.size() + w.k.weight.size() + w.k.bias.size();
}
template <class T>
Index query_key_parameters(const CollabHeadWeights<T>& w) {
  return w.q.size() + w.k.size() + w.mixing.size() + w.content_bias.size();
}

}  // namespace headmix::decomp
