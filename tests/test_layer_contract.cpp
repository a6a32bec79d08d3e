// The contract every attention layer keeps, as typed tests over the variant
// list in tests/variants.hpp: a new variant is covered by one entry there.
//
// Part 1 (float and double): thread counts do not change a bit; a reused
// Workspace gives what a fresh one gives and stops growing; probs arrive
// resized and fully written; the allocating and single-sequence forms equal
// the buffer form; set_options() between calls; flops() equals the naive
// reference's count. Expected values come from the naive double references
// (Problem::reference(), tests/reference/*), with each variant's own shapes.
//
// Part 2 (double): the argument checks every layer shares. Each case breaks
// one thing of a valid setup and expects a shape_error whose message names
// the variant, the argument, what was expected and what was given. The
// checks of a variant's own weights stay in its test file.

#include "variants.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;


// "[2, 5, 16]", as shape_error prints a shape.
std::string shape_text(std::initializer_list<Index> dims) {
  std::ostringstream o;
  o << '[';
  const char* sep = "";
  for (Index d : dims) o << sep << d, sep = ", ";
  o << ']';
  return o.str();
}

// ---------------------------------------------------------------------------
// Part 1: the contract, float and double

template <class Param>
class LayerContract : public ::testing::Test {
 public:
  using V = typename Param::Variant;
  using T = typename Param::Scalar;
  using Problem = typename V::template Problem<T>;
  using Shape = typename V::Shape;
  struct Outputs {
    Tensor<T> out, probs;
  };

  static Problem make(const Shape& s, unsigned seed) { return V::template make<T>(s, seed); }

  // fn(p, dims of p) for a problem p of each shape (seeds first_seed,
  // first_seed + 1, ...), with p described in every failure fn reports.
  template <class Fn>
  static void for_each_problem(const std::vector<Shape>& shapes, unsigned first_seed, Fn fn) {
    for (const Shape& shape : shapes) {
      const Problem p = make(shape, first_seed++);
      SCOPED_TRACE(V::describe(p));
      fn(p, V::dims(p));
    }
  }

  static Outputs run(const Problem& p, headmix::Workspace<T>& ws, bool with_probs = true) {
    const Dims d = V::dims(p);
    Outputs r;
    r.out = Tensor<T>({d.B, d.T, d.out});
    p.layer().forward(p.input(), r.out.batch(), ws, with_probs ? &r.probs : nullptr);
    return r;
  }
  static Outputs run(const Problem& p, bool with_probs = true) {
    headmix::Workspace<T> ws;
    return run(p, ws, with_probs);
  }

  // Bit for bit; where the variant allows it, +0 and -0 count as equal.
  static ::testing::AssertionResult same(const char* what, const Tensor<T>& a, const Tensor<T>& b) {
    if (V::zero_sign_exact) return bit_identical(what, a, b);
    if (a.shape() != b.shape()) return ::testing::AssertionFailure() << what << ": shapes differ";
    for (Index i = 0; i < a.size(); ++i)
      if (!(a[i] == b[i]) && !(a[i] != a[i] && b[i] != b[i]))
        return ::testing::AssertionFailure() << what << ": differ at " << i << ": " << a[i] << " vs " << b[i];
    return ::testing::AssertionSuccess();
  }

  static void expect_matches_reference(const Problem& p, const Outputs& got) {
    const auto want = p.reference();
    EXPECT_TRUE(all_close("output", got.out, want.output, default_tolerance<T>()));
    if (!got.probs.shape().empty()) {
      EXPECT_TRUE(all_close("probs", got.probs, want.probs, default_tolerance<T>()));
    }
  }
};
TYPED_TEST_SUITE(LayerContract, AllVariantsInBothScalars, VariantInName);

// Task boundaries do not depend on the thread count, so neither may a bit
// of the result.
TYPED_TEST(LayerContract, ThreadCountDoesNotChangeBits) {
  using F = TestFixture;
  using V = typename F::V;
  F::for_each_problem(V::thread_shapes(), 33, [](const auto& p, const Dims&) {
    for (auto q : V::thread_variations(p)) {
      const auto one = F::run(q);
      for (int threads : {2, 3}) {
        V::set_threads(q, threads);
        const auto many = F::run(q);
        EXPECT_TRUE(F::same("output", one.out, many.out)) << threads << " threads";
        EXPECT_TRUE(F::same("probs", one.probs, many.probs)) << threads << " threads";
      }
    }
    F::expect_matches_reference(p, F::run(p));
  });
}

