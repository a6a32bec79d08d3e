// One traits entry per attention variant, for the typed tests that every
// variant must pass (tests/test_layer_contract.cpp). An entry names the
// variant, builds a small random problem of it (its own cases/<variant>.hpp,
// which holds the naive double reference adapter), says what it can do, and
// lists the shapes that exercise its own paths in each contract test. A new
// variant is covered by one more entry here and in the list All below.
//
// Each entry provides:
//   tag, name                    the "[mha]" prefix of its errors, a readable name
//   cross_keys, has_block_rows,  capabilities (cross_keys: takes a key sequence);
//   window, gqa, decodes,        a contract test that needs one skips the
//   finite_scale,                variants without it
//   probs_sum_to_one, zero_sign_exact
//   Layer<T>, Problem<T>, Shape  the layer, and its test problem (cases/*.hpp)
//   make<T>(shape, seed)         a random problem; Problem::reference() is the
//                                naive double reference, Problem::layer() the layer
//   dims(p), query(p)            sizes, and the [B*T, D] query matrix
//   describe(p), set_threads(p, n), change_options(p, step)
//   thread_shapes(), workspace_shapes(), probs_shape(), allocating_shape(),
//   single_sequence_shape(), options_shape(), flops_shapes(), bad_input_shape()
//   non_finite_shapes(), decoder_shapes(s)   test_bad_input.cpp's non-finite and step cases
//   masking_variation(s, seed)               test_masking.cpp: the variant's own switches per case
//   expect_flops(p)              flops() against the reference's counts
//   reference_tolerance<T>()     the bound against the naive reference (test_extremes, test_differential)
//   differential_case<T>(d), decoded_form(p), split_tasks(p)   test_differential.cpp
//   limit_shape(), limit_logits(p, a), equal_logits(p), single_key(s), single_query(s, offset),
//   set_masking(p, causal, offset), masked_output_exact(p), extremes_shapes(s), and the
//   flags causal_offsets, masks_exactly, extremes_limit, equal_logits_uniform   test_extremes.cpp
//   step_tolerance<T>(), bf16_cache_refusal,
//   decoding_shapes(), decoding_allocation_shapes(),
//   decoding_conformance, decoding_conformance_layer<T>(f)  test_decoding.cpp
//   checkpoint_shapes(), for_each_tensor(w, f)             test_checkpoint_files.cpp
//   determinism_shape(), determinism_decoding_shape() (decoding variants),
//   thread_safety_shapes(), thread_safety_resized(), padding_isolated,
//   has_buckets                  tests/test_determinism.cpp, test_thread_safety.cpp
//   GroupedQuery<T> (with gqa)   test_grouped_query.cpp: a grouped layer and its expansion
#pragma once

#include "cases/collab_head.hpp"
#include "cases/dcmha.hpp"
#include "cases/lsh.hpp"
#include "cases/mha.hpp"
#include "cases/talking_heads.hpp"
#include "conformance/case_collab.hpp"
#include "conformance/case_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <initializer_list>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace headmix_test::variants {

/// A problem's sizes: probs are [B, probs_heads, T, S], the output [B, T, out].
struct Dims {
  headmix::Index B, T, S, D, Dkv, probs_heads, out;
};

/// test_differential.cpp's random draws (64-bit seeds, so that a variant's
/// salt can sit in the high bits).
struct Draw {
  std::mt19937_64 rng;
  explicit Draw(unsigned long long seed) : rng(seed) {}
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
  bool coin(double p = 0.5) { return real(0, 1) < p; }
  template <class X>
  X pick(std::initializer_list<X> options) {
    return options.begin()[integer(0, static_cast<int>(options.size()) - 1)];
  }
  unsigned seed() { return static_cast<unsigned>(rng()); }  // for make<T>(shape, seed)
};

/// One random configuration of test_differential.cpp: the problem, and how to run it.
template <class P>
struct DifferentialCase {
  P p;
  bool decode = false;          // step() over random chunks, against decoded_form(p)'s forward
  bool pad_first_item = false;  // every key of batch item 0 padded too
  std::string note;             // what p.describe() does not say
  // Padding: none (half the time), 30 % of the keys, or 70 % and all of
  // item 0; none when decoding. Returns the shape's pad_rate.
  double draw_padding(Draw& d) {
    const int mode = decode ? 0 : d.pick({0, 0, 1, 2});
    pad_first_item = mode == 2;
    return mode == 0 ? 0.0 : mode == 1 ? 0.3 : 0.7;
  }
};

/// test_decoding.cpp: a conformance folder and how many causal
/// self-attention cases (no keys, no padding) it holds at least.
struct CausalCases {
  const char* folder;
  std::size_t count;
};

/// What most variants share: flops() splits into projection and attention
/// multiply-adds exactly as the reference counts them.
struct VariantBase {
  static constexpr bool cross_keys = true, has_block_rows = true, window = true, gqa = false, decodes = false;
  static constexpr bool finite_scale = true, probs_sum_to_one = true;
  static constexpr bool zero_sign_exact = true;  // false: repeated runs may differ in the sign of a zero
  // test_extremes.cpp, test_differential.cpp: the bound against the naive reference.
  template <class T>
  static headmix_test::Tolerance reference_tolerance() {
    return headmix_test::default_tolerance<T>();
  }
  // test_differential.cpp: query blocks that cut B items of T rows into at
  // least two tasks (false: one task whatever the block size). 0 is
  // DCMHA's automatic size (>= 16 rows, at least T there).
  static bool split_rows(headmix::Index& block_rows, headmix::Index B, headmix::Index T) {
    if (B * T < 2) return false;
    if (B == 1 && (block_rows == 0 || block_rows >= T)) block_rows = (T + 1) / 2;
    return true;
  }
  // test_extremes.cpp. The masking has a causal offset (set_masking); a
  // masked key gets weight exactly 0, so that a row that sees no key gives
  // exactly the reference's output (LSH masks with finite values); the
  // limit_shape() / limit_logits() hooks exist (LSH's logits are bounded by
  // its key norms: its own tests); equal logits give every visible key of a
  // row the same weight (LSH: only within its chunks).
  static constexpr bool causal_offsets = true, masks_exactly = true, extremes_limit = true;
  static constexpr bool equal_logits_uniform = true;
  // The problems each extremes test varies (s: probs_shape()).
  template <class S> static std::vector<S> extremes_shapes(S s) { return {s}; }
  // A row that sees no key outputs exactly the reference's value (false
  // where the output goes through a LayerNorm rounded in T).
  template <class P> static bool masked_output_exact(const P&) { return true; }
  // s with one key per item; false: the variant's keys are its queries.
  template <class S> static bool single_key(S&) { return false; }
  // test_decoding.cpp: how close steps stay to the full causal forward of
  // the same layer (two summation orders), relative to 1 + |value| ...
  template <class T>
  static headmix_test::Tolerance step_tolerance() {
    return std::is_same_v<T, float> ? headmix_test::Tolerance{2e-5, 2e-5} : headmix_test::Tolerance{1e-12, 1e-12};
  }
  // ... and the shape_error a bfloat16 cache gets (nullptr: steps accept one).
  static constexpr const char* bf16_cache_refusal = nullptr;
  // test_checkpoint_files.cpp: a Linear's tensors, <name>.weight and <name>.bias.
  template <class L, class F>
  static void linear_tensors(const std::string& name, L& lin, F& f) {
    f(name + ".weight", lin.weight);
    f(name + ".bias", lin.bias);
  }
  // test_bad_input.cpp: a NaN / Inf input may change which keys the finite
  // rows attend to (LSH re-hashes it), so rows are held to the reference.
  static constexpr bool non_finite_reorders = false;
  // test_determinism: a padded key has weight exactly 0, so what a padded
  // token holds reaches no other row (false for LSH: it moves the hashing).
  static constexpr bool padding_isolated = true;
  // test_thread_safety: the layer has buckets() (LSH's hashing) to call too.
  static constexpr bool has_buckets = false;
  // test_thread_safety: a setup's call of another size through its layer.
  template <class S>
  static S thread_safety_resized(S s, int B, int T, double pad_rate) {
    s.B = B, s.T = T, s.pad_rate = pad_rate;
    return s;
  }

  // The problems a thread-count test runs (LSH adds the seeded rotations).
  template <class P>
  static std::vector<P> thread_variations(const P& p) {
    return {p};
  }

