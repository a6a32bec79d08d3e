// Shared pieces of the conformance adapters: reading a case's inputs and
// parameters into headmix types.
#pragma once

#include <headmix/headmix.hpp>
#include <headmix/io/safetensors.hpp>

#include "precompiled_layers.hpp"  // the layers compiled once, if CMake says so

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace headmix::conformance {

/// What a layer produced for one case, in double for comparison. The
/// runner compares every expected.output / .probs / .softmax the case holds
/// and fails the case when the adapter produced none for one of them; any
/// other expected.* tensor must be named in `checked` by an adapter that
/// compared it itself (LSH's expected.buckets).
struct CaseOutputs {
  Tensor<double> output;
  std::optional<Tensor<double>> probs;    ///< final weights, for expected.probs
  std::optional<Tensor<double>> softmax;  ///< softmax before a post-softmax mix, for expected.softmax
  std::vector<std::string> checked;       ///< expected.* tensors the adapter compared itself
};

/// A case's inputs, converted to the compute type. Owns the data that the
/// AttentionInput views.
template <class T>
struct CaseInputs {
  Tensor<T> query, key;
  Tensor<std::uint8_t> padding;

  explicit CaseInputs(const io::TensorFile& f) : query(f.get<T>("input.query")) {
    if (f.contains("input.key")) key = f.get<T>("input.key");
    if (f.contains("input.key_padding_mask")) padding = f.get<std::uint8_t>("input.key_padding_mask");
  }
  AttentionInput<T> view() const {
    AttentionInput<T> in;
    in.query = query.batch();
    if (key.rank() == 3) in.key = key.batch();
    if (padding.rank() == 2) in.key_padding = {padding.data(), padding.dim(0), padding.dim(1)};
    return in;
  }
};

template <class T>
Tensor<double> to_double(const Tensor<T>& t) {
  Tensor<double> d(t.shape());
  for (Index i = 0; i < t.size(); ++i) d[i] = static_cast<double>(t[i]);
  return d;
}

inline nlohmann::json case_config(const io::TensorFile& f) {
  auto it = f.metadata.find("config");
  return it == f.metadata.end() ? nlohmann::json::object() : nlohmann::json::parse(it->second);
}

/// The options every dense case shares, from its config: causal,
/// causal_offset, window (absent or null: none) and scale (absent or null:
/// the variant's default). block_rows 4, so that small cases run over
/// several query blocks.
inline void read_dense_options(const nlohmann::json& config, DenseOptions& opt) {
  auto present = [&](const char* key) { return config.contains(key) && !config[key].is_null(); };
  opt.causal = config.value("causal", false);
  if (present("causal_offset")) opt.causal_offset = config["causal_offset"].get<Index>();
  if (present("window")) opt.window = config["window"].get<Index>();
  if (present("scale")) opt.scale = config["scale"].get<double>();
  opt.block_rows = 4;
}

/// A case's `num_kv_heads`: 0 (the layer's default, one K/V head per head)
/// when absent or null.
inline Index read_kv_heads(const nlohmann::json& config) {
  return config.contains("num_kv_heads") && !config["num_kv_heads"].is_null() ? config["num_kv_heads"].get<Index>()
                                                                                : 0;
}

/// Whether a variant's options have grouped K/V heads (num_kv_heads).
template <class Options, class = void>
struct has_kv_heads : std::false_type {};
template <class Options>
struct has_kv_heads<Options, std::void_t<decltype(Options::num_kv_heads)>> : std::true_type {};

/// The options of a dense case: num_heads, read_dense_options' and, where
/// the variant has them, num_kv_heads. The adapter adds its own fields.
template <class Options>
Options dense_case_options(const nlohmann::json& config) {
  Options opt;
  opt.num_heads = config.at("num_heads").get<Index>();
  read_dense_options(config, opt);
  if constexpr (has_kv_heads<Options>::value) opt.num_kv_heads = read_kv_heads(config);
  return opt;
}

/// A dense layer run on its case's inputs: the output, the final weights
/// and, from `softmax_of(layer, input, ws)` when given, the softmax before
/// a post-softmax mix.
template <template <class> class Layer, class T, class SoftmaxOf = std::nullptr_t>
CaseOutputs run_dense_layer(const Layer<T>& layer, const io::TensorFile& f, SoftmaxOf softmax_of = nullptr) {
  const CaseInputs<T> inputs(f);
  Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> out = layer.forward(inputs.view(), ws, &probs);
  CaseOutputs result{to_double(out), to_double(probs), std::nullopt, {}};
  if constexpr (!std::is_same_v<SoftmaxOf, std::nullptr_t>) result.softmax = to_double(softmax_of(layer, inputs.view(), ws));
  return result;
}

/// One variant's adapter: its case runner in double and in float.
struct Adapter {
  using Run = CaseOutputs (*)(const io::TensorFile&);
  Run in_double, in_float;
};

/// Every adapter, by the variant name a case's metadata gives. Each
/// case_<variant>.hpp registers its own, so the runner names no variant.
inline std::map<std::string, Adapter>& adapters() {
  static std::map<std::string, Adapter> all;
  return all;
}
struct AdapterRegistration {
  AdapterRegistration(const char* variant, Adapter adapter) { adapters().emplace(variant, adapter); }
};

}  // namespace headmix::conformance
