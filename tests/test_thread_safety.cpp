// One layer object, many threads: a layer is immutable after construction
// (its const methods only read it), and all scratch lives in the caller's
// Workspace (and decoding cache). So several std::threads may call one
// layer at once, each with its own Workspace, and must get exactly the
// results of serial use: bit for bit, for every variant, with the layer's
// own threads option at 1 and 2 (its workers then run inside each caller
// thread).
//
// Every caller thread runs every call of a variant several times, in an
// order of its own, reusing its one Workspace across the calls (so buffers
// grow and are reused under contention), and compares each result with the
// serial one. A variant's thread_safety_shapes() (tests/variants.hpp) are
// its setups; each setup's layer (and, for LSH, its seeded twin) serves
// calls that differ in batch, length and padding, with and without the
// attention weights, plus buckets() where the variant has it and decoding
// steps (each thread with its own cache) for the self-attention setups of
// the variants that decode.
//
// Run under ThreadSanitizer with `cmake --workflow --preset tsan` (that
// preset's ctest runs only the tests whose names contain "ThreadSafety").

#include "variants.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;

constexpr int kCallers = 4;  // concurrent caller threads
constexpr int kRounds = 3;   // times each caller runs every call

// A call on a layer with a given workspace; returns everything it produced
// (output, and weights or buckets where the call has them) as one tensor.
template <class T>
using Call = std::function<Tensor<T>(headmix::Workspace<T>&)>;

bool same_bits(const void* a, const void* b, std::size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

// The test proper: serial results first (fresh workspace per call), then
// kCallers threads released together, each with its own workspace.
template <class T>
void expect_concurrent_equals_serial(const std::string& name, const std::vector<Call<T>>& calls) {
  const std::size_t n = calls.size();
  std::vector<Tensor<T>> serial;
  for (const auto& call : calls) {
    headmix::Workspace<T> ws;
    serial.push_back(call(ws));
  }
  // Serial use is itself repeatable (a sanity check of the comparison).
  {
    headmix::Workspace<T> ws;
    for (std::size_t k = 0; k < n; ++k) {
      const Tensor<T> again = calls[k](ws);
      ASSERT_EQ(again.shape(), serial[k].shape()) << name;
      ASSERT_TRUE(same_bits(again.data(), serial[k].data(), sizeof(T) * static_cast<std::size_t>(again.size())))
          << name << ": serial call " << k << " is not repeatable";
    }
  }

  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::string> errors(kCallers);
  std::vector<int> checked(kCallers, 0);
  std::vector<std::thread> callers;
  for (int t = 0; t < kCallers; ++t)
    callers.emplace_back([&, t] {
      headmix::Workspace<T> ws;  // this caller's own scratch, reused for every call
      ++ready;
      while (!go.load()) std::this_thread::yield();
      try {
        for (int r = 0; r < kRounds; ++r)
          for (std::size_t j = 0; j < n; ++j) {
            const std::size_t k = (j + static_cast<std::size_t>(t + r)) % n;  // each caller its own order
            const Tensor<T> got = calls[k](ws);
            ++checked[static_cast<std::size_t>(t)];
            if (got.shape() != serial[k].shape() ||
                !same_bits(got.data(), serial[k].data(), sizeof(T) * static_cast<std::size_t>(got.size()))) {
              std::ostringstream e;
              e << "caller " << t << " round " << r << " call " << k << " differs from serial use";
              errors[static_cast<std::size_t>(t)] = e.str();
              return;
            }
          }
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(t)] = std::string("threw ") + e.what();
      }
    });
  while (ready.load() < kCallers) std::this_thread::yield();
  go = true;
  for (auto& th : callers) th.join();
  for (std::size_t t = 0; t < kCallers; ++t) {
    EXPECT_TRUE(errors[t].empty()) << name << ": " << errors[t];
    if (errors[t].empty()) {
      EXPECT_EQ(checked[t], kRounds * static_cast<int>(n)) << name;  // every call was compared
    }
  }
}

// Output and, when given, weights of a forward, as one tensor.
template <class T, class Layer>
Tensor<T> forward(const Layer& layer, const headmix::AttentionInput<T>& in, bool with_probs,
                  headmix::Workspace<T>& ws) {
  Tensor<T> probs;
  const Tensor<T> y = layer.forward(in, ws, with_probs ? &probs : nullptr);
  Tensor<T> t({y.size() + probs.size()});
  std::copy_n(y.data(), y.size(), t.data());
  std::copy_n(probs.data(), probs.size(), t.data() + y.size());
  return t;
}

