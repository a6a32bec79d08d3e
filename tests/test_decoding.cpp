// Incremental decoding over a SequenceCache: token-by-token and chunked
// steps must reproduce one full causal forward pass, never allocate once
// sized, and refuse to overflow.

// Count heap allocations, operator new and Eigen's alike, in any build type
// (headmix_test::allocations_during()), to check that a sized step
// allocates nothing. Must come before any Eigen header.
#define HEADMIX_TEST_COUNT_ALLOCATIONS
#include "test_util.hpp"

#include <headmix/headmix.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <random>

using namespace headmix;

namespace {

using headmix_test::shape_error_message;

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
  return headmix_test::random_tensor<T>(rng, {B, T_, D}, 1.0);
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

HEADMIX_TYPED_OVER_SCALARS(Decoding);

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

// A step of x that does not fit in `cache` throws cache_full_error with
// `message` and changes nothing: the size, and each of the layer's
// `streams` cached streams, bit for bit over the whole capacity.
template <class Layer>
void expect_full_step_refused(const Layer& layer, SequenceCache<double>& cache, const Tensor<double>& x,
                              std::size_t streams, const char* message) {
  const Index size = cache.size();
  const auto before = headmix_test::cache_streams(cache, streams);
  Workspace<double> ws;
  Tensor<double> y({x.dim(0), x.dim(1), layer.out_dim()});
  try {
    layer.step(x.batch(), cache, y.batch(), ws);
    ADD_FAILURE() << "no throw";
  } catch (const cache_full_error& e) {
    EXPECT_STREQ(e.what(), message);
  }
  EXPECT_EQ(cache.size(), size);
  EXPECT_TRUE(headmix_test::same_cache_bits(headmix_test::cache_streams(cache, streams), before))
      << "a refused step wrote to the cache";
}

// An MHA with D x D projections (q, k, v and o drawn in that order) and H heads.
template <class T>
Mha<T> square_mha(std::mt19937& rng, Index D, Index H) {
  MhaWeights<T> w{random_linear<T>(D, D, rng), random_linear<T>(D, D, rng), random_linear<T>(D, D, rng),
                  random_linear<T>(D, D, rng)};
  MhaOptions opt;
  opt.num_heads = H;
  return Mha<T>(w, opt);
}

TEST(Decoding, FullCacheThrowsAndKeepsContents) {
  std::mt19937 rng(2);
  const Index D = 8, H = 2;
  Mha<double> layer = square_mha<double>(rng, D, H);
  SequenceCache<double> cache(1, 3);
  Workspace<double> ws;
  Tensor<double> x = random_batch<double>(1, 2, D, rng), y({1, 2, D});
  layer.step(x.batch(), cache, y.batch(), ws);
  expect_full_step_refused(layer, cache, x, 2, "[mha] cache: 2 new positions do not fit (2 of 3 used)");
  cache.reset();
  EXPECT_NO_THROW(layer.step(x.batch(), cache, y.batch(), ws));
}

TEST(Decoding, CacheOfAnotherBatchSizeIsAShapeError) {
  std::mt19937 rng(3);
  const Index D = 8;
  Mha<double> layer = square_mha<double>(rng, D, 2);
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
  Mha<float> layer = square_mha<float>(rng, D, H);
  SequenceCache<float> cache(1, 64);
  Workspace<float> ws;
  Tensor<float> x = random_batch<float>(1, 1, D, rng), y({1, 1, D});
  layer.step(x.batch(), cache, y.batch(), ws);  // sizes the cache streams and the workspace
  EXPECT_EQ(headmix_test::allocations_during([&] {
              for (int t = 0; t < 20; ++t) layer.step(x.batch(), cache, y.batch(), ws);
            }),
            0);
}

// A forward call on a sized Workspace allocates nothing either (without
// exported weights, whose Tensor the call resizes), over several key blocks
// and query blocks, causal with padding, on 1 and 2 threads.
TEST(Decoding, SizedForwardAllocatesNothing) {
  std::mt19937 rng(5);
  const Index D = 32, H = 4, T = 150;
  MhaWeights<float> w{random_linear<float>(D, D, rng), random_linear<float>(D, D, rng),
                      random_linear<float>(D, D, rng), random_linear<float>(D, D, rng)};
  const Tensor<float> x = random_batch<float>(2, T, D, rng);
  std::vector<std::uint8_t> pad(2 * T, 0);
  for (Index j = 0; j < 2 * T; j += 7) pad[j] = 1;
  Tensor<float> y({2, T, D});
  const AttentionInput<float> in{x.batch(), {}, {pad.data(), 2, T}};
  for (int threads : {1, 2}) {
    MhaOptions opt;
    opt.num_heads = H, opt.causal = true, opt.key_block = 32, opt.block_rows = 16, opt.threads = threads;
    Mha<float> layer(w, opt);
    Workspace<float> ws;
    layer.forward(in, y.batch(), ws);  // sizes the workspace (and starts the workers)
    EXPECT_EQ(headmix_test::allocations_during([&] {
                for (int t = 0; t < 3; ++t) layer.forward(in, y.batch(), ws);
              }),
              0)
        << threads << " threads";
  }
}

// The allocation check itself works, in this build type: an Eigen matrix
// (std::malloc, seen through EIGEN_RUNTIME_NO_MALLOC) and a std::vector
// (operator new) made inside the window are both counted.
TEST(Decoding, AllocationCheckSeesEigenAndOperatorNew) {
  static const void* volatile escape;  // the buffers escape, so that no allocation can be elided
  EXPECT_GT(headmix_test::allocations_during([] {
              Matrix<float> fresh(64, 64);
              escape = fresh.data();
            }),
            0);
  EXPECT_GT(headmix_test::allocations_during([] {
              std::vector<int> fresh(100);
              escape = fresh.data();
            }),
            0);
  EXPECT_EQ(headmix_test::allocations_during([] {}), 0);
  EXPECT_NE(escape, nullptr);
}

}  // namespace

// ---- Talking-Heads steps, and steps on the causal conformance cases --------

#include <headmix/io/safetensors.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <string>

namespace {

// Mixing matrices near the identity, with random off-diagonal terms (some
// rows of negative sum, which a wrong mask order would expose).
template <class T>
Matrix<T> random_mix(Index out, Index in, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-0.6, 0.6);
  Matrix<T> m(out, in);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(u(rng));
  for (Index i = 0; i < std::min(out, in); ++i) m(i, i) += T(1);
  return m;
}

struct ThShape {
  Index hk, h, hv;
  bool pre, post;
};

template <class T>
TalkingHeads<T> random_talking_heads(const ThShape& s, Index D, Index dk, Index dv, Index out_dim, std::mt19937& rng,
                                     Index block_rows = 4, int threads = 1) {
  TalkingHeadsWeights<T> w;
  w.q = random_linear<T>(s.hk * dk, D, rng);
  w.k = random_linear<T>(s.hk * dk, D, rng);
  w.v = random_linear<T>(s.hv * dv, D, rng);
  w.o = random_linear<T>(out_dim, s.hv * dv, rng);
  if (s.pre) w.pre_softmax = random_mix<T>(s.h, s.hk, rng);
  if (s.post) w.post_softmax = random_mix<T>(s.hv, s.h, rng);
  TalkingHeadsOptions opt;
  opt.num_heads = s.h;
  opt.key_heads = s.hk;
  opt.value_heads = s.hv;
  opt.causal = true;
  opt.block_rows = block_rows;
  opt.threads = threads;
  return TalkingHeads<T>(std::move(w), opt);
}

