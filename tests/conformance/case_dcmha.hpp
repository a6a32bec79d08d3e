// Conformance adapter for `dcmha` cases (../shared/conformance/dcmha.md).
#pragma once

#include "case_common.hpp"

#include <headmix/variants/dcmha.hpp>

#include <stdexcept>

namespace headmix::conformance {

/// The layer a dcmha case describes (block_rows 4, so that small cases run
/// over several query blocks).
template <class T>
Dcmha<T> load_dcmha_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  auto opt = dense_case_options<DcmhaOptions>(config);
  opt.groups = config.value("groups", Index(1));
  opt.rank = config.value("rank", Index(2));
  opt.use_pre = config.value("use_pre", true);
  opt.use_post = config.value("use_post", true);
  opt.query_wise = config.value("query_wise", true);
  opt.key_wise = config.value("key_wise", true);
  opt.static_w = config.value("static_w", false);
  opt.dw_norm_eps = config.value("dw_norm_eps", 1e-6);
  const std::string gelu = config.value("dw_gelu", std::string("erf"));
  if (gelu != "erf" && gelu != "tanh") throw std::runtime_error("dcmha case: unknown dw_gelu '" + gelu + "'");
  opt.gelu = gelu == "erf" ? DcmhaGelu::erf : DcmhaGelu::tanh;
  return Dcmha<T>::from_tensors(f, "", opt);
}

/// P0, the softmax before the post-compose (the case's expected.softmax).
/// forward() returns only the final weights P, so P0 is the final weights
/// of the same layer without its post-compose.
template <class T>
Tensor<T> dcmha_softmax(const Dcmha<T>& layer, const AttentionInput<T>& in, Workspace<T>& ws) {
  DcmhaOptions opt = layer.options();
  opt.use_post = false;
  Tensor<T> softmax;
  (void)Dcmha<T>(layer.weights(), opt).forward(in, ws, &softmax);
  return softmax;
}

template <class T>
CaseOutputs run_dcmha_case(const io::TensorFile& f) {
  return run_dense_layer(load_dcmha_case<T>(f), f, dcmha_softmax<T>);
}

inline const AdapterRegistration dcmha_adapter{"dcmha", {run_dcmha_case<double>, run_dcmha_case<float>}};

}  // namespace headmix::conformance
