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
  const auto opt = dense_case_options<CollabHeadOptions>(config);
  return CollabHead<T>::from_tensors(f, "", opt, config.value("layer_norm_eps", 1e-5));
}

template <class T>
CaseOutputs run_collab_case(const io::TensorFile& f) {
  return run_dense_layer(load_collab_case<T>(f), f);
}

inline const AdapterRegistration collab_adapter{"collab", {run_collab_case<double>, run_collab_case<float>}};

}  // namespace headmix::conformance