  template <class P>
  static void expect_flops(const P& p, headmix::Index B, headmix::Index T, headmix::Index S) {
    const auto want = p.reference();
    const headmix::FlopCount got = p.layer().flops(B, T, S);
    EXPECT_EQ(got.projection_macs, want.projection_macs);
    EXPECT_EQ(got.attention_macs, want.attention_macs);
    EXPECT_EQ(got.macs(), want.projection_macs + want.attention_macs);
  }
};

/// The dense cross-attention variants' problems (MHA, Talking-Heads,
/// CollabHead) share their field names: s.B, s.T, s.S, s.threads, xq.
struct DenseVariant : VariantBase {
  template <class P> static const auto& query(const P& p) { return p.xq; }
  template <class P> static void set_threads(P& p, int n) { p.s.threads = n; }
  // set_options() may change masking, block size and threads between calls.
  template <class P> static void change_options(P& p, int step) {
    p.s.causal = step > 0, p.s.offset = step == 2 ? -2 : 0, p.s.block_rows = 2 + step, p.s.threads = 1 + step;
  }
  template <class P> static void expect_flops(const P& p) { VariantBase::expect_flops(p, p.s.B, p.s.T, p.s.S); }
  // test_differential.cpp: the forward whose rows step() gives (causal,
  // offset 0, whatever p's options say), and p cut into >= 2 tasks for its threads.
  template <class P> static P decoded_form(P p) {
    p.s.causal = true, p.s.offset = 0;
    return p;
  }
  template <class P> static bool split_tasks(P& p) {
    return p.s.threads >= 2 && split_rows(p.s.block_rows, p.s.B, p.s.T);
  }
  // test_extremes.cpp (see VariantBase): one unpadded key for every query ...
  template <class S> static bool single_key(S& s) {
    s.cross = true, s.S = 1, s.causal = false, s.pad_rate = 0;
    return true;
  }
  // ... one query over 9 keys, causal with `offset` ...
  template <class S> static void single_query(S& s, long offset) {
    s.cross = true, s.T = 1, s.S = 9, s.causal = true, s.offset = offset;
  }
  template <class P> static void set_masking(P& p, bool causal, long offset) { p.s.causal = causal, p.s.offset = offset; }
  // ... and keys that all give the same logit: k = its bias, the same for every key.
  template <class P> static void equal_logits(P& p) { p.w.k.weight.setZero(); }
  // test_bad_input.cpp: the self-attention decoder of setup s, and another whose value heads are wider.
  template <class S> static std::vector<S> decoder_shapes(S s) {
    s.cross = false;
    S other = s;
    other.Dv += 1;
    return {s, other};
  }
  // test_masking.cpp: the variant's own switches, varied over a test's cases.
  template <class S> static void masking_variation(S&, unsigned) {}
  template <class S> static S thread_safety_resized(S s, int B, int T, double pad_rate) {  // keys: another length
    s = VariantBase::thread_safety_resized(s, B, T, pad_rate);
    s.S = T + 3;
    return s;
  }
};

/// Shapes the dense cross-attention variants (MHA, Talking-Heads, CollabHead)
/// share in the contract tests; their entries add their own fields.
namespace dense {
template <class S> S allocating() {
  S s;
  s.cross = true, s.S = 7, s.out = 5, s.pad_rate = 0.2;
  return s;
}
template <class S> S single_sequence() {
  S s;
  s.B = 1, s.T = 7, s.out = 6, s.causal = true;
  return s;
}
template <class S> S options() {
  S s;
  s.T = 9, s.pad_rate = 0.2;
  return s;
}
// test_decoding.cpp: a conformance case's layer, options o plus the ones every dense case sets.
template <class Layer, class O> Layer conformance_layer(const headmix::io::TensorFile& f, O o) {
  headmix::conformance::read_dense_options(headmix::conformance::case_config(f), o);
  return Layer::from_tensors(f, "", o);
}
// Cross-attention with an offset, padding and short blocks.
template <class S> S threads_cross() {
  S s;
  s.B = 3, s.T = 10, s.cross = true, s.S = 13, s.Dkv = 5;
  s.causal = true, s.offset = 2, s.pad_rate = 0.3, s.block_rows = 3;
  return s;
}
// test_determinism: two items of 37 queries, 40 keys of another width, 5 row blocks.
template <class S> S determinism() {
  S s;
  s.B = 2, s.T = 37, s.D = 13, s.cross = true, s.S = 40, s.Dkv = 7, s.block_rows = 8;
  return s;
}
// test_thread_safety: causal cross-attention in 8-row blocks (the suite adds sizes and padding).
template <class S> S thread_safety() {
  S s;
  s.B = 2, s.T = 37, s.cross = true, s.S = 40, s.causal = true, s.block_rows = 8;
  return s;
}
// The self-attention form of a setup (decoding needs one).
template <class S> S self(S s) {
  s.cross = false;
  return s;
}
// test_bad_input.cpp (non-finite input): three items, 7 keys of width 3 and
// 2-row query blocks, so that a row and the bad key can sit in different blocks.
template <class S> S non_finite() {
  S s;
  s.B = 3, s.T = 6, s.cross = true, s.S = 7, s.D = 5, s.Dkv = 3, s.out = 4, s.block_rows = 2;
  return s;
}
// test_extremes.cpp: one-dimensional query/key heads (each logit is one
// product, q·k, of inputs |x| <= 1), 3 items of 5 queries over 7 keys with padding.
template <class S> S limit() {
  S s;
  s.B = 3, s.T = 5, s.cross = true, s.S = 7, s.D = 1, s.Dkv = 1, s.out = 4, s.scale = 1, s.pad_rate = 0.3;
  s.block_rows = 2;
  return s;
}
// limit_logits: q = a·x, k = a·y, so logit(i, j) = a²·x_i·y_j; the last
// item's keys are all 1, so its logits are equal along each row.
template <class P, class Q>
void limit_query_key(P& p, Q& q, Q& k, double a) {
  using T = typename std::decay_t<decltype(p.xq)>::Scalar;
  q.setConstant(static_cast<T>(a)), k.setConstant(static_cast<T>(a));
  p.xk.bottomRows(p.s.S).setConstant(T(1));
}

// test_differential.cpp: a random configuration of a dense variant V. The
// fields they share are drawn here, heads(s) draws V's own, and tweak(p)
// changes the built problem where the shape has no field for it (returning
// a note for the failure message).
template <class V, class T, class Heads, class Tweak>
DifferentialCase<typename V::template Problem<T>> differential(Draw& d, Heads&& heads, Tweak&& tweak) {
  typename V::Shape s;
  s.B = d.integer(1, 3), s.T = d.integer(1, 24), s.cross = d.coin();
  s.S = s.cross ? d.integer(1, 24) : s.T, s.D = d.integer(1, 12), s.Dkv = s.cross ? d.integer(1, 12) : s.D;
  s.out_proj = d.coin(0.75), s.out = d.integer(1, 12);
  s.causal = d.coin();
  if (s.causal) s.offset = d.pick<long>({d.integer(-4, 4), d.integer(-4, 4), s.S - s.T, -(s.T + 2), s.S + 3});
  if (d.coin(0.25)) s.scale = d.real(0.05, 1.5);
  s.block_rows = d.pick<headmix::Index>({1, 2, 3, 64, d.integer(1, s.T + 2)});
  s.threads = d.integer(1, 4);
  heads(s);
  DifferentialCase<typename V::template Problem<T>> c;
  c.decode = V::decodes && !s.cross && d.coin(0.25);
  s.pad_rate = c.draw_padding(d);
  // Inputs up to 3 in one configuration in three: logits up to ~10x larger.
  const double in_scale = d.pick({1.0, 1.0, 3.0});
  c.p = V::template make<T>(s, d.seed());
  c.p.xq *= static_cast<T>(in_scale), c.p.xk *= static_cast<T>(in_scale);
  c.note = " in_scale=" + std::to_string(in_scale) + tweak(c.p);
  return c;
}
}  // namespace dense

// ---------------------------------------------------------------------------
// MHA

