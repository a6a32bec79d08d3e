// Grouped-query attention, for every variant that has it (MHA,
// Talking-Heads, DCMHA), in float and double. The contract: a layer whose K
// and V store Hkv heads, each read by a contiguous group of heads, is the
// same layer as one with a K/V head per head whose weights repeat each
// stored head across its group. The expanded weights are built here by
// plain loops, and the two layers must agree in forward, attention weights
// and decoding to the last bits: only the K/V projections differ, GEMMs of
// different widths whose kernels may round the last bit differently; the
// cache holds only the stored heads; flops() counts the smaller
// projections; a head count that does not divide is a clear error.
// MHA's GQA is also checked against the naive reference in test_mha.cpp.

#include "headmix/headmix.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;

constexpr Index kWidth = 11, kBatch = 2, kLength = 13;

// Rows of `lin` repeated by head: out head j is stored head j / group;
// each head is `width` rows.
template <class T>
headmix::Linear<T> repeat_heads(const headmix::Linear<T>& lin, Index heads, Index group, Index width) {
  headmix::Linear<T> out;
  out.weight.resize(heads * width, lin.weight.cols());
  if (lin.has_bias()) out.bias.resize(heads * width);
  for (Index j = 0; j < heads; ++j)
    for (Index r = 0; r < width; ++r) {
      out.weight.row(j * width + r) = lin.weight.row(j / group * width + r);
      if (lin.has_bias()) out.bias(j * width + r) = lin.bias(j / group * width + r);
    }
  return out;
}

// One variant: its grouped layer (kv stored heads) and the expanded layer.
// A grouped layer's weights with K and V repeated per group: the same
// layer as a standard one (num_kv_heads = num_heads).
template <class W>
W with_repeated_kv(W w, Index heads, Index kv, Index dk, Index dv) {
  w.k = repeat_heads(w.k, heads, heads / kv, dk);
  w.v = repeat_heads(w.v, heads, heads / kv, dv);
  return w;
}

template <class T>
struct MhaGqa {
  using Layer = headmix::Mha<T>;
  using Scalar = T;
  static Tolerance tolerance() { return default_tolerance<T>(); }  // decoding against the forward
  static constexpr Index kHeads = 4, kDk = 3, kDv = 2;
  static headmix::MhaOptions options(Index kv) {
    headmix::MhaOptions o;
    o.num_heads = kHeads, o.num_kv_heads = kv, o.causal = true, o.block_rows = 4;
    return o;
  }
  static headmix::MhaWeights<T> weights(Rng& rng, Index kv) {
    return {random_linear<T>(rng, kHeads * kDk, kWidth), random_linear<T>(rng, kv * kDk, kWidth),
            random_linear<T>(rng, kv * kDv, kWidth), random_linear<T>(rng, 5, kHeads * kDv)};
  }
  static Layer expanded(headmix::MhaWeights<T> w, Index kv) {
    return Layer(with_repeated_kv(std::move(w), kHeads, kv, kDk, kDv), options(0));
  }
  // Cache values per position the grouping saves.
  static Index saved_per_position(Index kv) { return (kHeads - kv) * (kDk + kDv); }
};

