// Conformance adapter for `collab` cases (../shared/conformance/collab.md).
#pragma once

#include "case_common.hpp"

#include <headmix/variants/collab_head.hpp>

namespace headmix::conformance {

/// The layer a collab case describes (block_rows 4, so that small cases run
/// over several query blocks).
template <class T>
CollabHead<T> load_collab_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  CollabHeadOptions opt;
  opt.num_heads = config.at("num_heads").get<Index>();
  read_dense_options(config, opt);
  return CollabHead<T>::from_tensors(f, "", opt, config.value("layer_norm_eps", 1e-5));
}

template <class T>
CaseOutputs run_collab_case(const io::TensorFile& f) {
  const CollabHead<T> layer = load_collab_case<T>(f);
  CaseInputs<T> inputs(f);
  Workspace<T> ws;
  Tensor<T> probs;
  Tensor<T> out = layer.forward(inputs.view(), ws, &probs);
  return {to_double(out), to_double(probs), std::nullopt, {}};
}

inline const AdapterRegistration collab_adapter{"collab", {run_collab_case<double>, run_collab_case<float>}};

}  // namespace headmix::conformance