// Feed x [B, T, D] to `step` in chunks and return the outputs [B, T, out]
// and, when asked, each step's weights placed as rows of [B, H, T, T].
template <class T, class Layer>
Tensor<T> decode(const Layer& layer, const Tensor<T>& x, const std::vector<Index>& chunks, Index out_dim,
                 Tensor<T>* probs = nullptr, Index heads = 0, CachePrecision precision = CachePrecision::full) {
  const Index B = x.dim(0), T_ = x.dim(1);
  SequenceCache<T> cache(B, T_, precision);
  Workspace<T> ws;
  Tensor<T> y({B, T_, out_dim});
  if (probs) {
    probs->resize({B, heads, T_, T_});
    probs->set_zero();
  }
  Index pos = 0;
  for (Index n : chunks) {
    Tensor<T> xs = slice(x, pos, n), ys({B, n, out_dim}), ps;
    layer.step(xs.batch(), cache, ys.batch(), ws, probs ? &ps : nullptr);
    for (Index b = 0; b < B; ++b)
      for (Index i = 0; i < n; ++i)
        for (Index c = 0; c < out_dim; ++c) y[(b * T_ + pos + i) * out_dim + c] = ys[(b * n + i) * out_dim + c];
    if (probs) {
      const Index S = pos + n;
      EXPECT_EQ(ps.shape(), (std::vector<Index>{B, heads, n, S}));
      for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < heads; ++h)
          for (Index i = 0; i < n; ++i)
            for (Index j = 0; j < S; ++j)
              (*probs)[((b * heads + h) * T_ + pos + i) * T_ + j] = ps[((b * heads + h) * n + i) * S + j];
    }
    pos += n;
  }
  EXPECT_EQ(cache.size(), pos);
  return y;
}

// Every |got - want| / (1 + |want|) <= tol; NaN (in either) never agrees.
template <class T>
void expect_close(const Tensor<T>& got, const Tensor<T>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  Index bad = 0, first = -1;
  double worst = 0;
  for (Index i = 0; i < want.size(); ++i) {
    const double err = std::abs(double(got[i]) - double(want[i])) / (1 + std::abs(double(want[i])));
    if (!(err <= tol) && bad++ == 0) first = i;
    if (!std::isnan(worst) && !(err <= worst)) worst = err;  // a NaN, once seen, stays
  }
  EXPECT_EQ(bad, 0) << what << ": first at flat index " << first << ", worst relative error " << worst;
}

// The chunkings every decoding test runs: token by token, and uneven chunks.
std::vector<std::vector<Index>> chunkings(Index T_) {
  std::vector<std::vector<Index>> all{std::vector<Index>(T_, 1)};
  std::vector<Index> uneven;
  for (Index pos = 0, n = 3; pos < T_; pos += n, n = n % 5 + 1) uneven.push_back(std::min(n, T_ - pos));
  all.push_back(uneven);
  all.push_back({T_});  // one step over an empty cache is the full forward itself
  return all;
}

// Steps of every chunking agree with the full causal forward of `layer`
// over x, outputs and the weights of its `heads` heads, to tolerance<T>().
template <class T, class Layer>
void expect_steps_match_forward(const Layer& layer, const Tensor<T>& x, Index heads, const std::string& what) {
  Workspace<T> ws;
  Tensor<T> full_probs;
  const Tensor<T> full = layer.forward(AttentionInput<T>{x.batch(), {}, {}}, ws, &full_probs);
  for (const auto& chunks : chunkings(x.dim(1))) {
    Tensor<T> probs;
    const Tensor<T> y = decode(layer, x, chunks, layer.out_dim(), &probs, heads);
    const std::string where = what + " steps=" + std::to_string(chunks.size());
    expect_close(y, full, tolerance<T>(), where + " output");
    expect_close(probs, full_probs, tolerance<T>(), where + " weights");
  }
}

// Steps agree with the full causal forward to the float tolerance of the
// MHA test (float 2e-5, double 1e-12 relative to 1 + |value|), outputs and
// the final (post-mix) weights alike, for three different head counts, a
// pre mix only, a post mix only and no mix at all.
TYPED_TEST(Decoding, TalkingHeadsStepsMatchFullCausalForward) {
  using T = TypeParam;
  const Index B = 2, T_ = 13, D = 12, dk = 4, dv = 3, out_dim = 7;
  const ThShape shapes[] = {
      {3, 5, 4, true, true}, {4, 2, 2, true, false}, {2, 2, 3, false, true}, {3, 3, 3, false, false}};
  std::mt19937 rng(21);
  for (const ThShape& s : shapes) {
    const TalkingHeads<T> layer = random_talking_heads<T>(s, D, dk, dv, out_dim, rng);
    const Tensor<T> x = random_batch<T>(B, T_, D, rng);
    expect_steps_match_forward(layer, x, s.hv,
                               "h_k=" + std::to_string(s.hk) + " h=" + std::to_string(s.h) +
                                   " h_v=" + std::to_string(s.hv));
  }
}

// Worker threads split a step's (batch, query block) tasks; the results
// must not depend on their number, bit for bit.
TEST(Decoding, TalkingHeadsStepsDoNotDependOnThreads) {
  std::mt19937 rng(22);
  const ThShape s{3, 5, 4, true, true};
  const std::mt19937 start = rng;
  const Index B = 3, T_ = 11, D = 12, out_dim = 6;
  std::vector<Tensor<double>> results;
  for (int threads : {1, 2, 3}) {
    rng = start;
    const auto layer = random_talking_heads<double>(s, D, 4, 3, out_dim, rng, 2, threads);
    const Tensor<double> x = random_batch<double>(B, T_, D, rng);
    results.push_back(decode(layer, x, {4, 1, 6}, out_dim));
  }
  for (std::size_t r = 1; r < results.size(); ++r)
    for (Index i = 0; i < results[0].size(); ++i) ASSERT_EQ(results[r][i], results[0][i]) << "threads run " << r;
}

TEST(Decoding, TalkingHeadsFullCacheThrowsAndKeepsContents) {
  std::mt19937 rng(23);
  const auto layer = random_talking_heads<double>({2, 3, 2, true, true}, 8, 4, 4, 8, rng);
  SequenceCache<double> cache(1, 3);
  Workspace<double> ws;
  Tensor<double> x = random_batch<double>(1, 2, 8, rng), y({1, 2, 8});
  layer.step(x.batch(), cache, y.batch(), ws);
  expect_full_step_refused(layer, cache, x, 2, "[talking_heads] cache: 2 new positions do not fit (2 of 3 used)");
  cache.reset();
  EXPECT_NO_THROW(layer.step(x.batch(), cache, y.batch(), ws));
  EXPECT_EQ(cache.size(), 2);
}

TEST(Decoding, TalkingHeadsCacheOfAnotherBatchOrLayerIsAShapeError) {
  std::mt19937 rng(24);
  const auto layer = random_talking_heads<double>({2, 3, 4, true, true}, 8, 4, 2, 8, rng);  // K 8, V 8 wide
  Workspace<double> ws;
  Tensor<double> x = random_batch<double>(1, 1, 8, rng), y({1, 1, 8});
  SequenceCache<double> wrong_batch(2, 4);
  try {
    layer.step(x.batch(), wrong_batch, y.batch(), ws);
    FAIL() << "no throw";
  } catch (const shape_error& e) {
    EXPECT_STREQ(e.what(), "[talking_heads] cache batch: expected [1], got [2]");
  }
  // A cache that an MHA layer with K/V rows of 8 and 4 values filled.
  MhaOptions mha_opt;
  mha_opt.num_heads = 2;
  const Mha<double> mha(MhaWeights<double>{random_linear<double>(8, 8, rng), random_linear<double>(8, 8, rng),
                                           random_linear<double>(4, 8, rng), {}},
                        mha_opt);
  SequenceCache<double> other(1, 4);
  Tensor<double> y_mha({1, 1, 4});
  mha.step(x.batch(), other, y_mha.batch(), ws);
  try {
    layer.step(x.batch(), other, y.batch(), ws);
    FAIL() << "no throw";
  } catch (const shape_error& e) {
    EXPECT_STREQ(e.what(), "[talking_heads] cache stream widths: expected [8, 8], got [8, 4]");
  }
  EXPECT_EQ(other.size(), 1);
  Tensor<double> wide = random_batch<double>(1, 1, 9, rng);
  SequenceCache<double> fresh(1, 4);
  EXPECT_THROW(layer.step(wide.batch(), fresh, y.batch(), ws), shape_error);
  Tensor<double> y_wrong({1, 1, 7});
  EXPECT_THROW(layer.step(x.batch(), fresh, y_wrong.batch(), ws), shape_error);
  EXPECT_EQ(fresh.size(), 0);
}

