// Conformance adapter for `talking_heads` cases
// (../shared/conformance/talking_heads.md).
#pragma once

#include "case_common.hpp"

namespace headmix::conformance {

/// W, the softmax of the pre-mixed logits before the post mix (the case's
/// expected.softmax). forward() returns only the final weights U, so W is
/// the final weights of the same layer without its post mix: h value heads,
/// whose values (zeros here) do not reach the weights.
template <class T>
Tensor<T> talking_heads_softmax(const TalkingHeads<T>& layer, const AttentionInput<T>& in, Workspace<T>& ws) {
  TalkingHeadsWeights<T> w = layer.weights();
  TalkingHeadsOptions opt = layer.options();
  opt.value_heads = layer.num_heads();
  w.v.weight = Matrix<T>::Zero(layer.num_heads() * layer.v_head_dim(), w.v.in_features());
  w.v.bias = Vector<T>();
  w.o = Linear<T>();
  w.post_softmax = Matrix<T>();
  Tensor<T> softmax;
  (void)TalkingHeads<T>(std::move(w), opt).forward(in, ws, &softmax);
  return softmax;
}

template <class T>
CaseOutputs run_talking_heads_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  auto opt = dense_case_options<TalkingHeadsOptions>(config);
  opt.num_heads = config.value("heads_logits", opt.num_heads);
  opt.key_heads = config.value("heads_key", opt.num_heads);
  opt.value_heads = config.value("heads_value", opt.num_heads);
  return run_dense_layer(TalkingHeads<T>::from_tensors(f, "", opt), f, talking_heads_softmax<T>);
}

inline const AdapterRegistration talking_heads_adapter{"talking_heads", {run_talking_heads_case<double>, run_talking_heads_case<float>}};

}  // namespace headmix::conformance
