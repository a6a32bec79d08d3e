// Conformance adapter for `mha` cases (../shared/conformance/mha.md).
#pragma once

#include "case_common.hpp"

namespace headmix::conformance {

template <class T>
CaseOutputs run_mha_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  MhaOptions opt;
  read_dense_options(config, opt);
  opt.num_heads = config.at("num_heads").get<Index>();
  opt.num_kv_heads = read_kv_heads(config);
  const auto layer = Mha<T>::from_tensors(f, "", opt);

  CaseInputs<T> inputs(f);
  Workspace<T> ws;
  Tensor<T> probs;
  Tensor<T> out = layer.forward(inputs.view(), ws, &probs);
  return {to_double(out), to_double(probs), std::nullopt, {}};
}

inline const AdapterRegistration mha_adapter{"mha", {run_mha_case<double>, run_mha_case<float>}};

}  // namespace headmix::conformance