struct Mha : DenseVariant {
  static constexpr const char* tag = "[mha]";
  static constexpr const char* name = "mha";
  static constexpr bool gqa = true, decodes = true;
  template <class T> using GroupedQuery = mha_case::GroupedQuery<T>;
  template <class T> using Layer = headmix::Mha<T>;
  template <class T> using Problem = mha_case::Problem<T>;
  using Shape = mha_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) { return mha_case::make_problem<T>(s, seed); }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.S, p.s.D, p.s.Dkv, p.s.H, p.s.out_dim()};
  }
  template <class T> static std::string describe(const Problem<T>& p) { return mha_case::describe(p.s); }
  template <class T> static DifferentialCase<Problem<T>> differential_case(Draw& d) {
    const auto heads = [&](Shape& s) {
      s.H = d.integer(1, 4), s.Dk = d.integer(1, 6), s.Dv = d.integer(1, 6), s.bias = d.coin();
    };
    return dense::differential<Mha, T>(d, heads, [](Problem<T>&) { return std::string(); });
  }
  // test_extremes.cpp: one-dimensional heads with logits up to a² ...
  static Shape limit_shape() {
    Shape s = dense::limit<Shape>();
    s.H = 1, s.Dk = 1, s.Dv = 3;
    return s;
  }
  template <class T> static void limit_logits(Problem<T>& p, double a) {
    p.w.q.bias.setZero(), p.w.k.bias.setZero();
    dense::limit_query_key(p, p.w.q.weight, p.w.k.weight, a);
  }
  // ... and equal logits (k = its bias), large and different per row.
  template <class T> static void equal_logits(Problem<T>& p) {
    p.w.k.weight.setZero(), p.w.k.bias.setConstant(T(2.5)), p.w.q.weight *= T(40);
  }
  // test_decoding.cpp: causal self-attention whose steps must equal the full
  // forward (the first also runs the cache tests): Dk != Dv, then grouped
  // queries (multi-query, two groups) and windows.
  static std::vector<Shape> decoding_shapes() {
    std::vector<Shape> s(5);
    for (Shape& e : s) e.B = 2, e.T = 13, e.D = 12, e.H = 4, e.Dk = 3, e.Dv = 5, e.out = 7, e.causal = true;
    for (Shape& e : s) e.block_rows = 4;
    s[0].H = 3, s[0].Dk = 4;
    s[1].Hkv = 1, s[2].Hkv = 2, s[2].window = 3, s[3].window = 1, s[4].Hkv = 1, s[4].window = 5;
    return s;
  }
  // Generating until the cache (capacity T) is full allocates nothing.
  static std::vector<Shape> decoding_allocation_shapes() {
    std::vector<Shape> s(2);
    for (Shape& e : s) e.D = 32, e.H = 4, e.Dk = 8, e.Dv = 8, e.out = 32, e.causal = true;
    s[0].B = 1, s[0].T = 64;
    s[1].B = 2, s[1].T = 40, s[1].Hkv = 2, s[1].key_block = 16;
    return s;
  }
  // The conformance folder, how many causal self-attention cases it holds,
  // and the layer a case describes.
  static constexpr CausalCases decoding_conformance{"mha", 1};
  template <class T> static Layer<T> decoding_conformance_layer(const headmix::io::TensorFile& f) {
    const auto config = headmix::conformance::case_config(f);
    headmix::MhaOptions o;
    o.num_heads = config.at("num_heads").get<headmix::Index>(), o.num_kv_heads = headmix::conformance::read_kv_heads(config);
    return dense::conformance_layer<Layer<T>>(f, o);
  }
  // test_checkpoint_files.cpp: problems holding every tensor (one grouped-
  // query), and f(name, value) for each weight under mha.md's names.
  static std::vector<Shape> checkpoint_shapes() {
    std::vector<Shape> s(2);
    s[1].H = 4, s[1].Hkv = 2, s[1].Dk = 2, s[1].Dv = 3;
    return s;
  }
  template <class W, class F> static void for_each_tensor(W& w, F&& f) {
    linear_tensors("q", w.q, f), linear_tensors("k", w.k, f), linear_tensors("v", w.v, f), linear_tensors("o", w.o, f);
  }

  // The second shape has B*T > 256 rows, so the projections also split into
  // several row chunks.
  static std::vector<Shape> thread_shapes() {
    std::vector<Shape> s(2);
    s[0] = dense::threads_cross<Shape>();
    s[1].B = 2, s[1].T = 150, s[1].D = 16, s[1].out = 12, s[1].block_rows = 16;
    return s;
  }
  static std::vector<Shape> workspace_shapes() {
    std::vector<Shape> s(5);
    s[0].B = 3, s[0].T = 12, s[0].cross = true, s[0].S = 9, s[0].Dkv = 6, s[0].pad_rate = 0.3;
    s[1].B = 1, s[1].T = 2, s[1].H = 1, s[1].Dk = 3, s[1].Dv = 2;
    s[2].T = 7, s[2].causal = true, s[2].threads = 3, s[2].block_rows = 2, s[2].pad_rate = 0.3;
    s[3].B = 3, s[3].T = 20, s[3].D = 12, s[3].H = 3, s[3].out_proj = false;
    s[4].B = 1, s[4].T = 1, s[4].cross = true, s[4].S = 4, s[4].Dkv = 2;
    return s;
  }
  static Shape probs_shape() {
    Shape s;
    s.cross = true, s.T = 6, s.S = 9, s.H = 3, s.causal = true, s.offset = 1, s.pad_rate = 0.3;
    return s;
  }
  static Shape allocating_shape() { return dense::allocating<Shape>(); }
  static Shape single_sequence_shape() { return dense::single_sequence<Shape>(); }
  static Shape options_shape() { return dense::options<Shape>(); }
  static Shape determinism_shape() {
    Shape s = dense::determinism<Shape>();
    s.H = 3, s.Dk = 5, s.Dv = 3, s.out = 11;
    return s;
  }
  static Shape determinism_decoding_shape() { return dense::self(determinism_shape()); }
  // Cross-attention with an offset, and the self-attention layer that decodes.
  static std::vector<Shape> thread_safety_shapes() {
    Shape s = dense::thread_safety<Shape>();
    s.D = 12, s.Dkv = 7, s.H = 3, s.Dk = 4, s.Dv = 3, s.out = 10, s.offset = 2;
    return {s, dense::self(s)};
  }
  // All projections, plus (Dk + Dv) per causally visible (query, key) pair
  // per head; grouped-query K/V projections count Hkv heads, windows only
  // the pairs inside the window.
  static std::vector<Shape> flops_shapes() {
    std::vector<Shape> s(10);
    s[0].D = 16, s[0].Dk = 8, s[0].Dv = 8, s[0].out = 16, s[0].T = 7;
    s[1].cross = true, s[1].T = 5, s[1].S = 11, s[1].Dkv = 6, s[1].Dk = 3, s[1].Dv = 5, s[1].causal = true,
    s[1].out_proj = false;
    s[2].T = 8, s[2].causal = true, s[2].offset = -3, s[2].pad_rate = 0.5;
    s[3].cross = true, s[3].T = 3, s[3].S = 10, s[3].causal = true, s[3].offset = 7;
    s[4].T = 6, s[4].causal = true, s[4].offset = -20;  // nothing visible
    s[5].B = 3, s[5].T = 1, s[5].H = 3, s[5].out = 2, s[5].bias = false;
    s[6].cross = true, s[6].T = 11, s[6].S = 4, s[6].causal = true, s[6].offset = 1, s[6].H = 1, s[6].pad_rate = 0.3;
    s[7].H = 4, s[7].Hkv = 2, s[7].T = 6, s[7].cross = true, s[7].S = 9;
    s[8].H = 4, s[8].Hkv = 1, s[8].T = 9, s[8].causal = true, s[8].window = 3;
    s[9].cross = true, s[9].T = 5, s[9].S = 12, s[9].causal = true, s[9].offset = 4, s[9].window = 2,
    s[9].pad_rate = 0.3;
    return s;
  }
  // A valid cross-attention setup (D != Dkv, Dk != Dv, out != D).
  static Shape bad_input_shape() {
    Shape s;
    s.B = 2, s.T = 5, s.cross = true, s.S = 7, s.D = 16, s.Dkv = 12, s.H = 2, s.Dk = 4, s.Dv = 3, s.out = 10;
    return s;
  }
  static std::vector<Shape> non_finite_shapes() {
    Shape s = dense::non_finite<Shape>();
    s.H = 2, s.Dk = 3, s.Dv = 2;
    return {s};
  }
  static void masking_variation(Shape& s, unsigned seed) { s.H = 3, s.Hkv = seed % 2 == 0 ? 0 : 1; }
};

