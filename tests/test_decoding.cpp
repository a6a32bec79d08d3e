// Incremental decoding over a SequenceCache: token-by-token and chunked
// steps must reproduce one full causal forward pass, never allocate once
// sized, and refuse to overflow.
// Eigen asserts on any heap allocation while set_is_malloc_allowed(false).
#define EIGEN_RUNTIME_NO_MALLOC
#include <headmix/headmix.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <random>

// Count heap allocations, to check that a sized step allocates nothing.
// (GCC cannot see that this operator new pairs with the free() below.)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
static std::atomic<long> g_allocations{0};
void* operator new(std::size_t n) {
  ++g_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using namespace headmix;

namespace {

template <class T>
Linear<T> random_linear(Index out, Index in, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  Linear<T> l;
  l.weight.resize(out, in);
  l.bias.resize(out);
  for (Index i = 0; i < l.weight.size(); ++i) l.weight.data()[i] = static_cast<T>(u(rng) / std::sqrt(double(in)));
  for (Index i = 0; i < l.bias.size(); ++i) l.bias[i] = static_cast<T>(0.1 * u(rng));
  return l;
}

template <class T>
Tensor<T> random_batch(Index B, Index T_, Index D, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  Tensor<T> x({B, T_, D});
  for (Index i = 0; i < x.size(); ++i) x[i] = static_cast<T>(u(rng));
  return x;
}

// Rows [from, from + n) of every batch item of x, as a new [B, n, D] tensor.
template <class T>
Tensor<T> slice(const Tensor<T>& x, Index from, Index n) {
  const Index B = x.dim(0), T_ = x.dim(1), D = x.dim(2);
  Tensor<T> s({B, n, D});
  for (Index b = 0; b < B; ++b)
    for (Index i = 0; i < n; ++i)
      for (Index d = 0; d < D; ++d) s[(b * n + i) * D + d] = x[(b * T_ + from + i) * D + d];
  return s;
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

template <class T>
class Decoding : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Decoding, Scalars);

// Steps of several sizes (1, then chunks) match the full causal pass.
TYPED_TEST(Decoding, MhaStepsMatchFullCausalForward) {
  using T = TypeParam;
  std::mt19937 rng(11);
  const Index B = 2, T_ = 13, D = 12, H = 3, Dk = 4, Dv = 5, out_dim = 7;
  MhaWeights<T> w{random_linear<T>(H * Dk, D, rng), random_linear<T>(H * Dk, D, rng),
                  random_linear<T>(H * Dv, D, rng), random_linear<T>(out_dim, H * Dv, rng)};
  MhaOptions opt;
  opt.num_heads = H;
  opt.causal = true;
  opt.block_rows = 4;
  Mha<T> layer(w, opt);
  Tensor<T> x = random_batch<T>(B, T_, D, rng);
  Workspace<T> ws;
  Tensor<T> full = layer.forward(AttentionInput<T>{x.batch(), {}, {}}, ws);

  for (const std::vector<Index>& chunks : {std::vector<Index>(T_, 1), std::vector<Index>{3, 1, 5, 4}}) {
    SequenceCache<T> cache(B, T_);
    Index pos = 0;
    for (Index n : chunks) {
      Tensor<T> xs = slice(x, pos, n);
      Tensor<T> ys({B, n, out_dim});
      layer.step(xs.batch(), cache, ys.batch(), ws);
      for (Index b = 0; b < B; ++b)
        for (Index i = 0; i < n; ++i)
          for (Index c = 0; c < out_dim; ++c) {
            const T want = full[(b * T_ + pos + i) * out_dim + c], got = ys[(b * n + i) * out_dim + c];
            EXPECT_NEAR(got, want, tolerance<T>() * (1 + std::abs(double(want)))) << "position " << pos + i;
          }
      pos += n;
    }
    EXPECT_EQ(cache.size(), T_);
  }
}

TEST(Decoding, FullCacheThrowsAndKeepsContents) {
  std::mt19937 rng(2);
  const Index D = 8, H = 2;
  MhaWeights<double> w{random_linear<double>(D, D, rng), random_linear<double>(D, D, rng),
                       random_linear<double>(D, D, rng), random_linear<double>(D, D, rng)};
  MhaOptions opt;
  opt.num_heads = H;
  Mha<double> layer(w, opt);
  SequenceCache<double> cache(1, 3);
  Workspace<double> ws;
  Tensor<double> x = random_batch<double>(1, 2, D, rng), y({1, 2, D});
  layer.step(x.batch(), cache, y.batch(), ws);
  EXPECT_THROW(layer.step(x.batch(), cache, y.batch(), ws), cache_full_error);
  EXPECT_EQ(cache.size(), 2);
  cache.reset();
  EXPECT_NO_THROW(layer.step(x.batch(), cache, y.batch(), ws));
}

TEST(Decoding, CacheOfAnotherBatchSizeIsAShapeError) {
  std::mt19937 rng(3);
  const Index D = 8;
  MhaWeights<double> w{random_linear<double>(D, D, rng), random_linear<double>(D, D, rng),
                       random_linear<double>(D, D, rng), random_linear<double>(D, D, rng)};
  MhaOptions opt;
  opt.num_heads = 2;
  Mha<double> layer(w, opt);
  SequenceCache<double> cache(2, 4);
  Workspace<double> ws;
  Tensor<double> x = random_batch<double>(1, 1, D, rng), y({1, 1, D});
  try {
    layer.step(x.batch(), cache, y.batch(), ws);
    FAIL() << "no throw";
  } catch (const shape_error& e) {
    EXPECT_STREQ(e.what(), "[mha] cache batch: expected [1], got [2]");
  }
}

TEST(Decoding, SizedStepAllocatesNothing) {
  std::mt19937 rng(4);
  const Index D = 32, H = 4;
  MhaWeights<float> w{random_linear<float>(D, D, rng), random_linear<float>(D, D, rng),
                      random_linear<float>(D, D, rng), random_linear<float>(D, D, rng)};
  MhaOptions opt;
  opt.num_heads = H;
  Mha<float> layer(w, opt);
  SequenceCache<float> cache(1, 64);
  Workspace<float> ws;
  Tensor<float> x = random_batch<float>(1, 1, D, rng), y({1, 1, D});
  layer.step(x.batch(), cache, y.batch(), ws);  // sizes the cache streams and the workspace
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  for (int t = 0; t < 20; ++t) layer.step(x.batch(), cache, y.batch(), ws);
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0);
}

}  // namespace
