// The determinism promises of the README, as tests, for every variant in
// float and double. CI runs this file in every build users make: the
// sanitized one, Release -O3 -march=native with gcc and with clang, and
// with the OpenBLAS backend. Within one build, a call's results (output
// and attention weights) are bit-identical
//   * across repeated calls on one Workspace, and with a fresh Workspace;
//   * for any thread count (1, 2, 3), with several tasks per call;
//   * wherever the caller's buffers are (inputs, keys and outputs moved by
//     every element offset within 64 bytes: a vectorised reduction that
//     peels to an aligned address would change its order with them);
//   * whatever the padded tokens hold (dense variants: a padded key has
//     weight exactly 0, so it cannot reach another row). LSH is exempt:
//     where a padded token hashes changes which keys share a chunk;
//   * for decoding steps, across thread counts and buffer addresses.
// Across builds (instruction sets, compilers, BLAS) results differ in the
// last bits; the reference and conformance tests bound that difference.

#include "headmix/headmix.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;

constexpr Index kBatch = 2, kLength = 37, kWidth = 13, kKeyWidth = 7, kBlockRows = 8;
constexpr Index kPaddedFrom = 29;  // item 1's positions >= this are padding

// ---- one case per variant ------------------------------------------------------

template <class T>
struct MhaCase {
  using Layer = headmix::Mha<T>;
  static constexpr bool kCross = true;
  static Layer make(Rng& rng, Index key_width) {
    const Index H = 3;
    headmix::MhaWeights<T> w{random_linear<T>(rng, H * 5, kWidth), random_linear<T>(rng, H * 5, key_width),
                             random_linear<T>(rng, H * 3, key_width), random_linear<T>(rng, 11, H * 3)};
    headmix::MhaOptions o;
    o.num_heads = H, o.block_rows = kBlockRows;
    return Layer(std::move(w), o);
  }
};

template <class T>
struct TalkingHeadsCase {
  using Layer = headmix::TalkingHeads<T>;
  static constexpr bool kCross = true;
  static Layer make(Rng& rng, Index key_width) {
    const Index hk = 2, h = 4, hv = 3;
    headmix::TalkingHeadsWeights<T> w;
    w.q = random_linear<T>(rng, hk * 5, kWidth), w.k = random_linear<T>(rng, hk * 5, key_width);
    w.v = random_linear<T>(rng, hv * 3, key_width), w.o = random_linear<T>(rng, 9, hv * 3);
    w.pre_softmax = random_matrix<T>(rng, h, hk, 1.0), w.post_softmax = random_matrix<T>(rng, hv, h, 1.0);
    headmix::TalkingHeadsOptions o;
    o.num_heads = h, o.key_heads = hk, o.value_heads = hv, o.block_rows = kBlockRows;
    return Layer(std::move(w), o);
  }
};

template <class T>
struct CollabHeadCase {
  using Layer = headmix::CollabHead<T>;
  static constexpr bool kCross = true;
  static Layer make(Rng& rng, Index key_width) {
    const Index H = 3, R = 9;
    headmix::CollabHeadWeights<T> w;
    w.q = random_matrix<T>(rng, R, kWidth, 0.3), w.k = random_matrix<T>(rng, R, key_width, 0.4);
    w.mixing = random_matrix<T>(rng, H, R, 1.0), w.content_bias = random_matrix<T>(rng, H, key_width, 0.4);
    w.v = random_linear<T>(rng, H * 3, key_width), w.o = random_linear<T>(rng, kWidth, H * 3);
    w.layer_norm.weight = random_matrix<T>(rng, kWidth, 1, 1.0), w.layer_norm.bias = random_matrix<T>(rng, kWidth, 1, 1.0);
    headmix::CollabHeadOptions o;
    o.num_heads = H, o.block_rows = kBlockRows;
    return Layer(std::move(w), o);
  }
};

template <class T>
struct DcmhaCase {
  using Layer = headmix::Dcmha<T>;
  static constexpr bool kCross = false;
  static Layer make(Rng& rng, Index) {
    const Index H = 4, G = 2, M = 2, R = 2, K = 5;
    headmix::DcmhaWeights<T> w;
    w.q = random_linear<T>(rng, H * 3, kWidth), w.k = random_linear<T>(rng, H * 3, kWidth);
    w.v = random_linear<T>(rng, H * 2, kWidth), w.o = random_linear<T>(rng, 7, H * 2);
    w.dw1 = random_tensor<T>(rng, {kWidth, G, 4, K}, 0.6), w.qkw = random_tensor<T>(rng, {G, 4, K, 2 * R, M}, 0.45);
    w.dd = random_tensor<T>(rng, {kWidth, G, 4 * M}, 0.6);
    w.pre_w = random_tensor<T>(rng, {G, M, M}, 0.5), w.post_w = random_tensor<T>(rng, {G, M, M}, 0.5);
    headmix::DcmhaOptions o;
    o.num_heads = H, o.groups = G, o.rank = R, o.static_w = true, o.block_rows = kBlockRows;
    return Layer(std::move(w), o);
  }
};