// One Workspace through calls of growing, shrinking and differently shaped
// problems (twice round, with and without probs) gives what a fresh one
// gives, bit for bit.
TYPED_TEST(LayerContract, WorkspaceReusedAcrossShapes) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  const auto shapes = V::workspace_shapes();
  headmix::Workspace<T> ws;
  for (int round = 0; round < 2; ++round)
    for (std::size_t n = 0; n < shapes.size(); ++n) {
      const auto p = F::make(shapes[n], 40 + static_cast<unsigned>(n));
      SCOPED_TRACE(V::describe(p));
      for (bool with_probs : {true, false}) {
        const auto reused = F::run(p, ws, with_probs);
        const auto fresh = F::run(p, with_probs);
        EXPECT_TRUE(F::same("output", reused.out, fresh.out));
        EXPECT_TRUE(F::same("probs", reused.probs, fresh.probs));
        if (round == 0 && with_probs) F::expect_matches_reference(p, reused);
      }
    }
}

// Once a workspace has seen a shape, calls of that shape allocate nothing
// more. With one thread: with more, a second call may still grow it by the
// scratch of a worker that took no task the first time (seen in LSH and
// Talking-Heads).
TYPED_TEST(LayerContract, WorkspaceStopsGrowing) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  unsigned seed = 50;
  for (const auto& shape : V::workspace_shapes()) {
    auto p = F::make(shape, seed++);
    V::set_threads(p, 1);
    SCOPED_TRACE(V::describe(p));
    headmix::Workspace<T> ws;
    F::run(p, ws);
    const std::size_t bytes = ws.bytes();
    F::run(p, ws);
    EXPECT_EQ(ws.bytes(), bytes);
  }
}

// probs is resized to [B, heads, T, S] and every entry written, even when
// the tensor arrives with another shape and stale contents.
TYPED_TEST(LayerContract, ProbsOutputResizedAndFullyWritten) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  F::for_each_problem({V::probs_shape()}, 51, [](const auto& p, const Dims& d) {
    const auto want = p.reference();
    for (const std::vector<Index>& stale : {std::vector<Index>{1, 1, 1, 1000}, std::vector<Index>{3}}) {
      Tensor<T> probs(stale);
      std::fill(probs.data(), probs.data() + probs.size(), std::numeric_limits<T>::quiet_NaN());
      Tensor<T> out({d.B, d.T, d.out});
      headmix::Workspace<T> ws;
      p.layer().forward(p.input(), out.batch(), ws, &probs);
      EXPECT_EQ(probs.shape(), (std::vector<Index>{d.B, d.probs_heads, d.T, d.S}));
      EXPECT_TRUE(all_close("probs", probs, want.probs, default_tolerance<T>()));
      if (!V::probs_sum_to_one) continue;
      for (Index row = 0; row < probs.size() / d.S; ++row) {
        double sum = 0;
        for (Index j = 0; j < d.S; ++j) sum += static_cast<double>(probs[row * d.S + j]);
        // 1 where a key is visible; 0 for rows that see only masked keys.
        if (sum != 0) {
          EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
        }
      }
    }
  });
}

TYPED_TEST(LayerContract, AllocatingForwardMatchesBufferForward) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  F::for_each_problem({V::allocating_shape()}, 52, [](const auto& p, const Dims& d) {
    const auto expected = F::run(p);
    const auto layer = p.layer();
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    const Tensor<T> out = layer.forward(p.input(), ws, &probs);
    EXPECT_EQ(out.shape(), (std::vector<Index>{d.B, d.T, d.out}));
    EXPECT_TRUE(F::same("output", out, expected.out));
    EXPECT_TRUE(F::same("probs", probs, expected.probs));
    EXPECT_TRUE(F::same("output without probs", layer.forward(p.input(), ws), expected.out));
    EXPECT_TRUE(all_close("output", out, p.reference().output, default_tolerance<T>()));
  });
}

// forward(Matrix) is self-attention over one [T, D] sequence.
TYPED_TEST(LayerContract, SingleSequenceForward) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  F::for_each_problem({V::single_sequence_shape()}, 53, [](const auto& p, const Dims& d) {
    ASSERT_EQ(d.B, 1);
    const Matrix<T> y = p.layer().forward(V::query(p));
    ASSERT_EQ(y.rows(), d.T);
    ASSERT_EQ(y.cols(), d.out);
    EXPECT_TRUE(all_close("output", y.data(), static_cast<std::size_t>(y.size()), p.reference().output,
                          default_tolerance<T>()));
    const auto batched = F::run(p);
    for (Index i = 0; i < y.size(); ++i) EXPECT_EQ(y.data()[i], batched.out[i]) << i;
  });
}

