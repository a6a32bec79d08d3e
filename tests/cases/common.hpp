// What every variant's test problem (cases/<variant>.hpp) shares: running
// it, and comparing output and probs with its naive double reference. A
// Problem<T> provides layer(), input(), reference() (with .output and
// .probs), out_shape() and probs_shape().
#pragma once

#include "test_util.hpp"  // first: it may set Eigen up for counting allocations
#include "headmix/headmix.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace headmix_test {

template <class T>
struct Result {
  Tensor<T> out, probs;
};

/// One forward call of p's layer; with_probs = false takes the path that keeps no weights.
template <template <class> class P, class T>
Result<T> run(const P<T>& p, headmix::Workspace<T>& ws, bool with_probs = true) {
  Result<T> r;
  r.out = Tensor<T>(p.out_shape());
  p.layer().forward(p.input(), r.out.batch(), ws, with_probs ? &r.probs : nullptr);
  return r;
}

template <template <class> class P, class T>
Result<T> run(const P<T>& p, bool with_probs = true) {
  headmix::Workspace<T> ws;
  return run(p, ws, with_probs);
}

/// The dense variants' input: queries, keys when cross-attending, padding when any.
template <class T, class S>
headmix::AttentionInput<T> dense_input(const S& s, const Matrix<T>& xq, const Matrix<T>& xk,
                                       const std::vector<std::uint8_t>& padding) {
  headmix::AttentionInput<T> in;
  in.query = headmix::ConstBatchView<T>(xq.data(), s.B, s.T, s.D);
  if (s.cross) in.key = headmix::ConstBatchView<T>(xk.data(), s.B, s.S, s.Dkv);
  if (!padding.empty()) in.key_padding = headmix::KeyPadding{padding.data(), s.B, s.S};
  return in;
}

/// The options the dense layers share (Mha, TalkingHeads, CollabHead), from
/// a case's shape; each case sets its own fields on top.
template <class O, class S>
O dense_options(const S& s) {
  O o;
  o.num_heads = s.H, o.causal = s.causal, o.causal_offset = s.offset, o.window = s.window;
  o.block_rows = s.block_rows, o.threads = s.threads;
  return o;
}

/// A dense reference call f(q, k) with the queries and, for cross-attention,
/// the keys as the reference's Batch (k is nullptr for self-attention).
template <class Batch, class S, class T, class F>
auto dense_reference(const S& s, const Matrix<T>& xq, const Matrix<T>& xk, F&& f) {
  const Batch q = ref_batch_as<Batch>(xq, s.B);
  if (!s.cross) return f(q, static_cast<const Batch*>(nullptr));
  const Batch k = ref_batch_as<Batch>(xk, s.B);
  return f(q, &k);
}

/// A headmix Linear as whichever reference Linear it initialises (the
/// references each have their own struct with the same fields).
template <class T>
struct RefLinearOf {
  const headmix::Linear<T>& lin;
  template <class R>
  operator R() const {
    return ref_linear_as<R>(lin);
  }
};
template <class T>
RefLinearOf<T> to_ref(const headmix::Linear<T>& lin) {
  return {lin};
}

/// Self-attention's input: x is [B*T, D], padding [B, T] or empty.
template <class T>
headmix::AttentionInput<T> self_input(const Matrix<T>& x, Index B, Index T_, Index D,
                                      const std::vector<std::uint8_t>& padding) {
  headmix::AttentionInput<T> in;
  in.query = headmix::ConstBatchView<T>(x.data(), B, T_, D);
  if (!padding.empty()) in.key_padding = headmix::KeyPadding{padding.data(), B, T_};
  return in;
}

