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
//   * whatever the padded tokens hold (a padded key has weight exactly 0,
//     so it cannot reach another row). LSH is exempt (padding_isolated):
//     where a padded token hashes changes which keys share a chunk;
//   * for decoding steps, across thread counts and buffer addresses, with
//     float weights and with bfloat16 ones (options.bfloat16_weights).
// Across builds (instruction sets, compilers, BLAS) results differ in the
// last bits; the reference and conformance tests bound that difference.
//
// Each variant's problem is its determinism_shape() in tests/variants.hpp:
// two batch items, several row blocks and tasks, and a key sequence of
// another width where the variant takes one. Item 1 is padded here (its
// last quarter of keys and one in the middle), item 0 not. LSH runs with
// its explicit rotations and with rotations drawn from the seed.

#include "variants.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;

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

// A [B, L, W] view's values as a [B*L, W] matrix.
template <class T>
Matrix<T> rows_of(const headmix::ConstBatchView<T>& v) {
  return Eigen::Map<const Matrix<T>>(v.data(), v.batch() * v.length(), v.width());
}

// Variant V's determinism problem in scalar T, its inputs, and item 1's padding.
template <class Variant, class Scalar>
class DeterminismOf : public ::testing::Test {
 protected:
  using V = Variant;
  using T = Scalar;
  using Problem = typename V::template Problem<T>;
  using Layer = typename V::template Layer<T>;

  DeterminismOf() : problems_(V::thread_variations(V::template make<T>(V::determinism_shape(), 7))) {
    const auto in = problems_[0].input();
    B_ = in.query.batch(), L_ = in.query.length(), S_ = in.keys().length();
    query_ = rows_of(in.query);
    if (!in.self_attention()) key_ = rows_of(in.key);
  }
  void SetUp() override {
    ASSERT_GE(B_, 2) << "determinism_shape() needs an unpadded and a padded item";
    ASSERT_GE(S_, 8);
    padding_.assign(static_cast<std::size_t>(B_ * S_), 0);
    for (Index s = S_ - S_ / 4; s < S_; ++s) padding_[static_cast<std::size_t>(S_ + s)] = 1;
    padding_[static_cast<std::size_t>(S_ + 4)] = 1;
  }

  bool cross() const { return key_.size() > 0; }
  bool padded(Index b, Index s) const { return padding_[static_cast<std::size_t>(b * S_ + s)] != 0; }

  // Forward on copies of the inputs placed `offset` elements into their
  // buffers; output and weights joined.
  Tensor<T> forward(const Layer& layer, headmix::Workspace<T>& ws, Index offset, const Matrix<T>& query,
                    const Matrix<T>& key, bool with_padding = true) const {
    const Placed<T> q(query.data(), query.size(), offset), k(key.data(), key.size(), offset);
    const Index out_dim = layer.out_dim(), n = B_ * L_ * out_dim;
    Placed<T> out(nullptr, n, offset);
    headmix::AttentionInput<T> in;
    in.query = {q.data, B_, L_, query.cols()};
    if (cross()) in.key = {k.data, B_, S_, key.cols()};
    if (with_padding) in.key_padding = {padding_.data(), B_, S_};
    Tensor<T> probs;
    layer.forward(in, {out.data, B_, L_, out_dim}, ws, &probs);
    Tensor<T> all({n + probs.size()});
    std::copy_n(out.data, n, all.data());
    std::copy_n(probs.data(), probs.size(), all.data() + n);
    return all;
  }
  Tensor<T> forward(const Layer& layer, headmix::Workspace<T>& ws, Index offset = 0) const {
    return forward(layer, ws, offset, query_, key_);
  }

  // Which problem a failure is in (LSH: explicit or seeded rotations).
  std::string trace(const Problem& p) const {
    return "variation " + std::to_string(&p - problems_.data()) + " of " + p.describe();
  }

  static Layer with_threads(Problem p, int threads) {
    V::set_threads(p, threads);
    return p.layer();
  }

  std::vector<Problem> problems_;  // one problem, as each way its layer can be built
  Index B_ = 0, L_ = 0, S_ = 0;
  Matrix<T> query_, key_;  // key_ empty for self-attention
  std::vector<std::uint8_t> padding_;
};
template <class Param>
class Determinism : public DeterminismOf<typename Param::Variant, typename Param::Scalar> {};
TYPED_TEST_SUITE(Determinism, AllVariantsInBothScalars, VariantInName);