template <class T>
struct LshCase {
  using Layer = headmix::Lsh<T>;
  static constexpr bool kCross = false;
  static Layer make(Rng& rng, Index) {
    const Index H = 2;
    headmix::LshWeights<T> w;
    w.qk = random_linear<T>(rng, H * 5, kWidth, false), w.v = random_linear<T>(rng, H * 3, kWidth, false);
    w.o = random_linear<T>(rng, 8, H * 3);
    headmix::LshOptions o;
    o.num_heads = H, o.bucket_size = 4, o.n_hashes = 3, o.seed = 17;
    return Layer(std::move(w), o);
  }
};

// ---- calls on caller buffers at chosen addresses --------------------------------

// A caller's buffer of n values starting `offset` elements into its storage.
template <class T>
struct Placed {
  std::vector<T> storage;
  T* data;
  Placed(const T* values, Index n, Index offset) : storage(static_cast<std::size_t>(n + offset)) {
    data = storage.data() + offset;
    if (values) std::memcpy(data, values, sizeof(T) * static_cast<std::size_t>(n));
  }
};

// Everything a call produced, output then weights, as one tensor.
template <class T>
Tensor<T> joined(const T* out, Index n, const Tensor<T>& probs) {
  Tensor<T> t({n + probs.size()});
  std::copy_n(out, n, t.data());
  std::copy_n(probs.data(), probs.size(), t.data() + n);
  return t;
}

template <class Case>
class Determinism : public ::testing::Test {
 protected:
  using T = typename Case::T_;
  using Layer = typename Case::Layer;

  Determinism() : rng_(7), layer_(Case::make(rng_, Case::kCross ? kKeyWidth : kWidth)) {
    query_ = random_matrix<T>(rng_, kBatch * kLength, kWidth, 1.0);
    if (Case::kCross) key_ = random_matrix<T>(rng_, kBatch * (kLength + 3), kKeyWidth, 1.0);
    padding_.assign(static_cast<std::size_t>(kBatch * keys()), 0);
    for (Index s = kPaddedFrom; s < keys(); ++s) padding_[static_cast<std::size_t>(keys() + s)] = 1;
    padding_[static_cast<std::size_t>(keys() + 4)] = 1;  // one in the middle too
  }

  Index keys() const { return Case::kCross ? kLength + 3 : kLength; }

  // Forward on copies of the inputs placed `offset` elements into their
  // buffers; output and weights joined.
  Tensor<T> forward(const Layer& layer, headmix::Workspace<T>& ws, Index offset, const Matrix<T>& query,
                    const Matrix<T>* key, bool padded) const {
    const Placed<T> q(query.data(), query.size(), offset);
    const Placed<T> k(key ? key->data() : nullptr, key ? key->size() : 0, offset);
    Placed<T> out(nullptr, kBatch * kLength * layer.out_dim(), offset);
    headmix::AttentionInput<T> in;
    in.query = {q.data, kBatch, kLength, kWidth};
    if (key) in.key = {k.data, kBatch, keys(), kKeyWidth};
    if (padded) in.key_padding = {padding_.data(), kBatch, keys()};
    Tensor<T> probs;
    layer.forward(in, {out.data, kBatch, kLength, layer.out_dim()}, ws, &probs);
    return joined<T>(out.data, kBatch * kLength * layer.out_dim(), probs);
  }
  Tensor<T> forward(const Layer& layer, headmix::Workspace<T>& ws, Index offset = 0, bool padded = true) const {
    return forward(layer, ws, offset, query_, Case::kCross ? &key_ : nullptr, padded);
  }

  Layer with_threads(int threads) const {
    Layer layer = layer_;
    auto o = layer.options();
    o.threads = threads;
    layer.set_options(o);
    return layer;
  }

  Rng rng_;
  Layer layer_;
  Matrix<T> query_, key_;
  std::vector<std::uint8_t> padding_;
};