// ---------------------------------------------------------------------------
// Talking-Heads (h_k, h and h_v heads; probs are the post-mixed weights)

struct TalkingHeads : DenseVariant {
  static constexpr const char* tag = "[talking_heads]";
  static constexpr const char* name = "talking_heads";
  static constexpr bool probs_sum_to_one = false, decodes = true, gqa = true;
  template <class T> using GroupedQuery = th_case::GroupedQuery<T>;
  template <class T> using Layer = headmix::TalkingHeads<T>;
  template <class T> using Problem = th_case::Problem<T>;
  using Shape = th_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) { return th_case::make_problem<T>(s, seed); }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.S, p.s.D, p.s.Dkv, p.s.Hv, p.s.out_dim()};
  }
  template <class T> static std::string describe(const Problem<T>& p) { return th_case::describe(p.s); }
  // A mix may be absent only between equal head counts.
  template <class T> static DifferentialCase<Problem<T>> differential_case(Draw& d) {
    const auto heads = [&](Shape& s) {
      s.Hk = d.integer(1, 4), s.H = d.integer(1, 4), s.Hv = d.integer(1, 4), s.Dk = d.integer(1, 6);
      s.Dv = d.integer(1, 6), s.bias = d.coin();
      s.pre = s.Hk != s.H || d.coin(0.7), s.post = s.H != s.Hv || d.coin(0.7), s.implicit_heads = d.coin();
    };
    return dense::differential<TalkingHeads, T>(d, heads, [](Problem<T>&) { return std::string(); });
  }
  // test_extremes.cpp (see Mha): a negative pre mix (-0.9) makes the
  // argmin the winner, and the post mix (1.5) scales the one-hot weights.
  static Shape limit_shape() {
    Shape s = dense::limit<Shape>();
    s.Hk = 1, s.H = 1, s.Hv = 1, s.Dk = 1, s.Dv = 3;
    return s;
  }
  template <class T> static void limit_logits(Problem<T>& p, double a) {
    p.w.q.bias.setZero(), p.w.k.bias.setZero();
    dense::limit_query_key(p, p.w.q.weight, p.w.k.weight, a);
    p.w.pre_softmax.setConstant(T(-0.9)), p.w.post_softmax.setConstant(T(1.5));
  }
  // test_decoding.cpp (see Mha): three head counts with both mixes, a pre
  // mix only, a post mix only, no mix, then windows 1 and 4.
  static std::vector<Shape> decoding_shapes() {
    std::vector<Shape> s(6);
    for (Shape& e : s) e.B = 2, e.T = 13, e.D = 12, e.Dk = 4, e.Dv = 3, e.out = 7, e.causal = true, e.block_rows = 4;
    for (Shape& e : s) e.Hk = 3, e.H = 5, e.Hv = 4;
    s[1].Hk = 4, s[1].H = 2, s[1].Hv = 2, s[1].post = false;
    s[2].Hk = 2, s[2].H = 2, s[2].Hv = 3, s[2].pre = false;
    s[3].Hk = 3, s[3].H = 3, s[3].Hv = 3, s[3].pre = false, s[3].post = false;
    s[4].window = 1, s[5].window = 4;
    return s;
  }
  // h · capacity values exceed the fused mix stage's 64 KiB chunk; and no mixes at all.
  static std::vector<Shape> decoding_allocation_shapes() {
    std::vector<Shape> s(2);
    for (Shape& e : s) e.T = 600, e.D = 32, e.Dk = 8, e.Dv = 8, e.out = 32, e.causal = true, e.block_rows = 64;
    s[0].B = 1, s[0].Hk = 4, s[0].H = 40, s[0].Hv = 4;
    s[1].B = 2, s[1].Hk = 4, s[1].H = 4, s[1].Hv = 4, s[1].pre = false, s[1].post = false;
    return s;
  }
  static constexpr CausalCases decoding_conformance{"talking_heads", 1};
  template <class T> static Layer<T> decoding_conformance_layer(const headmix::io::TensorFile& f) {
    const auto config = headmix::conformance::case_config(f);
    headmix::TalkingHeadsOptions o;
    o.num_heads = config.value("heads_logits", config.at("num_heads").get<headmix::Index>());
    o.key_heads = config.value("heads_key", o.num_heads);
    o.value_heads = config.value("heads_value", o.num_heads);
    return dense::conformance_layer<Layer<T>>(f, o);
  }
  // test_checkpoint_files.cpp (see Mha).
  static std::vector<Shape> checkpoint_shapes() { return {Shape()}; }
  template <class W, class F> static void for_each_tensor(W& w, F&& f) {
    linear_tensors("q", w.q, f), linear_tensors("k", w.k, f), linear_tensors("v", w.v, f), linear_tensors("o", w.o, f);
    f("pre_softmax.weight", w.pre_softmax), f("post_softmax.weight", w.post_softmax);
  }

  static std::vector<Shape> thread_shapes() {
    std::vector<Shape> s(3);
    s[0] = dense::threads_cross<Shape>();
    s[1].B = 2, s[1].T = 150, s[1].D = 16, s[1].out = 12, s[1].Hk = 4, s[1].H = 6, s[1].Hv = 3;
    s[2].B = 1, s[2].T = 40, s[2].causal = true, s[2].post = false, s[2].block_rows = 7;
    return s;
  }
  // Problems that grow, shrink and change head counts.
  static std::vector<Shape> workspace_shapes() {
    std::vector<Shape> s(5);
    s[0].B = 3, s[0].T = 12, s[0].cross = true, s[0].S = 9, s[0].Dkv = 6, s[0].pad_rate = 0.3;
    s[1].B = 1, s[1].T = 2, s[1].Hk = 1, s[1].H = 1, s[1].Hv = 1, s[1].Dk = 3;
    s[2].T = 7, s[2].causal = true, s[2].threads = 3, s[2].block_rows = 2, s[2].Hk = 5, s[2].H = 2, s[2].Hv = 6;
    s[3].B = 3, s[3].T = 20, s[3].D = 12, s[3].pre = false, s[3].out_proj = false;
    s[4].B = 1, s[4].T = 1, s[4].cross = true, s[4].S = 4, s[4].Dkv = 2;
    return s;
  }
  static Shape probs_shape() {
    Shape s;
    s.cross = true, s.T = 6, s.S = 9, s.Hk = 2, s.H = 3, s.Hv = 4, s.causal = true, s.offset = 1, s.pad_rate = 0.3;
    return s;
  }
  static Shape allocating_shape() { return dense::allocating<Shape>(); }
  static Shape single_sequence_shape() { return dense::single_sequence<Shape>(); }
  static Shape options_shape() { return dense::options<Shape>(); }
  static Shape determinism_shape() {
    Shape s = dense::determinism<Shape>();
    s.Hk = 2, s.H = 4, s.Hv = 3, s.Dk = 5, s.Dv = 3, s.out = 9;
    return s;
  }
  static Shape determinism_decoding_shape() { return dense::self(determinism_shape()); }
  static std::vector<Shape> thread_safety_shapes() {
    Shape s = dense::thread_safety<Shape>();
    s.D = 10, s.Dkv = 6, s.Hk = 2, s.H = 4, s.Hv = 3, s.Dk = 4, s.Dv = 3, s.out = 9;
    return {s, dense::self(s)};
  }
  static std::vector<Shape> flops_shapes() {
    std::vector<Shape> s(10);
    s[0].T = 7, s[0].Hk = 3, s[0].H = 5, s[0].Hv = 4;
    s[1].cross = true, s[1].T = 5, s[1].S = 11, s[1].Dkv = 6, s[1].causal = true, s[1].out_proj = false;
    s[2].T = 8, s[2].causal = true, s[2].offset = -3, s[2].pad_rate = 0.5, s[2].pre = false;
    s[3].cross = true, s[3].T = 3, s[3].S = 10, s[3].causal = true, s[3].offset = 7, s[3].post = false;
    s[4].T = 6, s[4].causal = true, s[4].offset = -20;  // nothing visible
    s[5].B = 3, s[5].T = 1, s[5].pre = false, s[5].post = false, s[5].bias = false;
    s[6].cross = true, s[6].T = 11, s[6].S = 4, s[6].causal = true, s[6].offset = 1, s[6].Hk = 1, s[6].H = 6,
    s[6].Hv = 2, s[6].pad_rate = 0.3;
    s[7].T = 9, s[7].Hk = 6, s[7].H = 2, s[7].Hv = 1, s[7].Dk = 2, s[7].Dv = 7;
    s[8].T = 9, s[8].causal = true, s[8].window = 3;  // only the pairs inside the window
    s[9].cross = true, s[9].T = 4, s[9].S = 12, s[9].causal = true, s[9].offset = 6, s[9].window = 5,
    s[9].pad_rate = 0.3, s[9].post = false;
    return s;
  }
  // Three different head counts (h_k 2, h 3, h_v 2), cross-attention.
  static Shape bad_input_shape() {
    Shape s;
    s.B = 2, s.T = 5, s.cross = true, s.S = 7, s.D = 16, s.Dkv = 12, s.Hk = 2, s.H = 3, s.Hv = 2, s.Dk = 4, s.Dv = 3;
    s.out = 10;
    return s;
  }
  static std::vector<Shape> non_finite_shapes() {
    Shape s = dense::non_finite<Shape>();
    s.Hk = 2, s.H = 3, s.Hv = 3, s.Dk = 2, s.Dv = 2;
    return {s};
  }
  static void masking_variation(Shape& s, unsigned seed) { s.pre = seed % 4 != 1, s.post = seed % 4 != 2; }
};

