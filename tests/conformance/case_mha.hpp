// Conformance adapter for `mha` cases (../shared/conformance/mha.md).
#pragma once

#include "case_common.hpp"

namespace headmix::conformance {

template <class T>
CaseOutputs run_mha_case(const io::TensorFile& f) {
  return run_dense_layer(Mha<T>::from_tensors(f, "", dense_case_options<MhaOptions>(case_config(f))), f);
}

inline const AdapterRegistration mha_adapter{"mha", {run_mha_case<double>, run_mha_case<float>}};

}  // namespace headmix::conformance
