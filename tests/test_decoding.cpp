// Incremental decoding over a SequenceCache, as typed tests over the
// variants of tests/variants.hpp that decode (V::decodes; the others skip):
// steps of every chunking reproduce the full causal forward and the naive
// double reference, do not depend on the thread count, refuse to overflow a
// cache and leave it as it was, refuse a cache of another batch or layer,
// roll back with truncate(), allocate nothing once sized, decode the causal
// conformance cases position by position, hold K and V in a bfloat16 cache
// (or refuse one by name), and read bfloat16 weights. A new decoding
// variant is covered by its traits entry: decoding_shapes(),
// decoding_allocation_shapes(), the decoding_conformance,
// bf16_cache_refusal, step_tolerance<T>().
//
// After the typed suite: MHA's own checks of the grouped-query cache layout
// and the allocation check's plumbing. MHA's bfloat16 cache and weights
// against naive loops and within their bound: test_half_precision.cpp.

// Count heap allocations, operator new and Eigen's alike, in any build type
// (headmix_test::allocations_during()). Must come before any Eigen header.
#define HEADMIX_TEST_COUNT_ALLOCATIONS
#include "test_util.hpp"

#include "decoding_util.hpp"
#include "variants.hpp"

#include <headmix/io/safetensors.hpp>
#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using headmix::AttentionInput;
using headmix::cache_full_error;
using headmix::CachePrecision;
using headmix::SequenceCache;
using headmix::shape_error;
using headmix::Workspace;
namespace io = headmix::io;

constexpr Index kWhole = Index(1) << 30;  // a chunk size: every position left

// The chunkings the steps-vs-forward test runs, each with the spare
// capacity of its cache: token by token into a cache that ends full, uneven
// and fixed-size chunks into a larger one, one step over the empty cache.
struct Chunking {
  std::vector<Index> chunks;
  Index spare;
};
const std::vector<Chunking> kChunkings = {{{1}, 0}, {{3, 4, 5, 1, 2}, 3}, {{3}, 3}, {{5, 1, 2}, 3}, {{kWhole}, 0}};

// Same values bit for bit; where the variant allows it, +0 and -0 count as equal.
template <class V, class T>
::testing::AssertionResult same_values(const char* what, const Tensor<T>& a, const Tensor<T>& b) {
  if (V::zero_sign_exact) return bit_identical(what, a, b);
  if (!(a.shape() == b.shape())) return ::testing::AssertionFailure() << what << ": shapes differ";
  for (Index i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i]) && !(a[i] != a[i] && b[i] != b[i]))
      return ::testing::AssertionFailure() << what << ": differ at " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// How many streams a layer bound in `cache` (full precision): those whose
// memory makes up cache.bytes().
template <class T>
std::size_t stream_count(SequenceCache<T>& cache) {
  std::size_t n = 0, bytes = 0;
  while (bytes < cache.bytes()) bytes += static_cast<std::size_t>(cache.stream(n++).size()) * sizeof(T);
  EXPECT_EQ(bytes, cache.bytes());
  return n;
}

// Every causal self-attention case without key padding in `dir`.
std::vector<std::filesystem::path> causal_cases(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> found;
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
Tolerance case_tolerance(const io::TensorFile& f) {
  auto number = [&](const char* key, double fallback) {
    const auto it = f.metadata.find(key);
    return it == f.metadata.end() ? fallback : std::stod(it->second);
  };
  if (std::is_same_v<T, double>) return {number("rtol", 1e-9), number("atol", 1e-12)};
  return {number("rtol_f32", 1e-4), number("atol_f32", 1e-5)};
}

// ---------------------------------------------------------------------------
// The typed suite, float and double

template <class Param>
class Decoding : public ::testing::Test {
 public:
  using V = typename Param::Variant;
  using T = typename Param::Scalar;
  static auto make(const typename V::Shape& s, unsigned seed) { return V::template make<T>(s, seed); }
  // The first decoding shape with B items of T positions.
  static auto first(Index B, Index T_, unsigned seed) {
    auto s = V::decoding_shapes()[0];
    s.B = static_cast<int>(B), s.T = static_cast<int>(T_);
    return make(s, seed);
  }
};
TYPED_TEST_SUITE(Decoding, variants::AllVariantsInBothScalars, variants::VariantInName);

// The test body that follows runs only for variants with step().
#define DECODING_VARIANTS_ONLY()                      \
  using V = typename TestFixture::V;                  \
  using T = typename TestFixture::T;                  \
  if constexpr (!V::decodes) {                        \
    GTEST_SKIP() << V::name << " does not decode";    \
  } else

// Steps of every chunking agree with one full causal forward of the same
// layer (outputs and weights, to V::step_tolerance) and with the naive
// double reference (to the forward's own bound).
TYPED_TEST(Decoding, StepsMatchFullCausalForwardAndReference) {
  DECODING_VARIANTS_ONLY() {
    const auto shapes = V::decoding_shapes();
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const auto p = TestFixture::make(shapes[i], 40 + static_cast<unsigned>(i));
      SCOPED_TRACE(p.describe());
      const auto layer = p.layer();
      Workspace<T> ws;
      Tensor<T> full_probs;
      const Tensor<T> full = layer.forward(p.input(), ws, &full_probs);
      const auto want = p.reference();
      const Tolerance tol = V::template step_tolerance<T>();
      for (const Chunking& c : kChunkings) {
        SCOPED_TRACE(::testing::Message() << "chunks from " << c.chunks[0] << ", spare " << c.spare);
        const Decoded<T> d = decode(layer, query_tensor<V>(p), c.chunks, c.spare);
        EXPECT_TRUE(all_close("output", d.out, widen(full), tol));
        EXPECT_TRUE(all_close("weights", d.probs, widen(full_probs), tol));
        EXPECT_TRUE(all_close("output vs reference", d.out, want.output, default_tolerance<T>()));
        EXPECT_TRUE(all_close("weights vs reference", d.probs, want.probs, default_tolerance<T>()));
      }
    }
  }
}