/// The random-shape tests of the dense cases (test_mha.cpp, ...): 80
/// problems of 1-3 items, 1-12 rows and widths, self- or cross-attention,
/// value heads of width 1-6, an output projection three times in four,
/// causal half the time with an offset in [-3, 3], padding (rate 0.3) a
/// third of the time, one of `blocks` query rows and 1-3 threads. The
/// variant draws its own fields with draw_own(rng, s); each problem's shape
/// and seed go to check(s, seed).
template <class S, std::size_t N, class DrawOwn, class Check>
void for_random_dense_shapes(unsigned seed, const Index (&blocks)[N], DrawOwn draw_own, Check check) {
  Rng rng(seed);
  for (unsigned n = 0; n < 80; ++n) {
    S s;
    s.B = uniform_int(rng, 1, 3), s.T = uniform_int(rng, 1, 12), s.cross = uniform_int(rng, 0, 1) == 1;
    s.S = uniform_int(rng, 1, 12), s.D = uniform_int(rng, 1, 12), s.Dkv = uniform_int(rng, 1, 12);
    s.Dv = uniform_int(rng, 1, 6), s.out_proj = uniform_int(rng, 0, 3) != 0, s.out = uniform_int(rng, 1, 12);
    draw_own(rng, s);
    s.causal = uniform_int(rng, 0, 1) == 1;
    s.offset = s.causal ? uniform_int(rng, -3, 3) : 0;
    s.pad_rate = uniform_int(rng, 0, 2) == 0 ? 0.3 : 0.0;
    s.block_rows = blocks[uniform_int(rng, 0, static_cast<int>(N) - 1)];
    s.threads = uniform_int(rng, 1, 3);
    check(s, 1000 + n);
  }
}

/// rows·keys padding flags, each set with chance rate (none when rate is 0).
inline std::vector<std::uint8_t> random_padding(Rng& rng, Index rows, Index keys, double rate) {
  std::vector<std::uint8_t> padding;
  if (rate > 0) {
    padding.resize(static_cast<std::size_t>(rows * keys));
    for (auto& m : padding) m = uniform(rng, 0, 1) < rate ? 1 : 0;
  }
  return padding;
}

/// A run of p against p.reference(): shapes, output and probs within tol.
template <template <class> class P, class T>
struct Compared {
  Result<T> got;
  decltype(std::declval<const P<T>&>().reference()) want;
};
template <template <class> class P, class T>
Compared<P, T> compare_with_reference(const P<T>& p, Tolerance tol, bool with_probs = true) {
  SCOPED_TRACE(p.describe());
  Compared<P, T> c{run(p, with_probs), p.reference()};
  EXPECT_EQ(c.got.out.shape(), p.out_shape());
  EXPECT_TRUE(all_close("output", c.got.out, c.want.output, tol));
  if (with_probs) {
    EXPECT_EQ(c.got.probs.shape(), p.probs_shape());
    EXPECT_TRUE(all_close("probs", c.got.probs, c.want.probs, tol));
  }
  return c;
}

/// The default comparison; a case with more to check (MHA's exact zeros,
/// LSH's buckets) overloads it for its own Problem.
template <template <class> class P, class T>
void expect_matches_reference(const P<T>& p, Tolerance tol = default_tolerance<T>()) {
  compare_with_reference(p, tol);
}

/// The dense cases' inputs: queries, keys for cross-attention, padding.
template <class P>
void draw_dense_inputs(Rng& rng, P& p) {
  using T = typename decltype(p.xq)::Scalar;
  const auto& s = p.s;
  p.xq = random_matrix<T>(rng, s.B * s.T, s.D, 1.0);
  if (s.cross) p.xk = random_matrix<T>(rng, s.B * s.S, s.Dkv, 1.0);
  p.padding = random_padding(rng, s.B, s.S, s.pad_rate);
}

/// Every entry finite.
template <class T>
::testing::AssertionResult all_finite(const char* what, const Tensor<T>& t) {
  for (Index i = 0; i < t.size(); ++i)
    if (!std::isfinite(static_cast<double>(t[i])))
      return ::testing::AssertionFailure() << what << "[" << i << "] is " << t[i];
  return ::testing::AssertionSuccess();
}

/// Rows [0, rows) of batch item b that see no key: their output is exactly
/// want(c) (the output bias, or 0) ...
template <class T, class Want>
void expect_rows_output(const Result<T>& got, Index b, Index rows, Want&& want) {
  const auto out = got.out.batch().item(b);
  for (Index i = 0; i < rows; ++i)
    for (Index c = 0; c < got.out.dim(2); ++c)
      EXPECT_EQ(out(i, c), want(c)) << "item " << b << " row " << i << " col " << c;
}
/// ... and their weights [B, heads, T, S] exactly 0 in every head.
template <class T>
void expect_rows_weights_zero(const Result<T>& got, Index b, Index rows) {
  const Index H = got.probs.dim(1), T_ = got.probs.dim(2), S = got.probs.dim(3);
  for (Index h = 0; h < H; ++h)
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < S; ++j)
        EXPECT_EQ(got.probs[((b * H + h) * T_ + i) * S + j], T(0)) << "item " << b << " head " << h << " row " << i;
}

