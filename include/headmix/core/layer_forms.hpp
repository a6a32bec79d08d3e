// The convenience forms of every layer, written once over the layer's own
// `forward(in, out, ws, probs)`, `step(x, cache, out, ws, probs)` and
// `out_dim()`. A CRTP base rather than free functions, so that the forms
// stay members (`layer.forward(x)`) and a new variant gets them by
// deriving, with `using LayerForms<...>::forward;` to keep them visible
// beside its own overload.
#pragma once

#include "headmix/core/input.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"

namespace headmix {

template <class Layer, class T>
class LayerForms {
 public:
  /// Allocating form: returns [B, T, out_dim].
  Tensor<T> forward(const AttentionInput<T>& in, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    Tensor<T> out({in.query.batch(), in.query.length(), layer().out_dim()});
    layer().forward(in, out.batch(), ws, probs);
    return out;
  }

  /// Self-attention over one sequence [T, D] -> [T, out_dim].
  Matrix<T> forward(const Matrix<T>& x) const {
    Workspace<T> ws;
    Matrix<T> y(x.rows(), layer().out_dim());
    layer().forward(AttentionInput<T>{as_batch(x), {}, {}}, as_batch(y), ws);
    return y;
  }

  /// Allocating form of step() (decoding layers): returns [B, n, out_dim].
  Tensor<T> step(ConstBatchView<T> x, SequenceCache<T>& cache, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    Tensor<T> out({x.batch(), x.length(), layer().out_dim()});
    layer().step(x, cache, out.batch(), ws, probs);
    return out;
  }

 private:
  const Layer& layer() const { return static_cast<const Layer&>(*this); }
};

}  // namespace headmix
