// Grouped-query attention, for every variant whose traits say it has it
// (tests/variants.hpp: `gqa`, with its GroupedQuery<T> problem in
// tests/cases/<variant>.hpp), in float and double. The contract: a layer
// whose K and V store Hkv heads, each read by a contiguous group of heads,
// is the same layer as one with a K/V head per head whose weights repeat
// each stored head across its group. The expanded weights are built by
// plain loops (repeat_kv_heads in tests/cases/common.hpp), and the two
// layers must agree in forward, attention weights and decoding to the last
// bits: only the K/V projections differ, GEMMs of different widths whose
// kernels may round the last bit differently; the cache holds only the
// stored heads; flops() counts the smaller projections; a head count that
// does not divide is a clear error. MHA's GQA is also checked against the
// naive reference in test_mha.cpp.

#include "variants.hpp"

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;

constexpr Index kBatch = 2, kLength = 13;

// A few units in the last place of values of order 1.
template <class T>
Tolerance last_bits() {
  return std::is_same_v<T, float> ? Tolerance{1e-6, 1e-6} : Tolerance{1e-14, 1e-14};
}

template <class X>
class GroupedQuery : public ::testing::Test {
 protected:
  void SetUp() override {
    if constexpr (!X::Variant::gqa) GTEST_SKIP() << X::Variant::name << " has no grouped-query attention";
  }
};
TYPED_TEST_SUITE(GroupedQuery, AllVariantsInBothScalars, VariantInName);

// The types a test body needs, for a variant with grouped-query attention.
template <class V, class T>
struct Grouped {
  using Case = typename V::template GroupedQuery<T>;
  using Layer = typename V::template Layer<T>;
  using Scalar = T;
};
// body(Grouped<V, T>{}) where X's variant has it (the others skip in SetUp).
template <class X, class Body>
void if_grouped(Body body) {
  if constexpr (X::Variant::gqa) body(Grouped<typename X::Variant, typename X::Scalar>{});
}

template <class Layer, class T>
Tensor<T> forward(const Layer& layer, const Matrix<T>& x, Tensor<T>* probs) {
  headmix::Workspace<T> ws;
  Tensor<T> out({kBatch, kLength, layer.out_dim()});
  headmix::AttentionInput<T> in;
  in.query = headmix::ConstBatchView<T>(x.data(), kBatch, kLength, layer.embed_dim());
  layer.forward(in, out.batch(), ws, probs);
  return out;
}

// Decode the sequence one token at a time; the outputs of every step.
template <class Layer, class T>
Tensor<T> decode(const Layer& layer, const Matrix<T>& x, headmix::SequenceCache<T>& cache) {
  headmix::Workspace<T> ws;
  const Index D = layer.embed_dim();
  Tensor<T> out({kBatch, kLength, layer.out_dim()});
  Matrix<T> token(kBatch, D);
  Matrix<T> y(kBatch, layer.out_dim());
  for (Index t = 0; t < kLength; ++t) {
    for (Index b = 0; b < kBatch; ++b) token.row(b) = x.row(b * kLength + t);
    layer.step(headmix::ConstBatchView<T>(token.data(), kBatch, 1, D), cache,
               headmix::BatchView<T>(y.data(), kBatch, 1, y.cols()), ws);
    for (Index b = 0; b < kBatch; ++b)
      for (Index c = 0; c < y.cols(); ++c) out[(b * kLength + t) * y.cols() + c] = y(b, c);
  }
  return out;
}

TYPED_TEST(GroupedQuery, EqualsTheLayerWithRepeatedKeyValueHeads) {
  if_grouped<TypeParam>([](auto g) {
    using Case = typename decltype(g)::Case;
    using Layer = typename decltype(g)::Layer;
    using T = typename decltype(g)::Scalar;
    for (Index kv : {Index(1), Index(2)}) {
      SCOPED_TRACE("num_kv_heads = " + std::to_string(kv));
      Rng rng(40 + static_cast<unsigned>(kv));
      const auto w = Case::weights(rng, kv);
      const Layer grouped(w, Case::options(kv));
      const auto expanded = Case::expanded(w, kv);
      const Layer full(expanded, Case::options(0));
      ASSERT_EQ(grouped.options().num_kv_heads, kv);
      const Matrix<T> x = random_matrix<T>(rng, kBatch * kLength, grouped.embed_dim(), 1.0);

      Tensor<T> probs_grouped, probs_full;
      const Tensor<T> out_full = forward(full, x, &probs_full);
      EXPECT_TRUE(all_close("forward", forward(grouped, x, &probs_grouped), widen(out_full), last_bits<T>()));
      EXPECT_TRUE(all_close("probs", probs_grouped, widen(probs_full), last_bits<T>()));

      // The caches' memory differs by exactly the K/V rows each layer stores:
      // K's (transposed) over each cache's K extent (its padded stride in
      // rows; its capacity in panels, as grouped MHA lays them), V's over
      // the capacity; any other streams (DCMHA's) alike in both.
      constexpr Index kCapacity = (kLength + 15) / 16 * 16;
      headmix::SequenceCache<T> cache_grouped(kBatch, kCapacity), cache_full(kBatch, kCapacity);
      const Tensor<T> steps_full = decode(full, x, cache_full);
      EXPECT_TRUE(all_close("decode", decode(grouped, x, cache_grouped), widen(steps_full), last_bits<T>()));
      EXPECT_TRUE(all_close("decode against forward", steps_full, widen(out_full), Case::tolerance()));
      const Index saved_k = expanded.k.weight.rows() - w.k.weight.rows();
      const Index saved_v = expanded.v.weight.rows() - w.v.weight.rows(), saved = saved_k + saved_v;
      auto held = [&](const headmix::SequenceCache<T>& cache, const auto& weights) {
        return static_cast<std::size_t>(kBatch * (key_extent(cache) * weights.k.weight.rows() +
                                                  kCapacity * weights.v.weight.rows())) * sizeof(T);
      };
      EXPECT_EQ(cache_full.bytes() - cache_grouped.bytes(), held(cache_full, expanded) - held(cache_grouped, w));

      // The K/V projections' multiply-adds the grouping saves.
      EXPECT_EQ(full.flops(kBatch, kLength, kLength).macs() - grouped.flops(kBatch, kLength, kLength).macs(),
                kBatch * kLength * grouped.embed_dim() * saved);
    }
  });
}

TYPED_TEST(GroupedQuery, HeadCountsThatDoNotDivideAreShapeErrors) {
  if_grouped<TypeParam>([](auto g) {
    using Case = typename decltype(g)::Case;
    using Layer = typename decltype(g)::Layer;
    using T = typename decltype(g)::Scalar;
    Rng rng(7);
    const auto w = Case::weights(rng, 2);
    for (Index kv : {Index(3), Index(-1)}) {
      SCOPED_TRACE("num_kv_heads = " + std::to_string(kv));
      const std::string message = shape_error_message([&] { Layer layer(w, Case::options(kv)); });
      EXPECT_TRUE(mentions(message, {"num_kv_heads", "got " + std::to_string(kv)})) << message;
    }
    // K stored for every head while the options say 2: the weight is named.
    auto wide = w;
    wide.k = random_linear<T>(rng, 4 * w.k.weight.rows(), w.k.weight.cols());
    const std::string message = shape_error_message([&] { Layer layer(wide, Case::options(2)); });
    EXPECT_TRUE(mentions(message, {"k.weight"})) << message;
  });
}

}  // namespace
