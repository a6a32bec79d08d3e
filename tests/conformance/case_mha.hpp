// Conformance adapter for `mha` cases (../shared/conformance/mha.md).
#pragma once

#include "case_common.hpp"

namespace headmix::conformance {

template <class T>
CaseOutputs run_mha_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  MhaOptions opt;
  opt.num_heads = config.at("num_heads").get<Index>();
  opt.causal = config.value("causal", false);
  if (config.contains("scale") && !config["scale"].is_null()) opt.scale = config["scale"].get<double>();
  opt.block_rows = 4;  // several blocks even on small cases, so block boundaries are exercised
  const auto layer = Mha<T>::from_tensors(f, "", opt);

  CaseInputs<T> inputs(f);
  Workspace<T> ws;
  Tensor<T> probs;
  Tensor<T> out = layer.forward(inputs.view(), ws, &probs);
  return {to_double(out), to_double(probs), std::nullopt, {}};
}

}  // namespace headmix::conformance