TYPED_TEST(Determinism, RepeatedCallsAndFreshWorkspaces) {
  using T = typename TestFixture::T;
  Rng rng(9);
  const Matrix<T> other = random_matrix<T>(rng, this->query_.rows(), this->query_.cols(), 1.0);
  for (const auto& p : this->problems_) {
    SCOPED_TRACE(this->trace(p));
    const auto layer = p.layer();
    headmix::Workspace<T> reused;
    const Tensor<T> first = this->forward(layer, reused);
    EXPECT_TRUE(bit_identical("second call, same workspace", first, this->forward(layer, reused)));
    headmix::Workspace<T> fresh;
    EXPECT_TRUE(bit_identical("fresh workspace", first, this->forward(layer, fresh)));
    // A workspace used by another call (other queries, no padding) first.
    headmix::Workspace<T> used;
    (void)this->forward(layer, used, 0, other, this->key_, false);
    EXPECT_TRUE(bit_identical("workspace used by another call", first, this->forward(layer, used)));
  }
}

TYPED_TEST(Determinism, AnyThreadCount) {
  using T = typename TestFixture::T;
  for (const auto& p : this->problems_) {
    SCOPED_TRACE(this->trace(p));
    headmix::Workspace<T> ws;
    const Tensor<T> serial = this->forward(TestFixture::with_threads(p, 1), ws);
    for (int threads : {2, 3}) {
      headmix::Workspace<T> ws_n;
      EXPECT_TRUE(bit_identical(("threads=" + std::to_string(threads)).c_str(), serial,
                                this->forward(TestFixture::with_threads(p, threads), ws_n)));
    }
  }
}

TYPED_TEST(Determinism, AnyBufferAddress) {
  using T = typename TestFixture::T;
  for (const auto& p : this->problems_) {
    SCOPED_TRACE(this->trace(p));
    const auto layer = p.layer();
    headmix::Workspace<T> ws;
    const Tensor<T> at_zero = this->forward(layer, ws, 0);
    for (Index offset = 1; offset < Index(64 / sizeof(T)); ++offset)
      EXPECT_TRUE(bit_identical(("inputs and output " + std::to_string(offset) + " elements in").c_str(), at_zero,
                                this->forward(layer, ws, offset)));
  }
}

TYPED_TEST(Determinism, PaddedTokensReachNoOtherRow) {
  using F = TestFixture;
  using T = typename F::T;
  if constexpr (!F::V::padding_isolated) {
    GTEST_SKIP() << "a padded token's values move the hashing";
  } else {
    const auto layer = this->problems_[0].layer();
    headmix::Workspace<T> ws;
    const Tensor<T> clean = this->forward(layer, ws);
    // Scribble over every padded token: the key rows, or in self-attention the query rows.
    Rng rng(10);
    Matrix<T> query = this->query_, key = this->key_;
    Matrix<T>& keys = this->cross() ? key : query;
    const Index B = this->B_, L = this->L_, S = this->S_;
    for (Index b = 0; b < B; ++b)
      for (Index s = 0; s < S; ++s)
        if (this->padded(b, s)) keys.row(b * S + s) = random_matrix<T>(rng, 1, keys.cols(), 50.0);
    const Tensor<T> scribbled = this->forward(layer, ws, 0, query, key);
    ASSERT_EQ(clean.shape(), scribbled.shape());

    const Index out_dim = layer.out_dim(), outputs = B * L * out_dim;
    const Index heads = (clean.size() - outputs) / (B * L * S);
    ASSERT_GE(heads, 1);
    // In self-attention a padded position is also a query whose own row changes.
    const auto own_row_scribbled = [&](Index b, Index t) { return !this->cross() && this->padded(b, t); };
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < L; ++t) {
        if (own_row_scribbled(b, t)) continue;
        const Index row = (b * L + t) * out_dim;
        ASSERT_EQ(0, std::memcmp(&clean[row], &scribbled[row], sizeof(T) * static_cast<std::size_t>(out_dim)))
            << "output row b=" << b << " t=" << t << " moved";
      }
    // Weights: exactly zero on every padded key, and unchanged elsewhere.
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < heads; ++h)
        for (Index t = 0; t < L; ++t)
          for (Index s = 0; s < S; ++s) {
            const Index at = outputs + ((b * heads + h) * L + t) * S + s;
            if (this->padded(b, s)) {
              ASSERT_EQ(clean[at], T(0)) << "padded key has weight";
            }
            if (own_row_scribbled(b, t)) continue;
            ASSERT_EQ(0, std::memcmp(&clean[at], &scribbled[at], sizeof(T)))
                << "weight b=" << b << " h=" << h << " t=" << t << " s=" << s << " moved";
          }
  }
}