/// The per-variant BadInput fixtures' plumbing: a valid cross-attention
/// setup in double whose weights (w) and options (opt) the derived fixture
/// fills; each test breaks one thing and calls build() or forward().
template <class Layer, class Weights, class Options>
class CrossBadInput : public ::testing::Test {
 protected:
  CrossBadInput(Index B, Index T, Index S, Index D, Index Dkv, Index out_dim)
      : padding(static_cast<std::size_t>(B * S), 0), B_(B), T_(T), S_(S), D_(D), Dkv_(Dkv), out_dim_(out_dim) {
    Rng rng(98);
    xq = random_matrix<double>(rng, B * T, D, 1.0);
    xk = random_matrix<double>(rng, B * S, Dkv, 1.0);
    out.resize(B * T, out_dim);
  }
  headmix::AttentionInput<double> input() const {
    return {headmix::ConstBatchView<double>(xq.data(), B_, T_, D_),
            headmix::ConstBatchView<double>(xk.data(), B_, S_, Dkv_), headmix::KeyPadding{padding.data(), B_, S_}};
  }
  headmix::BatchView<double> out_view() { return headmix::BatchView<double>(out.data(), B_, T_, out_dim_); }
  void build() const { Layer layer(w, opt); }
  void forward(const headmix::AttentionInput<double>& in, headmix::BatchView<double> dst) const {
    Layer layer(w, opt);
    headmix::Workspace<double> ws;
    layer.forward(in, dst, ws);
  }

  Weights w;
  Options opt;
  Matrix<double> xq, xk, out;
  std::vector<std::uint8_t> padding;

 private:
  Index B_, T_, S_, D_, Dkv_, out_dim_;
};

// The reference gives masked keys exactly 0 (and float underflows before
// double does), so wherever it has 0 the layer must have 0 exactly, not ~1e-38.
template <class T>
::testing::AssertionResult masked_weights_exactly_zero(const Tensor<T>& got, const std::vector<double>& want) {
  if (static_cast<std::size_t>(got.size()) != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (std::size_t i = 0; i < want.size(); ++i)
    if (want[i] == 0 && got[static_cast<Index>(i)] != T(0))
      return ::testing::AssertionFailure() << "masked weight at flat index " << i << " is "
                                           << got[static_cast<Index>(i)] << ", not 0";
  return ::testing::AssertionSuccess();
}

/// Rows of `lin` repeated by head: out head j is stored head j / group, each
/// head `width` rows. A grouped-query layer's K or V expanded to one head
/// per query head (test_grouped_query.cpp), by plain loops.
template <class T>
headmix::Linear<T> repeat_kv_heads(const headmix::Linear<T>& lin, Index heads, Index group, Index width) {
  headmix::Linear<T> out;
  out.weight.resize(heads * width, lin.weight.cols());
  if (lin.has_bias()) out.bias.resize(heads * width);
  for (Index j = 0; j < heads; ++j)
    for (Index r = 0; r < width; ++r) {
      out.weight.row(j * width + r) = lin.weight.row(j / group * width + r);
      if (lin.has_bias()) out.bias(j * width + r) = lin.bias(j / group * width + r);
    }
  return out;
}

/// Weights `w` (of kv stored K/V heads) with K repeated over k_heads heads
/// of dk rows and V over v_heads heads of dv rows.
template <class W>
W with_repeated_kv(W w, Index k_heads, Index v_heads, Index kv, Index dk, Index dv) {
  w.k = repeat_kv_heads(w.k, k_heads, k_heads / kv, dk);
  w.v = repeat_kv_heads(w.v, v_heads, v_heads / kv, dv);
  return w;
}

}  // namespace headmix_test