// Worker threads split a step's (batch, query block) tasks; outputs and
// weights must not depend on their number, bit for bit.
TYPED_TEST(Decoding, StepsDoNotDependOnThreads) {
  DECODING_VARIANTS_ONLY() {
    for (auto s : V::decoding_shapes()) {
      s.B = 3, s.T = 11, s.block_rows = 2;
      auto p = TestFixture::make(s, 22);
      SCOPED_TRACE(p.describe());
      const Tensor<T> x = query_tensor<V>(p);
      for (const std::vector<Index>& chunks : {std::vector<Index>{4, 1, 6}, {1, 4, 2, 4}, {4}}) {
        Decoded<T> one;
        for (int threads : {1, 2, 3}) {
          V::set_threads(p, threads);
          const Decoded<T> d = decode(p.layer(), x, chunks);
          if (threads == 1) {
            one = d;
            continue;
          }
          EXPECT_TRUE(same_values<V>("output", d.out, one.out)) << threads << " threads, " << chunks.size() << " sizes";
          EXPECT_TRUE(same_values<V>("weights", d.probs, one.probs)) << threads << " threads";
        }
      }
    }
  }
}

// step() is bottom-right causal whatever options().causal says: a
// non-causal layer decodes exactly like the causal one.
TYPED_TEST(Decoding, StepIsCausalWhateverTheOptions) {
  DECODING_VARIANTS_ONLY() {
    auto s = V::decoding_shapes()[0];
    const auto causal = TestFixture::make(s, 104);
    s.causal = false;
    const auto plain = TestFixture::make(s, 104);
    const Tensor<T> x = query_tensor<V>(causal);
    const Decoded<T> a = decode(causal.layer(), x, {2}), b = decode(plain.layer(), x, {2});
    EXPECT_TRUE(same_values<V>("output", b.out, a.out));
    EXPECT_TRUE(same_values<V>("weights", b.probs, a.probs));
  }
}

// A step that does not fit throws cache_full_error and changes nothing:
// the size, and every stream the layer bound, bit for bit over the whole
// capacity; the next position still comes out right; reset() starts over.
TYPED_TEST(Decoding, FullCacheRefusesAStepAndKeepsItsContents) {
  DECODING_VARIANTS_ONLY() {
    const auto p = TestFixture::first(1, 6, 100);
    const auto layer = p.layer();
    const Tensor<T> x = query_tensor<V>(p);
    Workspace<T> ws;
    const Tensor<T> full = layer.forward(p.input(), ws);
    const Index out = layer.out_dim();
    SequenceCache<T> cache(1, 4);
    Tensor<T> first({1, 3, out}), two({1, 2, out}), one({1, 1, out}), again({1, 3, out});
    layer.step(slice(x, 0, 3).batch(), cache, first.batch(), ws);
    const auto before = cache_streams(cache, stream_count(cache));
    try {
      layer.step(slice(x, 3, 2).batch(), cache, two.batch(), ws);
      ADD_FAILURE() << "no throw";
    } catch (const cache_full_error& e) {
      EXPECT_EQ(std::string(e.what()), std::string(V::tag) + " cache: 2 new positions do not fit (3 of 4 used)");
    }
    EXPECT_EQ(cache.size(), 3);
    EXPECT_TRUE(same_cache_bits(cache_streams(cache, before.size()), before)) << "a refused step wrote to the cache";
    layer.step(slice(x, 3, 1).batch(), cache, one.batch(), ws);
    EXPECT_TRUE(all_close("the position after the refused step", one, widen(slice(full, 3, 1)),
                          V::template step_tolerance<T>()));
    EXPECT_EQ(cache.size(), 4);
    EXPECT_THROW(layer.step(slice(x, 4, 1).batch(), cache, one.batch(), ws), cache_full_error);
    cache.reset();
    EXPECT_EQ(cache.size(), 0);
    layer.step(slice(x, 0, 3).batch(), cache, again.batch(), ws);
    EXPECT_TRUE(same_values<V>("first step after reset()", again, first));
  }
}

