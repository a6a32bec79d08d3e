// A linear map in PyTorch layout: weight [out, in], optional bias [out],
// y = x · weightᵀ + bias.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/gemm.hpp"
#include "headmix/core/row_product.hpp"
#include "headmix/core/types.hpp"
#include "headmix/io/io_error.hpp"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace headmix {

template <class T>
struct Linear {
  Matrix<T> weight;  ///< [out_features, in_features]
  Vector<T> bias;    ///< [out_features], or empty for no bias
  /// weightᵀ [in_features, out_features] packed for the GEMM backend when it
  /// multiplies untransposed operands only (libxsmm), which one-row products
  /// stream too: made by prepare(), which the layers call when built. Empty
  /// otherwise, and then unused.
  PackedMatrix<T> weight_packed = {};
  /// weightᵀ in bfloat16, in the same panels, which a one-row product
  /// streams instead of weight_packed (half the bytes: a decoding step
  /// reads every weight once per token). Made by prepare(true); empty
  /// otherwise.
  PackedMatrix<Eigen::bfloat16> weight_half = {};

  /// Lay out weightᵀ for the GEMM backend, once (call again after changing
  /// `weight`); a no-op on Eigen's GEMM, which reads weight transposed as is.
  /// With `bfloat16_weights`, first round `weight` to bfloat16 (to nearest
  /// even, through float) and keep the bfloat16 copy for one-row products:
  /// every product then uses the same rounded weights. Without it, drop
  /// that copy (a rounding made before stays).
  void prepare(bool bfloat16_weights = false) {
    using Half = Eigen::bfloat16;
    weight_half = {};
    if (bfloat16_weights) {
      weight = weight.unaryExpr([](T w) { return static_cast<T>(static_cast<float>(Half(static_cast<float>(w)))); });
      weight_half = PackedMatrix<Half>(weight.transpose().unaryExpr([](T w) { return Half(static_cast<float>(w)); }));
    }
#ifdef HEADMIX_USE_LIBXSMM
    weight_packed = PackedMatrix<T>(weight.transpose());
#endif
  }

  Index in_features() const { return weight.cols(); }
  Index out_features() const { return weight.rows(); }
  /// In code, an empty bias means "no bias" and an empty Linear "no such
  /// projection". A stored tensor is never read as empty: read_linear and
  /// from_tensors refuse a tensor with no elements, so absent means not in
  /// the file. A weight [0, n] or [n, 0] is a shape error (check_optional).
  bool has_bias() const { return bias.size() != 0; }
  bool empty() const { return weight.rows() == 0 && weight.cols() == 0 && !has_bias(); }

  /// `y = x · weightᵀ + bias` for the rows of `x`; `y` must already be [x.rows(), out].
  template <class In, class Out>
  void apply(const Eigen::MatrixBase<In>& x, Eigen::MatrixBase<Out> const& y) const {
    HEADMIX_ASSERT(y.cols() == out_features());
    apply_columns(x, 0, y);
  }