// ---------------------------------------------------------------------------
// CollabHead (shared query/key projections mixed per head)

struct CollabHead : DenseVariant {
  static constexpr const char* tag = "[collab]";
  static constexpr const char* name = "collab_head";
  static constexpr bool decodes = true;
  template <class T> using Layer = headmix::CollabHead<T>;
  template <class T> using Problem = collab_case::Problem<T>;
  using Shape = collab_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) {
    return collab_case::make_problem<T>(s, seed);
  }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.S, p.s.D, p.s.Dkv, p.s.H, p.s.out_dim()};
  }
  template <class T> static std::string describe(const Problem<T>& p) { return collab_case::describe(p.s); }
  // Mixing: dense, banded, a zero row (a random head's), block, or dense
  // with 30 % zeros; o with or without its bias; LayerNorm weights of
  // either sign and two epsilons.
  template <class T> static DifferentialCase<Problem<T>> differential_case(Draw& d) {
    using collab_case::Mixing;
    int mixing = 0;
    const auto heads = [&](Shape& s) {
      s.H = d.integer(1, 4), s.R = d.integer(1, 12), s.Dv = d.integer(1, 6);
      s.layer_norm = d.coin(0.25), s.v_bias = d.coin(), s.content_bias = d.coin(0.75), mixing = d.integer(0, 4);
      s.mixing = mixing == 1 ? Mixing::banded : mixing == 2 ? Mixing::zero_row : mixing == 3 ? Mixing::block : Mixing::dense;
    };
    const auto tweak = [&](Problem<T>& p) {
      const int h = d.integer(0, p.s.H - 1);
      if (mixing == 2 && h != 0) p.w.mixing.row(0).swap(p.w.mixing.row(h));
      if (mixing == 4)
        for (headmix::Index i = 0; i < p.w.mixing.size(); ++i)
          if (d.coin(0.3)) p.w.mixing.data()[i] = T(0);
      const bool o_bias = d.coin();
      if (!o_bias) p.w.o.bias = headmix::Vector<T>();
      if (p.s.layer_norm)
        p.w.layer_norm.weight = random_matrix<T>(d.rng, p.s.D, 1, 1.5), p.w.layer_norm.eps = d.pick({1e-5, 1e-3});
      return " mixing_kind=" + std::to_string(mixing) + " o_bias=" + std::to_string(o_bias) +
             " ln_eps=" + std::to_string(p.w.layer_norm.eps);
    };
    return dense::differential<CollabHead, T>(d, heads, tweak);
  }
  // test_extremes.cpp (see Mha): one shared dimension mixed by 1, no
  // content bias; equal logits: K̃ = 0 and no content bias make every logit 0.
  static Shape limit_shape() {
    Shape s = dense::limit<Shape>();
    s.H = 1, s.R = 1, s.Dv = 3, s.content_bias = false;
    return s;
  }
  template <class T> static void limit_logits(Problem<T>& p, double a) {
    p.w.mixing.setConstant(T(1));
    dense::limit_query_key(p, p.w.q, p.w.k, a);
  }
  template <class T> static void equal_logits(Problem<T>& p) { p.w.k.setZero(), p.w.content_bias = Matrix<T>(); }
  // Fully masked rows with the LayerNorm too: LN(x + o.bias), rounded in T.
  static std::vector<Shape> extremes_shapes(Shape s) {
    Shape ln = s;
    ln.layer_norm = true;
    return {s, ln};
  }
  template <class P> static bool masked_output_exact(const P& p) { return !p.s.layer_norm; }
  // test_decoding.cpp (see Mha): with and without the content bias, dense
  // and block mixing, without o, with the LayerNorm, windows 1 and 4, and
  // 150 positions (the cache's keys in three panels). Steps read no
  // bfloat16 K/V, so a bfloat16 cache is refused by name.
  static constexpr const char* bf16_cache_refusal =
      "[collab] cache precision: expected CachePrecision::full (this layer's steps read no bfloat16 streams), got "
      "CachePrecision::bfloat16";
  static std::vector<Shape> decoding_shapes() {
    std::vector<Shape> s(7);
    for (Shape& e : s) e.B = 2, e.T = 13, e.D = 12, e.R = 8, e.H = 4, e.Dv = 3, e.out = 12, e.causal = true;
    for (Shape& e : s) e.block_rows = 4;
    s[1].mixing = collab_case::Mixing::block, s[1].layer_norm = true;
    s[2].content_bias = false, s[2].out_proj = false;
    for (int i : {3, 4, 5}) s[i].layer_norm = true;
    s[4].window = 1, s[5].window = 4;
    s[6].T = 150, s[6].block_rows = 16;  // the cache's keys over three panels of 64 positions, the last narrower
    return s;
  }
  // With the content bias (its per-worker row) and the LayerNorm.
  static std::vector<Shape> decoding_allocation_shapes() {
    std::vector<Shape> s(2);
    for (Shape& e : s) e.D = 32, e.R = 16, e.H = 4, e.Dv = 8, e.out = 32, e.layer_norm = true, e.causal = true;
    for (Shape& e : s) e.block_rows = 64;
    s[0].B = 1, s[0].T = 300;
    s[1].B = 2, s[1].T = 100;
    return s;
  }
  static constexpr CausalCases decoding_conformance{"collab", 1};
  template <class T> static Layer<T> decoding_conformance_layer(const headmix::io::TensorFile& f) {
    return headmix::conformance::load_collab_case<T>(f);
  }
  // test_checkpoint_files.cpp (see Mha): with the LayerNorm.
  static std::vector<Shape> checkpoint_shapes() {
    Shape s;
    s.layer_norm = true;
    return {s};
  }
  template <class W, class F> static void for_each_tensor(W& w, F&& f) {
    f("q.weight", w.q), f("k.weight", w.k), f("mixing", w.mixing), f("content_bias.weight", w.content_bias);
    linear_tensors("v", w.v, f), linear_tensors("o", w.o, f);
    f("layer_norm.weight", w.layer_norm.weight), f("layer_norm.bias", w.layer_norm.bias);
  }
  template <class T> static void change_options(Problem<T>& p, int step) {  // ... and the scale
    DenseVariant::change_options(p, step);
    p.s.scale = step == 1 ? 0.3 : 0;
  }

  static std::vector<Shape> thread_shapes() {
    using collab_case::Mixing;
    std::vector<Shape> s(3);
    s[0] = dense::threads_cross<Shape>();
    s[1].B = 2, s[1].T = 150, s[1].D = 16, s[1].R = 12, s[1].block_rows = 16, s[1].layer_norm = true;
    s[2].B = 2, s[2].T = 140, s[2].cross = true, s[2].S = 200, s[2].mixing = Mixing::block, s[2].H = 3, s[2].R = 9,
    s[2].block_rows = 32;
    return s;
  }
  static std::vector<Shape> workspace_shapes() {
    std::vector<Shape> s(5);
    s[0].B = 3, s[0].T = 12, s[0].cross = true, s[0].S = 9, s[0].Dkv = 6, s[0].pad_rate = 0.3;
    s[1].B = 1, s[1].T = 2, s[1].H = 1, s[1].R = 3, s[1].Dv = 2;
    s[2].T = 7, s[2].causal = true, s[2].threads = 3, s[2].block_rows = 2, s[2].pad_rate = 0.3;
    s[3].B = 3, s[3].T = 20, s[3].D = 12, s[3].H = 3, s[3].R = 15, s[3].out_proj = false;
    s[4].B = 1, s[4].T = 1, s[4].cross = true, s[4].S = 4, s[4].Dkv = 2, s[4].content_bias = false;
    return s;
  }
  static Shape probs_shape() {
    Shape s;
    s.cross = true, s.T = 6, s.S = 9, s.H = 3, s.R = 7, s.causal = true, s.offset = 1, s.pad_rate = 0.3;
    return s;
  }
  static Shape allocating_shape() { return dense::allocating<Shape>(); }
  static Shape single_sequence_shape() { return dense::single_sequence<Shape>(); }
  static Shape options_shape() { return dense::options<Shape>(); }
  static Shape determinism_shape() {  // LayerNorm on: out = D
    Shape s = dense::determinism<Shape>();
    s.H = 3, s.R = 9, s.Dv = 3, s.layer_norm = true;
    return s;
  }
  static Shape determinism_decoding_shape() { return dense::self(determinism_shape()); }
  // Heads with narrower spans (banded mixing), LayerNorm, a negative offset.
  static std::vector<Shape> thread_safety_shapes() {
    Shape s = dense::thread_safety<Shape>();
    s.D = 10, s.Dkv = 6, s.H = 3, s.R = 9, s.Dv = 2, s.layer_norm = true, s.mixing = collab_case::Mixing::banded;
    s.offset = -1;
    return {s, dense::self(s)};
  }
  static std::vector<Shape> flops_shapes() {
    using collab_case::Mixing;
    std::vector<Shape> s(11);
    s[0].D = 16, s[0].R = 12, s[0].Dv = 8, s[0].out = 16, s[0].T = 7;
    s[1].cross = true, s[1].T = 5, s[1].S = 11, s[1].Dkv = 6, s[1].R = 5, s[1].Dv = 5, s[1].causal = true,
    s[1].out_proj = false;
    s[2].T = 8, s[2].causal = true, s[2].offset = -3, s[2].pad_rate = 0.5;
    s[3].cross = true, s[3].T = 3, s[3].S = 10, s[3].causal = true, s[3].offset = 7;
    s[4].T = 6, s[4].causal = true, s[4].offset = -20;  // nothing visible
    s[5].B = 3, s[5].T = 1, s[5].H = 3, s[5].out = 2, s[5].content_bias = false;
    s[6].H = 4, s[6].R = 16, s[6].T = 9, s[6].mixing = Mixing::block;
    s[7].H = 3, s[7].R = 11, s[7].T = 6, s[7].mixing = Mixing::banded, s[7].layer_norm = true;
    s[8].H = 2, s[8].T = 4, s[8].mixing = Mixing::zero_row, s[8].cross = true, s[8].S = 3;
    s[9].T = 9, s[9].causal = true, s[9].window = 3;  // only the pairs inside the window
    s[10].cross = true, s[10].T = 4, s[10].S = 12, s[10].causal = true, s[10].offset = 6, s[10].window = 5,
    s[10].pad_rate = 0.3, s[10].mixing = Mixing::block, s[10].H = 3;
    return s;
  }
  static Shape bad_input_shape() {
    Shape s;
    s.B = 2, s.T = 5, s.cross = true, s.S = 7, s.D = 16, s.Dkv = 12, s.H = 2, s.R = 6, s.Dv = 3, s.out = 10;
    return s;
  }
  static std::vector<Shape> non_finite_shapes() {  // without and with LayerNorm (out = D)
    Shape s = dense::non_finite<Shape>();
    s.H = 2, s.R = 4, s.Dv = 2;
    Shape ln = s;
    ln.layer_norm = true;
    return {s, ln};
  }
  static void masking_variation(Shape& s, unsigned seed) {
    s.mixing = seed % 3 == 1 ? collab_case::Mixing::block : collab_case::Mixing::dense, s.layer_norm = seed % 4 == 3;
  }
};