// A cache of another batch size, or one another layer bound (other stream
// widths), is a shape error naming both; so are a query or an output of
// another width. None of them caches anything.
TYPED_TEST(Decoding, CacheOfAnotherBatchOrLayerIsAShapeError) {
  DECODING_VARIANTS_ONLY() {
    const auto p = TestFixture::first(1, 2, 24);
    const auto layer = p.layer();
    const Tensor<T> x = slice(query_tensor<V>(p), 0, 1);
    const Index D = x.dim(2), out = layer.out_dim();
    Workspace<T> ws;
    Tensor<T> y({1, 1, out});
    SequenceCache<T> wrong_batch(2, 4);
    EXPECT_EQ(shape_error_message([&] { layer.step(x.batch(), wrong_batch, y.batch(), ws); }),
              std::string(V::tag) + " cache batch: expected [1], got [2]");
    EXPECT_EQ(wrong_batch.size(), 0);
    // The widths this layer binds, against a cache an MHA of K and V width 1 filled.
    SequenceCache<T> own(1, 4);
    layer.step(x.batch(), own, y.batch(), ws);
    std::string widths = "[";
    for (std::size_t i = 0, n = stream_count(own); i < n; ++i)
      widths += (i == 0 ? "" : ", ") + std::to_string(own.stream(i).cols());
    mha_case::Shape ms;
    ms.B = 1, ms.T = 1, ms.D = static_cast<int>(D), ms.H = 1, ms.Dk = 1, ms.Dv = 1, ms.out = 1;
    const auto filler = mha_case::make_problem<T>(ms, 25).layer();
    SequenceCache<T> other(1, 4);
    Tensor<T> y_filler({1, 1, 1});
    filler.step(x.batch(), other, y_filler.batch(), ws);
    EXPECT_EQ(shape_error_message([&] { layer.step(x.batch(), other, y.batch(), ws); }),
              std::string(V::tag) + " cache stream widths: expected " + widths + "], got [1, 1]");
    EXPECT_EQ(other.size(), 1);
    SequenceCache<T> fresh(1, 4);
    Tensor<T> wide({1, 1, D + 1}), y_wrong({1, 1, out + 1});
    wide.set_zero();
    EXPECT_THROW(layer.step(wide.batch(), fresh, y.batch(), ws), shape_error);
    EXPECT_THROW(layer.step(x.batch(), fresh, y_wrong.batch(), ws), shape_error);
    EXPECT_EQ(fresh.size(), 0);
  }
}

// truncate(n) rolls a cache back (rejected draft tokens): the positions
// stepped after it give what a cache that never saw the dropped ones gives.
// reserve() with another capacity starts over.
TYPED_TEST(Decoding, TruncateAndReserveRollBack) {
  DECODING_VARIANTS_ONLY() {
    const Index B = 2, T_ = 9, kept = 5;
    const auto p = TestFixture::first(B, T_, 38);
    const auto layer = p.layer();
    const Tensor<T> x = query_tensor<V>(p), draft = slice(query_tensor<V>(TestFixture::first(B, T_, 39)), 0, 3);
    const Tensor<T> want = decode(layer, x, {kWhole}).out;
    const Tolerance tol = V::template step_tolerance<T>();
    const Index out = layer.out_dim();
    SequenceCache<T> cache(B, T_ + 3);
    Workspace<T> ws;
    Tensor<T> y_kept({B, kept, out}), y_draft({B, 3, out}), y_rest({B, T_ - kept, out}), y_token({B, 1, out});
    layer.step(slice(x, 0, kept).batch(), cache, y_kept.batch(), ws);
    layer.step(draft.batch(), cache, y_draft.batch(), ws);
    EXPECT_THROW(cache.truncate(kept + 4), shape_error);
    EXPECT_THROW(cache.truncate(-1), shape_error);
    EXPECT_EQ(cache.size(), kept + 3);
    cache.truncate(kept);
    EXPECT_EQ(cache.size(), kept);
    layer.step(slice(x, kept, T_ - kept).batch(), cache, y_rest.batch(), ws);
    EXPECT_TRUE(all_close("after truncate", y_rest, widen(slice(want, kept, T_ - kept)), tol));
    cache.reserve(B, T_ + 5);
    EXPECT_EQ(cache.size(), 0);
    for (Index t = 0; t < T_; ++t) {
      layer.step(slice(x, t, 1).batch(), cache, y_token.batch(), ws);
      EXPECT_TRUE(all_close("after reserve", y_token, widen(slice(want, t, 1)), tol)) << "position " << t;
    }
  }
}