// After a prompt of several positions has sized the cache and the
// workspace, generating token by token allocates nothing, with both mixes
// (the fused stage's scratch) and without any (MHA's single tile).
TEST(Decoding, TalkingHeadsSizedStepsAllocateNothing) {
  std::mt19937 rng(25);
  const Index D = 32, capacity = 600;  // h · capacity values exceed the fused stage's 64 KiB chunk
  for (const ThShape& s : {ThShape{4, 40, 4, true, true}, ThShape{4, 4, 4, false, false}}) {
    const auto layer = random_talking_heads<float>(s, D, 8, 8, D, rng, 64);
    SequenceCache<float> cache(1, capacity);
    Workspace<float> ws;
    Tensor<float> prompt = random_batch<float>(1, 5, D, rng), y_prompt({1, 5, D});
    layer.step(prompt.batch(), cache, y_prompt.batch(), ws);
    Tensor<float> x = random_batch<float>(1, 1, D, rng), y({1, 1, D});
    EXPECT_EQ(headmix_test::allocations_during([&] {
                while (cache.size() < capacity) layer.step(x.batch(), cache, y.batch(), ws);
              }),
              0)
        << "h = " << s.h;
  }
}

// ---- conformance cases --------------------------------------------------------

// Every causal self-attention case without key padding in <variant>/ (none
// when the folder is absent).
std::vector<std::filesystem::path> causal_cases(const std::string& variant) {
  std::vector<std::filesystem::path> found;
  const std::filesystem::path dir = std::filesystem::path(HEADMIX_CONFORMANCE_DIR) / variant;
  if (!std::filesystem::is_directory(dir)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    const io::TensorFile f = io::load_safetensors(entry.path().string());
    const auto config = nlohmann::json::parse(f.metadata.at("config"));
    if (config.value("causal", false) && !f.contains("input.key") && !f.contains("input.key_padding_mask"))
      found.push_back(entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

// Tolerances of FORMAT.md: the case's own rtol/atol in double, rtol_f32 /
// atol_f32 (default 1e-4 / 1e-5) in float.
template <class T>
std::pair<double, double> case_tolerance(const io::TensorFile& f) {
  auto number = [&](const char* key, double fallback) {
    const auto it = f.metadata.find(key);
    return it == f.metadata.end() ? fallback : std::stod(it->second);
  };
  if (std::is_same_v<T, double>) return {number("rtol", 1e-9), number("atol", 1e-12)};
  return {number("rtol_f32", 1e-4), number("atol_f32", 1e-5)};
}

// Decode a case position by position (and in chunks of 3) with `make`'s
// layer and compare every output with expected.output, and each step's
// weights with the matching rows of expected.probs.
template <class T, class Make>
void decode_case(const std::filesystem::path& path, Make make) {
  SCOPED_TRACE(path.filename().string());
  const io::TensorFile f = io::load_safetensors(path.string());
  const auto config = nlohmann::json::parse(f.metadata.at("config"));
  const auto layer = make(f, config);
  const Tensor<T> x = f.get<T>("input.query");
  const Tensor<double> want = f.get<double>("expected.output");
  const Index B = x.dim(0), T_ = x.dim(1), out_dim = want.dim(2);
  const bool has_probs = f.contains("expected.probs");
  const Tensor<double> want_probs = has_probs ? f.get<double>("expected.probs") : Tensor<double>();
  const auto [rtol, atol] = case_tolerance<T>(f);
  for (const auto& chunks : {std::vector<Index>(T_, 1), std::vector<Index>{3, 3, 3, 3, 3, 3, 3, 3}}) {
    std::vector<Index> fitted;
    for (Index pos = 0, k = 0; pos < T_; pos += fitted.back(), ++k)
      fitted.push_back(std::min(chunks[static_cast<std::size_t>(k) % chunks.size()], T_ - pos));
    Tensor<T> probs;
    const Tensor<T> got = decode(layer, x, fitted, out_dim, has_probs ? &probs : nullptr,
                                 has_probs ? want_probs.dim(1) : 0);
    Index bad = 0;
    for (Index i = 0; i < want.size(); ++i)
      if (!(std::abs(double(got[i]) - want[i]) <= atol + rtol * std::abs(want[i]))) ++bad;
    EXPECT_EQ(bad, 0) << "outputs outside rtol " << rtol << " / atol " << atol << ", " << fitted.size() << " steps";
    if (has_probs) {
      ASSERT_EQ(probs.shape(), want_probs.shape());
      Index bad_probs = 0;
      for (Index i = 0; i < want_probs.size(); ++i)
        if (!(std::abs(double(probs[i]) - want_probs[i]) <= atol + rtol * std::abs(want_probs[i]))) ++bad_probs;
      EXPECT_EQ(bad_probs, 0) << "weights outside the tolerance, " << fitted.size() << " steps";
    }
    (void)B;
  }
}

TYPED_TEST(Decoding, TalkingHeadsConformanceCausalCasesPositionByPosition) {
  using T = TypeParam;
  const auto cases = causal_cases("talking_heads");
  if (cases.empty()) HEADMIX_CONFORMANCE_MISSING() << "no causal talking_heads cases under " << HEADMIX_CONFORMANCE_DIR;
  for (const auto& path : cases)
    decode_case<T>(path, [](const io::TensorFile& f, const nlohmann::json& config) {
      TalkingHeadsOptions opt;
      opt.num_heads = config.value("heads_logits", config.at("num_heads").template get<Index>());
      opt.key_heads = config.value("heads_key", opt.num_heads);
      opt.value_heads = config.value("heads_value", opt.num_heads);
      if (config.contains("scale") && !config["scale"].is_null()) opt.scale = config["scale"].template get<double>();
      opt.block_rows = 2;
      return TalkingHeads<T>::from_tensors(f, "", opt);
    });
}

TYPED_TEST(Decoding, MhaConformanceCausalCasePositionByPosition) {
  using T = TypeParam;
  const std::filesystem::path path = std::filesystem::path(HEADMIX_CONFORMANCE_DIR) / "mha" / "causal.safetensors";
  if (!std::filesystem::exists(path)) HEADMIX_CONFORMANCE_MISSING() << path << " is absent";
  decode_case<T>(path, [](const io::TensorFile& f, const nlohmann::json& config) {
    MhaOptions opt;
    opt.num_heads = config.at("num_heads").template get<Index>();
    opt.block_rows = 2;
    return Mha<T>::from_tensors(f, "", opt);
  });
  // Every causal MHA case without padding decodes too.
  for (const auto& other : causal_cases("mha"))
    if (other != path)
      decode_case<T>(other, [](const io::TensorFile& f, const nlohmann::json& config) {
        MhaOptions opt;
        opt.num_heads = config.at("num_heads").template get<Index>();
        return Mha<T>::from_tensors(f, "", opt);
      });
}

// ---- LSH from named tensors -----------------------------------------------------

// from_tensors reads lsh.md's names under a prefix (F32 and BF16 storage
// included) and builds the same layer as the weights given directly.
TEST(Decoding, LshFromTensorsReadsLshMdNamesUnderAPrefix) {
  std::mt19937 rng(26);
  const Index D = 16, H = 2, dh = 8;
  LshWeights<double> w;
  w.qk = random_linear<double>(H * dh, D, rng);
  w.qk.bias.resize(0);
  w.v = random_linear<double>(H * dh, D, rng);
  w.v.bias.resize(0);
  w.o = random_linear<double>(D, H * dh, rng);
  LshOptions opt;
  opt.num_heads = H;
  opt.bucket_size = 4;
  opt.n_hashes = 2;
  opt.n_buckets = 4;
  w.rotations = Tensor<double>({1, dh, 2, 2});
  std::normal_distribution<double> n(0, 1);
  for (Index i = 0; i < w.rotations.size(); ++i) w.rotations[i] = n(rng);

  auto as_tensor = [](const auto& m) {
    Tensor<double> t({m.rows(), m.cols()});
    std::copy_n(m.data(), m.size(), t.data());
    return t;
  };
  io::TensorFile f;
  const std::string p = "encoder.layer.3.attention.";
  f.put(p + "qk.weight", io::StoredTensor::from(as_tensor(w.qk.weight), io::DType::F32));
  f.put(p + "v.weight", io::StoredTensor::from(as_tensor(w.v.weight)));
  f.put(p + "o.weight", io::StoredTensor::from(as_tensor(w.o.weight), io::DType::BF16));
  Tensor<double> o_bias({D});
  std::copy_n(w.o.bias.data(), D, o_bias.data());
  f.put(p + "o.bias", io::StoredTensor::from(o_bias));
  f.put(p + "rotations", io::StoredTensor::from(w.rotations));
  const Lsh<double> loaded = Lsh<double>::from_tensors(f, p, opt);

  // What the file holds after rounding: F32 and BF16 weights.
  LshWeights<double> rounded = w;
  rounded.qk.weight = w.qk.weight.cast<float>().cast<double>();
  rounded.o.weight = f.matrix<double>(p + "o.weight");
  EXPECT_NE(rounded.o.weight, w.o.weight);  // BF16 really rounded
  EXPECT_LE((rounded.o.weight - w.o.weight).cwiseAbs().maxCoeff(), 0.01);
  const Lsh<double> direct(rounded, opt);

  Tensor<double> x = random_batch<double>(1, 16, D, rng);
  Workspace<double> ws;
  const Tensor<double> a = loaded.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  const Tensor<double> b = direct.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]);

  // Optional parts: no o (concatenated heads), no rotations (seeded).
  io::TensorFile bare;
  bare.put("qk.weight", f.at(p + "qk.weight"));
  bare.put("v.weight", f.at(p + "v.weight"));
  const Lsh<double> minimal = Lsh<double>::from_tensors(bare, "", opt);
  EXPECT_EQ(minimal.out_dim(), H * dh);
  EXPECT_TRUE(minimal.weights().rotations.shape().empty());

  // A bias without its weight, or a missing tensor, names the tensor.
  io::TensorFile broken = bare;
  broken.put("o.bias", f.at(p + "o.bias"));
  try {
    (void)Lsh<double>::from_tensors(broken, "", opt);
    FAIL() << "no throw";
  } catch (const io::io_error& e) {
    EXPECT_NE(std::string(e.what()).find("'o.weight'"), std::string::npos) << e.what();
  }
  try {
    (void)Lsh<double>::from_tensors(f, "encoder.layer.4.attention.", opt);
    FAIL() << "no throw";
  } catch (const io::io_error& e) {
    EXPECT_NE(std::string(e.what()).find("'encoder.layer.4.attention.qk.weight'"), std::string::npos) << e.what();
  }
  // A wrong shape names the tensor and both shapes.
  io::TensorFile wrong = bare;
  wrong.put("v.weight", io::StoredTensor::from(Tensor<double>({H * dh, D + 1})));
  try {
    (void)Lsh<double>::from_tensors(wrong, "", opt);
    FAIL() << "no throw";
  } catch (const shape_error& e) {
    EXPECT_STREQ(e.what(), "[lsh] v.weight: expected [16, 16], got [16, 17]");
  }
}

// ---- CollabHead steps ---------------------------------------------------------

struct CollabShape {
  bool content_bias, block_mixing, dense, layer_norm;
};

template <class T>
CollabHead<T> random_collab(const CollabShape& s, Index D, Index R, Index H, Index dv, std::mt19937& rng,
                            Index block_rows = 4, int threads = 1) {
  std::uniform_real_distribution<double> u(-1, 1);
  auto fill = [&](Matrix<T>& m, Index rows, Index cols, double gain) {
    m.resize(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(gain * u(rng));
  };
  CollabHeadWeights<T> w;
  fill(w.q, R, D, 1 / std::sqrt(double(D)));
  fill(w.k, R, D, 1 / std::sqrt(double(D)));
  fill(w.mixing, H, R, 1.0);
  if (s.block_mixing)  // CONCATENATE: head h owns shared columns [h·R/H, (h+1)·R/H)
    for (Index h = 0; h < H; ++h)
      for (Index r = 0; r < R; ++r) w.mixing(h, r) = r / (R / H) == h ? T(1) : T(0);
  if (s.content_bias) fill(w.content_bias, H, D, 1 / std::sqrt(double(D)));
  w.v = random_linear<T>(H * dv, D, rng);
  if (s.dense) w.o = random_linear<T>(D, H * dv, rng);
  if (s.layer_norm) {
    w.layer_norm.weight = Vector<T>::Constant(D, T(1.5));
    w.layer_norm.bias = Vector<T>::Constant(D, T(-0.25));
  }
  CollabHeadOptions opt;
  opt.num_heads = H;
  opt.causal = true;
  opt.block_rows = block_rows;
  opt.threads = threads;
  return CollabHead<T>(std::move(w), opt);
}

// Steps agree with the full causal forward (float 2e-5, double 1e-12
// relative to 1 + |value|), outputs and weights, with and without the
// content bias, with dense and block mixing, without o, with the LayerNorm.
TYPED_TEST(Decoding, CollabHeadStepsMatchFullCausalForward) {
  using T = TypeParam;
  const Index B = 2, T_ = 13, D = 12, R = 8, H = 4, dv = 3;
  const CollabShape shapes[] = {
      {true, false, true, false}, {true, true, true, true}, {false, false, false, false}, {true, false, true, true}};
  std::mt19937 rng(31);
  for (const CollabShape& s : shapes) {
    const CollabHead<T> layer = random_collab<T>(s, D, R, H, dv, rng);
    const Tensor<T> x = random_batch<T>(B, T_, D, rng);
    expect_steps_match_forward(layer, x, H,
                               "content_bias=" + std::to_string(s.content_bias) + " block=" +
                                   std::to_string(s.block_mixing) + " dense=" + std::to_string(s.dense) +
                                   " layer_norm=" + std::to_string(s.layer_norm));
  }
}

TEST(Decoding, CollabHeadStepsDoNotDependOnThreads) {
  const Index B = 3, T_ = 11, D = 12;
  std::mt19937 rng(32);
  const std::mt19937 start = rng;
  std::mt19937 rng1 = start, rng2 = start;
  const auto one = random_collab<double>({true, false, true, true}, D, 8, 4, 3, rng1, 2, 1);
  const auto two = random_collab<double>({true, false, true, true}, D, 8, 4, 3, rng2, 2, 2);
  const Tensor<double> x = random_batch<double>(B, T_, D, rng);
  const std::vector<Index> chunks{1, 4, 2, 4};
  const Tensor<double> a = decode(one, x, chunks, D), b = decode(two, x, chunks, D);
  ASSERT_EQ(a.shape(), b.shape());
  for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
}

TEST(Decoding, CollabHeadFullCacheThrowsAndKeepsContents) {
  std::mt19937 rng(33);
  const Index D = 8;
  const auto layer = random_collab<double>({true, false, true, false}, D, 4, 2, 2, rng);
  SequenceCache<double> cache(1, 3);
  Workspace<double> ws;
  Tensor<double> x = random_batch<double>(1, 2, D, rng), y({1, 2, D});
  layer.step(x.batch(), cache, y.batch(), ws);
  const Tensor<double> first = y;
  // Three streams: shared keys, values, content bias.
  expect_full_step_refused(layer, cache, x, 3, "[collab] cache: 2 new positions do not fit (2 of 3 used)");
  cache.reset();
  layer.step(x.batch(), cache, y.batch(), ws);
  for (Index i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], first[i]);
  // A cache bound by another layer (other stream widths) is a shape error.
  MhaWeights<double> mw{random_linear<double>(D, D, rng), random_linear<double>(D, D, rng),
                        random_linear<double>(D, D, rng), random_linear<double>(D, D, rng)};
  MhaOptions mo;
  mo.num_heads = 2;
  SequenceCache<double> mha_cache(1, 3);
  Tensor<double> x1 = random_batch<double>(1, 1, D, rng), y1({1, 1, D});
  Mha<double>(mw, mo).step(x1.batch(), mha_cache, y1.batch(), ws);
  try {
    layer.step(x1.batch(), mha_cache, y1.batch(), ws);
    FAIL() << "no throw";
  } catch (const shape_error& e) {
    EXPECT_STREQ(e.what(), "[collab] cache stream widths: expected [4, 4, 2], got [8, 8]");
  }
}

// Token-by-token generation after a prompt allocates nothing, with the
// content bias (its per-worker row) and the LayerNorm.
TEST(Decoding, CollabHeadSizedStepsAllocateNothing) {
  std::mt19937 rng(34);
  const Index D = 32, capacity = 300;
  const auto layer = random_collab<float>({true, false, true, true}, D, 16, 4, 8, rng, 64);
  SequenceCache<float> cache(1, capacity);
  Workspace<float> ws;
  Tensor<float> prompt = random_batch<float>(1, 5, D, rng), y_prompt({1, 5, D});
  layer.step(prompt.batch(), cache, y_prompt.batch(), ws);
  Tensor<float> x = random_batch<float>(1, 1, D, rng), y({1, 1, D});
  EXPECT_EQ(headmix_test::allocations_during([&] {
              while (cache.size() < capacity) layer.step(x.batch(), cache, y.batch(), ws);
            }),
            0);
}

// ---- Grouped-query attention and sliding windows in steps --------------------

// A causal MHA layer of H = 4 query heads over `kv_heads` KV heads.
template <class T>
Mha<T> random_gqa(Index kv_heads, Index window, Index D, Index dk, Index dv, Index out_dim, std::mt19937& rng) {
  const Index H = 4;
  MhaWeights<T> w{random_linear<T>(H * dk, D, rng), random_linear<T>(kv_heads * dk, D, rng),
                  random_linear<T>(kv_heads * dv, D, rng), random_linear<T>(out_dim, H * dv, rng)};
  MhaOptions opt;
  opt.num_heads = H;
  opt.num_kv_heads = kv_heads;
  opt.causal = true;
  opt.window = window;
  opt.block_rows = 4;
  return Mha<T>(std::move(w), opt);
}

// Steps (token by token, uneven chunks, one chunk) agree with the full
// causal forward of the same options, window included, outputs and
// weights, to the tolerance of the other decoding tests: grouped-query MHA
// (multi-query, two groups, standard), Talking-Heads and CollabHead.
TYPED_TEST(Decoding, GroupedQueryAndWindowedStepsMatchForward) {
  using T = TypeParam;
  const Index B = 2, T_ = 13, D = 12;
  std::mt19937 rng(41);
  auto check = [&](const auto& layer, Index heads, const std::string& what) {
    expect_steps_match_forward(layer, random_batch<T>(B, T_, D, rng), heads, what);
  };
  for (const auto& [kv_heads, window] : {std::pair<Index, Index>{1, 0}, {2, 3}, {4, 1}, {1, 5}})
    check(random_gqa<T>(kv_heads, window, D, 3, 5, 7, rng), 4,
          "mha kv_heads=" + std::to_string(kv_heads) + " window=" + std::to_string(window));
  for (Index window : {1, 4}) {
    TalkingHeads<T> th = random_talking_heads<T>({3, 5, 4, true, true}, D, 4, 3, 7, rng);
    CollabHead<T> collab = random_collab<T>({true, false, true, true}, D, 8, 4, 3, rng);
    auto to = th.options();
    to.window = window;
    th.set_options(to);
    auto co = collab.options();
    co.window = window;
    collab.set_options(co);
    check(th, 4, "talking_heads window=" + std::to_string(window));
    check(collab, 4, "collab window=" + std::to_string(window));
  }
}

// The cache keeps the KV heads only: streams of Hkv·Dk and Hkv·Dv, so
// 1/group of a standard MHA's memory. A cache bound to one grouping does
// not serve another.
TEST(Decoding, GroupedQueryCacheHoldsOnlyKvHeads) {
  std::mt19937 rng(42);
  const Index B = 2, cap = 6, D = 8, dk = 3, dv = 5;
  const Tensor<double> x = random_batch<double>(B, 1, D, rng);
  Workspace<double> ws;
  Tensor<double> y({B, 1, 7});
  SequenceCache<double> two_groups(B, cap);
  for (Index kv_heads : {2, 1, 4}) {
    const Mha<double> layer = random_gqa<double>(kv_heads, 0, D, dk, dv, 7, rng);
    SequenceCache<double> cache(B, cap);
    layer.step(x.batch(), cache, y.batch(), ws);
    EXPECT_EQ(cache.stream(0).cols(), kv_heads * dk) << kv_heads;
    EXPECT_EQ(cache.stream(1).cols(), kv_heads * dv) << kv_heads;
    // Head-major: head g of item b holds that head's keys (as K_gᵀ, one run
    // per dimension) and values (one run per position); head() reads either
    // as [capacity, dim] (checked against x Wᵀ + b in loops).
    const auto& w = layer.weights();
    for (Index b = 0; b < B; ++b)
      for (Index g = 0; g < kv_heads; ++g) {
        const auto key = cache.head(0, b, g), value = cache.head(1, b, g);
        EXPECT_EQ(key.cols(), dk);
        for (Index c = 0; c < dk + dv; ++c) {
          const auto& lin = c < dk ? w.k : w.v;
          const Index row = c < dk ? g * dk + c : g * dv + (c - dk);
          double expect = lin.has_bias() ? lin.bias(row) : 0.0;
          for (Index d = 0; d < D; ++d) expect += x[b * D + d] * lin.weight(row, d);
          EXPECT_NEAR(c < dk ? key(0, c) : value(0, c - dk), expect, 1e-12) << "item " << b << " head " << g << " col " << c;
        }
      }
    EXPECT_EQ(cache.stream(0).size() + cache.stream(1).size(), B * kv_heads * (cache.transposed_stride() * dk + cap * dv))
        << kv_heads;
    if (kv_heads == 2) layer.step(x.batch(), two_groups, y.batch(), ws);
    if (kv_heads == 1) {
      EXPECT_THROW(layer.step(x.batch(), two_groups, y.batch(), ws), shape_error);
    }
  }
}

// truncate(n) rolls a cache back (rejected draft tokens): the positions
// stepped after it give what a cache that never saw the dropped ones gives.
TEST(Decoding, TruncateRollsBackToAnEarlierPosition) {
  std::mt19937 rng(38);
  const Index B = 2, D = 12, T_ = 9, kept = 5;
  const auto layer = random_collab<double>({true, false, true, false}, D, 8, 4, 3, rng);
  const Tensor<double> x = random_batch<double>(B, T_, D, rng), draft = random_batch<double>(B, 3, D, rng);
  const Tensor<double> want = decode(layer, x, {T_}, D);
  SequenceCache<double> cache(B, T_ + 3);
  Workspace<double> ws;
  Tensor<double> y_kept({B, kept, D}), y_draft({B, 3, D}), y_rest({B, T_ - kept, D});
  layer.step(slice(x, 0, kept).batch(), cache, y_kept.batch(), ws);
  layer.step(draft.batch(), cache, y_draft.batch(), ws);
  EXPECT_THROW(cache.truncate(kept + 4), shape_error);
  EXPECT_THROW(cache.truncate(-1), shape_error);
  EXPECT_EQ(cache.size(), kept + 3);
  cache.truncate(kept);
  EXPECT_EQ(cache.size(), kept);
  layer.step(slice(x, kept, T_ - kept).batch(), cache, y_rest.batch(), ws);
  expect_close(y_rest, slice(want, kept, T_ - kept), tolerance<double>(), "after truncate");
}

// With two worker threads the steps run on the persistent worker pool:
// once it has started its thread, steps allocate nothing either (two batch
// items give the pipeline two tasks).
TEST(Decoding, SizedStepsOnTwoThreadsAllocateNothing) {
  std::mt19937 rng(37);
  const Index B = 2, D = 32, capacity = 100;
  MhaWeights<float> w{random_linear<float>(D, D, rng), random_linear<float>(D, D, rng),
                      random_linear<float>(D, D, rng), random_linear<float>(D, D, rng)};
  MhaOptions opt;
  opt.num_heads = 4;
  opt.threads = 2;
  const Mha<float> mha(w, opt);
  const auto collab = random_collab<float>({true, false, true, true}, D, 16, 4, 8, rng, 64, 2);
  auto run = [&](const auto& layer, const char* name) {
    SequenceCache<float> cache(B, capacity);
    Workspace<float> ws;
    Tensor<float> x = random_batch<float>(B, 1, D, rng), y({B, 1, D});
    layer.step(x.batch(), cache, y.batch(), ws);
    EXPECT_EQ(headmix_test::allocations_during([&] {
                while (cache.size() < capacity) layer.step(x.batch(), cache, y.batch(), ws);
              }),
              0)
        << name;
  };
  run(mha, "mha");
  run(collab, "collab");
}

}  // namespace