  /// Output columns [c0, c0 + y.cols()) of `x · weightᵀ + bias` into `y`.
  /// From a multiple of 64 (a panel boundary of weight_packed), libxsmm
  /// runs the tiles apply() would run there: the same bits. So does a
  /// one-row product that also ends on a panel boundary or at the last
  /// column (its sums for a full 64-column chunk and for a narrower rest
  /// may contract into FMAs differently).
  template <class In, class Out>
  void apply_columns(const Eigen::MatrixBase<In>& x, Index c0, Eigen::MatrixBase<Out> const& y_) const {
    auto& y = const_cast<Eigen::MatrixBase<Out>&>(y_);
    const Index n = y.cols();
    HEADMIX_ASSERT(x.cols() == in_features() && y.rows() == x.rows() && c0 >= 0 && c0 + n <= out_features());
    if (!apply_one_row(x, c0, y)) {
      if (weight_packed.rows() == in_features() && weight_packed.cols() == out_features())
        gemm(x, weight_packed.panels().middle_cols(c0, n), y);
      else
        y.noalias() = x * weight.middleRows(c0, n).transpose();
    }
    if (has_bias()) y.rowwise() += bias.segment(c0, n).transpose();
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

 private:
  // Columns [c0, c0 + y.cols()) of x · weightᵀ when x is one contiguous
  // row and the weights are in panels (weight_half, else weight_packed,
  // which libxsmm builds have): a matrix-vector product bound by reading
  // the weights, which accumulate_rows streams (bfloat16 rows widened in
  // registers), products in T. A decoding step's projections read weights
  // its cache has evicted: D = 1024, float, 0.80-0.82x the time of
  // libxsmm's one-row GEMM (about equal when the weights are in cache).
  // Returns whether it ran.
  template <class In, class Out>
  bool apply_one_row(const Eigen::MatrixBase<In>& x, Index c0, Out& y) const {
    if constexpr (detail::row_major_direct<In>() && detail::row_major_direct<Out>()) {
      if (x.rows() != 1 || x.innerStride() != 1 || y.innerStride() != 1) return false;
      auto stream = [&](const auto& panels) {
        constexpr Index width = std::decay_t<decltype(panels)>::kWidth;
        for (Index c = c0, end = c0 + y.cols(); c < end;) {
          const Index p0 = c / width * width, stride = panels.panel_cols(p0), next = std::min(end, p0 + stride);
          accumulate_rows(x.derived().data(), panels.panel(p0).data() + (c - p0), in_features(), stride, next - c,
                          y.derived().data() + (c - c0), false);
          c = next;
        }
        return true;
      };
      if (weight_half.rows() == in_features() && weight_half.cols() == out_features())
        return stream(weight_half.panels());
      if (weight_packed.rows() == in_features() && weight_packed.cols() == out_features())
        return stream(weight_packed.panels());
    }
    return false;
  }
};

/// prepare() each projection of a layer, when the layer is built or its
/// bfloat16_weights option changes.
template <class... Linears>
void prepare_projections(bool bfloat16_weights, Linears&... linears) {
  (linears.prepare(bfloat16_weights), ...);
}

namespace detail {

/// Weights use an empty matrix (or a rank-0 Tensor) for "absent", so a
/// tensor that is in the source must hold elements and have a rank: else a
/// stored [0] bias or [0, 0] weight would silently become a missing one and
/// the layer would run as another model.
inline void check_stored(const std::string& name, const Shape& shape, Index size) {
  if (shape.rank() != 0 && size != 0) return;
  throw_shape("io", name, "a tensor with at least one element (a stored tensor is never taken for an absent one)",
              format_shape(shape));
}

template <class T, class Source>
Matrix<T> read_matrix(const Source& tensors, const std::string& name) {
  Matrix<T> m = tensors.template matrix<T>(name);
  check_stored(name, {m.rows(), m.cols()}, m.size());
  return m;
}

template <class T, class Source>
Vector<T> read_vector(const Source& tensors, const std::string& name) {
  Vector<T> v = tensors.template vector<T>(name);
  check_stored(name, {v.size()}, v.size());
  return v;
}

template <class T, class Source>
Tensor<T> read_tensor(const Source& tensors, const std::string& name) {
  Tensor<T> t = tensors.template get<T>(name);
  check_stored(name, t.shape(), t.rank() == 0 ? 0 : t.size());
  return t;
}

}  // namespace detail

/// Read `<name>.weight` and, when present, `<name>.bias` from any source of
/// named tensors that has `contains(name)`, `matrix<T>(name)` and
/// `vector<T>(name)` (io::TensorFile is one). A missing weight is the
/// source's error (io::io_error names the tensor); a stored tensor without
/// elements is a shape_error, never "no bias".
template <class T, class Source>
Linear<T> read_linear(const Source& tensors, const std::string& name) {
  Linear<T> lin;
  lin.weight = detail::read_matrix<T>(tensors, name + ".weight");
  if (tensors.contains(name + ".bias")) lin.bias = detail::read_vector<T>(tensors, name + ".bias");
  return lin;
}

namespace detail {
/// An optional projection: absent when neither tensor is stored; a bias
/// without its weight is the missing weight's io_error.
template <class T, class Source>
Linear<T> read_optional_linear(const Source& tensors, const std::string& name) {
  if (!tensors.contains(name + ".weight") && !tensors.contains(name + ".bias")) return {};
  return read_linear<T>(tensors, name);
}

/// Sources that can list their names: a `tensors` map keyed by name, as
/// io::TensorFile (and a plain std::map adapter) has.
template <class Source, class = void>
struct lists_tensors : std::false_type {};
template <class Source>
struct lists_tensors<Source, std::void_t<decltype(std::declval<const Source&>().tensors.lower_bound(std::string()))>>
    : std::true_type {};

/// The stem of a tensor name: up to its first '.' ("q" of "q.weight").
inline std::string_view name_stem(std::string_view name) { return name.substr(0, name.find('.')); }

/// A stored name under `prefix` whose stem is one of the layer's but which is
/// not one of `tensor_names` ("attn.q.bias" for a layer without a q bias)
/// would be silently dropped: io_error. Names with other stems stay allowed,
/// since a broader prefix also holds other layers' tensors. Only a source
/// that can list its names is checked (lists_tensors); an adapter with just
/// contains/matrix/vector cannot say what else it holds.
template <class Source>
void check_no_stray_tensors(const Source& tensors, const std::string& prefix,
                            std::initializer_list<const char*> tensor_names) {
  if constexpr (lists_tensors<Source>::value) {
    const auto& stored = tensors.tensors;
    for (auto it = stored.lower_bound(prefix); it != stored.end(); ++it) {
      const std::string& name = it->first;
      if (name.compare(0, prefix.size(), prefix) != 0) break;  // past the names under prefix
      const std::string_view rest = std::string_view(name).substr(prefix.size());
      bool own_stem = false, own_name = false;
      for (const char* own : tensor_names) {
        own_stem = own_stem || name_stem(own) == name_stem(rest);
        own_name = own_name || rest == own;
      }
      if (!own_stem || own_name) continue;
      std::string own;
      for (const char* n : tensor_names) own += (own.empty() ? "" : ", ") + std::string(n);
      const std::string shown = name.size() <= 200 ? name : name.substr(0, 200) + "...";
      throw io::io_error("'" + shown + "' is not a tensor of this layer, which reads " + own +
                         (prefix.empty() ? std::string() : " under the prefix '" + prefix + "'"));
    }
  }
}

}  // namespace detail

/// Run `build()` (a layer constructor over tensors read from `tensors` under
/// `prefix`) so that a shape_error names the tensor as it is stored: an
/// argument "o.weight" of "[mha] o.weight: expected ..." becomes
/// "attn.o.weight" when it is one of the layer's `tensor_names` and the
/// source holds "attn.o.weight". Options are never tensors: "num_heads"
/// keeps its name even if the file has a tensor "attn.num_heads". First, a
/// stored name under one of the layer's stems that is none of its
/// `tensor_names` is an io_error (detail::check_no_stray_tensors).
template <class Source, class Build>
auto with_tensor_prefix(const Source& tensors, const std::string& prefix,
                        std::initializer_list<const char*> tensor_names, Build&& build) -> decltype(build()) {
  detail::check_no_stray_tensors(tensors, prefix, tensor_names);
  try {
    return build();
  } catch (const shape_error& e) {
    // The argument is a tensor's name, possibly qualified ("q.weight
    // columns (D)"), or an option's, which keeps its name.
    const std::string tensor = e.argument().substr(0, e.argument().find(' '));
    const bool is_tensor = std::find(tensor_names.begin(), tensor_names.end(), tensor) != tensor_names.end() &&
                           tensors.contains(prefix + tensor);
    if (prefix.empty() || !is_tensor) throw;
    throw e.renamed(prefix + e.argument());
  }
}

}  // namespace headmix