template <template <class> class C, class T>
struct Bind : C<T> {
  using T_ = T;
};
using DenseCases = ::testing::Types<Bind<MhaCase, float>, Bind<MhaCase, double>, Bind<TalkingHeadsCase, float>,
                                    Bind<TalkingHeadsCase, double>, Bind<CollabHeadCase, float>,
                                    Bind<CollabHeadCase, double>, Bind<DcmhaCase, float>, Bind<DcmhaCase, double>>;
using Cases = ::testing::Types<Bind<MhaCase, float>, Bind<MhaCase, double>, Bind<TalkingHeadsCase, float>,
                               Bind<TalkingHeadsCase, double>, Bind<CollabHeadCase, float>,
                               Bind<CollabHeadCase, double>, Bind<DcmhaCase, float>, Bind<DcmhaCase, double>,
                               Bind<LshCase, float>, Bind<LshCase, double>>;

// Test names that say the variant and the scalar ("Mha_float").
struct CaseName {
  template <class Case>
  static std::string GetName(int) {
    return std::string(Case::Layer::kName) + (std::is_same_v<typename Case::T_, float> ? "_float" : "_double");
  }
};
TYPED_TEST_SUITE(Determinism, Cases, CaseName);

// The promises that only the dense, decoding variants make.
template <class Case>
class DenseDeterminism : public Determinism<Case> {};
TYPED_TEST_SUITE(DenseDeterminism, DenseCases, CaseName);

TYPED_TEST(Determinism, RepeatedCallsAndFreshWorkspaces) {
  using T = typename TestFixture::T;
  headmix::Workspace<T> reused;
  const Tensor<T> first = this->forward(this->layer_, reused);
  EXPECT_TRUE(bit_identical("second call, same workspace", first, this->forward(this->layer_, reused)));
  headmix::Workspace<T> fresh;
  EXPECT_TRUE(bit_identical("fresh workspace", first, this->forward(this->layer_, fresh)));
  // A workspace grown by a larger call first, then reused.
  headmix::Workspace<T> grown;
  const Matrix<T> other = random_matrix<T>(this->rng_, kBatch * kLength, kWidth, 1.0);
  (void)this->forward(this->layer_, grown, 0, other, TypeParam::kCross ? &this->key_ : nullptr, false);
  EXPECT_TRUE(bit_identical("workspace grown by another call", first, this->forward(this->layer_, grown)));
}

TYPED_TEST(Determinism, AnyThreadCount) {
  using T = typename TestFixture::T;
  headmix::Workspace<T> ws;
  const Tensor<T> serial = this->forward(this->with_threads(1), ws);
  for (int threads : {2, 3}) {
    headmix::Workspace<T> ws_n;
    EXPECT_TRUE(bit_identical(("threads=" + std::to_string(threads)).c_str(), serial,
                              this->forward(this->with_threads(threads), ws_n)));
  }
}

TYPED_TEST(Determinism, AnyBufferAddress) {
  using T = typename TestFixture::T;
  headmix::Workspace<T> ws;
  const Tensor<T> at_zero = this->forward(this->layer_, ws, 0);
  for (Index offset = 1; offset < Index(64 / sizeof(T)); ++offset)
    EXPECT_TRUE(bit_identical(("inputs and output " + std::to_string(offset) + " elements in").c_str(), at_zero,
                              this->forward(this->layer_, ws, offset)));
}

TYPED_TEST(DenseDeterminism, PaddedTokensReachNoOtherRow) {
  using T = typename TestFixture::T;
  using Case = TypeParam;
  headmix::Workspace<T> ws;
  const Tensor<T> clean = this->forward(this->layer_, ws);
  // Scribble over every padded token, in the query rows and the key rows.
  Matrix<T> query = this->query_, key = this->key_;
  Matrix<T>& keys = Case::kCross ? key : query;
  for (Index s = 0; s < this->keys(); ++s)
    if (this->padding_[static_cast<std::size_t>(this->keys() + s)])
      keys.row(this->keys() + s) = random_matrix<T>(this->rng_, 1, keys.cols(), 50.0);
  const Tensor<T> scribbled = this->forward(this->layer_, ws, 0, query, Case::kCross ? &key : nullptr, true);
  ASSERT_EQ(clean.shape(), scribbled.shape());

  const Index out_dim = this->layer_.out_dim(), outputs = kBatch * kLength * out_dim;
  const Index S = this->keys(), heads = (clean.size() - outputs) / (kBatch * kLength * S);
  for (Index b = 0; b < kBatch; ++b)
    for (Index t = 0; t < kLength; ++t) {
      // In self-attention a padded position is also a query whose own row changes.
      const bool own_row_scribbled = !Case::kCross && this->padding_[static_cast<std::size_t>(b * S + t)];
      if (own_row_scribbled) continue;
      const Index row = (b * kLength + t) * out_dim;
      ASSERT_EQ(0, std::memcmp(&clean[row], &scribbled[row], sizeof(T) * static_cast<std::size_t>(out_dim)))
          << "output row b=" << b << " t=" << t << " moved";
    }
  // Weights: exactly zero on every padded key, and unchanged elsewhere.
  for (Index b = 0; b < kBatch; ++b)
    for (Index h = 0; h < heads; ++h)
      for (Index t = 0; t < kLength; ++t)
        for (Index s = 0; s < S; ++s) {
          const Index at = outputs + ((b * heads + h) * kLength + t) * S + s;
          if (this->padding_[static_cast<std::size_t>(b * S + s)]) {
            ASSERT_EQ(clean[at], T(0)) << "padded key has weight";
          }
          if (!Case::kCross && this->padding_[static_cast<std::size_t>(b * S + t)]) continue;
          ASSERT_EQ(0, std::memcmp(&clean[at], &scribbled[at], sizeof(T))) << "weight b=" << b << " h=" << h
                                                                           << " t=" << t << " s=" << s << " moved";
        }
}