// ---- CollabHead and DCMHA from named tensors; conformance cases decoded -----

#include "conformance/case_collab.hpp"
#include "conformance/case_dcmha.hpp"

namespace {

TYPED_TEST(Decoding, CollabHeadConformanceCausalCasesPositionByPosition) {
  using T = TypeParam;
  const auto cases = causal_cases("collab");
  if (cases.empty()) HEADMIX_CONFORMANCE_MISSING() << "no causal collab cases under " << HEADMIX_CONFORMANCE_DIR;
  for (const auto& path : cases)
    decode_case<T>(path, [](const io::TensorFile& f, const nlohmann::json&) {
      return conformance::load_collab_case<T>(f);
    });
}

template <class T>
Tensor<double> as_tensor(const T& m) {
  Tensor<double> t({m.rows(), m.cols()});
  for (Index r = 0; r < m.rows(); ++r)
    for (Index c = 0; c < m.cols(); ++c) t[r * m.cols() + c] = static_cast<double>(m(r, c));
  return t;
}
Tensor<double> as_tensor(const Vector<double>& v) {
  Tensor<double> t({v.size()});
  std::copy_n(v.data(), v.size(), t.data());
  return t;
}

// from_tensors reads collab.md's names under a prefix (F16 storage
// included), builds the layer the weights build directly, and names the
// stored tensor, prefix and all, in a shape error.
TEST(Decoding, CollabHeadFromTensorsReadsCollabMdNamesUnderAPrefix) {
  std::mt19937 rng(35);
  const Index D = 12, R = 8, H = 4, dv = 3;
  const auto direct = random_collab<double>({true, false, true, true}, D, R, H, dv, rng);
  const auto& w = direct.weights();
  const std::string p = "encoder.layer.3.attention.";
  io::TensorFile f;
  f.put(p + "q.weight", io::StoredTensor::from(as_tensor(w.q)));
  f.put(p + "k.weight", io::StoredTensor::from(as_tensor(w.k), io::DType::F32));
  f.put(p + "mixing", io::StoredTensor::from(as_tensor(w.mixing)));
  f.put(p + "content_bias.weight", io::StoredTensor::from(as_tensor(w.content_bias)));
  f.put(p + "v.weight", io::StoredTensor::from(as_tensor(w.v.weight)));
  f.put(p + "v.bias", io::StoredTensor::from(as_tensor(w.v.bias)));
  f.put(p + "o.weight", io::StoredTensor::from(as_tensor(w.o.weight), io::DType::F16));
  f.put(p + "o.bias", io::StoredTensor::from(as_tensor(w.o.bias)));
  f.put(p + "layer_norm.weight", io::StoredTensor::from(as_tensor(w.layer_norm.weight)));
  f.put(p + "layer_norm.bias", io::StoredTensor::from(as_tensor(w.layer_norm.bias)));
  const auto loaded = CollabHead<double>::from_tensors(f, p, direct.options());

  CollabHeadWeights<double> rounded = w;  // what the file holds: F32 keys, F16 output weight
  rounded.k = w.k.cast<float>().cast<double>();
  rounded.o.weight = f.matrix<double>(p + "o.weight");
  EXPECT_NE(rounded.o.weight, w.o.weight);
  const CollabHead<double> same(rounded, direct.options());
  const Tensor<double> x = random_batch<double>(2, 7, D, rng);
  Workspace<double> ws;
  const Tensor<double> a = loaded.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  const Tensor<double> b = same.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]);

  io::TensorFile wrong = f;
  wrong.put(p + "mixing", io::StoredTensor::from(Tensor<double>({H, R + 1})));
  EXPECT_EQ(shape_error_message([&] { (void)CollabHead<double>::from_tensors(wrong, p, direct.options()); }),
            "[collab] encoder.layer.3.attention.mixing: expected [4, 8], got [4, 9]");
  io::TensorFile half_norm = f;
  half_norm.tensors.erase(p + "layer_norm.bias");
  EXPECT_THROW((void)CollabHead<double>::from_tensors(half_norm, p, direct.options()), io::io_error);
  // An option is not a tensor: its name stays as it is.
  CollabHeadOptions bad = direct.options();
  bad.block_rows = -1;
  EXPECT_EQ(shape_error_message([&] { (void)CollabHead<double>::from_tensors(f, p, bad); }),
            "[collab] block_rows: expected >= 0 (0 = automatic), got -1");
}