// Once a first step (one token, or a prompt of five) has sized the cache
// and the workspace, generating token by token until the cache is full
// allocates nothing and grows no workspace, on 1 and 2 threads (the
// persistent worker pool, whichever worker takes a task), in every cache
// precision the variant takes; and the threads agree bit for bit.
TYPED_TEST(Decoding, SizedStepsAllocateNothing) {
  DECODING_VARIANTS_ONLY() {
    std::vector<CachePrecision> precisions{CachePrecision::full};
    if (V::bf16_cache_refusal == nullptr) precisions.push_back(CachePrecision::bfloat16);
    for (const auto& s : V::decoding_allocation_shapes()) {
      auto p = TestFixture::make(s, 4);
      SCOPED_TRACE(p.describe());
      const Tensor<T> x = query_tensor<V>(p);
      const Index B = x.dim(0), T_ = x.dim(1);
      std::vector<Tensor<T>> tokens;  // sliced before the counting starts
      for (Index t = 0; t < T_; ++t) tokens.push_back(slice(x, t, 1));
      const Tensor<T> prompt = slice(x, 0, 5);
      for (CachePrecision precision : precisions)
        for (Index first : {1, 5}) {
          Tensor<T> last_of_one;
          for (int threads : {1, 2}) {
            V::set_threads(p, threads);
            const auto layer = p.layer();
            SequenceCache<T> cache(B, T_, precision);
            Workspace<T> ws;
            Tensor<T> y_first({B, first, layer.out_dim()}), y({B, 1, layer.out_dim()});
            layer.step((first == 1 ? tokens[0] : prompt).batch(), cache, y_first.batch(), ws);
            const std::size_t ws_bytes = ws.bytes();
            EXPECT_EQ(allocations_during([&] {
                        for (Index t = first; t < T_; ++t) layer.step(tokens[t].batch(), cache, y.batch(), ws);
                      }),
                      0)
                << threads << " threads, first step of " << first << ", bfloat16 " << (precision != CachePrecision::full);
            EXPECT_EQ(ws.bytes(), ws_bytes);
            EXPECT_EQ(cache.size(), T_);
            if (threads == 1) last_of_one = y;
            EXPECT_TRUE(same_values<V>("last token vs 1 thread", y, last_of_one)) << threads << " threads";
          }
        }
    }
  }
}

// The conformance folder's causal self-attention cases, decoded token by
// token and in chunks of 3 and 5 over 2-row query blocks: outputs and each
// step's weights equal the case's expected values to its own tolerance.
TYPED_TEST(Decoding, ConformanceCausalCasesDecodePositionByPosition) {
  DECODING_VARIANTS_ONLY() {
    const std::filesystem::path dir = std::filesystem::path(HEADMIX_CONFORMANCE_DIR) / V::decoding_conformance.folder;
    if (!std::filesystem::is_directory(dir)) HEADMIX_CONFORMANCE_MISSING() << dir << " is absent";
    const auto cases = causal_cases(dir);
    EXPECT_GE(cases.size(), V::decoding_conformance.count) << "causal self-attention cases under " << dir;
    for (const auto& path : cases) {
      SCOPED_TRACE(path.filename().string());
      const io::TensorFile f = io::load_safetensors(path.string());
      auto layer = V::template decoding_conformance_layer<T>(f);
      auto options = layer.options();
      options.block_rows = 2;
      layer.set_options(options);
      const Tensor<T> x = f.get<T>("input.query");
      const std::vector<double> want = widen(f.get<double>("expected.output"));
      const bool has_probs = f.contains("expected.probs");
      const std::vector<double> want_probs = has_probs ? widen(f.get<double>("expected.probs")) : std::vector<double>();
      const Tolerance tol = case_tolerance<T>(f);
      for (Index chunk : {1, 3, 5}) {
        const Decoded<T> d = decode(layer, x, {chunk});
        EXPECT_TRUE(all_close("output", d.out, want, tol)) << "chunks of " << chunk;
        if (has_probs) {
          EXPECT_TRUE(all_close("weights", d.probs, want_probs, tol)) << "chunks of " << chunk;
        }
      }
    }
  }
}