template <class T>
struct TalkingHeadsGqa {
  using Layer = headmix::TalkingHeads<T>;
  using Scalar = T;
  static Tolerance tolerance() { return default_tolerance<T>(); }  // decoding against the forward
  static constexpr Index kKeyHeads = 4, kHeads = 3, kValueHeads = 2, kDk = 3, kDv = 2;
  static headmix::TalkingHeadsOptions options(Index kv) {
    headmix::TalkingHeadsOptions o;
    o.num_heads = kHeads, o.key_heads = kKeyHeads, o.value_heads = kValueHeads, o.num_kv_heads = kv;
    o.causal = true, o.block_rows = 4;
    return o;
  }
  static headmix::TalkingHeadsWeights<T> weights(Rng& rng, Index kv) {
    headmix::TalkingHeadsWeights<T> w;
    w.q = random_linear<T>(rng, kKeyHeads * kDk, kWidth), w.k = random_linear<T>(rng, kv * kDk, kWidth);
    w.v = random_linear<T>(rng, kv * kDv, kWidth), w.o = random_linear<T>(rng, 5, kValueHeads * kDv);
    w.pre_softmax = random_matrix<T>(rng, kHeads, kKeyHeads, 1.0);
    w.post_softmax = random_matrix<T>(rng, kValueHeads, kHeads, 1.0);
    return w;
  }
  static Layer expanded(headmix::TalkingHeadsWeights<T> w, Index kv) {
    w.k = repeat_heads(w.k, kKeyHeads, kKeyHeads / kv, kDk);
    w.v = repeat_heads(w.v, kValueHeads, kValueHeads / kv, kDv);
    return Layer(std::move(w), options(0));
  }
  static Index saved_per_position(Index kv) { return (kKeyHeads - kv) * kDk + (kValueHeads - kv) * kDv; }
};

template <class T>
struct DcmhaGqa {
  using Layer = headmix::Dcmha<T>;
  using Scalar = T;
  static Tolerance tolerance() { return dcmha_tolerance<T>(); }  // decoding against the forward
  static constexpr Index kHeads = 4, kGroups = 2, kM = 2, kRank = 2, kHidden = 5, kDk = 3, kDv = 2;
  static headmix::DcmhaOptions options(Index kv) {
    headmix::DcmhaOptions o;
    o.num_heads = kHeads, o.groups = kGroups, o.rank = kRank, o.num_kv_heads = kv, o.causal = true;
    o.block_rows = 4;
    return o;
  }
  static headmix::DcmhaWeights<T> weights(Rng& rng, Index kv) {
    headmix::DcmhaWeights<T> w;
    w.q = random_linear<T>(rng, kHeads * kDk, kWidth), w.k = random_linear<T>(rng, kv * kDk, kWidth);
    w.v = random_linear<T>(rng, kv * kDv, kWidth), w.o = random_linear<T>(rng, 5, kHeads * kDv);
    w.dw1 = random_tensor<T>(rng, {kWidth, kGroups, 4, kHidden}, 0.6);
    w.qkw = random_tensor<T>(rng, {kGroups, 4, kHidden, 2 * kRank, kM}, 0.45);
    w.dd = random_tensor<T>(rng, {kWidth, kGroups, 4 * kM}, 0.6);
    return w;
  }
  static Layer expanded(headmix::DcmhaWeights<T> w, Index kv) {
    return Layer(with_repeated_kv(std::move(w), kHeads, kv, kDk, kDv), options(0));
  }
  static Index saved_per_position(Index kv) { return (kHeads - kv) * (kDk + kDv); }
};

// A few units in the last place of values of order 1.
template <class T>
Tolerance last_bits() {
  return std::is_same_v<T, float> ? Tolerance{1e-6, 1e-6} : Tolerance{1e-14, 1e-14};
}

template <class Case>
class GroupedQuery : public ::testing::Test {};

using Cases = ::testing::Types<MhaGqa<float>, MhaGqa<double>, TalkingHeadsGqa<float>, TalkingHeadsGqa<double>,
                               DcmhaGqa<float>, DcmhaGqa<double>>;
TYPED_TEST_SUITE(GroupedQuery, Cases);

template <class Layer, class T>
Tensor<T> forward(const Layer& layer, const Matrix<T>& x, Tensor<T>* probs) {
  headmix::Workspace<T> ws;
  Tensor<T> out({kBatch, kLength, layer.out_dim()});
  headmix::AttentionInput<T> in;
  in.query = headmix::ConstBatchView<T>(x.data(), kBatch, kLength, kWidth);
  layer.forward(in, out.batch(), ws, probs);
  return out;
}