// MHA and Talking-Heads name the prefixed tensor too.
TEST(Decoding, FromTensorsShapeErrorsNameTheStoredTensor) {
  std::mt19937 rng(36);
  const Index D = 8, H = 2;
  const std::string p = "model.layers.0.self_attn.";
  io::TensorFile f;
  f.put(p + "q.weight", io::StoredTensor::from(as_tensor(random_linear<double>(D, D, rng).weight)));
  f.put(p + "k.weight", io::StoredTensor::from(as_tensor(random_linear<double>(D, D, rng).weight)));
  f.put(p + "v.weight", io::StoredTensor::from(as_tensor(random_linear<double>(D, D + 1, rng).weight)));
  MhaOptions mo;
  mo.num_heads = H;
  EXPECT_EQ(shape_error_message([&] { (void)Mha<double>::from_tensors(f, p, mo); }),
            "[mha] model.layers.0.self_attn.v.weight: expected [8, 8], got [8, 9]");
  TalkingHeadsOptions to;
  to.num_heads = H;
  EXPECT_EQ(shape_error_message([&] { (void)TalkingHeads<double>::from_tensors(f, p, to); }),
            "[talking_heads] model.layers.0.self_attn.v.weight: expected [8, 8], got [8, 9]");
  mo.block_rows = -1;  // an option, not a tensor
  EXPECT_EQ(shape_error_message([&] { (void)Mha<double>::from_tensors(f, p, mo); }),
            "[mha] block_rows: expected >= 0 (0 = automatic), got -1");
  // The parts of the message are fields of the error, the prefix on the argument.
  mo.block_rows = 0;
  try {
    (void)Mha<double>::from_tensors(f, p, mo);
    ADD_FAILURE() << "no shape_error";
  } catch (const shape_error& e) {
    EXPECT_EQ(e.variant(), "mha");
    EXPECT_EQ(e.argument(), p + "v.weight");
    EXPECT_EQ(e.expected(), "[8, 8]");
    EXPECT_EQ(e.actual(), "[8, 9]");
  }
}