// Decoding: the queries of `in` fed to layer.step in chunks of 1, 2, 3, ...
// positions, on a cache of the caller's; the outputs concatenated in order.
template <class T, class Layer>
Tensor<T> decode_all(const Layer& layer, const headmix::AttentionInput<T>& in, headmix::Workspace<T>& ws) {
  const Index B = in.query.batch(), L = in.query.length(), D = in.query.width(), out_dim = layer.out_dim();
  const auto x = Eigen::Map<const Matrix<T>>(in.query.data(), B * L, D);
  headmix::SequenceCache<T> cache(B, L);
  Tensor<T> all({B * L * out_dim});
  Index t0 = 0, pos = 0;
  for (Index n = 1; t0 < L; ++n) {
    n = std::min(n, L - t0);
    Matrix<T> chunk(B * n, D);
    for (Index b = 0; b < B; ++b) chunk.middleRows(b * n, n) = x.middleRows(b * L + t0, n);
    Tensor<T> y({B, n, out_dim});
    layer.step({chunk.data(), B, n, D}, cache, y.batch(), ws);
    std::copy_n(y.data(), y.size(), all.data() + pos);
    pos += y.size();
    t0 += n;
  }
  return all;
}

// Every setup of variant V, on 1 and 2 threads of its own.
template <class V, class T>
void expect_shared_layers_give_serial_results() {
  using Problem = typename V::template Problem<T>;
  using Layer = typename V::template Layer<T>;
  bool decoded = false;
  unsigned seed = 1;
  for (const auto& setup : V::thread_safety_shapes())
    for (int threads : {1, 2}) {
      // Three calls of different sizes, so that a reused workspace grows
      // and shrinks; the middle one padded. Only their inputs are used.
      const std::vector<Problem> problems{V::template make<T>(setup, seed),
                                          V::template make<T>(V::thread_safety_resized(setup, 3, 20, 0.3), seed + 1),
                                          V::template make<T>(V::thread_safety_resized(setup, 1, 53, 0), seed + 2)};
      seed += 3;
      std::vector<headmix::AttentionInput<T>> inputs;
      for (const auto& p : problems) inputs.push_back(p.input());
      ASSERT_FALSE(inputs[1].key_padding.empty()) << "the middle call is padded";
      std::vector<Layer> layers;  // the setup's layer (and LSH's seeded twin), shared by every call
      for (auto q : V::thread_variations(problems[0])) {
        V::set_threads(q, threads);
        layers.push_back(q.layer());
      }

      std::vector<Call<T>> calls;
      for (const Layer& shared : layers)
        for (const auto& in : inputs) {
          const Layer* layer = &shared;
          for (bool with_probs : {true, false})
            calls.push_back([=](headmix::Workspace<T>& ws) { return forward(*layer, in, with_probs, ws); });
          if constexpr (V::has_buckets)
            calls.push_back([=](headmix::Workspace<T>& ws) {
              const Tensor<std::int64_t> b = layer->buckets(in, ws);
              Tensor<T> t({b.size()});
              for (Index i = 0; i < b.size(); ++i) t[i] = static_cast<T>(b[i]);
              return t;
            });
          if constexpr (V::decodes)
            if (in.self_attention() && in.key_padding.empty()) {  // step() takes no padding
              decoded = true;
              calls.push_back([=](headmix::Workspace<T>& ws) { return decode_all(*layer, in, ws); });
            }
        }
      expect_concurrent_equals_serial<T>(problems[0].describe() + " threads=" + std::to_string(threads), calls);
    }
  if constexpr (V::decodes) {
    EXPECT_TRUE(decoded) << "a decoding variant needs a self-attention setup in thread_safety_shapes()";
  }
}

template <class Param>
class ThreadSafety : public ::testing::Test {};
TYPED_TEST_SUITE(ThreadSafety, AllVariantsInBothScalars, VariantInName);

TYPED_TEST(ThreadSafety, SharedLayersGiveSerialResults) {
  expect_shared_layers_give_serial_results<typename TypeParam::Variant, typename TypeParam::Scalar>();
}

}  // namespace