// options.bfloat16_weights rounds the projection weights once and lets a
// one-row step (B = 1, one token) stream them as bfloat16: steps of one
// token (the bfloat16 path) and of three (GEMMs over the rounded weights)
// agree with the forward of the same layer, on 1 and 2 threads with the
// same bits, and allocate nothing once sized; the rounding is visible
// against the layer without the option; turning the option off keeps the
// rounded weights (the same forward bits).
TYPED_TEST(Decoding, BfloatWeightsStepsMatchTheirForward) {
  DECODING_VARIANTS_ONLY() {
    auto p = TestFixture::first(1, 9, 45);
    SCOPED_TRACE(p.describe());
    const Tensor<T> x = query_tensor<V>(p);
    const Tolerance tol = V::template step_tolerance<T>();
    auto rounded = [](auto layer) {
      auto options = layer.options();
      options.bfloat16_weights = true;
      layer.set_options(options);
      return layer;
    };
    auto layer = rounded(p.layer());
    Workspace<T> ws;
    Tensor<T> full_probs;
    const Tensor<T> full = layer.forward(p.input(), ws, &full_probs);
    for (const std::vector<Index>& chunks : {std::vector<Index>{1}, {3}}) {
      const Decoded<T> d = decode(layer, x, chunks);
      EXPECT_TRUE(all_close("output", d.out, widen(full), tol)) << "chunks of " << chunks[0];
      EXPECT_TRUE(all_close("weights", d.probs, widen(full_probs), tol)) << "chunks of " << chunks[0];
    }
    V::set_threads(p, 2);
    const Decoded<T> two = decode(rounded(p.layer()), x, {1});
    EXPECT_TRUE(same_values<V>("2 threads", two.out, decode(layer, x, {1}).out));
    {  // once the first token has sized cache and workspace, the rest allocate nothing
      std::vector<Tensor<T>> tokens;
      for (Index t = 0; t < x.dim(1); ++t) tokens.push_back(slice(x, t, 1));
      SequenceCache<T> cache(1, x.dim(1));
      Workspace<T> sized;
      Tensor<T> y({1, 1, layer.out_dim()});
      layer.step(tokens[0].batch(), cache, y.batch(), sized);
      EXPECT_EQ(allocations_during([&] {
                  for (std::size_t t = 1; t < tokens.size(); ++t) layer.step(tokens[t].batch(), cache, y.batch(), sized);
                }),
                0);
    }

    const Tensor<T> plain = p.layer().forward(p.input(), ws);
    double moved = 0;
    for (Index i = 0; i < full.size(); ++i) moved = std::max(moved, std::abs(double(full[i]) - double(plain[i])));
    EXPECT_GT(moved, 1e-5) << "the rounding must be visible for this test to mean anything";
    auto options = layer.options();
    options.bfloat16_weights = false;
    layer.set_options(options);
    EXPECT_TRUE(same_values<V>("forward with the option off again", layer.forward(p.input(), ws), full));
  }
}