// set_options() may change masking, block size, threads (and the variant's
// own switches) between calls; an invalid change throws and leaves the
// layer as it was.
TYPED_TEST(LayerContract, OptionsChangedBetweenCalls) {
  using F = TestFixture;
  using V = typename F::V;
  using T = typename F::T;
  auto p = F::make(V::options_shape(), 54);
  const Dims d = V::dims(p);
  auto layer = p.layer();
  headmix::Workspace<T> ws;
  Tensor<T> out({d.B, d.T, d.out});
  for (int step = 0; step < 3; ++step) {
    V::change_options(p, step);
    SCOPED_TRACE(V::describe(p));
    layer.set_options(p.options());
    layer.forward(p.input(), out.batch(), ws);
    EXPECT_TRUE(all_close("output", out, p.reference().output, default_tolerance<T>())) << "step " << step;
  }
  auto bad = p.options();
  bad.threads = 0;
  EXPECT_THROW(layer.set_options(bad), headmix::shape_error);
  EXPECT_EQ(layer.options().threads, p.options().threads);
  EXPECT_TRUE(F::same("after a failed set_options", layer.forward(p.input(), ws), out));
}

// flops() equals the multiply-adds the naive algorithm performs (the
// variant's entry says how it splits them).
TYPED_TEST(LayerContract, FlopsEqualReferenceCount) {
  using F = TestFixture;
  using V = typename F::V;
  F::for_each_problem(V::flops_shapes(), 60, [](const auto& p, const Dims&) { V::expect_flops(p); });
}

// ---------------------------------------------------------------------------
// Part 2: the argument checks every layer shares (double)

template <class V>
class LayerBadInput : public ::testing::Test {
 protected:
  using Problem = typename V::template Problem<double>;
  using Options = decltype(std::declval<Problem>().options());

  LayerBadInput() : p(V::template make<double>(V::bad_input_shape(), 99)), d(V::dims(p)) {
    out.resize(d.B * d.T, d.out);
  }
  headmix::BatchView<double> out_view() { return headmix::BatchView<double>(out.data(), d.B, d.T, d.out); }
  headmix::ConstBatchView<double> query(Index B, Index T, Index D) const {
    return headmix::ConstBatchView<double>(V::query(p).data(), B, T, D);
  }
  // p's input with its query viewed as [B, T, D].
  headmix::AttentionInput<double> with_query(Index B, Index T, Index D) const {
    auto in = p.input();
    in.query = query(B, T, D);
    return in;
  }
  void build(const Options& o) const { typename V::template Layer<double> layer(p.w, o); }
  void build() const { build(p.options()); }
  void forward(const headmix::AttentionInput<double>& in, headmix::BatchView<double> dst) const {
    headmix::Workspace<double> ws;
    p.layer().forward(in, dst, ws);
  }
  // build() with p's options changed by `edit` throws a shape_error naming `parts`.
  template <class Edit, class... Parts>
  void expect_option_error(Edit edit, const Parts&... parts) const {
    Options o = p.options();
    edit(o);
    HEADMIX_EXPECT_SHAPE_ERROR_IN(V::tag, build(o), parts...);
  }
  // forward(in) throws a shape_error naming `what`, the shape it wants and the one it got.
  void expect_input_error(const headmix::AttentionInput<double>& in, const char* what,
                          std::initializer_list<Index> want, std::initializer_list<Index> got) {
    HEADMIX_EXPECT_SHAPE_ERROR_IN(V::tag, forward(in, out_view()), what, "expected " + shape_text(want),
                                  "got " + shape_text(got));
  }

  Problem p;
  Dims d;
  Matrix<double> out;
};
TYPED_TEST_SUITE(LayerBadInput, AllVariants, VariantName);

#define EXPECT_SHAPE_ERROR(call, ...) HEADMIX_EXPECT_SHAPE_ERROR_IN(TypeParam::tag, call, __VA_ARGS__)

TYPED_TEST(LayerBadInput, ValidSetupRuns) {  // so that each failure below is the one broken thing
  EXPECT_NO_THROW(this->forward(this->p.input(), this->out_view()));
}

TYPED_TEST(LayerBadInput, ZeroHeads) {
  this->expect_option_error([](auto& o) { o.num_heads = 0; }, "num_heads", "expected >= 1", "got 0");
}

TYPED_TEST(LayerBadInput, ZeroThreads) {
  this->expect_option_error([](auto& o) { o.threads = 0; }, "threads", "expected >= 1", "got 0");
}

