// One traits entry per attention variant, for the typed tests that every
// variant must pass (tests/test_layer_contract.cpp). An entry names the
// variant, builds a small random problem of it (its own cases/<variant>.hpp,
// which holds the naive double reference adapter), says what it can do, and
// lists the shapes that exercise its own paths in each contract test. A new
// variant is covered by one more entry here and in AllVariants.
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
//   expect_flops(p)              flops() against the reference's counts
#pragma once

#include "cases/collab_head.hpp"
#include "cases/dcmha.hpp"
#include "cases/lsh.hpp"
#include "cases/mha.hpp"
#include "cases/talking_heads.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

namespace headmix_test::variants {

/// A problem's sizes: probs are [B, probs_heads, T, S], the output [B, T, out].
struct Dims {
  headmix::Index B, T, S, D, Dkv, probs_heads, out;
};

/// What most variants share: flops() splits into projection and attention
/// multiply-adds exactly as the reference counts them.
struct VariantBase {
  static constexpr bool cross_keys = true, has_block_rows = true, window = true, gqa = false, decodes = false;
  static constexpr bool finite_scale = true, probs_sum_to_one = true;
  static constexpr bool zero_sign_exact = true;  // false: repeated runs may differ in the sign of a zero

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
// Cross-attention with an offset, padding and short blocks.
template <class S> S threads_cross() {
  S s;
  s.B = 3, s.T = 10, s.cross = true, s.S = 13, s.Dkv = 5;
  s.causal = true, s.offset = 2, s.pad_rate = 0.3, s.block_rows = 3;
  return s;
}
}  // namespace dense

// ---------------------------------------------------------------------------
// MHA

struct Mha : DenseVariant {
  static constexpr const char* tag = "[mha]";
  static constexpr const char* name = "mha";
  static constexpr bool gqa = true, decodes = true;
  template <class T> using Layer = headmix::Mha<T>;
  template <class T> using Problem = mha_case::Problem<T>;
  using Shape = mha_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) { return mha_case::make_problem<T>(s, seed); }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.S, p.s.D, p.s.Dkv, p.s.H, p.s.out_dim()};
  }
  template <class T> static std::string describe(const Problem<T>& p) { return mha_case::describe(p.s); }

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
};

// ---------------------------------------------------------------------------
// Talking-Heads (h_k, h and h_v heads; probs are the post-mixed weights)

struct TalkingHeads : DenseVariant {
  static constexpr const char* tag = "[talking_heads]";
  static constexpr const char* name = "talking_heads";
  static constexpr bool probs_sum_to_one = false;
  template <class T> using Layer = headmix::TalkingHeads<T>;
  template <class T> using Problem = th_case::Problem<T>;
  using Shape = th_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) { return th_case::make_problem<T>(s, seed); }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.S, p.s.D, p.s.Dkv, p.s.Hv, p.s.out_dim()};
  }
  template <class T> static std::string describe(const Problem<T>& p) { return th_case::describe(p.s); }

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
};

// ---------------------------------------------------------------------------
// CollabHead (shared query/key projections mixed per head)

struct CollabHead : DenseVariant {
  static constexpr const char* tag = "[collab]";
  static constexpr const char* name = "collab_head";
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
};

// ---------------------------------------------------------------------------
// DCMHA (causal by default, probs after the post-compose)

struct Dcmha : VariantBase {
  static constexpr const char* tag = "[dcmha]";
  static constexpr const char* name = "dcmha";
  // It takes a separate key sequence (tested in test_dcmha.cpp); its problems here are self-attention.
  static constexpr bool decodes = true, probs_sum_to_one = false, zero_sign_exact = false;
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
    std::vector<Shape> s(3);
    s[0].T = 20, s[0].H = 8, s[0].G = 2;
    s[1].T = 5, s[1].B = 1;
    s[2].T = 13, s[2].static_w = true, s[2].window = 3;
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
};

// ---------------------------------------------------------------------------
// LSH (self-attention over hashed buckets; no block_rows, no window)

struct Lsh : VariantBase {
  static constexpr const char* tag = "[lsh]";
  static constexpr const char* name = "lsh";
  static constexpr bool cross_keys = false, has_block_rows = false, window = false, finite_scale = false;
  static constexpr bool probs_sum_to_one = false;
  template <class T> using Layer = headmix::Lsh<T>;
  template <class T> using Problem = lsh_case::Problem<T>;
  using Shape = lsh_case::Shape;

  template <class T> static Problem<T> make(const Shape& s, unsigned seed) { return lsh_case::make_problem<T>(s, seed); }
  template <class T> static Dims dims(const Problem<T>& p) {
    return {p.s.B, p.s.T, p.s.T, p.s.D, p.s.D, p.s.H, p.s.out_dim()};
  }
  template <class T> static const headmix::Matrix<T>& query(const Problem<T>& p) { return p.x; }
  template <class T> static std::string describe(const Problem<T>& p) { return lsh_case::describe(p.s); }
  template <class T> static void set_threads(Problem<T>& p, int n) { p.s.threads = n; }
  // Masking, bucket rules and threads between calls.
  template <class T> static void change_options(Problem<T>& p, int step) {
    p.s.causal = step > 0, p.s.across = step != 1, p.s.dup = step != 2, p.s.threads = 1 + step;
  }
  template <class P> static void expect_flops(const P& p) { VariantBase::expect_flops(p, p.s.B, p.s.T, p.s.T); }
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
};

using AllVariants = ::testing::Types<Mha, TalkingHeads, CollabHead, Dcmha, Lsh>;

/// A variant in one scalar type, for the typed tests that run in both.
template <class V, class T>
struct In {
  using Variant = V;
  using Scalar = T;
};
using AllVariantsInBothScalars =
    ::testing::Types<In<Mha, float>, In<Mha, double>, In<TalkingHeads, float>, In<TalkingHeads, double>,
                     In<CollabHead, float>, In<CollabHead, double>, In<Dcmha, float>, In<Dcmha, double>,
                     In<Lsh, float>, In<Lsh, double>>;

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