// from_tensors reads grouped-query K and V ([Hkv·Dk, D], [Hkv·Dv, D]) under
// the same names: the layer the weights build directly, bit for bit. The
// same file read as a standard MHA names the stored k.weight.
TEST(Decoding, MhaFromTensorsReadsGroupedQueryKv) {
  std::mt19937 rng(43);
  const Index D = 8, H = 4, Hkv = 2, dk = 2, dv = 2;
  const std::string p = "model.layers.1.self_attn.";
  MhaWeights<double> w{random_linear<double>(H * dk, D, rng), random_linear<double>(Hkv * dk, D, rng),
                       random_linear<double>(Hkv * dv, D, rng), random_linear<double>(D, H * dv, rng)};
  io::TensorFile f;
  for (const auto& [name, lin] : {std::pair<std::string, const Linear<double>*>{"q", &w.q}, {"k", &w.k}, {"v", &w.v},
                                  {"o", &w.o}}) {
    f.put(p + name + ".weight", io::StoredTensor::from(as_tensor(lin->weight)));
    f.put(p + name + ".bias", io::StoredTensor::from(as_tensor(lin->bias)));
  }
  MhaOptions mo;
  mo.num_heads = H;
  mo.num_kv_heads = Hkv;
  mo.causal = true;
  const auto loaded = Mha<double>::from_tensors(f, p, mo);
  EXPECT_EQ(loaded.num_kv_heads(), Hkv);
  const Mha<double> direct(w, mo);
  const Tensor<double> x = random_batch<double>(2, 5, D, rng);
  Workspace<double> ws;
  const Tensor<double> a = loaded.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  const Tensor<double> b = direct.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]);
  mo.num_kv_heads = 0;  // standard MHA wants H·Dk key rows
  EXPECT_EQ(shape_error_message([&] { (void)Mha<double>::from_tensors(f, p, mo); }),
            "[mha] model.layers.1.self_attn.k.weight: expected [8, 8], got [4, 8]");
}