// A bfloat16 cache (K and V rounded to 8 significant bits, u = 2^-8) holds
// its K and V streams in half the bytes and the rest as a full cache does;
// its steps differ from the full cache's, by at most 8u of the output's
// scale (a regression bound: DCMHA's Compose weights depend on the query,
// so there is no closed bound as for MHA, tested below), and chunked steps
// on 2 threads agree with token-by-token ones. A variant whose steps read
// no bfloat16 refuses the cache by name.
TYPED_TEST(Decoding, HalfCacheHoldsKeysAndValuesInBfloat16OrIsRefused) {
  DECODING_VARIANTS_ONLY() {
    for (auto s : V::decoding_shapes()) {
      s.T = 14;
      auto p = TestFixture::make(s, 321);
      SCOPED_TRACE(p.describe());
      const auto layer = p.layer();
      const Tensor<T> x = query_tensor<V>(p);
      const Index B = x.dim(0), T_ = x.dim(1);
      Workspace<T> ws;
      Tensor<T> y({B, T_, layer.out_dim()});
      SequenceCache<T> full(B, 32), half(B, 32, CachePrecision::bfloat16);
      EXPECT_EQ(half.precision(), CachePrecision::bfloat16);
      if (V::bf16_cache_refusal != nullptr) {
        EXPECT_EQ(shape_error_message([&] { layer.step(x.batch(), half, y.batch(), ws); }), V::bf16_cache_refusal);
        EXPECT_EQ(half.size(), 0);
        continue;
      }
      layer.step(x.batch(), full, y.batch(), ws);
      layer.step(x.batch(), half, y.batch(), ws);
      // K (as K_hᵀ rows, each cache's padded to lines of what it stores, or a
      // grouped cache's panels) and
      // V in bfloat16; any other stream as it was or, DCMHA's key-side
      // factors, in bfloat16 as well (test_dcmha.cpp).
      const Index wk = full.stream(0).cols(), wv = full.stream(1).cols(), t = sizeof(T), h = sizeof(Eigen::bfloat16);
      EXPECT_EQ(Index(full.stream_bytes(0)) - Index(half.stream_bytes(0)),
                B * wk * (key_extent(full) * t - key_extent(half) * h));
      EXPECT_EQ(Index(full.stream_bytes(1)) - Index(half.stream_bytes(1)), B * 32 * wv * (t - h));
      ASSERT_EQ(half.streams(), full.streams());
      for (std::size_t s = 2; s < full.streams(); ++s) {
        if (half.is_half(s)) continue;
        EXPECT_EQ(half.stream_bytes(s), full.stream_bytes(s)) << "stream " << s;
      }
      const Decoded<T> exact = decode(layer, x, {1});
      const Decoded<T> rounded = decode(layer, x, {1}, 0, CachePrecision::bfloat16);
      V::set_threads(p, 2);
      const Decoded<T> chunked = decode(p.layer(), x, {3, 5}, 0, CachePrecision::bfloat16);
      double worst = 0, scale = 0;
      for (Index i = 0; i < exact.out.size(); ++i) {
        worst = std::max(worst, std::abs(double(rounded.out[i]) - double(exact.out[i])));
        scale = std::max(scale, std::abs(double(exact.out[i])));
      }
      EXPECT_GT(worst, 0.0) << "the bfloat16 cache changed nothing";
      EXPECT_LE(worst, 8.0 / 256 * scale);
      const double tol = (std::is_same_v<T, float> ? 1e-5 : 1e-12) * (1 + scale);
      EXPECT_TRUE(all_close("chunked on 2 threads", chunked.out, widen(rounded.out), Tolerance{0, tol}));
    }
  }
}

// ---------------------------------------------------------------------------
// MHA's own: the grouped-query cache layout (the bfloat16 cache and weights
// against naive loops and within their bound: test_half_precision.cpp)