// Token-by-token decoding of item sequences, on the layer's self-attention
// form; the outputs of every step concatenated.
template <class T, class Layer>
Tensor<T> decode(const Layer& layer, const Matrix<T>& x, Index offset, headmix::Workspace<T>& ws) {
  headmix::SequenceCache<T> cache(kBatch, kLength);
  Tensor<T> all({kBatch * kLength * layer.out_dim()});
  for (Index t = 0; t < kLength; ++t) {
    Matrix<T> token(kBatch, kWidth);
    for (Index b = 0; b < kBatch; ++b) token.row(b) = x.row(b * kLength + t);
    const Placed<T> in(token.data(), token.size(), offset);
    Placed<T> out(nullptr, kBatch * layer.out_dim(), offset);
    layer.step({in.data, kBatch, 1, kWidth}, cache, {out.data, kBatch, 1, layer.out_dim()}, ws);
    std::copy_n(out.data, kBatch * layer.out_dim(), all.data() + t * kBatch * layer.out_dim());
  }
  return all;
}

TYPED_TEST(DenseDeterminism, DecodingSteps) {
  using T = typename TestFixture::T;
  using Case = TypeParam;
  Rng rng(11);
  auto layer = Case::make(rng, kWidth);  // self-attention form
  headmix::Workspace<T> ws;
  const Tensor<T> serial = decode<T>(layer, this->query_, 0, ws);
  EXPECT_TRUE(bit_identical("decoding again, same workspace", serial, decode<T>(layer, this->query_, 0, ws)));
  for (Index offset : {1, 3, 5}) {
    headmix::Workspace<T> fresh;
    EXPECT_TRUE(bit_identical(("token buffers " + std::to_string(offset) + " elements in").c_str(), serial,
                              decode<T>(layer, this->query_, offset, fresh)));
  }
  auto o = layer.options();
  o.threads = 2;
  layer.set_options(o);
  headmix::Workspace<T> ws2;
  EXPECT_TRUE(bit_identical("decoding on 2 threads", serial, decode<T>(layer, this->query_, 0, ws2)));
}

TYPED_TEST(Determinism, SameSeedSameLayer) {
  using T = typename TestFixture::T;
  using Case = TypeParam;
  // Two layers built alike (LSH: the same seed draws the same rotations).
  Rng a(23), b(23);
  const auto first = Case::make(a, Case::kCross ? kKeyWidth : kWidth);
  const auto second = Case::make(b, Case::kCross ? kKeyWidth : kWidth);
  headmix::Workspace<T> ws1, ws2;
  EXPECT_TRUE(bit_identical("two layers built alike", this->forward(first, ws1), this->forward(second, ws2)));
}

// Tensor storage is aligned as Eigen aligns its matrices, so that the
// caller's own Eigen reductions over a Tensor (a LayerNorm in a model, as in
// examples/encoder_blocks.cpp) do not change with the heap address.
TEST(DeterminismStorage, TensorsAreAlignedLikeEigenMatrices) {
  for (Index n : {1, 3, 17, 1000}) {
    const Tensor<float> f({n});
    const Tensor<double> d({n, 3});
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(f.data()) % EIGEN_DEFAULT_ALIGN_BYTES, 0u) << n;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(d.data()) % EIGEN_DEFAULT_ALIGN_BYTES, 0u) << n;
  }
}

}  // namespace
