// Differential fuzzing: random configurations of every variant (shapes,
// options, masks, block sizes, thread counts, decoding chunkings) against
// that variant's naive double reference in tests/reference/.
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
// every option at once) and also drives the decoding entry points (step() of
// MHA, Talking-Heads, CollabHead and DCMHA) with random chunkings against the
// full causal reference.
// One configuration in four with threads > 1 is also rerun, split into at
// least two tasks, on those threads and on one, and the two runs must match
// bit for bit, weights included (thread_rerun).
//
// Inputs and weights are drawn in T and handed to the reference widened to
// double, so a comparison measures only the layer's own arithmetic.
// Tolerance, element-wise |got - want| <= atol + rtol·|want|, the bounds the
// per-variant suites derive for the same kind of values:
//   MHA, Talking-Heads, CollabHead, LSH: double 1e-10 / 1e-12, float 2e-4 / 2e-5
//   DCMHA: double 1e-10 / 1e-11, float 5e-4 / 1e-4 (the dynamic-weight MLP and
//   two compositions lengthen the chain; see test_dcmha.cpp)
// Inputs are drawn with magnitude up to 1, or 3 in one configuration in
// three (logits up to ~10x larger); the float bounds hold because softmax
// passes a logit's relative error on to a weight at most twice over and
// float's unit roundoff times the largest logit (~20) stays below 2e-5.

#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "cases/ref_adapters.hpp"
#include "reference/collab_reference.hpp"
#include "reference/dcmha_reference.hpp"
#include "reference/lsh_reference.hpp"
#include "reference/mha_reference.hpp"
#include "reference/talking_heads_reference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;

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
// Drawing

struct Draw {
  std::mt19937_64 rng;
  explicit Draw(unsigned long long seed) : rng(seed) {}
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
  bool coin(double p = 0.5) { return real(0, 1) < p; }
  template <class V>
  V pick(std::initializer_list<V> options) {
    return options.begin()[integer(0, static_cast<int>(options.size()) - 1)];
  }
};

