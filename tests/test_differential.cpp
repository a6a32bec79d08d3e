// Differential fuzzing: random configurations of every variant (shapes,
// options, masks, block sizes, thread counts, decoding chunkings) against
// that variant's naive double reference in tests/reference/, as typed
// tests over the variant list in tests/variants.hpp: each entry's
// differential_case<T>(d) draws a configuration (its problem, built by the
// entry's make<T>), and this file runs every one alike.
//
// Ordinary ctest runs kDefaultConfigs configurations per variant and scalar
// type (small shapes, a few seconds in all). For a longer run, set
//   HEADMIX_DIFF_ITERATIONS=N   configurations per variant and type
//   HEADMIX_DIFF_SEED=S         first seed (default 1); configuration i uses S + i
// e.g. HEADMIX_DIFF_ITERATIONS=20000 build/rel/tests/test_differential.
// A failure prints the configuration and its seed; rerun it with
// HEADMIX_DIFF_SEED=<seed> HEADMIX_DIFF_ITERATIONS=1.
// Every test prints "[differential] <variant><type>: N configurations ..."
// and records the count as the gtest property "configurations".
//
// The per-variant suites (test_<variant>.cpp) already cover hand-picked
// cases and ~80 random shapes each; this file draws from wider ranges
// (longer rows so that query blocks and LSH chunks repeat, up to 4 threads,
// every option at once) and also drives the decoding entry point step() of
// the variants that decode with random chunkings against the full causal
// reference.
// One configuration in four whose threads can split it is also rerun, cut
// into at least two tasks, on those threads and on one, and the two runs
// must match bit for bit, weights included (thread_rerun).
//
// Inputs and weights are drawn in T and handed to the reference widened to
// double, so a comparison measures only the layer's own arithmetic.
// Tolerance: each entry's reference_tolerance<T>(), element-wise
// |got - want| <= atol + rtol·|want|, the bounds the per-variant suites
// derive for the same kind of values:
//   MHA, Talking-Heads, CollabHead, LSH: double 1e-10 / 1e-12, float 2e-4 / 2e-5
//   DCMHA: double 1e-10 / 1e-11, float 5e-4 / 1e-4 (the dynamic-weight MLP and
//   two compositions lengthen the chain; see test_dcmha.cpp)
// The dense variants' inputs are drawn with magnitude up to 1, or 3 in one
// configuration in three (logits up to ~10x larger); the float bounds hold
// because softmax passes a logit's relative error on to a weight at most
// twice over and float's unit roundoff times the largest logit (~20) stays
// below 2e-5.

#include "variants.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;

constexpr int kDefaultConfigs = 200;