// The cache keeps the KV heads only: streams of Hkv·Dk and Hkv·Dv, so
// 1/group of a standard MHA's memory. A cache bound to one grouping does
// not serve another, nor an MHA whose K lies in rows.
TEST(MhaDecoding, GroupedQueryCacheHoldsOnlyKvHeads) {
  const Index B = 2, cap = 6, D = 8, dk = 3, dv = 5;
  Workspace<double> ws;
  Tensor<double> y({B, 1, 7});
  SequenceCache<double> two_groups(B, cap);
  for (int kv_heads : {2, 1, 4}) {
    const auto p = gqa_problem<double>(kv_heads, B, 1, D, dk, dv, 7, 42);
    const headmix::Mha<double> layer = p.layer();
    const Tensor<double> x = query_tensor<variants::Mha>(p);
    SequenceCache<double> cache(B, cap);
    layer.step(x.batch(), cache, y.batch(), ws);
    EXPECT_EQ(cache.stream(0).cols(), kv_heads * dk) << kv_heads;
    EXPECT_EQ(cache.stream(1).cols(), kv_heads * dv) << kv_heads;
    // Grouped (fewer KV heads than the 4 query heads): K in panels, the
    // operand of the GEMM that scores a KV group's heads; else in rows.
    const bool panels = kv_heads < 4;
    EXPECT_EQ(cache.key_layout(), panels ? headmix::KeyLayout::panels : headmix::KeyLayout::rows) << kv_heads;
    // Head-major: head g of item b holds that head's keys (as K_gᵀ, one run
    // per dimension, or one panel of the first 64 positions) and values
    // (one run per position); head() reads rows as [capacity, dim]
    // (checked against x Wᵀ + b in loops).
    const auto& w = layer.weights();
    for (Index b = 0; b < B; ++b)
      for (Index g = 0; g < kv_heads; ++g) {
        const auto value = cache.head(1, b, g);
        // Position 0, dimension c: panel 0 is [dk, cap] row-major (cap < 64).
        auto key = [&](Index c) {
          return panels ? cache.stream_data(0)[(b * kv_heads + g) * dk * cap + c * cap] : cache.head(0, b, g)(0, c);
        };
        for (Index c = 0; c < dk + dv; ++c) {
          const auto& lin = c < dk ? w.k : w.v;
          const Index row = c < dk ? g * dk + c : g * dv + (c - dk);
          double expect = lin.has_bias() ? lin.bias(row) : 0.0;
          for (Index d = 0; d < D; ++d) expect += x[b * D + d] * lin.weight(row, d);
          EXPECT_NEAR(c < dk ? key(c) : value(0, c - dk), expect, 1e-12) << "item " << b << " head " << g << " col " << c;
        }
      }
    const Index values = B * kv_heads * (key_extent(cache) * dk + cap * dv);
    EXPECT_EQ(cache.stream(0).size() + cache.stream(1).size(), values) << kv_heads;
    EXPECT_EQ(cache.bytes(), static_cast<std::size_t>(values) * sizeof(double)) << kv_heads;
    if (kv_heads == 2) layer.step(x.batch(), two_groups, y.batch(), ws);
    if (kv_heads == 1) {
      EXPECT_THROW(layer.step(x.batch(), two_groups, y.batch(), ws), shape_error);
    }
  }
  // MHA of 2 heads stores streams of the same widths and heads, K in rows:
  // refused by the layout, where it would otherwise read panels as rows.
  const auto two_heads = gqa_problem<double>(2, B, 1, D, dk, dv, 7, 42, /*H=*/2);
  EXPECT_EQ(shape_error_message([&] {
              two_heads.layer().step(query_tensor<variants::Mha>(two_heads).batch(), two_groups, y.batch(), ws);
            }),
            "[mha] cache key layout: expected panels, got rows");
}

// A cache's K_hᵀ rows lie an odd number of lines of what it stores apart
// (detail::odd_line_stride): before, a capacity of 1280 floats put every
// fourth of a step's dk rows in one L1 set.
TEST(MhaDecoding, KeyRowsAreAnOddNumberOfStoredLinesApart) {
  const auto p = gqa_problem<float>(4, 1, 1, 8, 3, 5, 7, 42);  // one KV head per head: K in rows
  const headmix::Mha<float> layer = p.layer();
  const Tensor<float> x = query_tensor<variants::Mha>(p);
  Workspace<float> ws;
  Tensor<float> y({1, 1, 7});
  for (Index cap : {1, 6, 768, 1000, 1024, 1280, 8192})
    for (CachePrecision precision : {CachePrecision::full, CachePrecision::bfloat16}) {
      SequenceCache<float> cache(1, cap, precision);
      layer.step(x.batch(), cache, y.batch(), ws);
      const Index element = precision == CachePrecision::full ? 4 : 2, bytes = cache.transposed_stride() * element;
      EXPECT_GE(bytes, cap * element + 64) << cap;
      EXPECT_EQ(bytes % 64, 0) << cap;
      EXPECT_EQ(bytes / 64 % 2, 1) << cap << (precision == CachePrecision::full ? " float" : " bfloat16");
      EXPECT_EQ(cache.key_layout(), headmix::KeyLayout::rows);
    }
}