// DCMHA from dcmha.md's names under a prefix equals the layer built from
// the same weights directly, BF16 storage included.
TEST(Decoding, DcmhaFromTensorsReadsDcmhaMdNamesUnderAPrefix) {
  const std::filesystem::path path = std::filesystem::path(HEADMIX_CONFORMANCE_DIR) / "dcmha";
  if (!std::filesystem::is_directory(path)) HEADMIX_CONFORMANCE_MISSING() << path << " is absent";
  std::filesystem::path any;
  for (const auto& e : std::filesystem::directory_iterator(path))
    if (e.path().extension() == ".safetensors" && (any.empty() || e.path() < any)) any = e.path();
  const io::TensorFile f = io::load_safetensors(any.string());
  const auto plain = conformance::load_dcmha_case<double>(f);
  const std::string p = "blocks.7.attn.";
  io::TensorFile prefixed;
  for (const auto& [name, t] : f.tensors)
    if (name.rfind("input.", 0) != 0 && name.rfind("expected.", 0) != 0) prefixed.put(p + name, t);
  prefixed.put(p + "dc.dd", io::StoredTensor::from(f.get<double>("dc.dd"), io::DType::BF16));
  const auto loaded = Dcmha<double>::from_tensors(prefixed, p, plain.options());
  DcmhaWeights<double> rounded = plain.weights();
  rounded.dd = prefixed.get<double>(p + "dc.dd");
  const Dcmha<double> same(rounded, plain.options());
  const Tensor<double> x = f.get<double>("input.query");
  Workspace<double> ws;
  const Tensor<double> a = loaded.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  const Tensor<double> b = same.forward(AttentionInput<double>{x.batch(), {}, {}}, ws);
  for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]);

  prefixed.put(p + "dc.dd", io::StoredTensor::from(Tensor<double>({1, 1, 1})));
  const std::string msg = shape_error_message([&] { (void)Dcmha<double>::from_tensors(prefixed, p, plain.options()); });
  EXPECT_EQ(msg.rfind("[dcmha] blocks.7.attn.dc.dd: expected ", 0), 0u) << msg;
}

}  // namespace

// ---- Half-precision (bfloat16) caches ------------------------------------------

namespace {

constexpr double kBf16Unit = 1.0 / 256;  // u: bfloat16 keeps 8 significant bits

double round_to_bfloat16(double x) { return double(static_cast<float>(Eigen::bfloat16(static_cast<float>(x)))); }

// y = x · Wᵀ + b in double, for one row.
template <class T>
std::vector<double> project_row(const Linear<T>& lin, const T* x) {
  std::vector<double> y(static_cast<std::size_t>(lin.out_features()));
  for (Index o = 0; o < lin.out_features(); ++o) {
    double s = lin.has_bias() ? double(lin.bias[o]) : 0.0;
    for (Index i = 0; i < lin.in_features(); ++i) s += double(lin.weight(o, i)) * double(x[i]);
    y[static_cast<std::size_t>(o)] = s;
  }
  return y;
}

// Causal grouped-query MHA over one sequence x [T, D] in double loops, with
// the projected keys and values passed through `store` (the cache's
// rounding); returns the outputs [T, out] and, per head, A = the largest
// Σ_i |q_i k_i| over visible pairs (scaled queries) and max |v|.
struct NaiveDecode {
  std::vector<double> y;
  double a_max = 0, v_max = 0;
};
template <class T, class Store>
NaiveDecode naive_causal_mha(const Mha<T>& layer, const T* x, Index T_, Store store) {
  const auto& w = layer.weights();
  const Index H = layer.num_heads(), Hkv = layer.num_kv_heads(), dk = layer.head_dim(), dv = layer.v_head_dim();
  const Index D = layer.embed_dim(), out = layer.out_dim();
  const double scale = double(layer.scale());
  std::vector<std::vector<double>> q, k, v;
  for (Index t = 0; t < T_; ++t) {
    q.push_back(project_row(w.q, x + t * D));
    k.push_back(project_row(w.k, x + t * D));
    v.push_back(project_row(w.v, x + t * D));
    for (double& e : k.back()) e = store(e);
    for (double& e : v.back()) e = store(e);
  }
  NaiveDecode r;
  r.y.assign(static_cast<std::size_t>(T_ * out), 0.0);
  for (Index t = 0; t < T_; ++t) {
    std::vector<double> ctx(static_cast<std::size_t>(H * dv), 0.0);
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / Hkv);
      std::vector<double> s(static_cast<std::size_t>(t + 1));
      double top = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j <= t; ++j) {
        double dot = 0, abs_dot = 0;
        for (Index i = 0; i < dk; ++i) {
          const double qi = scale * q[t][h * dk + i], ki = k[j][g * dk + i];
          dot += qi * ki;
          abs_dot += std::abs(qi * ki);
        }
        s[j] = dot;
        top = std::max(top, dot);
        r.a_max = std::max(r.a_max, abs_dot);
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - top));
      for (Index j = 0; j <= t; ++j)
        for (Index c = 0; c < dv; ++c) {
          ctx[h * dv + c] += s[j] / sum * v[j][g * dv + c];
          r.v_max = std::max(r.v_max, std::abs(v[j][g * dv + c]));
        }
    }
    const std::vector<double> y = project_row(w.o, ctx.data());
    std::copy(y.begin(), y.end(), r.y.begin() + t * out);
  }
  return r;
}

Tensor<double> to_double(const Tensor<float>& x) {
  Tensor<double> d(x.shape());
  for (Index i = 0; i < x.size(); ++i) d[i] = x[i];
  return d;
}

// ‖W‖_∞: the largest row sum of |W|.
template <class T>
double inf_norm(const Matrix<T>& w) {
  return w.template cast<double>().cwiseAbs().rowwise().sum().maxCoeff();
}

}  // namespace