int configs_per_variant() {
  if (const char* env = std::getenv("HEADMIX_DIFF_ITERATIONS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n > 0) return static_cast<int>(n);
  }
  return kDefaultConfigs;
}
unsigned long long first_seed() {
  if (const char* env = std::getenv("HEADMIX_DIFF_SEED")) return std::strtoull(env, nullptr, 10);
  return 1;
}

// ---------------------------------------------------------------------------
// Comparing

// One configuration's verdict, with its description for the failure message.
struct Outcome {
  ::testing::AssertionResult ok = ::testing::AssertionSuccess();
  std::string config;
  std::string kind = "forward";  // or "decode"
  bool rerun = false;            // also rerun on one thread (thread_rerun)
};

#define DIFF_CHECK(outcome, expr)          \
  do {                                     \
    auto r_ = (expr);                      \
    if (!r_) {                             \
      (outcome).ok = r_;                   \
      return outcome;                      \
    }                                      \
  } while (0)

// Positions [0, T) cut into random chunks of 1..4, for decoding.
std::vector<int> chunking(Draw& d, int T) {
  std::vector<int> sizes;
  for (int t = 0; t < T;) {
    const int n = std::min(T - t, d.integer(1, 4));
    sizes.push_back(n);
    t += n;
  }
  return sizes;
}
// Rows [t0, t0 + n) of every batch item of x [B·T, D], as [B·n, D].
template <class T>
Matrix<T> chunk_rows(const Matrix<T>& x, int B, int T_, int t0, int n) {
  Matrix<T> c(B * n, x.cols());
  for (int b = 0; b < B; ++b) c.middleRows(b * n, n) = x.middleRows(b * T_ + t0, n);
  return c;
}

// Decode rows [0, T) of every batch item of p's queries with step() over
// random chunks and compare each chunk's output and weights with `want`,
// the reference's causal (offset 0) forward over all T positions.
template <class V, class T, class P, class Want>
::testing::AssertionResult check_steps(Draw& d, const P& p, bool want_probs, const Want& want, const Tolerance& tol) {
  const Dims dims = V::dims(p);
  const int B = static_cast<int>(dims.B), T_ = static_cast<int>(dims.T), out_dim = static_cast<int>(dims.out);
  const Matrix<T>& x = V::query(p);
  const auto layer = p.layer();
  headmix::SequenceCache<T> cache(B, T_ + d.integer(0, 3));
  headmix::Workspace<T> ws;
  int t0 = 0;
  for (int n : chunking(d, T_)) {
    const Matrix<T> xc = chunk_rows(x, B, T_, t0, n);
    Tensor<T> y({B, n, out_dim}), probs;
    layer.step({xc.data(), B, n, x.cols()}, cache, y.batch(), ws, want_probs ? &probs : nullptr);
    const auto out_at = [&](std::size_t i) {
      const std::size_t b = i / (n * out_dim), r = i % (n * out_dim);
      return (b * T_ + t0) * out_dim + r;
    };
    auto ok = all_close_at("step output", y.data(), static_cast<std::size_t>(y.size()),
                           static_cast<std::size_t>(B) * n * out_dim, want.output, tol, out_at);
    if (!ok) return ok;
    if (want_probs) {
      const int keys = t0 + n;
      const auto prob_at = [&](std::size_t i) {  // probs [B, H, n, keys] within [B, H, T, T]
        const std::size_t j = i % keys, row = i / keys, q = row % n, bh = row / n;
        return (bh * T_ + t0 + q) * T_ + j;
      };
      const std::size_t heads = want.probs.size() / (static_cast<std::size_t>(B) * T_ * T_);
      ok = all_close_at("step probs", probs.data(), static_cast<std::size_t>(probs.size()),
                        static_cast<std::size_t>(B) * heads * n * keys, want.probs, tol, prob_at);
      if (!ok) return ok;
    }
    t0 += n;
  }
  return ::testing::AssertionSuccess();
}

// One configuration in four that its threads can split is rerun: the
// forward on its threads and on one thread must agree bit for bit, outputs
// and (when asked) weights. The rerun is cut into at least two tasks
// (V::split_tasks), so that the workers really split it: the dense pipeline
// makes B·ceil(T / block_rows) (batch item, query block) tasks, so with one
// batch item the blocks are halved; LSH makes B·H (batch item, head) tasks.
template <class V, class T, class P>
::testing::AssertionResult thread_rerun(Draw& d, Outcome& oc, P p, bool want_probs) {
  if (!V::split_tasks(p) || !d.coin(0.25)) return ::testing::AssertionSuccess();
  oc.rerun = true;
  headmix::Workspace<T> ws;
  Tensor<T> probs_n, probs_1;  // LSH keeps its tiles elsewhere with probs: ask both runs alike
  const Tensor<T> y_n = p.layer().forward(p.input(), ws, want_probs ? &probs_n : nullptr);
  V::set_threads(p, 1);
  const Tensor<T> y_1 = p.layer().forward(p.input(), ws, want_probs ? &probs_1 : nullptr);
  auto ok = bit_identical("output on 1 thread", y_1, y_n);
  if (ok && want_probs) ok = bit_identical("probs on 1 thread", probs_1, probs_n);
  return ok;
}

// One configuration of V drawn from `seed`: a forward against the
// reference's output (and weights when drawn), then the thread-count
// rerun; or, where the entry draws decoding, step() against the causal forward.
template <class V, class T>
Outcome configuration(unsigned long long seed) {
  Draw d(seed);
  auto c = V::template differential_case<T>(d);
  auto& p = c.p;
  if (c.pad_first_item) std::fill(p.padding.begin(), p.padding.begin() + p.padding.size() / V::dims(p).B, 1);
  const bool want_probs = d.coin();
  Outcome oc;
  oc.config = p.describe() + c.note + (c.pad_first_item ? " item0_padded" : "") + (want_probs ? " probs" : "");
  const Tolerance tol = V::template reference_tolerance<T>();
  if constexpr (V::decodes) {
    if (c.decode) {
      oc.kind = "decode";
      DIFF_CHECK(oc, (check_steps<V, T>(d, p, want_probs, V::decoded_form(p).reference(), tol)));
      return oc;
    }
  }
  const auto want = p.reference();
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = p.layer().forward(p.input(), ws, want_probs ? &probs : nullptr);
  DIFF_CHECK(oc, all_close("output", y, want.output, tol));
  if (want_probs) DIFF_CHECK(oc, all_close("probs", probs, want.probs, tol));
  DIFF_CHECK(oc, (thread_rerun<V, T>(d, oc, p, want_probs)));
  return oc;
}

// ---------------------------------------------------------------------------
// The driver

// Runs the configured number of configurations of one variant and scalar
// type; stops after five failures. Seeds differ per variant (a salt from
// its name, FNV-1a) so that variants do not share their draws.
template <class Param>
class Differential : public ::testing::Test {};
TYPED_TEST_SUITE(Differential, AllVariantsInBothScalars, VariantInName);

TYPED_TEST(Differential, RandomConfigurations) {
  using V = typename TypeParam::Variant;
  using T = typename TypeParam::Scalar;
  const std::string variant = std::string(V::name) + (std::is_same_v<T, float> ? "<float>" : "<double>");
  unsigned long long salt = 14695981039346656037ull;
  for (const char* c = V::name; *c; ++c) salt = (salt ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  const int n = configs_per_variant();
  const unsigned long long base = first_seed();
  int ran = 0, failed = 0, decoded = 0, reruns = 0;
  for (int i = 0; i < n && failed < 5; ++i, ++ran) {
    const unsigned long long seed = base + static_cast<unsigned long long>(i);
    Outcome oc;
    try {
      oc = configuration<V, T>(seed ^ (salt << 40));
    } catch (const std::exception& e) {
      oc.ok = ::testing::AssertionFailure() << "threw " << e.what();
    }
    decoded += oc.kind == "decode";
    reruns += oc.rerun;
    if (!oc.ok) {
      ++failed;
      ADD_FAILURE() << variant << " configuration " << i << ", HEADMIX_DIFF_SEED=" << seed << " (" << oc.kind
                    << "): " << oc.ok.message() << "\n  " << oc.config;
    }
  }
  ::testing::Test::RecordProperty("configurations", ran);
  std::cout << "[differential] " << variant << ": " << ran << " configurations (" << decoded
            << " of them decoding, " << reruns << " rerun on one thread), " << failed << " failed, seeds " << base
            << ".." << base + ran - 1 << std::endl;
}

}  // namespace
