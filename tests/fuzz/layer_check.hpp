// Differential check of from_tensors against the file it reads, shared by the
// fuzz target and tests/test_checkpoint_files.cpp: building a variant from a
// file must either throw (shape_error or io_error) or give a layer that holds
// exactly the file's tensors: each of the variant's names present in the
// file is present in the layer with the same shape and values, each name
// absent from the file is absent from the layer, and no stored name under the
// prefix shares a stem (the part before the first '.') with the variant's
// names without being one of them. A stored tensor read as "absent" (or the
// other way round), or one the layer quietly drops, is a wrong model that
// runs. "Present in the layer" means applied: DCMHA's static terms count only
// for a stage the options use.
#pragma once

#include <headmix/io/safetensors.hpp>
#include <headmix/variants/collab_head.hpp>
#include <headmix/variants/dcmha.hpp>
#include <headmix/variants/lsh.hpp>
#include <headmix/variants/mha.hpp>
#include <headmix/variants/talking_heads.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace headmix_check {

using headmix::Index;
namespace io = headmix::io;

// One fixed set of options per variant: two heads, so that the seeds (and the
// catalogue's valid layers, D = 4, two heads of 2) build.
template <class Options>
Options two_heads() {
  Options o;
  o.num_heads = 2;
  return o;
}
inline headmix::MhaOptions mha_options() { return two_heads<headmix::MhaOptions>(); }
inline headmix::TalkingHeadsOptions talking_heads_options() { return two_heads<headmix::TalkingHeadsOptions>(); }
inline headmix::CollabHeadOptions collab_options() { return two_heads<headmix::CollabHeadOptions>(); }
inline headmix::LshOptions lsh_options() {
  auto o = two_heads<headmix::LshOptions>();
  o.n_hashes = 2;
  o.n_buckets = 4;
  o.bucket_size = 2;
  return o;
}
inline headmix::DcmhaOptions dcmha_options(bool static_w, bool use_pre = true) {
  auto o = two_heads<headmix::DcmhaOptions>();
  o.static_w = static_w;
  o.use_pre = use_pre;
  return o;
}

/// Compares a built layer's parameters with the file's tensors.
class Comparer {
 public:
  Comparer(const io::TensorFile& file, std::string prefix) : file_(file), prefix_(std::move(prefix)) {}

  template <class Derived>
  void dense(const std::string& name, const Eigen::PlainObjectBase<Derived>& m) {
    const std::vector<Index> shape =
        Derived::ColsAtCompileTime == 1 ? std::vector<Index>{m.rows()} : std::vector<Index>{m.rows(), m.cols()};
    compare(name, m.size() != 0, shape, m.data(), m.size());
  }
  void tensor(const std::string& name, const headmix::Tensor<double>& t) {
    compare(name, t.rank() != 0, t.shape(), t.data(), t.size());
  }
  void linear(const std::string& name, const headmix::Linear<double>& l) {
    dense(name + ".weight", l.weight);
    dense(name + ".bias", l.bias);
  }
  /// Empty when the layer matches the file; else what differs. Call after
  /// every name of the variant has been compared.
  const std::string& mismatch() {
    std::vector<std::string> stems;
    for (const std::string& name : compared_) stems.push_back(name.substr(0, name.find('.')));
    for (const auto& [stored, tensor] : file_.tensors) {
      if (!mismatch_.empty() || stored.compare(0, prefix_.size(), prefix_) != 0) continue;
      const std::string rest = stored.substr(prefix_.size());
      const bool own_stem = std::find(stems.begin(), stems.end(), rest.substr(0, rest.find('.'))) != stems.end();
      if (own_stem && std::find(compared_.begin(), compared_.end(), rest) == compared_.end())
        mismatch_ = rest + " is in the file, under one of the layer's stems, but not a tensor of the layer";
    }
    return mismatch_;
  }

 private:
  void compare(const std::string& name, bool held, const std::vector<Index>& shape, const double* data, Index size) {
    compared_.push_back(name);
    if (!mismatch_.empty()) return;
    const bool stored = file_.contains(prefix_ + name);
    if (stored != held) {
      mismatch_ = name + (stored ? " is in the file but absent from the layer" : " is in the layer but not in the file");
      return;
    }
    if (!stored) return;
    const headmix::Tensor<double> t = file_.get<double>(prefix_ + name);
    if (t.shape() != shape || t.size() != size) {
      mismatch_ = name + ": the layer holds another shape than the file";
      return;
    }
    for (Index i = 0; i < size; ++i) {
      const double a = t[i], b = data[i];
      if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
        mismatch_ = name + ": element " + std::to_string(i) + " differs from the file";
        return;
      }
    }
  }

  const io::TensorFile& file_;
  std::string prefix_;
  std::vector<std::string> compared_;
  std::string mismatch_;
};