// A bfloat16 cache stores K and V rounded to nearest even and computes the
// rest as a full-precision cache does: steps equal naive double loops whose
// K and V are so rounded, to double's tolerance.
TEST(HalfCache, StepsEqualNaiveLoopsOverRoundedKeysAndValues) {
  std::mt19937 rng(61);
  const Index T_ = 11, D = 12;
  for (Index kv_heads : {4, 2, 1}) {
    const Mha<double> layer = random_gqa<double>(kv_heads, 0, D, 3, 5, 7, rng);
    const Tensor<double> x = random_batch<double>(1, T_, D, rng);
    const Tensor<double> y = decode<double>(layer, x, std::vector<Index>(T_, 1), layer.out_dim(), nullptr, 0,
                                            CachePrecision::bfloat16);
    const NaiveDecode want = naive_causal_mha(layer, x.data(), T_, round_to_bfloat16);
    const NaiveDecode unrounded = naive_causal_mha(layer, x.data(), T_, [](double e) { return e; });
    double worst = 0, rounding = 0;
    for (Index i = 0; i < y.size(); ++i) {
      worst = std::max(worst, std::abs(y[i] - want.y[i]) / (1 + std::abs(want.y[i])));
      rounding = std::max(rounding, std::abs(want.y[i] - unrounded.y[i]));
    }
    EXPECT_LE(worst, 1e-12) << "kv_heads " << kv_heads;
    EXPECT_GT(rounding, 1e-6) << "the rounding must be visible for this test to mean anything";
  }
}

// Against the full-precision cache, in float: within the stated bound
// ‖W_o‖_∞ · ((e^(2u·A) − 1)(1 + u) + u) · max|v| (core/sequence_cache.hpp),
// plus the float tolerance of the other decoding tests. Talking-Heads: the
// same with A scaled by ‖pre‖_∞ and the whole by ‖post‖_∞ (the mixes are
// linear maps over heads).
TEST(HalfCache, StepsStayWithinTheirBoundOfTheFullCache) {
  std::mt19937 rng(62);
  const Index T_ = 24, D = 16;
  const double u = kBf16Unit;
  auto bound_of = [&](double a, double v_max, double wo, double pre, double post) {
    return wo * post * ((std::exp(2 * u * pre * a) - 1) * (1 + u) + u) * v_max;
  };
  auto check = [&](const auto& layer, double bound, const Tensor<float>& x, const std::string& what) {
    const std::vector<Index> tokens(T_, 1);
    const Tensor<float> full = decode(layer, x, tokens, layer.out_dim());
    const Tensor<float> half = decode<float>(layer, x, tokens, layer.out_dim(), nullptr, 0, CachePrecision::bfloat16);
    double worst = 0, excess = 0;
    for (Index i = 0; i < full.size(); ++i) {
      const double diff = std::abs(double(half[i]) - double(full[i]));
      worst = std::max(worst, diff);
      excess = std::max(excess, diff - bound - tolerance<float>() * (1 + std::abs(double(full[i]))));
    }
    EXPECT_LE(excess, 0.0) << what << ": worst difference " << worst << ", bound " << bound;
    EXPECT_GT(worst, 0.0) << what << ": the half-precision cache changed nothing";
  };
  for (Index kv_heads : {4, 1}) {
    const Mha<float> layer = random_gqa<float>(kv_heads, 0, D, 8, 8, 8, rng);
    const Tensor<float> x = random_batch<float>(1, T_, D, rng);
    const Mha<double> exact(MhaWeights<double>{layer.weights().q.cast<double>(), layer.weights().k.cast<double>(),
                                               layer.weights().v.cast<double>(), layer.weights().o.cast<double>()},
                            layer.options());
    const Tensor<double> xd = to_double(x);
    const NaiveDecode r = naive_causal_mha(exact, xd.data(), T_, [](double e) { return e; });
    check(layer, bound_of(r.a_max, r.v_max, inf_norm(layer.weights().o.weight), 1, 1), x,
          "mha kv_heads=" + std::to_string(kv_heads));
  }
  {
    // Talking-Heads: A and max|v| of the key heads, from an MHA over the
    // same q/k (value heads: v); the mixes' norms scale them.
    const TalkingHeads<float> th = random_talking_heads<float>({4, 3, 4, true, true}, D, 8, 8, 8, rng);
    const auto& w = th.weights();
    MhaOptions mo;
    mo.num_heads = 4;
    mo.causal = true;
    const Mha<double> qk(MhaWeights<double>{w.q.cast<double>(), w.k.cast<double>(), w.v.cast<double>(),
                                            w.o.cast<double>()},
                         mo);
    const Tensor<float> x = random_batch<float>(1, T_, D, rng);
    const NaiveDecode r = naive_causal_mha(qk, to_double(x).data(), T_,
                                           [](double e) { return e; });
    check(th, bound_of(r.a_max, r.v_max, inf_norm(w.o.weight), inf_norm(w.pre_softmax), inf_norm(w.post_softmax)),
          x, "talking_heads");
  }
}

// Half the bytes for K and V; a layer whose steps read no bfloat16 streams
// (CollabHead) refuses a bfloat16 cache by name.
TEST(HalfCache, HalvesTheBytesAndIsRefusedWhereUnsupported) {
  std::mt19937 rng(63);
  const Index D = 12, T_ = 6;
  const Mha<float> layer = random_gqa<float>(2, 0, D, 3, 5, 7, rng);
  const Tensor<float> x = random_batch<float>(2, T_, D, rng);
  Workspace<float> ws;
  SequenceCache<float> full(2, 32), half(2, 32, CachePrecision::bfloat16);
  Tensor<float> y({2, T_, layer.out_dim()});
  layer.step(x.batch(), full, y.batch(), ws);
  layer.step(x.batch(), half, y.batch(), ws);
  EXPECT_EQ(half.precision(), CachePrecision::bfloat16);
  EXPECT_EQ(2 * half.bytes(), full.bytes());
  EXPECT_EQ(full.bytes(), std::size_t(2 * 32 * 2 * (3 + 5)) * sizeof(float));

  const CollabHead<float> collab = random_collab<float>({true, false, true, true}, D, 8, 4, 3, rng);
  SequenceCache<float> collab_cache(2, 32, CachePrecision::bfloat16);
  Tensor<float> yc({2, T_, collab.out_dim()});
  EXPECT_EQ(shape_error_message([&] { collab.step(x.batch(), collab_cache, yc.batch(), ws); }),
            "[collab] cache precision: expected CachePrecision::full (this layer's steps read no bfloat16 streams), got "
            "CachePrecision::bfloat16");
}

// Sized bfloat16 steps allocate nothing, and are bit-identical on 1 and 2
// threads.
TEST(HalfCache, SizedStepsAllocateNothingAndDoNotDependOnThreads) {
  std::mt19937 rng(64);
  const Index D = 32, T_ = 40;
  const Tensor<float> x = random_batch<float>(2, T_, D, rng);
  Tensor<float> by_threads[2];
  for (int threads : {1, 2}) {
    std::mt19937 same(65);
    MhaWeights<float> w{random_linear<float>(D, D, same), random_linear<float>(D / 2, D, same),
                        random_linear<float>(D / 2, D, same), random_linear<float>(D, D, same)};
    MhaOptions opt;
    opt.num_heads = 4, opt.num_kv_heads = 2, opt.threads = threads, opt.key_block = 16;
    const Mha<float> layer(w, opt);
    SequenceCache<float> cache(2, T_, CachePrecision::bfloat16);
    Workspace<float> ws;
    Tensor<float> y({2, 1, D});
    layer.step(slice(x, 0, 1).batch(), cache, y.batch(), ws);  // sizes cache and workspace
    std::vector<Tensor<float>> tokens;
    for (Index t = 1; t < T_; ++t) tokens.push_back(slice(x, t, 1));
    EXPECT_EQ(headmix_test::allocations_during([&] {
                for (const auto& xt : tokens) layer.step(xt.batch(), cache, y.batch(), ws);
              }),
              0)
        << threads << " threads";
    by_threads[threads - 1] = y;
  }
  for (Index i = 0; i < by_threads[0].size(); ++i) ASSERT_EQ(by_threads[0][i], by_threads[1][i]) << i;
}
