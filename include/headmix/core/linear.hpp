// A linear map in PyTorch layout: weight [out, in], optional bias [out],
// y = x · weightᵀ + bias.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/types.hpp"

#include <string>

namespace headmix {

template <class T>
struct Linear {
  Matrix<T> weight;  ///< [out_features, in_features]
  Vector<T> bias;    ///< [out_features], or empty for no bias

  Index in_features() const { return weight.cols(); }
  Index out_features() const { return weight.rows(); }
  bool has_bias() const { return bias.size() != 0; }
  /// No weight and no bias: the layer has no such projection. A weight with
  /// a zero dimension is not "absent" but a shape error (check_optional).
  bool empty() const { return weight.rows() == 0 && weight.cols() == 0 && !has_bias(); }

  /// `y = x · weightᵀ + bias` for the rows of `x`; `y` must already be [x.rows(), out].
  template <class In, class Out>
  void apply(const Eigen::MatrixBase<In>& x, Eigen::MatrixBase<Out> const& y_) const {
    auto& y = const_cast<Eigen::MatrixBase<Out>&>(y_);
    HEADMIX_ASSERT(x.cols() == in_features() && y.rows() == x.rows() && y.cols() == out_features());
    y.noalias() = x * weight.transpose();
    if (has_bias()) y.rowwise() += bias.transpose();
  }

  /// Validate against an expected [out, in]; the bias, if any, must be [out].
  void check(const std::string& variant, const std::string& name, Index out, Index in) const {
    check_matrix(variant, name + ".weight", weight, out, in);
    if (has_bias()) check_vector(variant, name + ".bias", bias, out);
  }

  /// Validate a projection the layer may go without: absent, or [out >= 1, in]
  /// with an optional bias [out]. A bias without its weight is a broken
  /// checkpoint, not "no projection".
  void check_optional(const std::string& variant, const std::string& name, Index in) const {
    if (empty()) return;
    if (weight.rows() == 0 && weight.cols() == 0)
      detail::throw_shape(variant, name + ".weight",
                          "[" + std::to_string(bias.size()) + ", " + std::to_string(in) + "] (" + name + ".bias is given)",
                          detail::format_shape(Shape{0, 0}));
    if (weight.rows() < 1)
      detail::throw_shape(variant, name + ".weight rows (out_dim)", ">= 1", std::to_string(weight.rows()));
    check(variant, name, weight.rows(), in);
  }

  template <class U>
  Linear<U> cast() const {
    return {weight.template cast<U>(), bias.template cast<U>()};
  }
};

/// Read `<name>.weight` and, when present, `<name>.bias` from any source of
/// named tensors that has `contains(name)`, `matrix<T>(name)` and
/// `vector<T>(name)` (io::TensorFile is one). A missing weight is the
/// source's error (io::io_error names the tensor).
template <class T, class Source>
Linear<T> read_linear(const Source& tensors, const std::string& name) {
  Linear<T> lin;
  lin.weight = tensors.template matrix<T>(name + ".weight");
  if (tensors.contains(name + ".bias")) lin.bias = tensors.template vector<T>(name + ".bias");
  return lin;
}

/// Run `build()` (a layer constructor over tensors read from `tensors` under
/// `prefix`) so that a shape_error names the tensor as it is stored: an
/// argument "o.weight" of "[mha] o.weight: expected ..." becomes
/// "attn.o.weight" when the source holds "attn.o.weight". Options and other
/// arguments keep their names.
template <class Source, class Build>
auto with_tensor_prefix(const Source& tensors, const std::string& prefix, Build&& build) -> decltype(build()) {
  try {
    return build();
  } catch (const shape_error& e) {
    const std::string what = e.what();  // "[variant] argument: expected ..."
    const std::size_t start = what.find("] ");
    if (prefix.empty() || start == std::string::npos) throw;
    const std::size_t end = what.find_first_of(" :", start + 2);
    if (end == std::string::npos || !tensors.contains(prefix + what.substr(start + 2, end - start - 2))) throw;
    throw shape_error(what.substr(0, start + 2) + prefix + what.substr(start + 2));
  }
}

}  // namespace headmix