// Decode the sequence one token at a time; the outputs of every step.
template <class Layer, class T>
Tensor<T> decode(const Layer& layer, const Matrix<T>& x, headmix::SequenceCache<T>& cache) {
  headmix::Workspace<T> ws;
  Tensor<T> out({kBatch, kLength, layer.out_dim()});
  Matrix<T> token(kBatch, kWidth);
  Matrix<T> y(kBatch, layer.out_dim());
  for (Index t = 0; t < kLength; ++t) {
    for (Index b = 0; b < kBatch; ++b) token.row(b) = x.row(b * kLength + t);
    layer.step(headmix::ConstBatchView<T>(token.data(), kBatch, 1, kWidth), cache,
               headmix::BatchView<T>(y.data(), kBatch, 1, y.cols()), ws);
    for (Index b = 0; b < kBatch; ++b)
      for (Index c = 0; c < y.cols(); ++c) out[(b * kLength + t) * y.cols() + c] = y(b, c);
  }
  return out;
}

TYPED_TEST(GroupedQuery, EqualsTheLayerWithRepeatedKeyValueHeads) {
  using Case = TypeParam;
  using T = typename Case::Scalar;
  for (Index kv : {Index(1), Index(2)}) {
    SCOPED_TRACE("num_kv_heads = " + std::to_string(kv));
    Rng rng(40 + static_cast<unsigned>(kv));
    const auto w = Case::weights(rng, kv);
    const typename Case::Layer grouped(w, Case::options(kv));
    const typename Case::Layer full = Case::expanded(w, kv);
    ASSERT_EQ(grouped.options().num_kv_heads, kv);
    const Matrix<T> x = random_matrix<T>(rng, kBatch * kLength, kWidth, 1.0);

    Tensor<T> probs_grouped, probs_full;
    const Tensor<T> out_full = forward(full, x, &probs_full);
    EXPECT_TRUE(all_close("forward", forward(grouped, x, &probs_grouped), widen(out_full), last_bits<T>()));
    EXPECT_TRUE(all_close("probs", probs_grouped, widen(probs_full), last_bits<T>()));

    // A capacity whose keys' stride has no padding (a multiple of 16), so
    // the caches' memory differs by exactly the heads not stored.
    constexpr Index kCapacity = (kLength + 15) / 16 * 16;
    headmix::SequenceCache<T> cache_grouped(kBatch, kCapacity), cache_full(kBatch, kCapacity);
    const Tensor<T> steps_full = decode(full, x, cache_full);
    EXPECT_TRUE(all_close("decode", decode(grouped, x, cache_grouped), widen(steps_full), last_bits<T>()));
    EXPECT_TRUE(all_close("decode against forward", steps_full, widen(out_full), Case::tolerance()));
    EXPECT_EQ(cache_full.bytes() - cache_grouped.bytes(),
              static_cast<std::size_t>(kBatch * kCapacity * Case::saved_per_position(kv)) * sizeof(T));

    const auto saved = kBatch * kLength * kWidth * Case::saved_per_position(kv);  // K/V projection MACs
    EXPECT_EQ(full.flops(kBatch, kLength, kLength).macs() - grouped.flops(kBatch, kLength, kLength).macs(), saved);
  }
}

TYPED_TEST(GroupedQuery, HeadCountsThatDoNotDivideAreShapeErrors) {
  using Case = TypeParam;
  Rng rng(7);
  const auto w = Case::weights(rng, 2);
  for (Index kv : {Index(3), Index(-1)}) {
    SCOPED_TRACE("num_kv_heads = " + std::to_string(kv));
    const std::string message = shape_error_message([&] { typename Case::Layer layer(w, Case::options(kv)); });
    EXPECT_TRUE(mentions(message, {"num_kv_heads", "got " + std::to_string(kv)})) << message;
  }
  // K stored for every head while the options say 2: the weight is named.
  auto wide = w;
  wide.k = random_linear<typename Case::Scalar>(rng, 4 * w.k.weight.rows(), kWidth);
  const std::string message = shape_error_message([&] { typename Case::Layer layer(wide, Case::options(2)); });
  EXPECT_TRUE(mentions(message, {"k.weight"})) << message;
}

}  // namespace