// ---------------------------------------------------------------------------
// DCMHA (causal by default, probs after the post-compose)

struct Dcmha : VariantBase {
  static constexpr const char* tag = "[dcmha]";
  static constexpr const char* name = "dcmha";
  // It takes a separate key sequence (tested in test_dcmha.cpp); its problems here are self-attention.
  static constexpr bool decodes = true, probs_sum_to_one = false, zero_sign_exact = false, gqa = true;
  template <class T> using GroupedQuery = dcmha_case::GroupedQuery<T>;
  template <class T> using Layer = headmix::Dcmha<T>;
  template <class T> using Problem = dcmha_case::Problem<T>;
  using Shape = dcmha_case::Config;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) {
    return dcmha_case::make_problem<T>(s, seed);
  }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.c.B, p.c.T, p.c.T, p.c.D, p.c.D, p.c.H, p.c.out_dim()};
  }
  template <class T> static const headmix::Matrix<T>& query(const Problem<T>& p) { return p.x; }
  template <class T> static std::string describe(const Problem<T>& p) { return dcmha_case::describe(p.c); }
  template <class T>
  static headmix_test::Tolerance reference_tolerance() {
    return headmix_test::dcmha_tolerance<T>();
  }
  template <class P> static P decoded_form(P p) {  // (see DenseVariant)
    p.c.causal = true, p.c.offset = 0;
    return p;
  }
  template <class P> static bool split_tasks(P& p) {
    return p.c.threads >= 2 && split_rows(p.c.block_rows, p.c.B, p.c.T);
  }
  // test_extremes.cpp (see VariantBase). Self-attention, so the limit's
  // logits are ±a²·x_i·x_j per head (head 1's query weight is negated). The
  // pre-compose would mix logits of ~a² across heads and overflow T itself,
  // so it is off; the post-compose (all dynamic terms and a static one) acts
  // on the one-hot weights. The last item's positions are all 1.
  static Shape limit_shape() {
    Shape s;
    s.B = 3, s.T = 6, s.D = 1, s.H = 2, s.G = 1, s.R = 1, s.K = 3, s.dk = 1, s.dv = 2, s.out = 3;
    s.static_w = true, s.use_pre = false, s.scale = 1, s.block_rows = 4;
    return s;
  }
  template <class T> static void limit_logits(Problem<T>& p, double a) {
    p.w.q.weight << static_cast<T>(a), static_cast<T>(-a);
    p.w.k.weight << static_cast<T>(a), static_cast<T>(a);
    p.w.pre_w = headmix::Tensor<T>();
    p.x.bottomRows(p.c.T).setConstant(T(1));
  }
  // Equal logits: all positions equal (identical rows of x), so every
  // visible key of a row carries the same composed weight.
  template <class T> static void equal_logits(Problem<T>& p) { p.x = p.x.row(0).replicate(p.x.rows(), 1).eval(); }
  template <class S> static void single_query(S& s, long offset) { s.T = 1, s.offset = offset, s.pad_rate = 0; }
  template <class P> static void set_masking(P& p, bool causal, long offset) { p.c.causal = causal, p.c.offset = offset; }
  // Every branch on or off, groups dividing H, windows, both GELUs, and the
  // W1 RMSNorm epsilon: the default, or large enough to change the result
  // (mean F² is O(0.1) with these weights). Steps need causal masking.
  template <class T> static DifferentialCase<Problem<T>> differential_case(Draw& d) {
    Shape s;
    s.B = d.integer(1, 3), s.T = d.integer(1, 16), s.D = d.integer(1, 10), s.H = d.pick({1, 2, 3, 4, 6});
    do s.G = d.integer(1, s.H);  // uniform over H's divisors
    while (s.H % s.G != 0);
    s.R = d.integer(1, 3), s.K = d.integer(1, 5), s.dk = d.integer(1, 4), s.dv = d.integer(1, 4);
    s.out = d.coin(0.75) ? d.integer(1, 10) : 0, s.bias = d.coin();
    s.use_pre = d.coin(0.7), s.use_post = d.coin(0.7), s.query_wise = d.coin(0.8), s.key_wise = d.coin(0.8);
    s.static_w = d.coin(0.4), s.causal = d.coin(0.7);
    if (s.causal && d.coin(0.4)) s.window = d.integer(1, s.T);
    s.gelu_tanh = d.coin();
    if (d.coin(0.2)) s.scale = d.real(0.05, 1.5);
    s.block_rows = d.pick<headmix::Index>({0, 0, 1, 2, d.integer(1, s.T + 1)});
    s.threads = d.integer(1, 4), s.dw_norm_eps = d.pick({1e-6, 1e-6, 0.05, 0.5});
    DifferentialCase<Problem<T>> c;
    c.decode = s.causal && d.coin(0.3);
    s.pad_rate = c.draw_padding(d);
    c.p = make<T>(s, d.seed());
    return c;
  }
  // test_decoding.cpp: DCMHA's looser bound (see VariantBase); steps whose
  // output must equal the full forward: every branch; a window with groups
  // and static terms; rank 1 without the pre-compose, with biases; no
  // key-wise term, no o; short query blocks.
  template <class T>
  static headmix_test::Tolerance step_tolerance() {
    return headmix_test::default_tolerance<T>().times(2);
  }
  static std::vector<Shape> decoding_shapes() {
    std::vector<Shape> s(5);
    s[0].T = 12;
    s[1].T = 10, s[1].window = 4, s[1].G = 2, s[1].static_w = true;
    s[2].T = 9, s[2].R = 1, s[2].use_pre = false, s[2].bias = true;
    s[3].T = 9, s[3].key_wise = false, s[3].B = 1, s[3].out = 0;
    s[4].T = 17, s[4].window = 5, s[4].G = 2, s[4].static_w = true, s[4].block_rows = 2;
    return s;
  }
  static std::vector<Shape> decoding_allocation_shapes() {
    Shape s;
    s.T = 12, s.B = 2, s.G = 2, s.static_w = true, s.window = 6;
    return {s};
  }
  static constexpr CausalCases decoding_conformance{"dcmha", 5};  // every case there is causal
  template <class T> static Layer<T> decoding_conformance_layer(const headmix::io::TensorFile& f) {
    return headmix::conformance::load_dcmha_case<T>(f);
  }
  // test_checkpoint_files.cpp (see Mha): biases and static terms.
  static std::vector<Shape> checkpoint_shapes() {
    Shape s;
    s.bias = true, s.static_w = true;
    return {s};
  }
  template <class W, class F> static void for_each_tensor(W& w, F&& f) {
    linear_tensors("q", w.q, f), linear_tensors("k", w.k, f), linear_tensors("v", w.v, f), linear_tensors("o", w.o, f);
    f("dc.dw1", w.dw1), f("dc.qkw", w.qkw), f("dc.dd", w.dd), f("dc.pre_w", w.pre_w), f("dc.post_w", w.post_w);
  }
  template <class T> static void set_threads(Problem<T>& p, int n) { p.c.threads = n; }
  // Branches, window, offset, block size and threads between calls.
  template <class T> static void change_options(Problem<T>& p, int step) {
    p.c.use_pre = step != 1, p.c.window = step == 1 ? 3 : 0, p.c.offset = step == 2 ? -2 : 0;
    p.c.block_rows = 2 * step, p.c.threads = 1 + step;
  }
  // flops() equals the reference's multiply-adds kind by kind.
  template <class P> static void expect_flops(const P& p) {
    const auto want = p.reference();
    const headmix::DcmhaFlops got = p.layer().flop_breakdown(p.c.B, p.c.T, p.c.T);
    EXPECT_EQ(got.projection_macs, want.projection_macs);
    EXPECT_EQ(got.dynamic_macs, want.dynamic_macs);
    EXPECT_EQ(got.score_macs, want.score_macs);
    EXPECT_EQ(got.compose_macs, want.compose_macs);
    EXPECT_EQ(p.layer().flops(p.c.B, p.c.T, p.c.T).macs(),
              want.projection_macs + want.dynamic_macs + want.score_macs + want.compose_macs);
  }

  static std::vector<Shape> thread_shapes() {
    std::vector<Shape> s(2);
    s[0].B = 3, s[0].T = 150, s[0].D = 16, s[0].H = 4, s[0].G = 2, s[0].static_w = true, s[0].block_rows = 7,
    s[0].pad_rate = 0.1;
    s[1] = s[0];
    s[1].window = 5, s[1].pad_rate = 0, s[1].block_rows = 0;
    return s;
  }
  static std::vector<Shape> workspace_shapes() {
    std::vector<Shape> s(4);
    s[0].T = 20, s[0].H = 8, s[0].G = 2;
    s[1].T = 5, s[1].B = 1;
    s[2].T = 13, s[2].static_w = true, s[2].window = 3;
    s[3].T = 20, s[3].H = 6, s[3].static_w = true;  // 6 heads a group: the static term as a GEMM, into scratch
    return s;
  }
  static Shape probs_shape() {
    Shape s;
    s.T = 6, s.offset = 1, s.pad_rate = 0.3;
    return s;
  }
  static Shape allocating_shape() {
    Shape s;
    s.B = 1, s.T = 6;
    return s;
  }
  static Shape single_sequence_shape() { return allocating_shape(); }
  static Shape options_shape() { return Shape(); }
  static Shape determinism_shape() {
    Shape s;
    s.B = 2, s.T = 37, s.D = 13, s.H = 4, s.G = 2, s.R = 2, s.K = 5, s.dk = 3, s.dv = 2, s.out = 7, s.bias = true;
    s.static_w = true, s.block_rows = 8;
    return s;
  }
  static Shape determinism_decoding_shape() { return determinism_shape(); }
  static std::vector<Shape> thread_safety_shapes() {  // a window, and decoding
    Shape s = determinism_shape();
    s.D = 10, s.window = 9;
    return {s};
  }
  static std::vector<Shape> flops_shapes() {
    std::vector<Shape> s(10);
    s[1].causal = false, s[1].static_w = true, s[1].out = 0;
    s[2].window = 3, s[2].T = 9, s[2].G = 2, s[2].R = 1;
    s[3].use_pre = false, s[3].key_wise = false, s[3].bias = true;
    s[4].use_post = false, s[4].query_wise = false, s[4].static_w = true, s[4].dk = 5;
    s[5].use_pre = s[5].use_post = false;
    s[6].H = 6, s[6].G = 3, s[6].R = 3, s[6].K = 4, s[6].pad_rate = 0.3, s[6].B = 1;
    s[7].T = 1, s[7].query_wise = s[7].key_wise = false;
    s[8].offset = -2, s[8].window = 3;  // only the pairs the offset and window leave
    s[9].offset = 3, s[9].T = 9, s[9].G = 2, s[9].static_w = true;
    return s;
  }
  static Shape bad_input_shape() {
    Shape s;
    s.B = 2, s.T = 5, s.D = 16, s.H = 4, s.G = 2, s.R = 2, s.K = 5, s.dk = 3, s.dv = 2, s.out = 7;
    s.static_w = true, s.pad_rate = 0.2;
    return s;
  }
  static std::vector<Shape> non_finite_shapes() {  // causal, static terms, 2-row blocks
    Shape s;
    s.B = 3, s.T = 6, s.D = 5, s.H = 4, s.G = 2, s.R = 1, s.K = 3, s.dk = 2, s.dv = 2, s.out = 4;
    s.bias = true, s.static_w = true, s.block_rows = 2;
    return {s};
  }
  static std::vector<Shape> decoder_shapes(Shape s) {
    Shape other = s;
    other.dv += 1;
    return {s, other};
  }
};

