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
  bool empty() const { return weight.size() == 0; }

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

}  // namespace headmix
