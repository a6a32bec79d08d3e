// Decoding helpers shared by test_decoding.cpp and test_half_precision.cpp:
// a problem's queries as [B, T, D], rows of them, steps over a cache in
// chunks, and the grouped-query MHA problems both files decode.
#pragma once

#include "test_util.hpp"
#include "variants.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace headmix_test {

// Rows [from, from + n) of every batch item of x [B, T, D], as [B, n, D].
template <class T>
Tensor<T> slice(const Tensor<T>& x, Index from, Index n) {
  const Index B = x.dim(0), T_ = x.dim(1), D = x.dim(2);
  Tensor<T> s({B, n, D});
  for (Index b = 0; b < B; ++b) std::copy_n(x.data() + (b * T_ + from) * D, n * D, s.data() + b * n * D);
  return s;
}

// A problem's queries ([B*T, D]) as [B, T, D].
template <class V, class P>
auto query_tensor(const P& p) {
  const auto& q = V::query(p);
  const variants::Dims d = V::dims(p);
  Tensor<typename std::decay_t<decltype(q)>::Scalar> x({d.B, d.T, d.D});
  std::copy_n(q.data(), q.size(), x.data());
  return x;
}

template <class T>
struct Decoded {
  Tensor<T> out;    // [B, T, out]
  Tensor<T> probs;  // each step's weights [B, H, n, S] placed as rows of [B, H, T, T]
};

// Feed x [B, T, D] to layer.step() in chunks of the given sizes (cycled;
// kWhole: every position left) over one cache of capacity T + spare.
template <class Layer, class T>
Decoded<T> decode(const Layer& layer, const Tensor<T>& x, const std::vector<Index>& chunks, Index spare = 0,
                  headmix::CachePrecision precision = headmix::CachePrecision::full) {
  const Index B = x.dim(0), T_ = x.dim(1), out = layer.out_dim();
  headmix::SequenceCache<T> cache(B, T_ + spare, precision);
  headmix::Workspace<T> ws;
  Decoded<T> r;
  r.out = Tensor<T>({B, T_, out});
  for (Index pos = 0, k = 0; pos < T_; ++k) {
    const Index n = std::min(chunks[static_cast<std::size_t>(k) % chunks.size()], T_ - pos), S = pos + n;
    Tensor<T> y({B, n, out}), probs;
    layer.step(slice(x, pos, n).batch(), cache, y.batch(), ws, &probs);
    EXPECT_EQ(cache.size(), S);
    const Index H = probs.rank() == 4 ? probs.dim(1) : 0;
    if (pos == 0) {
      r.probs = Tensor<T>({B, H, T_, T_});
      r.probs.set_zero();
    }
    if (!(probs.shape() == std::vector<Index>{B, r.probs.dim(1), n, S})) {
      ADD_FAILURE() << "a step of " << n << " at " << pos << " gave weights of another shape";
      return r;
    }
    for (Index b = 0; b < B; ++b) {
      std::copy_n(y.data() + b * n * out, n * out, r.out.data() + (b * T_ + pos) * out);
      for (Index h = 0; h < H; ++h)
        for (Index i = 0; i < n; ++i)
          std::copy_n(probs.data() + ((b * H + h) * n + i) * S, S, r.probs.data() + ((b * H + h) * T_ + pos + i) * T_);
    }
    pos = S;
  }
  return r;
}

// A causal MHA problem of H query heads (4 unless said) over `kv_heads`
// K/V heads, in blocks of `block_rows` query rows.
template <class T>
mha_case::Problem<T> gqa_problem(int kv_heads, int B, int T_, int D, int dk, int dv, int out, unsigned seed, int H = 4,
                                 int block_rows = 4) {
  mha_case::Shape s;
  s.B = B, s.T = T_, s.D = D, s.H = H, s.Hkv = kv_heads, s.Dk = dk, s.Dv = dv, s.out = out, s.causal = true;
  s.block_rows = block_rows;
  return mha_case::make_problem<T>(s, seed);
}

}  // namespace headmix_test