// A K stream in panels (KeyLayout::panels, CollabHead's) stores position p
// of row r at p0·dim + r·width + (p - p0), p0 = 64·⌊p / 64⌋, width the
// panel's (the last one narrower): Panels' layout of the [dim, capacity]
// keys, whatever chunks the positions arrive in. A layer asking for the
// other layout is refused by name.
TEST(SequenceCacheLayout, KeysInPanelsLieAsPanelsLayThemOut) {
  const Index B = 2, cap = 150, dim = 3;
  SequenceCache<double> cache(B, cap);
  cache.bind("test", {dim, 1}, {1, 1}, 2, 0, headmix::KeyLayout::panels);
  EXPECT_EQ(cache.key_layout(), headmix::KeyLayout::panels);
  auto key = [](Index b, Index p, Index r) { return double(1000 * b + 10 * p + r); };
  for (Index b = 0; b < B; ++b)
    for (auto [at, n] : {std::pair<Index, Index>{0, 60}, {60, 5}, {65, 1}, {66, 84}}) {  // across 64 and 128
      headmix::Matrix<double> rows(n, dim);
      for (Index i = 0; i < n; ++i)
        for (Index r = 0; r < dim; ++r) rows(i, r) = key(b, at + i, r);
      cache.write(0, b, at, rows);
    }
  EXPECT_EQ(cache.stream(0).size(), B * cap * dim);
  for (Index b = 0; b < B; ++b) {
    const double* stored = cache.stream_data(0) + b * dim * cap;
    for (Index p = 0; p < cap; ++p)
      for (Index r = 0; r < dim; ++r) {
        const Index p0 = p / 64 * 64, width = std::min<Index>(64, cap - p0);
        ASSERT_EQ(stored[p0 * dim + r * width + (p - p0)], key(b, p, r)) << "item " << b << " position " << p;
      }
    headmix::Matrix<double> keys_t(dim, cap), laid_out(dim, cap);
    for (Index p = 0; p < cap; ++p)
      for (Index r = 0; r < dim; ++r) keys_t(r, p) = key(b, p, r);
    headmix::Panels<double>::write(keys_t, laid_out.data());
    EXPECT_TRUE(std::equal(stored, stored + dim * cap, laid_out.data())) << "item " << b;
  }
  EXPECT_EQ(shape_error_message([&] { cache.bind("test", {dim, 1}, {1, 1}, 2, 0); }),
            "[test] cache key layout: expected panels, got rows");
}

// ---------------------------------------------------------------------------
// The allocation check's plumbing

// A forward call on a sized Workspace allocates nothing either (without
// exported weights, whose Tensor the call resizes), over several key blocks
// and query blocks, causal with padding, on 1 and 2 threads.
TEST(AllocationCheck, SizedForwardAllocatesNothing) {
  mha_case::Shape s;
  s.B = 2, s.T = 150, s.D = 32, s.H = 4, s.Dk = 8, s.Dv = 8, s.out = 32, s.causal = true;
  s.key_block = 32, s.block_rows = 16;
  auto p = mha_case::make_problem<float>(s, 5);
  p.padding.assign(static_cast<std::size_t>(s.B * s.T), 0);
  for (std::size_t j = 0; j < p.padding.size(); j += 7) p.padding[j] = 1;
  Tensor<float> y({s.B, s.T, s.out});
  for (int threads : {1, 2}) {
    p.s.threads = threads;
    const headmix::Mha<float> layer = p.layer();
    const AttentionInput<float> in = p.input();
    Workspace<float> ws;
    layer.forward(in, y.batch(), ws);  // sizes the workspace (and starts the workers)
    EXPECT_EQ(allocations_during([&] {
                for (int t = 0; t < 3; ++t) layer.forward(in, y.batch(), ws);
              }),
              0)
        << threads << " threads";
  }
}

// ... for every variant: on 2 threads, whichever worker takes a task finds
// its scratch sized.
template <class V>
class SizedForward : public ::testing::Test {};
TYPED_TEST_SUITE(SizedForward, variants::AllVariants, variants::VariantName);

TYPED_TEST(SizedForward, AllocatesNothingOnOneAndTwoThreads) {
  using V = TypeParam;
  for (const auto& s : V::thread_shapes()) {
    auto p = V::template make<float>(s, 5);
    for (int threads : {1, 2}) {
      V::set_threads(p, threads);
      const auto layer = p.layer();
      const AttentionInput<float> in = p.input();
      Tensor<float> y(p.out_shape());
      Workspace<float> ws;
      layer.forward(in, y.batch(), ws);
      EXPECT_EQ(allocations_during([&] {
                  for (int t = 0; t < 3; ++t) layer.forward(in, y.batch(), ws);
                }),
                0)
          << threads << " threads, " << p.describe();
    }
  }
}

// The allocation check itself works, in this build type: an Eigen matrix
// (std::malloc, seen through EIGEN_RUNTIME_NO_MALLOC) and a std::vector
// (operator new) made inside the window are both counted.
TEST(AllocationCheck, SeesEigenAndOperatorNew) {
  static const void* volatile escape;  // the buffers escape, so that no allocation can be elided
  EXPECT_GT(allocations_during([] {
              Matrix<float> fresh(64, 64);
              escape = fresh.data();
            }),
            0);
  EXPECT_GT(allocations_during([] {
              std::vector<int> fresh(100);
              escape = fresh.data();
            }),
            0);
  EXPECT_EQ(allocations_during([] {}), 0);
  EXPECT_NE(escape, nullptr);
}

}  // namespace