inline std::string compare_layer(const io::TensorFile& f, const std::string& p, const headmix::Mha<double>& layer) {
  Comparer c(f, p);
  const auto& w = layer.weights();
  c.linear("q", w.q); c.linear("k", w.k); c.linear("v", w.v); c.linear("o", w.o);
  return c.mismatch();
}
inline std::string compare_layer(const io::TensorFile& f, const std::string& p,
                                 const headmix::TalkingHeads<double>& layer) {
  Comparer c(f, p);
  const auto& w = layer.weights();
  c.linear("q", w.q); c.linear("k", w.k); c.linear("v", w.v); c.linear("o", w.o);
  c.dense("pre_softmax.weight", w.pre_softmax); c.dense("post_softmax.weight", w.post_softmax);
  return c.mismatch();
}
inline std::string compare_layer(const io::TensorFile& f, const std::string& p,
                                 const headmix::CollabHead<double>& layer) {
  Comparer c(f, p);
  const auto& w = layer.weights();
  c.dense("q.weight", w.q); c.dense("k.weight", w.k); c.dense("mixing", w.mixing);
  c.dense("content_bias.weight", w.content_bias); c.linear("v", w.v); c.linear("o", w.o);
  c.dense("layer_norm.weight", w.layer_norm.weight); c.dense("layer_norm.bias", w.layer_norm.bias);
  return c.mismatch();
}
inline std::string compare_layer(const io::TensorFile& f, const std::string& p, const headmix::Lsh<double>& layer) {
  Comparer c(f, p);
  const auto& w = layer.weights();
  c.linear("qk", w.qk); c.linear("v", w.v); c.linear("o", w.o); c.tensor("rotations", w.rotations);
  return c.mismatch();
}
inline std::string compare_layer(const io::TensorFile& f, const std::string& p, const headmix::Dcmha<double>& layer) {
  Comparer c(f, p);
  const auto& w = layer.weights();
  c.linear("q", w.q); c.linear("k", w.k); c.linear("v", w.v); c.linear("o", w.o);
  c.tensor("dc.dw1", w.dw1); c.tensor("dc.qkw", w.qkw); c.tensor("dc.dd", w.dd);
  // A static term the options leave out is not applied: as good as absent.
  const auto& o = layer.options();
  c.tensor("dc.pre_w", o.static_w && o.use_pre ? w.pre_w : headmix::Tensor<double>());
  c.tensor("dc.post_w", o.static_w && o.use_post ? w.post_w : headmix::Tensor<double>());
  return c.mismatch();
}

/// The outcome of building one variant from a file.
struct Built {
  std::string variant;
  enum class Outcome { built, shape_error, io_error } outcome = Outcome::built;
  std::string message;   ///< the error's text
  std::string mismatch;  ///< when built: empty, or how the layer differs from the file
};

template <class Build>
Built try_build(const std::string& variant, Build&& build) {
  Built result{variant, Built::Outcome::built, "", ""};
  try {
    result.mismatch = build();
  } catch (const headmix::shape_error& e) {
    result.outcome = Built::Outcome::shape_error;
    result.message = e.what();
  } catch (const io::io_error& e) {
    result.outcome = Built::Outcome::io_error;
    result.message = e.what();
  }
  return result;
}

/// Every variant's from_tensors over `file` under `prefix` (double), with
/// the options above. Exceptions other than shape_error / io_error escape.
inline std::vector<Built> build_every_variant(const io::TensorFile& file, const std::string& prefix) {
  auto check = [&](const auto& layer) { return compare_layer(file, prefix, layer); };
  return {
      try_build("mha", [&] { return check(headmix::Mha<double>::from_tensors(file, prefix, mha_options())); }),
      try_build("talking_heads",
                [&] { return check(headmix::TalkingHeads<double>::from_tensors(file, prefix, talking_heads_options())); }),
      try_build("collab",
                [&] { return check(headmix::CollabHead<double>::from_tensors(file, prefix, collab_options())); }),
      try_build("lsh", [&] { return check(headmix::Lsh<double>::from_tensors(file, prefix, lsh_options())); }),
      try_build("dcmha", [&] { return check(headmix::Dcmha<double>::from_tensors(file, prefix, dcmha_options(false))); }),
      try_build("dcmha_static_w",
                [&] { return check(headmix::Dcmha<double>::from_tensors(file, prefix, dcmha_options(true))); }),
      try_build("dcmha_static_post_only",
                [&] { return check(headmix::Dcmha<double>::from_tensors(file, prefix, dcmha_options(true, false))); }),
  };
}

}  // namespace headmix_check