// ---------------------------------------------------------------------------
// LSH (self-attention over hashed buckets; no block_rows, no window)

struct Lsh : VariantBase {
  static constexpr const char* tag = "[lsh]";
  static constexpr const char* name = "lsh";
  static constexpr bool cross_keys = false, has_block_rows = false, window = false, finite_scale = false;
  static constexpr bool probs_sum_to_one = false, padding_isolated = false, has_buckets = true;
  static constexpr bool non_finite_reorders = true;
  template <class T> using Layer = headmix::Lsh<T>;
  template <class T> using Problem = lsh_case::Problem<T>;
  using Shape = lsh_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) { return lsh_case::make_problem<T>(s, seed); }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.T, p.s.D, p.s.D, p.s.H, p.s.out_dim()};
  }
  template <class T> static const headmix::Matrix<T>& query(const Problem<T>& p) { return p.x; }
  template <class T> static std::string describe(const Problem<T>& p) { return lsh_case::describe(p.s); }
  // test_checkpoint_files.cpp (see Mha): explicit rotations.
  static std::vector<Shape> checkpoint_shapes() { return {Shape()}; }
  template <class W, class F> static void for_each_tensor(W& w, F&& f) {
    linear_tensors("qk", w.qk, f), linear_tensors("v", w.v, f), linear_tensors("o", w.o, f);
    f("rotations", w.rotations);
  }
  template <class T> static void set_threads(Problem<T>& p, int n) { p.s.threads = n; }
  // Masking, bucket rules and threads between calls.
  template <class T> static void change_options(Problem<T>& p, int step) {
    p.s.causal = step > 0, p.s.across = step != 1, p.s.dup = step != 2, p.s.threads = 1 + step;
  }
  template <class P> static void expect_flops(const P& p) { VariantBase::expect_flops(p, p.s.B, p.s.T, p.s.T); }
  // test_differential.cpp: B·H (batch item, head) tasks.
  template <class P> static bool split_tasks(P& p) { return p.s.threads >= 2 && p.s.B * p.s.H >= 2; }
  // test_extremes.cpp (see VariantBase): no causal offset, finite masking,
  // logits bounded by the key norms; equal logits: all positions equal, so
  // every key has the same value and each output row is o(v(x)).
  static constexpr bool causal_offsets = false, masks_exactly = false, extremes_limit = false;
  static constexpr bool equal_logits_uniform = false;
  template <class T> static void equal_logits(Problem<T>& p) { p.x = p.x.row(0).replicate(p.x.rows(), 1).eval(); }
  template <class S> static void single_query(S& s, long) { s.T = 1, s.pad_rate = 0; }
  // Bucket sizes, rounds, fixed bucket counts, every bucket rule, per-head rotations.
  template <class T> static DifferentialCase<Problem<T>> differential_case(Draw& d) {
    Shape s;
    s.B = d.integer(1, 3), s.T = d.integer(1, 40), s.D = d.integer(1, 12), s.H = d.integer(1, 3);
    s.dh = d.integer(1, 6), s.dv = d.integer(1, 6), s.out = d.integer(1, 10);
    s.bs = d.integer(1, 6), s.NH = d.integer(1, 4), s.NB = d.coin(0.3) ? 2 * d.integer(1, 4) : 0;
    s.causal = d.coin(), s.across = d.coin(0.7), s.dup = d.coin(0.6), s.per_head = d.coin(0.3);
    s.threads = d.integer(1, 4), s.qkv_bias = d.coin(0.3), s.out_proj = d.coin(0.75), s.out_bias = d.coin();
    DifferentialCase<Problem<T>> c;
    s.pad_rate = c.draw_padding(d);
    c.p = make<T>(s, d.seed());  // hashing ignores padding: item 0's keys may be padded after
    return c;
  }
  // Explicit rotations, and per-head rotations drawn inside the tasks.
  template <class P>
  static std::vector<P> thread_variations(const P& p) {
    P seeded = p;
    seeded.w.rotations = decltype(p.w.rotations)();
    return {p, seeded};
  }

  static std::vector<Shape> thread_shapes() {
    std::vector<Shape> s(2);
    s[0].B = 3, s[0].H = 2, s[0].T = 30, s[0].NH = 3, s[0].causal = true, s[0].pad_rate = 0.2, s[0].per_head = true;
    s[1].B = 2, s[1].H = 3, s[1].T = 300, s[1].bs = 8, s[1].NH = 2, s[1].dup = false;
    return s;
  }
  static std::vector<Shape> workspace_shapes() {
    std::vector<Shape> s(4);
    s[0].B = 3, s[0].T = 40, s[0].NH = 3, s[0].pad_rate = 0.3, s[0].dup = false;
    s[1].B = 1, s[1].T = 5, s[1].H = 1, s[1].dh = 3, s[1].dv = 2;
    s[2].T = 20, s[2].causal = true, s[2].threads = 3, s[2].across = false;
    s[3].B = 2, s[3].T = 64, s[3].bs = 8, s[3].NH = 4, s[3].out_proj = false;
    return s;
  }
  static Shape probs_shape() {
    Shape s;
    s.T = 18, s.NH = 2, s.causal = true, s.pad_rate = 0.2;
    return s;
  }
  static Shape allocating_shape() {
    Shape s;
    s.B = 1, s.T = 21, s.NH = 2, s.out = 5;
    return s;
  }
  static Shape single_sequence_shape() { return allocating_shape(); }
  static Shape options_shape() {
    Shape s;
    s.T = 24, s.NH = 2, s.pad_rate = 0.2;
    return s;
  }
  static Shape determinism_shape() {
    Shape s;
    s.B = 2, s.T = 37, s.D = 13, s.H = 2, s.dh = 5, s.dv = 3, s.out = 8, s.bs = 4, s.NH = 3;
    return s;
  }
  // One shared rotation, and per-head ones without duplicates; a fixed
  // bucket count, so that the rotations fit every call's length.
  static std::vector<Shape> thread_safety_shapes() {
    Shape s;
    s.B = 2, s.T = 37, s.D = 10, s.H = 2, s.dh = 4, s.dv = 3, s.out = 8, s.bs = 4, s.NH = 3, s.NB = 10;
    s.causal = true;
    Shape per_head = s;
    per_head.per_head = true, per_head.dup = false;
    return {s, per_head};
  }
  // Per-head rotations are per batch item: those calls keep the batch size.
  static Shape thread_safety_resized(Shape s, int B, int T, double pad_rate) {
    const int batch = s.B;
    s = VariantBase::thread_safety_resized(s, B, T, pad_rate);
    if (s.per_head) s.B = batch;
    return s;
  }
  // Projections of the T real rows, then per head key norms and hashing of
  // all Tp positions, (dh + dv) per slot of every row's 2·bs window, and
  // NH·dv per real position to merge the rounds.
  static std::vector<Shape> flops_shapes() {
    std::vector<Shape> s(5);
    s[0].T = 16, s[0].NH = 1;
    s[1].T = 13, s[1].NH = 3, s[1].causal = true, s[1].out_proj = false;
    s[2].T = 20, s[2].NB = 6, s[2].dh = 5, s[2].dv = 3, s[2].dup = false, s[2].pad_rate = 0.3;
    s[3].B = 3, s[3].T = 3, s[3].H = 3, s[3].bs = 2, s[3].across = false, s[3].per_head = true;
    s[4].B = 1, s[4].T = 40, s[4].bs = 8, s[4].NH = 2, s[4].out_bias = false;
    return s;
  }
  static Shape bad_input_shape() {
    Shape s;
    s.B = 2, s.T = 16, s.D = 12, s.H = 2, s.dh = 4, s.dv = 3, s.out = 10, s.bs = 4, s.NH = 2;
    return s;
  }
  static std::vector<Shape> non_finite_shapes() {  // T = 8: 4 buckets of 2, three rounds
    Shape s;
    s.B = 3, s.T = 8, s.D = 5, s.H = 2, s.dh = 2, s.dv = 2, s.out = 4, s.bs = 2, s.NH = 3;
    return {s};
  }
};

