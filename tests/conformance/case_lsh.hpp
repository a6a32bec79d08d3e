// Conformance adapter for `lsh` cases (../shared/conformance/lsh.md).
//
// The case's rotations are passed explicitly. Hashing is discontinuous, so
// the buckets are compared with expected.buckets first: a mismatch fails
// the case with the first differing bucket, which says more than an output
// far off (lsh.md section 7).
#pragma once

#include "case_common.hpp"

#include <sstream>
#include <stdexcept>

namespace headmix::conformance {

template <class T>
CaseOutputs run_lsh_case(const io::TensorFile& f) {
  const auto config = case_config(f);
  if (!config.value("shared_qk", true) || !config.value("rehash_each_round", true))
    throw std::runtime_error("lsh case needs shared_qk and rehash_each_round (the only forms headmix implements)");
  LshWeights<T> w;
  w.qk = read_linear<T>(f, "qk");
  w.v = read_linear<T>(f, "v");
  w.o = read_linear<T>(f, "o");
  w.rotations = f.get<T>("rotations");
  LshOptions opt;
  opt.num_heads = config.at("num_heads").get<Index>();
  opt.bucket_size = config.at("bucket_size").get<Index>();
  opt.n_hashes = config.at("n_hashes").get<Index>();
  opt.n_buckets = config.at("n_buckets").get<Index>();
  opt.causal = config.value("causal", false);
  opt.attend_across_buckets = config.value("attend_across_buckets", true);
  opt.allow_duplicate_attention = config.value("allow_duplicate_attention", true);
  opt.rotations_per_head = config.value("random_rotations_per_head", false);
  opt.threads = 2;  // several (batch, head) tasks per worker on most cases
  Lsh<T> layer(std::move(w), opt);

  CaseInputs<T> inputs(f);
  Workspace<T> ws;
  if (f.contains("expected.buckets")) {
    const Tensor<std::int64_t> got = layer.buckets(inputs.view(), ws);
    const Tensor<std::int64_t> want = f.get<std::int64_t>("expected.buckets");
    if (got.shape() != want.shape())
      throw std::runtime_error("buckets shape " + detail::format_shape(got.shape()) + " != expected " +
                               detail::format_shape(want.shape()));
    for (Index i = 0; i < got.size(); ++i)
      if (got[i] != want[i]) {
        std::ostringstream s;  // [B, H, NH, Tp]
        const Index Tp = want.dim(3), NH = want.dim(2), H = want.dim(1);
        s << "bucket differs first at [b=" << i / (Tp * NH * H) << ", h=" << i / (Tp * NH) % H
          << ", round=" << i / Tp % NH << ", pos=" << i % Tp << "]: got " << got[i] << ", expected " << want[i];
        throw std::runtime_error(s.str());
      }
  }
  Tensor<T> probs;
  Tensor<T> out = layer.forward(inputs.view(), ws, f.contains("expected.probs") ? &probs : nullptr);
  CaseOutputs result{to_double(out), std::nullopt, std::nullopt, {}};
  if (f.contains("expected.probs")) result.probs = to_double(probs);
  if (f.contains("expected.buckets")) result.checked.push_back("expected.buckets");
  return result;
}

inline const AdapterRegistration lsh_adapter{"lsh", {run_lsh_case<double>, run_lsh_case<float>}};

}  // namespace headmix::conformance