TYPED_TEST(LayerBadInput, NegativeBlockRows) {
  if constexpr (!TypeParam::has_block_rows) {
    GTEST_SKIP() << "no block_rows option";
  } else {
    this->expect_option_error([](auto& o) { o.block_rows = -1; }, "block_rows", "expected >= 0", "got -1");
  }
}

TYPED_TEST(LayerBadInput, NonFiniteScale) {
  if constexpr (!TypeParam::finite_scale) {
    GTEST_SKIP() << "scale is checked by the variant's own tests";
  } else {
    this->expect_option_error([](auto& o) { o.scale = std::numeric_limits<double>::quiet_NaN(); }, "scale",
                              "expected a finite number", "got nan");
    this->expect_option_error([](auto& o) { o.scale = std::numeric_limits<double>::infinity(); }, "scale",
                              "expected a finite number", "got inf");
  }
}

TYPED_TEST(LayerBadInput, WindowNeedsCausalAndIsNotNegative) {
  if constexpr (!TypeParam::window) {
    GTEST_SKIP() << "no window option";
  } else {
    this->expect_option_error([](auto& o) { o.causal = false, o.window = 2; }, "window",
                              "a window needs causal = true", "got 2");
    this->expect_option_error([](auto& o) { o.causal = true, o.window = -1; }, "window", "expected >= 0", "got -1");
  }
}

// An o.bias without an o.weight is a broken weight set, not "no output
// projection": it is rejected.
TYPED_TEST(LayerBadInput, OutputBiasWithoutOutputWeight) {
  auto& o = this->p.w.o;
  if (o.bias.size() == 0) o.bias = headmix::Vector<double>::Zero(o.weight.rows());
  o.weight.resize(0, 0);
  EXPECT_SHAPE_ERROR(this->build(), "o.weight", "got [0, 0]");
}

// o.weight is [out, heads · value width] and o.bias [out] (the per-variant
// files test their other weights).
TYPED_TEST(LayerBadInput, OutputWeightColumns) {
  auto& o = this->p.w.o;
  const Index rows = o.weight.rows(), cols = o.weight.cols();
  o.weight.conservativeResize(rows, cols - 1);
  EXPECT_SHAPE_ERROR(this->build(), "o.weight", "expected " + shape_text({rows, cols}),
                     "got " + shape_text({rows, cols - 1}));
}

TYPED_TEST(LayerBadInput, OutputBiasLength) {
  auto& o = this->p.w.o;
  const Index rows = o.weight.rows();
  o.bias = headmix::Vector<double>::Zero(rows - 1);
  EXPECT_SHAPE_ERROR(this->build(), "o.bias", "expected " + shape_text({rows}), "got " + shape_text({rows - 1}));
}

// set_options() validates like the constructor and keeps the old options
// when the new ones are invalid, so a layer never runs broken.
TYPED_TEST(LayerBadInput, SetOptionsValidatesAndKeepsTheOldOptions) {
  auto layer = this->p.layer();
  auto bad = this->p.options();
  bad.threads = 0;
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "threads", "expected >= 1", "got 0");
  bad = this->p.options();
  bad.num_heads = 0;
  EXPECT_SHAPE_ERROR(layer.set_options(bad), "num_heads", "expected >= 1", "got 0");
  EXPECT_EQ(layer.options().num_heads, this->p.options().num_heads);
  EXPECT_EQ(layer.options().threads, this->p.options().threads);
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(layer.forward(this->p.input(), this->out_view(), ws));
}

TYPED_TEST(LayerBadInput, QueryWidth) {
  const Dims d = this->d;
  this->expect_input_error(this->with_query(d.B, d.T, d.D - 1), "input.query", {d.B, d.T, d.D}, {d.B, d.T, d.D - 1});
}

TYPED_TEST(LayerBadInput, ZeroLengthQuery) {
  const Dims d = this->d;
  auto in = this->with_query(d.B, 0, d.D);
  in.key_padding = {};  // of self-attention it would follow the query
  EXPECT_SHAPE_ERROR(this->forward(in, headmix::BatchView<double>(this->out.data(), d.B, 0, d.out)), "input.query",
                     "T >= 1", "got " + shape_text({d.B, 0, d.D}));
}

TYPED_TEST(LayerBadInput, ZeroBatch) {
  const Dims d = this->d;
  const auto in = this->with_query(0, d.T, d.D);
  EXPECT_SHAPE_ERROR(this->forward(in, headmix::BatchView<double>(this->out.data(), 0, d.T, d.out)), "input.query",
                     "B >= 1", "got " + shape_text({0, d.T, d.D}));
}