// Decoding of p's queries (each batch item a sequence) `tokens` at a time,
// the token buffers `offset` elements into their storage; every step's
// outputs concatenated.
template <class T, class P, class Layer>
Tensor<T> decode(const P& p, const Layer& layer, Index offset, headmix::Workspace<T>& ws,
                 headmix::CachePrecision precision = headmix::CachePrecision::full, Index tokens = 1) {
  const auto in = p.input();
  const Index B = in.query.batch(), L = in.query.length(), D = in.query.width(), out_dim = layer.out_dim();
  const Matrix<T> x = rows_of(in.query);
  headmix::SequenceCache<T> cache(B, L, precision);
  Tensor<T> all({B * L * out_dim});
  for (Index t = 0; t < L; t += tokens) {
    const Index n = std::min(tokens, L - t);
    Matrix<T> chunk(B * n, D);
    for (Index b = 0; b < B; ++b) chunk.middleRows(b * n, n) = x.middleRows(b * L + t, n);
    const Placed<T> tok(chunk.data(), chunk.size(), offset);
    Placed<T> out(nullptr, B * n * out_dim, offset);
    layer.step({tok.data, B, n, D}, cache, {out.data, B, n, out_dim}, ws);
    std::copy_n(out.data, B * n * out_dim, all.data() + t * B * out_dim);
  }
  return all;
}

TYPED_TEST(Determinism, DecodingSteps) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  if constexpr (!V::decodes) {
    GTEST_SKIP() << "no decoding steps";
  } else {
    const auto p = V::template make<T>(V::determinism_decoding_shape(), 11);
    SCOPED_TRACE(p.describe());
    ASSERT_TRUE(p.input().self_attention());
    const auto layer = p.layer();
    headmix::Workspace<T> ws;
    const Tensor<T> serial = decode<T>(p, layer, 0, ws);
    EXPECT_TRUE(bit_identical("decoding again, same workspace", serial, decode<T>(p, layer, 0, ws)));
    for (Index offset : {1, 3, 5}) {
      headmix::Workspace<T> fresh;
      EXPECT_TRUE(bit_identical(("token buffers " + std::to_string(offset) + " elements in").c_str(), serial,
                                decode<T>(p, layer, offset, fresh)));
    }
    headmix::Workspace<T> ws2;
    EXPECT_TRUE(bit_identical("decoding on 2 threads", serial, decode<T>(p, F::with_threads(p, 2), 0, ws2)));

    // With bfloat16 weights, a one-token step of one sequence streams the
    // rounded weights (Linear's one-row path): the same checks.
    auto shape = V::determinism_decoding_shape();
    shape.B = 1;
    const auto one = V::template make<T>(shape, 12);
    auto rounded = [](auto l) {
      auto options = l.options();
      options.bfloat16_weights = true;
      l.set_options(options);
      return l;
    };
    const auto lean = rounded(one.layer());
    headmix::Workspace<T> lean_ws, lean_fresh, lean_ws2;
    const Tensor<T> lean_serial = decode<T>(one, lean, 0, lean_ws);
    EXPECT_TRUE(bit_identical("bfloat16 weights, again", lean_serial, decode<T>(one, lean, 0, lean_ws)));
    EXPECT_TRUE(bit_identical("bfloat16 weights, token buffers 3 elements in", lean_serial,
                              decode<T>(one, lean, 3, lean_fresh)));
    EXPECT_TRUE(bit_identical("bfloat16 weights, 2 threads", lean_serial,
                              decode<T>(one, rounded(F::with_threads(one, 2)), 0, lean_ws2)));

    // Over a bfloat16 cache, in steps of 3 tokens (a step's few rows
    // streaming over the stored bfloat16 rows): the same checks.
    if (V::bf16_cache_refusal == nullptr) {
      const auto half = headmix::CachePrecision::bfloat16;
      headmix::Workspace<T> half_ws, half_fresh, half_ws2;
      const Tensor<T> half_serial = decode<T>(p, layer, 0, half_ws, half, 3);
      EXPECT_TRUE(bit_identical("bfloat16 cache, again", half_serial, decode<T>(p, layer, 0, half_ws, half, 3)));
      EXPECT_TRUE(bit_identical("bfloat16 cache, token buffers 5 elements in", half_serial,
                                decode<T>(p, layer, 5, half_fresh, half, 3)));
      EXPECT_TRUE(bit_identical("bfloat16 cache, 2 threads", half_serial,
                                decode<T>(p, F::with_threads(p, 2), 0, half_ws2, half, 3)));
    }
  }
}

TYPED_TEST(Determinism, SameSeedSameLayer) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  // Two layers built alike (LSH's seeded variation: the same seed draws the same rotations).
  const auto firsts = V::thread_variations(V::template make<T>(V::determinism_shape(), 23));
  const auto seconds = V::thread_variations(V::template make<T>(V::determinism_shape(), 23));
  ASSERT_EQ(firsts.size(), seconds.size());
  for (std::size_t i = 0; i < firsts.size(); ++i) {
    SCOPED_TRACE(firsts[i].describe());
    headmix::Workspace<T> ws1, ws2;
    EXPECT_TRUE(bit_identical("two layers built alike", this->forward(firsts[i].layer(), ws1),
                              this->forward(seconds[i].layer(), ws2)));
  }
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
