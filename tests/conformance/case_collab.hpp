// Conformance adapter for `collab` cases (../shared/conformance/collab.md).
#pragma once

#include "case_common.hpp"

#include <headmix/variants/collab_head.hpp>

namespace headmix::conformance {

template <class T>
CaseOutputs run_collab_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  CollabHeadWeights<T> w;
  w.q = f.matrix<T>("q.weight");
  w.k = f.matrix<T>("k.weight");
  w.mixing = f.matrix<T>("mixing");
  w.content_bias = f.matrix<T>("content_bias.weight");
  w.v = read_linear<T>(f, "v");
  if (config.value("use_dense_layer", f.contains("o.weight"))) w.o = read_linear<T>(f, "o");
  if (config.value("use_layer_norm", f.contains("layer_norm.weight"))) {
    w.layer_norm.weight = f.vector<T>("layer_norm.weight");
    w.layer_norm.bias = f.vector<T>("layer_norm.bias");
    w.layer_norm.eps = config.value("layer_norm_eps", 1e-5);
  }
  CollabHeadOptions opt;
  opt.num_heads = config.at("num_heads").get<Index>();
  opt.causal = config.value("causal", false);
  if (config.contains("scale") && !config["scale"].is_null()) opt.scale = config["scale"].get<double>();
  opt.block_rows = 4;  // several blocks even on small cases, so block boundaries are exercised
  CollabHead<T> layer(std::move(w), opt);

  CaseInputs<T> inputs(f);
  Workspace<T> ws;
  Tensor<T> probs;
  Tensor<T> out = layer.forward(inputs.view(), ws, &probs);
  return {to_double(out), to_double(probs)};
}

}  // namespace headmix::conformance