TYPED_TEST(LayerBadInput, KeyPaddingMaskShape) {
  const Dims d = this->d;
  auto in = this->p.input();
  std::vector<std::uint8_t> padding(static_cast<std::size_t>(d.B * d.S), 0);
  in.key_padding = headmix::KeyPadding{padding.data(), d.B, d.S - 1};
  this->expect_input_error(in, "input.key_padding_mask", {d.B, d.S}, {d.B, d.S - 1});
  in.key_padding = headmix::KeyPadding{padding.data(), 1, d.S};
  this->expect_input_error(in, "input.key_padding_mask", {d.B, d.S}, {1, d.S});
}

TYPED_TEST(LayerBadInput, OutputBufferShape) {
  const Dims d = this->d;
  const std::string want = "expected " + shape_text({d.B, d.T, d.out});
  double* o = this->out.data();
  const auto in = this->p.input();
  EXPECT_SHAPE_ERROR(this->forward(in, headmix::BatchView<double>(o, d.B, d.T, d.out - 1)), "output", want,
                     "got " + shape_text({d.B, d.T, d.out - 1}));
  EXPECT_SHAPE_ERROR(this->forward(in, headmix::BatchView<double>(o, d.B, d.T - 1, d.out)), "output", want,
                     "got " + shape_text({d.B, d.T - 1, d.out}));
  EXPECT_SHAPE_ERROR(this->forward(in, headmix::BatchView<double>()), "output", want, "no buffer");
}

// Self-attention variants take no key sequence.
TYPED_TEST(LayerBadInput, KeyGivenToSelfAttention) {
  if (TypeParam::cross_keys) GTEST_SKIP() << "takes a key sequence";
  const Dims d = this->d;
  auto in = this->p.input();
  in.key = this->query(d.B, d.T, d.D);
  EXPECT_SHAPE_ERROR(this->forward(in, this->out_view()), "input.key", "expected none", "self-attention",
                     "got " + shape_text({d.B, d.T, d.D}));
}

// The key-sequence checks of the variants whose problems here are
// cross-attention, with a key width Dkv != D (DCMHA's keys: test_dcmha.cpp).
template <class V>
class CrossKeyBadInput : public LayerBadInput<V> {
 protected:
  // p's input with its key sequence viewed as [B, S, Dkv].
  headmix::AttentionInput<double> with_key(Index B, Index S, Index Dkv) const {
    auto in = this->p.input();
    in.key = headmix::ConstBatchView<double>(this->p.xk.data(), B, S, Dkv);
    return in;
  }
};
using CrossKeyVariants = ::testing::Types<Mha, TalkingHeads, CollabHead>;
TYPED_TEST_SUITE(CrossKeyBadInput, CrossKeyVariants, VariantName);

TYPED_TEST(CrossKeyBadInput, SetupIsCrossAttention) {
  EXPECT_TRUE(TypeParam::cross_keys);
  EXPECT_NE(this->d.Dkv, this->d.D);
  EXPECT_NE(this->d.S, this->d.T);
}

TYPED_TEST(CrossKeyBadInput, KeyWidth) {
  const Dims d = this->d;
  this->expect_input_error(this->with_key(d.B, d.S, d.Dkv - 1), "input.key", {d.B, d.S, d.Dkv}, {d.B, d.S, d.Dkv - 1});
}

TYPED_TEST(CrossKeyBadInput, KeyBatchNotQueryBatch) {
  const Dims d = this->d;
  this->expect_input_error(this->with_key(1, d.S, d.Dkv), "input.key", {d.B, d.S, d.Dkv}, {1, d.S, d.Dkv});
}

TYPED_TEST(CrossKeyBadInput, ZeroLengthKey) {
  const Dims d = this->d;
  auto in = this->with_key(d.B, 0, d.Dkv);
  in.key_padding = {};
  EXPECT_SHAPE_ERROR(this->forward(in, this->out_view()), "input.key",
                     "expected [" + std::to_string(d.B) + ", S >= 1, " + std::to_string(d.Dkv) + "]",
                     "got " + shape_text({d.B, 0, d.Dkv}));
}

// Self-attention uses the query as key; there is no key shape to show, so
// the message names the key width the layer wants and says none was given.
TYPED_TEST(CrossKeyBadInput, SelfAttentionWithKeyWidthNotEmbedWidth) {
  auto in = this->p.input();
  in.key = {};
  in.key_padding = {};
  EXPECT_SHAPE_ERROR(this->forward(in, this->out_view()), "input.key",
                     "expected a key sequence of width " + std::to_string(this->d.Dkv), "got none");
}

}  // namespace