/// A variant in one scalar type, for the typed tests that run in both.
template <class V, class T>
struct In {
  using Variant = V;
  using Scalar = T;
};

/// The variants the typed suites run over: every one, and the dense ones,
/// whose shapes share the masking fields (cross, S, Dkv, causal, offset,
/// window, pad_rate, block_rows; tests/test_masking.cpp). A new variant
/// joins here.
template <class... V>
struct VariantList {
  using Each = ::testing::Types<V...>;
  using InBothScalars = ::testing::Types<In<V, float>..., In<V, double>...>;
};
using All = VariantList<Mha, TalkingHeads, CollabHead, Dcmha, Lsh>;
using Dense = VariantList<Mha, TalkingHeads, CollabHead>;

using AllVariants = All::Each;
using AllVariantsInBothScalars = All::InBothScalars;
using DenseVariantsInBothScalars = Dense::InBothScalars;

/// Names typed tests by variant ("mha", ...) instead of 0, 1, ...
struct VariantName {
  template <class V>
  static std::string GetName(int) {
    return V::name;
  }
};
/// ... and by variant and scalar ("mha_float", ...).
struct VariantInName {
  template <class X>
  static std::string GetName(int) {
    return std::string(X::Variant::name) + (std::is_same_v<typename X::Scalar, float> ? "_float" : "_double");
  }
};

}  // namespace headmix_test::variants