std::vector<std::uint8_t> padding(Draw& d, int B, int S, int mode) {
  std::vector<std::uint8_t> p;
  if (mode == 0) return p;  // none
  p.resize(static_cast<std::size_t>(B) * S);
  for (auto& m : p) m = d.coin(mode == 1 ? 0.3 : 0.7) ? 1 : 0;
  if (mode == 2) std::fill(p.begin(), p.begin() + S, 1);  // item 0 fully padded
  return p;
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

// Decode rows [0, T) of every batch item of x [B·T, D] with layer.step()
// over random chunks and compare each chunk's output and weights with
// `want`, the reference's causal (offset 0) forward over all T positions.
template <class T, class Layer, class Want>
::testing::AssertionResult check_steps(Draw& d, const Layer& layer, const Matrix<T>& x, int B, int T_, int out_dim,
                                       bool want_probs, const Want& want, const Tolerance& tol) {
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

// One configuration in four with threads > 1 is rerun: the forward on
// o.threads and on one thread must agree bit for bit, outputs and (when
// asked) weights. The rerun is cut into at least two tasks, so that the
// workers really split it: the dense pipeline makes B·ceil(T / block_rows)
// (batch item, query block) tasks, so with one batch item the blocks are
// halved; LSH makes B·H (batch item, head) tasks. B = T = 1 (LSH: B = H = 1)
// has one task whatever the options, and is not rerun.
template <class Layer, class W, class O, class T>
::testing::AssertionResult thread_rerun(Draw& d, Outcome& oc, const W& w, O o, const headmix::AttentionInput<T>& in,
                                        bool want_probs, Index heads) {
  if (o.threads < 2 || !d.coin(0.25)) return ::testing::AssertionSuccess();
  const Index B = in.query.batch(), T_ = in.query.length();
  if constexpr (std::is_same_v<Layer, headmix::Lsh<T>>) {
    if (B * heads < 2) return ::testing::AssertionSuccess();
  } else {
    if (B * T_ < 2) return ::testing::AssertionSuccess();
    // 0 is DCMHA's automatic size, >= 16 rows: at least T here, so one block.
    // Halving gives ceil(T / ceil(T/2)) >= 2 blocks.
    const Index rows = o.block_rows > 0 ? o.block_rows : T_;
    if (B == 1 && rows >= T_) o.block_rows = (T_ + 1) / 2;
  }
  oc.rerun = true;
  headmix::Workspace<T> ws;
  Tensor<T> probs_n, probs_1;  // LSH keeps its tiles elsewhere with probs: ask both runs alike
  const Tensor<T> y_n = Layer(w, o).forward(in, ws, want_probs ? &probs_n : nullptr);
  o.threads = 1;
  const Tensor<T> y_1 = Layer(w, o).forward(in, ws, want_probs ? &probs_1 : nullptr);
  auto ok = bit_identical("output on 1 thread", y_1, y_n);
  if (ok && want_probs) ok = bit_identical("probs on 1 thread", probs_1, probs_n);
  return ok;
}

// The dense layers' input: queries, keys when cross-attending, padding when drawn.
template <class T>
headmix::AttentionInput<T> cross_input(const Matrix<T>& xq, const Matrix<T>& xk, bool cross,
                                       const std::vector<std::uint8_t>& pad, Index B, Index T_, Index S, Index D,
                                       Index Dkv) {
  headmix::AttentionInput<T> in;
  in.query = {xq.data(), B, T_, D};
  if (cross) in.key = {xk.data(), B, S, Dkv};
  if (!pad.empty()) in.key_padding = {pad.data(), B, S};
  return in;
}

// One forward of Layer(w, o) on `in` against the reference's output (and
// weights when drawn), then the thread-count rerun.
template <class Layer, class W, class O, class T, class Want>
::testing::AssertionResult forward_matches(Draw& d, Outcome& oc, const W& w, const O& o,
                                           const headmix::AttentionInput<T>& in, bool want_probs, const Want& want,
                                           Index heads, Tolerance tol) {
  const Layer layer(w, o);
  headmix::Workspace<T> ws;
  Tensor<T> probs;
  const Tensor<T> y = layer.forward(in, ws, want_probs ? &probs : nullptr);
  auto out_ok = all_close("output", y, want.output, tol);
  if (!out_ok) return out_ok;
  if (want_probs) {
    auto probs_ok = all_close("probs", probs, want.probs, tol);
    if (!probs_ok) return probs_ok;
  }
  return thread_rerun<Layer>(d, oc, w, o, in, want_probs, heads);
}

// ---------------------------------------------------------------------------
// MHA

template <class T>
Outcome mha_config(unsigned long long seed) {
  Draw d(seed);
  Outcome oc;
  const int B = d.integer(1, 3), T_ = d.integer(1, 24), H = d.integer(1, 4), Dk = d.integer(1, 6), Dv = d.integer(1, 6);
  const bool cross = d.coin();
  const int S = cross ? d.integer(1, 24) : T_, D = d.integer(1, 12), Dkv = cross ? d.integer(1, 12) : D;
  const bool bias = d.coin(), out_proj = d.coin(0.75);
  const int out = d.integer(1, 12);
  headmix::MhaOptions o;
  o.num_heads = H;
  o.causal = d.coin();
  if (o.causal) o.causal_offset = d.pick<Index>({d.integer(-4, 4), d.integer(-4, 4), S - T_, -(T_ + 2), S + 3});
  if (d.coin(0.25)) o.scale = d.real(0.05, 1.5);
  o.block_rows = d.pick<Index>({1, 2, 3, 64, d.integer(1, T_ + 2)});
  o.threads = d.integer(1, 4);
  const double in_scale = d.pick({1.0, 1.0, 3.0});
  const bool decode = !cross && d.coin(0.25);
  const int pad_mode = decode ? 0 : d.pick({0, 0, 1, 2});
  const bool want_probs = d.coin();

  headmix::MhaWeights<T> w{random_linear<T>(d.rng, H * Dk, D, bias), random_linear<T>(d.rng, H * Dk, Dkv, bias),
                           random_linear<T>(d.rng, H * Dv, Dkv, bias), {}};
  if (out_proj) w.o = random_linear<T>(d.rng, out, H * Dv, bias);
  const Matrix<T> xq = random_matrix<T>(d.rng, B * T_, D, in_scale), xk = random_matrix<T>(d.rng, B * S, Dkv, in_scale);
  const std::vector<std::uint8_t> pad = padding(d, B, S, pad_mode);
  const int out_dim = out_proj ? out : H * Dv;

  std::ostringstream desc;
  desc << "B=" << B << " T=" << T_ << " S=" << S << " D=" << D << " Dkv=" << Dkv << " H=" << H << " Dk=" << Dk
       << " Dv=" << Dv << " out=" << (out_proj ? std::to_string(out) : "none") << " bias=" << bias
       << " causal=" << o.causal << " offset=" << o.causal_offset << " scale=" << o.scale.value_or(0)
       << " block_rows=" << o.block_rows << " threads=" << o.threads << " pad_mode=" << pad_mode
       << " in_scale=" << in_scale << (decode ? " decode" : "");
  oc.config = desc.str();

  headmix_ref::RefMhaOptions ro;
  ro.num_heads = H, ro.causal = o.causal, ro.causal_offset = static_cast<long>(o.causal_offset);
  ro.scale = o.scale.value_or(0);
  const headmix_ref::RefMhaWeights rw{ref_linear(w.q), ref_linear(w.k), ref_linear(w.v), ref_linear(w.o)};
  const headmix::Mha<T> layer(w, o);

  if (decode) {  // Mha::step over random chunks equals the causal (offset 0) forward
    oc.kind = "decode";
    ro.causal = true, ro.causal_offset = 0;
    const auto want = headmix_ref::mha_reference(rw, ro, ref_batch(xq, B));
    DIFF_CHECK(oc, check_steps(d, layer, xq, B, T_, out_dim, want_probs, want, default_tolerance<T>()));
    return oc;
  }

  const auto in = cross_input(xq, xk, cross, pad, B, T_, S, D, Dkv);
  const auto kb = ref_batch(xk, B);
  const auto want = headmix_ref::mha_reference(rw, ro, ref_batch(xq, B), cross ? &kb : nullptr, pad);
  DIFF_CHECK(oc, forward_matches<headmix::Mha<T>>(d, oc, w, o, in, want_probs, want, H, default_tolerance<T>()));
  return oc;
}

// ---------------------------------------------------------------------------
// Talking-Heads

template <class T>
headmix_ref::RefMix ref_mix(const Matrix<T>& m) {
  headmix_ref::RefMix r;
  if (m.size() == 0) return r;
  r.rows = static_cast<int>(m.rows()), r.cols = static_cast<int>(m.cols()), r.w = widen(m);
  return r;
}

template <class T>
Outcome talking_heads_config(unsigned long long seed) {
  Draw d(seed);
  Outcome oc;
  const int B = d.integer(1, 3), T_ = d.integer(1, 24), hk = d.integer(1, 4), h = d.integer(1, 4),
            hv = d.integer(1, 4), Dk = d.integer(1, 6), Dv = d.integer(1, 6);
  const bool cross = d.coin();
  const int S = cross ? d.integer(1, 24) : T_, D = d.integer(1, 12), Dkv = cross ? d.integer(1, 12) : D;
  const bool bias = d.coin(), out_proj = d.coin(0.75);
  const int out = d.integer(1, 12);
  const bool pre = hk != h || d.coin(0.7), post = h != hv || d.coin(0.7);
  headmix::TalkingHeadsOptions o;
  o.num_heads = h;
  o.key_heads = hk == h && d.coin() ? 0 : hk;  // 0: follow num_heads
  o.value_heads = hv == h && d.coin() ? 0 : hv;
  o.causal = d.coin();
  if (o.causal) o.causal_offset = d.pick<Index>({d.integer(-4, 4), d.integer(-4, 4), S - T_, -(T_ + 2)});
  if (d.coin(0.25)) o.scale = d.real(0.05, 1.5);
  o.block_rows = d.pick<Index>({1, 2, 3, 64, d.integer(1, T_ + 2)});
  o.threads = d.integer(1, 4);
  const double in_scale = d.pick({1.0, 1.0, 3.0});
  const bool decode = !cross && d.coin(0.25);
  const int pad_mode = decode ? 0 : d.pick({0, 0, 1, 2});
  const bool want_probs = d.coin();

  headmix::TalkingHeadsWeights<T> w;
  w.q = random_linear<T>(d.rng, hk * Dk, D, bias), w.k = random_linear<T>(d.rng, hk * Dk, Dkv, bias), w.v = random_linear<T>(d.rng, hv * Dv, Dkv, bias);
  if (out_proj) w.o = random_linear<T>(d.rng, out, hv * Dv, bias);
  if (pre) w.pre_softmax = random_matrix<T>(d.rng, h, hk, 1.0);
  if (post) w.post_softmax = random_matrix<T>(d.rng, hv, h, 1.0);
  const Matrix<T> xq = random_matrix<T>(d.rng, B * T_, D, in_scale), xk = random_matrix<T>(d.rng, B * S, Dkv, in_scale);
  const std::vector<std::uint8_t> pad = padding(d, B, S, pad_mode);

  std::ostringstream desc;
  desc << "B=" << B << " T=" << T_ << " S=" << S << " D=" << D << " Dkv=" << Dkv << " hk=" << hk << " h=" << h
       << " hv=" << hv << " Dk=" << Dk << " Dv=" << Dv << " out=" << (out_proj ? std::to_string(out) : "none")
       << " pre=" << pre << " post=" << post << " bias=" << bias << " causal=" << o.causal
       << " offset=" << o.causal_offset << " scale=" << o.scale.value_or(0) << " block_rows=" << o.block_rows
       << " threads=" << o.threads << " pad_mode=" << pad_mode << " in_scale=" << in_scale
       << (decode ? " decode" : "");
  oc.config = desc.str();

  headmix_ref::RefThWeights rw;
  auto th_linear = [](const headmix::Linear<T>& l) {
    const auto r = ref_linear(l);
    return headmix_ref::RefThLinear{r.out, r.in, r.weight, r.bias};
  };
  rw.q = th_linear(w.q), rw.k = th_linear(w.k), rw.v = th_linear(w.v), rw.o = th_linear(w.o);
  rw.pre = ref_mix(w.pre_softmax), rw.post = ref_mix(w.post_softmax);
  headmix_ref::RefThOptions ro;
  ro.key_heads = hk, ro.heads = h, ro.value_heads = hv, ro.causal = o.causal;
  ro.causal_offset = static_cast<long>(o.causal_offset), ro.scale = o.scale.value_or(0);
  const headmix_ref::RefThBatch qb{B, T_, D, widen(xq)}, kb{B, S, Dkv, widen(xk)};
  if (decode) {  // TalkingHeads::step over random chunks equals the causal (offset 0) forward
    oc.kind = "decode";
    ro.causal = true, ro.causal_offset = 0;
    const auto want = headmix_ref::talking_heads_reference(rw, ro, qb, nullptr, pad);
    const int out_dim = out_proj ? out : hv * Dv;
    DIFF_CHECK(oc, check_steps(d, headmix::TalkingHeads<T>(w, o), xq, B, T_, out_dim, want_probs, want,
                               default_tolerance<T>()));
    return oc;
  }
  const auto want = headmix_ref::talking_heads_reference(rw, ro, qb, cross ? &kb : nullptr, pad);

  const auto in = cross_input(xq, xk, cross, pad, B, T_, S, D, Dkv);
  DIFF_CHECK(oc, forward_matches<headmix::TalkingHeads<T>>(d, oc, w, o, in, want_probs, want, h, default_tolerance<T>()));
  return oc;
}

// ---------------------------------------------------------------------------
// CollabHead

template <class T>
Outcome collab_config(unsigned long long seed) {
  Draw d(seed);
  Outcome oc;
  const int B = d.integer(1, 3), T_ = d.integer(1, 24), H = d.integer(1, 4), R = d.integer(1, 12),
            Dv = d.integer(1, 6);
  const bool cross = d.coin();
  const int S = cross ? d.integer(1, 24) : T_, D = d.integer(1, 12), Dkv = cross ? d.integer(1, 12) : D;
  const bool layer_norm = d.coin(0.25);
  const bool out_proj = layer_norm || d.coin(0.75), v_bias = d.coin(), o_bias = d.coin(), content_bias = d.coin(0.75);
  const int out = layer_norm ? D : d.integer(1, 12);
  const int mixing_kind = d.integer(0, 3);  // dense, per-head band, one zero row, dense with zeros
  headmix::CollabHeadOptions o;
  o.num_heads = H;
  o.causal = d.coin();
  if (o.causal) o.causal_offset = d.pick<Index>({d.integer(-4, 4), d.integer(-4, 4), S - T_, -(T_ + 2)});
  if (d.coin(0.25)) o.scale = d.real(0.05, 1.5);
  o.block_rows = d.pick<Index>({1, 2, 3, 64, d.integer(1, T_ + 2)});
  o.threads = d.integer(1, 4);
  const double in_scale = d.pick({1.0, 1.0, 3.0});
  const bool decode = !cross && d.coin(0.25);
  const int pad_mode = decode ? 0 : d.pick({0, 0, 1, 2});
  const bool want_probs = d.coin();

  headmix::CollabHeadWeights<T> w;
  w.q = random_matrix<T>(d.rng, R, D, 1.0 / std::sqrt(double(D)));
  w.k = random_matrix<T>(d.rng, R, Dkv, 1.0 / std::sqrt(double(Dkv)));
  w.mixing = random_matrix<T>(d.rng, H, R, 1.0);
  if (mixing_kind == 1) {  // head h keeps a random band of columns (the block mixing of an MHA copy is one case)
    for (int hh = 0; hh < H; ++hh) {
      const int lo = d.integer(0, R - 1), hi = d.integer(lo + 1, R);
      for (int r = 0; r < R; ++r)
        if (r < lo || r >= hi) w.mixing(hh, r) = T(0);
    }
  } else if (mixing_kind == 2) {
    w.mixing.row(d.integer(0, H - 1)).setZero();  // that head's logits are its content bias alone
  } else if (mixing_kind == 3) {
    for (Index i = 0; i < w.mixing.size(); ++i)
      if (d.coin(0.3)) w.mixing.data()[i] = T(0);
  }
  if (content_bias) w.content_bias = random_matrix<T>(d.rng, H, Dkv, 1.0 / std::sqrt(double(Dkv)));
  w.v = random_linear<T>(d.rng, H * Dv, Dkv, v_bias);
  if (out_proj) w.o = random_linear<T>(d.rng, out, H * Dv, o_bias);
  if (layer_norm) {
    w.layer_norm.weight = random_matrix<T>(d.rng, D, 1, 1.5);
    w.layer_norm.bias = random_matrix<T>(d.rng, D, 1, 0.5);
    w.layer_norm.eps = d.pick({1e-5, 1e-3});
  }
  const Matrix<T> xq = random_matrix<T>(d.rng, B * T_, D, in_scale), xk = random_matrix<T>(d.rng, B * S, Dkv, in_scale);
  const std::vector<std::uint8_t> pad = padding(d, B, S, pad_mode);

  std::ostringstream desc;
  desc << "B=" << B << " T=" << T_ << " S=" << S << " D=" << D << " Dkv=" << Dkv << " H=" << H << " R=" << R
       << " Dv=" << Dv << " out=" << (out_proj ? std::to_string(out) : "none") << " mixing_kind=" << mixing_kind
       << " content_bias=" << content_bias << " v_bias=" << v_bias << " o_bias=" << o_bias
       << " layer_norm=" << layer_norm << " causal=" << o.causal << " offset=" << o.causal_offset
       << " scale=" << o.scale.value_or(0) << " block_rows=" << o.block_rows << " threads=" << o.threads
       << " pad_mode=" << pad_mode << " in_scale=" << in_scale << (decode ? " decode" : "");
  oc.config = desc.str();

  headmix_ref::RefCollabWeights rw;
  rw.num_heads = H, rw.shared_dim = R, rw.embed_dim = D, rw.key_dim = Dkv;
  rw.q = widen(w.q), rw.k = widen(w.k), rw.mixing = widen(w.mixing), rw.content_bias = widen(w.content_bias);
  rw.v = ref_linear(w.v), rw.o = ref_linear(w.o);
  if (layer_norm) {
    rw.ln_weight = widen(w.layer_norm.weight.data(), D), rw.ln_bias = widen(w.layer_norm.bias.data(), D);
    rw.ln_eps = w.layer_norm.eps;
  }
  headmix_ref::RefCollabOptions ro;
  ro.causal = o.causal, ro.causal_offset = static_cast<long>(o.causal_offset), ro.scale = o.scale.value_or(0);
  if (decode) {  // CollabHead::step over random chunks equals the causal (offset 0) forward
    oc.kind = "decode";
    ro.causal = true, ro.causal_offset = 0;
    const auto want = headmix_ref::collab_reference(rw, ro, ref_batch(xq, B), nullptr, pad);
    const int out_dim = out_proj ? out : H * Dv;
    DIFF_CHECK(oc, check_steps(d, headmix::CollabHead<T>(w, o), xq, B, T_, out_dim, want_probs, want,
                               default_tolerance<T>()));
    return oc;
  }
  const auto kb = ref_batch(xk, B);
  const auto want = headmix_ref::collab_reference(rw, ro, ref_batch(xq, B), cross ? &kb : nullptr, pad);

  const auto in = cross_input(xq, xk, cross, pad, B, T_, S, D, Dkv);
  DIFF_CHECK(oc, forward_matches<headmix::CollabHead<T>>(d, oc, w, o, in, want_probs, want, H, default_tolerance<T>()));
  return oc;
}

// ---------------------------------------------------------------------------
// LSH

template <class T>
headmix_ref::LshRefLinear lsh_linear(const headmix::Linear<T>& l) {
  return ref_linear_as<headmix_ref::LshRefLinear>(l);
}

template <class T>
Outcome lsh_config(unsigned long long seed) {
  Draw d(seed);
  Outcome oc;
  const int B = d.integer(1, 3), T_ = d.integer(1, 40), D = d.integer(1, 12), H = d.integer(1, 3),
            dh = d.integer(1, 6), dv = d.integer(1, 6), out = d.integer(1, 10);
  headmix::LshOptions o;
  o.num_heads = H;
  o.bucket_size = d.integer(1, 6);
  o.n_hashes = d.integer(1, 4);
  o.n_buckets = d.coin(0.3) ? 2 * d.integer(1, 4) : 0;
  o.causal = d.coin();
  o.attend_across_buckets = d.coin(0.7);
  o.allow_duplicate_attention = d.coin(0.6);
  o.rotations_per_head = d.coin(0.3);
  o.threads = d.integer(1, 4);
  const bool qkv_bias = d.coin(0.3), out_proj = d.coin(0.75), out_bias = d.coin();
  const int pad_mode = d.pick({0, 0, 1, 2});
  const bool want_probs = d.coin();
  const int bs = static_cast<int>(o.bucket_size), Tp = (T_ + 2 * bs - 1) / (2 * bs) * (2 * bs);
  const int NB = o.n_buckets > 0 ? static_cast<int>(o.n_buckets) : Tp / bs;

  headmix::LshWeights<T> w;
  w.qk = random_linear<T>(d.rng, H * dh, D, qkv_bias), w.v = random_linear<T>(d.rng, H * dv, D, qkv_bias);
  if (out_proj) w.o = random_linear<T>(d.rng, out, H * dv, out_bias);
  const Matrix<T> x = random_matrix<T>(d.rng, B * T_, D, 1.0);
  const std::vector<std::uint8_t> pad = padding(d, B, T_, pad_mode);

  std::ostringstream desc;
  desc << "B=" << B << " T=" << T_ << " (Tp=" << Tp << ") D=" << D << " H=" << H << " dh=" << dh << " dv=" << dv
       << " out=" << (out_proj ? std::to_string(out) : "none") << " bs=" << bs << " NH=" << o.n_hashes
       << " NB=" << NB << (o.n_buckets ? " (fixed)" : "") << " causal=" << o.causal
       << " across=" << o.attend_across_buckets << " dup=" << o.allow_duplicate_attention
       << " per_head=" << o.rotations_per_head << " qkv_bias=" << qkv_bias << " threads=" << o.threads
       << " pad_mode=" << pad_mode;
  oc.config = desc.str();

  headmix_ref::LshRefOptions ro;
  ro.num_heads = H, ro.bucket_size = bs, ro.n_hashes = static_cast<int>(o.n_hashes);
  ro.n_buckets = static_cast<int>(o.n_buckets), ro.causal = o.causal;
  ro.attend_across_buckets = o.attend_across_buckets, ro.allow_duplicate_attention = o.allow_duplicate_attention;
  ro.rotations_per_head = o.rotations_per_head;
  headmix_ref::LshRefWeights rw{lsh_linear(w.qk), lsh_linear(w.v), lsh_linear(w.o), {}};
  // Hashing is an argmax: redraw the rotations until the reference's top two
  // entries are apart by more than T's rounding (as test_lsh.cpp does).
  const double margin = std::is_same_v<T, float> ? 1e-5 : 1e-10;
  for (int attempt = 0;; ++attempt) {
    w.rotations = random_tensor<T>(d.rng, {o.rotations_per_head ? B * H : 1, dh, o.n_hashes, NB / 2}, 1.0);
    rw.rotations = widen(w.rotations.data(), w.rotations.size());
    if (headmix_ref::lsh_reference(rw, ro, B, T_, D, widen(x), pad, true).min_hash_margin >= margin) break;
    if (attempt == 100) {
      oc.ok = ::testing::AssertionFailure() << "no rotation with a safe hash margin (test setup)";
      return oc;
    }
  }
  const auto want = headmix_ref::lsh_reference(rw, ro, B, T_, D, widen(x), pad);

  headmix::AttentionInput<T> in;
  in.query = {x.data(), B, T_, D};
  if (!pad.empty()) in.key_padding = {pad.data(), B, T_};
  DIFF_CHECK(oc, forward_matches<headmix::Lsh<T>>(d, oc, w, o, in, want_probs, want, H, default_tolerance<T>()));
  return oc;
}

// ---------------------------------------------------------------------------
// DCMHA

template <class T>
Outcome dcmha_config(unsigned long long seed) {
  Draw d(seed);
  Outcome oc;
  const int B = d.integer(1, 3), T_ = d.integer(1, 16), D = d.integer(1, 10), H = d.pick({1, 2, 3, 4, 6});
  std::vector<int> divisors;
  for (int g = 1; g <= H; ++g)
    if (H % g == 0) divisors.push_back(g);
  const int G = divisors[static_cast<std::size_t>(d.integer(0, static_cast<int>(divisors.size()) - 1))];
  const int M = H / G, R = d.integer(1, 3), K = d.integer(1, 5), dk = d.integer(1, 4), dv = d.integer(1, 4);
  const int out = d.coin(0.75) ? d.integer(1, 10) : 0;
  const bool bias = d.coin();
  headmix::DcmhaOptions o;
  o.num_heads = H, o.groups = G, o.rank = R;
  o.use_pre = d.coin(0.7), o.use_post = d.coin(0.7), o.query_wise = d.coin(0.8), o.key_wise = d.coin(0.8);
  o.static_w = d.coin(0.4);
  o.causal = d.coin(0.7);
  if (o.causal && d.coin(0.4)) o.window = d.integer(1, T_);
  o.gelu = d.coin() ? headmix::DcmhaGelu::erf : headmix::DcmhaGelu::tanh;
  if (d.coin(0.2)) o.scale = d.real(0.05, 1.5);
  o.block_rows = d.pick<Index>({0, 0, 1, 2, d.integer(1, T_ + 1)});
  o.threads = d.integer(1, 4);
  // The RMSNorm epsilon of W1: the default, or large enough to change the
  // result (mean F² is O(0.1) with these weights). The reference gets it
  // from this draw, not from the layer.
  const double eps = d.pick({1e-6, 1e-6, 0.05, 0.5});
  o.dw_norm_eps = eps;
  const bool decode = o.causal && d.coin(0.3);
  const int pad_mode = decode ? 0 : d.pick({0, 0, 1, 2});
  const bool want_probs = d.coin();

  headmix::DcmhaWeights<T> w;
  w.q = random_linear<T>(d.rng, H * dk, D, bias), w.k = random_linear<T>(d.rng, H * dk, D, bias), w.v = random_linear<T>(d.rng, H * dv, D, bias);
  if (out) w.o = random_linear<T>(d.rng, out, H * dv, bias);
  // Scaled as test_dcmha.cpp: every dynamic term comparable to the identity.
  w.dw1 = random_tensor<T>(d.rng, {D, G, 4, K}, 2.0 / std::sqrt(double(D)));
  w.qkw = random_tensor<T>(d.rng, {G, 4, K, 2 * R, M}, 1.0 / std::sqrt(double(K)));
  w.dd = random_tensor<T>(d.rng, {D, G, 4 * M}, 2.0 / std::sqrt(double(D)));
  if (o.static_w) w.pre_w = random_tensor<T>(d.rng, {G, M, M}, 0.5), w.post_w = random_tensor<T>(d.rng, {G, M, M}, 0.5);
  const Matrix<T> x = random_matrix<T>(d.rng, B * T_, D, 1.0);
  const std::vector<std::uint8_t> pad = padding(d, B, T_, pad_mode);
  const int out_dim = out ? out : H * dv;

  std::ostringstream desc;
  desc << "B=" << B << " T=" << T_ << " D=" << D << " H=" << H << " G=" << G << " R=" << R << " K=" << K
       << " dk=" << dk << " dv=" << dv << " out=" << out << " bias=" << bias << " pre=" << o.use_pre
       << " post=" << o.use_post << " qw=" << o.query_wise << " kw=" << o.key_wise << " static=" << o.static_w
       << " causal=" << o.causal << " window=" << o.window << " gelu_tanh=" << (o.gelu == headmix::DcmhaGelu::tanh)
       << " scale=" << o.scale.value_or(0) << " eps=" << eps << " block_rows=" << o.block_rows
       << " threads=" << o.threads << " pad_mode=" << pad_mode << (decode ? " decode" : "");
  oc.config = desc.str();

  const auto rw = ref_dcmha_weights(w, D, H, G, R);
  headmix_ref::RefDcmhaOptions ro;
  ro.use_pre = o.use_pre, ro.use_post = o.use_post, ro.query_wise = o.query_wise, ro.key_wise = o.key_wise;
  ro.static_w = o.static_w, ro.causal = o.causal, ro.window = static_cast<int>(o.window);
  ro.gelu_tanh = o.gelu == headmix::DcmhaGelu::tanh, ro.scale = o.scale.value_or(0), ro.eps = eps;
  const auto want = headmix_ref::dcmha_reference(rw, ro, B, T_, widen(x), pad);
  const headmix::Dcmha<T> layer(w, o);

  if (decode) {  // Dcmha::step over random chunks equals the causal forward
    oc.kind = "decode";
    DIFF_CHECK(oc, check_steps(d, layer, x, B, T_, out_dim, want_probs, want, dcmha_tolerance<T>()));
    return oc;
  }

  headmix::AttentionInput<T> in;
  in.query = {x.data(), B, T_, D};
  if (!pad.empty()) in.key_padding = {pad.data(), B, T_};
  DIFF_CHECK(oc, forward_matches<headmix::Dcmha<T>>(d, oc, w, o, in, want_probs, want, H, dcmha_tolerance<T>()));
  return oc;
}

// ---------------------------------------------------------------------------
// The driver

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float" : "double";
}

// Runs the configured number of configurations of one variant; stops after
// five failures. Seeds differ per variant (salt) so that variants do not
// share their draws.
template <class T>
void run_variant(const char* variant, unsigned long long salt, Outcome (*config)(unsigned long long)) {
  const int n = configs_per_variant();
  const unsigned long long base = first_seed();
  int ran = 0, failed = 0, decoded = 0, reruns = 0;
  for (int i = 0; i < n && failed < 5; ++i, ++ran) {
    const unsigned long long seed = base + static_cast<unsigned long long>(i);
    Outcome oc;
    try {
      oc = config(seed ^ (salt << 40));
    } catch (const std::exception& e) {
      oc.ok = ::testing::AssertionFailure() << "threw " << e.what();
    }
    decoded += oc.kind == "decode";
    reruns += oc.rerun;
    if (!oc.ok) {
      ++failed;
      ADD_FAILURE() << variant << "<" << type_name<T>() << "> configuration " << i << ", HEADMIX_DIFF_SEED=" << seed
                    << " (" << oc.kind << "): " << oc.ok.message() << "\n  " << oc.config;
    }
  }
  ::testing::Test::RecordProperty("configurations", ran);
  std::cout << "[differential] " << variant << "<" << type_name<T>() << ">: " << ran << " configurations ("
            << decoded << " of them decoding, " << reruns << " rerun on one thread), " << failed
            << " failed, seeds " << base << ".." << base + ran - 1 << std::endl;
}

HEADMIX_TYPED_OVER_SCALARS(Differential);

TYPED_TEST(Differential, Mha) { run_variant<TypeParam>("mha", 1, &mha_config<TypeParam>); }
TYPED_TEST(Differential, TalkingHeads) { run_variant<TypeParam>("talking_heads", 2, &talking_heads_config<TypeParam>); }
TYPED_TEST(Differential, CollabHead) { run_variant<TypeParam>("collab", 3, &collab_config<TypeParam>); }
TYPED_TEST(Differential, Lsh) { run_variant<TypeParam>("lsh", 4, &lsh_config<TypeParam>); }
TYPED_TEST(Differential, Dcmha) { run_variant<TypeParam>("dcmha", 5, &dcmha_config<TypeParam>); }

}  // namespace
