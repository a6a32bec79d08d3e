// Conformance adapter for `talking_heads` cases
// (../shared/conformance/talking_heads.md).
#pragma once

#include "case_common.hpp"

namespace headmix::conformance {

template <class T>
CaseOutputs run_talking_heads_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  TalkingHeadsOptions opt;
  opt.num_heads = config.value("heads_logits", config.at("num_heads").get<Index>());
  opt.key_heads = config.value("heads_key", opt.num_heads);
  opt.value_heads = config.value("heads_value", opt.num_heads);
  opt.causal = config.value("causal", false);
  if (config.contains("scale") && !config["scale"].is_null()) opt.scale = config["scale"].get<double>();
  opt.block_rows = 4;  // several blocks even on small cases, so block boundaries are exercised
  const auto layer = TalkingHeads<T>::from_tensors(f, "", opt);

  CaseInputs<T> inputs(f);
  Workspace<T> ws;
  Tensor<T> probs;
  Tensor<T> out = layer.forward(inputs.view(), ws, &probs);
  return {to_double(out), to_double(probs)};
}

}  // namespace headmix::conformance
