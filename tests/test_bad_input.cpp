// One catalogue of bad input over every public entry point of every variant,
// and the documented behaviour of NaN / Inf inputs.
//
// Part 1, the catalogue: a table of cases, each one valid call with exactly
// one thing broken (a weight shape, a head count that does not divide, a
// zero-sized extent, a mask or batch mismatch, a rank / bucket / group
// setting that cannot work, a bad file or cache). Every case names the
// exception type the entry point documents (headmix::shape_error,
// headmix::io::io_error, headmix::cache_full_error) and the text its
// message must contain: the variant, the argument, what was expected and
// what was given ("[mha] k.weight: expected [8, 12], got [6, 12]"). The
// per-variant BadInput suites test each check in depth; this table is the
// cross-section: one place that shows every entry point is guarded, and
// that the messages follow one format.
// The cases every layer shares are made for each entry of tests/variants.hpp
// from its valid setup (V::bad_input_shape(); decoders also V::decoder_shapes),
// as capabilities allow: a new variant gets them from its entry. The cases of
// one variant's own weights and options follow under "Variant-specific cases".
//
// Part 2, non-finite input. The contract tested here (and stated in the
// README) for every variant, float and double:
//   * nothing crashes, hangs or throws;
//   * batch items are independent: a NaN / Inf in item b leaves every other
//     item's output bit-identical;
//   * every output row is either bit-identical to the run without the bad
//     value or non-finite in every entry: a finite-looking but wrong row
//     never comes out;
//   * a row whose computation uses the bad value (its own query, or a key it
//     attends to) is non-finite in every entry.
// Masking does not shield other rows: a row that cannot see the bad key may
// still come out NaN (0 · NaN in the readout of its query block), as in
// PyTorch. Keep padded positions finite.
// LSH is the exception to "identical or non-finite" (V::non_finite_reorders):
// a bad position hashes to another bucket, which re-sorts the sequence and
// legitimately changes what other rows attend to. Its rows of the affected
// item are held to the naive reference instead: where the reference row is
// NaN / Inf the layer's must be non-finite, elsewhere it must match it.

#include "variants.hpp"
#include "headmix/decomp.hpp"
#include "headmix/headmix.hpp"
#include "headmix/io/safetensors.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_test::variants;
using headmix::BatchView;
using headmix::ConstBatchView;
using headmix::KeyPadding;

// "[2, 5, 16]", as shape_error prints a shape.
std::string shape_text(std::initializer_list<Index> dims) {
  std::string s;
  for (Index d : dims) s += (s.empty() ? "[" : ", ") + std::to_string(d);
  return s + "]";
}

// A TensorFile holding `m` under `name` (F64), for the from_tensors cases.
void put_matrix(headmix::io::TensorFile& f, const std::string& name, const Matrix<double>& m) {
  Tensor<double> t({m.rows(), m.cols()});
  std::copy_n(m.data(), m.size(), t.data());
  f.put(name, headmix::io::StoredTensor::from(t));
}
void put_vector(headmix::io::TensorFile& f, const std::string& name, const Vector<double>& v) {
  Tensor<double> t({v.size()});
  std::copy_n(v.data(), v.size(), t.data());
  f.put(name, headmix::io::StoredTensor::from(t));
}

// The named Linears' weights and biases as prefix + name + ".weight" / ".bias".
void put_linears(headmix::io::TensorFile& f, const std::string& prefix,
                 std::initializer_list<std::pair<const char*, const headmix::Linear<double>*>> parts) {
  for (const auto& [name, lin] : parts) {
    put_matrix(f, prefix + name + ".weight", lin->weight);
    if (lin->bias.size() != 0) put_vector(f, prefix + name + ".bias", lin->bias);
  }
}

// ---------------------------------------------------------------------------
// The catalogue

enum class Throws { shape_error, io_error, cache_full_error };

const char* name_of(Throws t) {
  switch (t) {
    case Throws::shape_error: return "headmix::shape_error";
    case Throws::io_error: return "headmix::io::io_error";
    case Throws::cache_full_error: return "headmix::cache_full_error";
  }
  return "?";
}

struct BadCase {
  std::string name;                   // <variant>_<entry point>_<what is broken>
  Throws expected;
  std::function<void()> call;
  std::vector<std::string> mentions;  // substrings the message must contain
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

// Zeros for the views a case breaks: a broken call throws before it reads
// more than a valid call of the setup would.
struct Scratch {
  std::vector<double> values = std::vector<double>(1 << 15, 0.0), outputs = values;
  std::vector<std::uint8_t> flags = std::vector<std::uint8_t>(1 << 12, 0);
  ConstBatchView<double> in(Index B, Index T, Index D) const { return {values.data(), B, T, D}; }
  BatchView<double> out(Index B, Index T, Index D) { return {outputs.data(), B, T, D}; }
  KeyPadding mask(Index B, Index S) const { return {flags.data(), B, S}; }
};

// Weights whose q and k are Linears (not CollabHead's shared matrices, not LSH's qk).
template <class W, class = void>
struct has_linear_qk : std::false_type {};
template <class W>
struct has_linear_qk<W, std::enable_if_t<std::is_same_v<decltype(W::q), headmix::Linear<double>> &&
                                         std::is_same_v<decltype(W::k), headmix::Linear<double>>>> : std::true_type {};

// Variant V's valid setup (V::bad_input_shape(), in double) and the ways a
// case breaks it. Each case gets a fresh copy of the setup.
template <class V>
struct Setup {
  using P = typename V::template Problem<double>;
  using Options = decltype(std::declval<const P&>().options());
  using Layer = typename V::template Layer<double>;
  using In = headmix::AttentionInput<double>;
  using Out = BatchView<double>;

  explicit Setup(std::vector<BadCase>& out) : cases(out) {}
  std::vector<BadCase>& cases;
  const P p = V::template make<double>(V::bad_input_shape(), 99);
  const Dims d = V::dims(p);
  const bool cross = !p.input().self_attention();

  // A case "<variant>_<what>"; its message holds the variant's tag, then
  // `first`, and each of `more`.
  void add(const std::string& what, std::function<void(P&)> call, const std::string& first,
           std::vector<std::string> more = {}, Throws t = Throws::shape_error) const {
    more.insert(more.begin(), std::string(V::tag) + " " + first);
    untagged(what, std::move(call), std::move(more), t);
  }
  void untagged(const std::string& what, std::function<void(P&)> call, std::vector<std::string> mentions,
                Throws t = Throws::io_error) const {
    cases.push_back({std::string(V::name) + "_" + what, t, [q = p, call] {
                       P copy = q;
                       call(copy);
                     },
                     std::move(mentions)});
  }
  // The constructor with changed options.
  void ctor(const std::string& what, std::function<void(Options&)> edit, const std::string& first,
            std::vector<std::string> more = {}) const {
    add(what, [edit](P& q) {
      Options o = q.options();
      edit(o);
      Layer layer(q.w, o);
    }, first, std::move(more));
  }
  // The constructor with changed weights (or shape fields the weights follow).
  void weights(const std::string& what, std::function<void(P&)> edit, const std::string& first,
               std::vector<std::string> more = {}) const {
    add(what, [edit](P& q) {
      edit(q);
      q.layer();
    }, first, std::move(more));
  }
  // set_options() on a valid layer.
  void set_options(const std::string& what, std::function<void(Options&)> edit, const std::string& first) const {
    add(what, [edit](P& q) {
      auto layer = q.layer();
      Options o = q.options();
      edit(o);
      layer.set_options(o);
    }, first);
  }
  // forward() with a changed input or output.
  void forward(const std::string& what, std::function<void(In&, Out&, Scratch&)> edit, const std::string& first,
               std::vector<std::string> more = {}) const {
    add(what, [edit, d = d](P& q) {
      Scratch z;
      In in = q.input();
      Out dst = z.out(d.B, d.T, d.out);
      edit(in, dst, z);
      headmix::Workspace<double> ws;
      q.layer().forward(in, dst, ws);
    }, first, std::move(more));
  }
};

// step(): n positions of x [B, n, D] into a cache of `batch` items and
// `capacity` positions, output [B, out_n, out].
template <class P>
void step(const P& p, const Dims& d, headmix::SequenceCache<double>& cache, Index n, Index D, Index out_n) {
  Scratch z;
  headmix::Workspace<double> ws;
  p.layer().step(z.in(d.B, n, D), cache, z.out(d.B, out_n, d.out), ws);
}

// The cases every layer shares, from V's setup and capabilities.
template <class V>
void shared_cases(std::vector<BadCase>& c) {
  const Setup<V> k(c);
  const Dims d = k.d;
  using Options = typename Setup<V>::Options;
  using In = typename Setup<V>::In;
  using Out = typename Setup<V>::Out;

  // ---- constructor and set_options -----------------------------------------
  k.ctor("ctor_zero_heads", [](Options& o) { o.num_heads = 0; }, "num_heads: expected >= 1, got 0");
  k.set_options("set_options_zero_threads", [](Options& o) { o.threads = 0; }, "threads: expected >= 1, got 0");
  if constexpr (V::has_block_rows)
    k.set_options("set_options_negative_block_rows", [](Options& o) { o.block_rows = -1; },
                  "block_rows: expected >= 0 (0 = automatic), got -1");
  if constexpr (V::finite_scale)
    k.set_options("set_options_infinite_scale", [](Options& o) { o.scale = std::numeric_limits<double>::infinity(); },
                  "scale: expected a finite number, got inf");
  if constexpr (V::window)
    k.ctor("ctor_window_without_causal", [](Options& o) { o.causal = false, o.window = 3; }, "window: expected ",
           {"a window needs causal = true), got 3"});
  const Index orows = k.p.w.o.weight.rows(), ocols = k.p.w.o.weight.cols();
  k.weights("ctor_output_columns", [](auto& q) {
    auto& w = q.w.o.weight;
    w.conservativeResize(w.rows(), w.cols() - 1);
  }, "o.weight: expected " + shape_text({orows, ocols}) + ", got " + shape_text({orows, ocols - 1}));
  k.weights("ctor_output_bias_length", [](auto& q) { q.w.o.bias = Vector<double>::Zero(q.w.o.weight.rows() - 1); },
            "o.bias: expected " + shape_text({orows}) + ", got " + shape_text({orows - 1}));
  // A bias without its weight is a broken weight set, not "no output projection".
  k.weights("ctor_output_bias_without_weight", [](auto& q) {
    q.w.o.bias = Vector<double>::Zero(q.w.o.weight.rows());
    q.w.o.weight.resize(0, 0);
  }, "o.weight", {"got [0, 0]"});

  // ---- projections: v in every variant, q and k where they are Linears ------
  const Index vrows = k.p.w.v.weight.rows(), vcols = k.p.w.v.weight.cols();
  k.weights("ctor_value_columns", [](auto& q) {
    auto& w = q.w.v.weight;
    w.conservativeResize(w.rows(), w.cols() - 1);
  }, "v.weight", {"expected " + shape_text({vrows, vcols}), "got " + shape_text({vrows, vcols - 1})});
  k.weights("ctor_value_bias_length", [](auto& q) { q.w.v.bias = Vector<double>::Zero(q.w.v.weight.rows() - 1); },
            "v.bias", {"expected " + shape_text({vrows}), "got " + shape_text({vrows - 1})});
  if constexpr (has_linear_qk<decltype(k.p.w)>::value) {
    const Index qrows = k.p.w.q.weight.rows(), kcols = k.p.w.k.weight.cols();
    k.weights("ctor_no_query_weight", [](auto& q) { q.w.q.weight.resize(0, 0); }, "q.weight", {"got [0, 0]"});
    k.weights("ctor_key_rows_not_query_rows", [](auto& q) {
      q.w.k.weight.conservativeResize(q.w.k.weight.rows() - 2, Eigen::NoChange);
      if (q.w.k.bias.size() != 0) q.w.k.bias.conservativeResize(q.w.k.weight.rows());
    }, "k.weight", {"expected " + shape_text({qrows, kcols}), "got " + shape_text({qrows - 2, kcols})});
    k.weights("ctor_query_bias_length", [](auto& q) { q.w.q.bias = Vector<double>::Zero(q.w.q.weight.rows() - 1); },
              "q.bias", {"expected " + shape_text({qrows}), "got " + shape_text({qrows - 1})});
    k.weights("ctor_key_bias_length", [](auto& q) { q.w.k.bias = Vector<double>::Zero(q.w.k.weight.rows() + 1); },
              "k.bias", {"expected " + shape_text({qrows}), "got " + shape_text({qrows + 1})});
  }

  // ---- forward ------------------------------------------------------------
  const std::string query_extents = "input.query: expected [B >= 1, T >= 1, " + std::to_string(d.D) + "], got ";
  k.forward("forward_zero_batch", [d](In& in, Out& out, Scratch& z) {
    in.query = z.in(0, d.T, d.D);
    out = z.out(0, d.T, d.out);
  }, query_extents + shape_text({0, d.T, d.D}));
  k.forward("forward_zero_length_query", [d, cross = k.cross](In& in, Out& out, Scratch& z) {
    in.query = z.in(d.B, 0, d.D);
    if (!cross) in.key_padding = {};  // self-attention's would follow the query
    out = z.out(d.B, 0, d.out);
  }, query_extents + shape_text({d.B, 0, d.D}));
  k.forward("forward_negative_length", [d](In& in, Out&, Scratch& z) { in.query = z.in(d.B, -3, d.D); },
            query_extents + shape_text({d.B, -3, d.D}));
  k.forward("forward_query_width", [d](In& in, Out&, Scratch& z) { in.query = z.in(d.B, d.T, d.D - 1); },
            "input.query: expected " + shape_text({d.B, d.T, d.D}) + ", got " + shape_text({d.B, d.T, d.D - 1}));
  const std::string mask_want = "input.key_padding_mask: expected " + shape_text({d.B, d.S}) + ", got ";
  k.forward("forward_padding_mask_length", [d](In& in, Out&, Scratch& z) { in.key_padding = z.mask(d.B, d.S - 1); },
            mask_want + shape_text({d.B, d.S - 1}));
  k.forward("forward_padding_mask_fewer_items", [d](In& in, Out&, Scratch& z) { in.key_padding = z.mask(1, d.S); },
            mask_want + shape_text({1, d.S}));
  k.forward("forward_padding_mask_more_items", [d](In& in, Out&, Scratch& z) { in.key_padding = z.mask(d.B + 1, d.S); },
            mask_want + shape_text({d.B + 1, d.S}));
  const std::string out_want = "output: expected " + shape_text({d.B, d.T, d.out}) + ", got ";
  k.forward("forward_output_width", [d](In&, Out& out, Scratch& z) { out = z.out(d.B, d.T, d.out - 1); },
            out_want + shape_text({d.B, d.T, d.out - 1}));
  k.forward("forward_output_batch", [d](In&, Out& out, Scratch& z) { out = z.out(1, d.T, d.out); },
            out_want + shape_text({1, d.T, d.out}));

  // ---- the key sequence ------------------------------------------------------
  if constexpr (V::cross_keys) {
    const std::string key_want = "input.key: expected " + shape_text({d.B, d.S, d.Dkv}) + ", got ";
    k.forward("forward_key_width", [d](In& in, Out&, Scratch& z) { in.key = z.in(d.B, d.S, d.Dkv - 1); },
              key_want + shape_text({d.B, d.S, d.Dkv - 1}));
    k.forward("forward_key_batch_not_query_batch", [d](In& in, Out&, Scratch& z) {
      in.key = z.in(1, d.S, d.Dkv);
      in.key_padding = {};
    }, key_want + shape_text({1, d.S, d.Dkv}));
    k.forward("forward_zero_keys", [d](In& in, Out&, Scratch& z) {
      in.key = z.in(d.B, 0, d.Dkv);
      in.key_padding = {};
    }, "input.key: expected [" + std::to_string(d.B) + ", S >= 1, " + std::to_string(d.Dkv) + "], got " +
           shape_text({d.B, 0, d.Dkv}));
  } else {
    k.forward("forward_key_sequence_given", [d](In& in, Out&, Scratch& z) { in.key = z.in(d.B, d.T, d.D); },
              "input.key: expected none (", {"self-attention", "got " + shape_text({d.B, d.T, d.D})});
  }
  // Without a key sequence the queries are the keys, which needs Dkv == D.
  const std::string self_key_want = "input.key: expected a key sequence of width " + std::to_string(d.Dkv);
  if (k.cross && d.Dkv != d.D)
    k.forward("forward_self_attention_needs_key_width_of_queries", [](In& in, Out&, Scratch&) {
      in.key = {};
      in.key_padding = {};
    }, self_key_want + " (self-attention needs key width == query width), got none");

  // ---- step (decoding) ----------------------------------------------------------
  if constexpr (V::decodes) {
    using P = typename Setup<V>::P;
    if (k.cross && d.Dkv != d.D)  // a decoder step has no key sequence
      k.add("step_on_cross_attention_layer", [d](P& q) {
        headmix::SequenceCache<double> cache(d.B, 4);
        step(q, d, cache, 1, d.D, 1);
      }, self_key_want, {"got none"});
    const auto shapes = V::decoder_shapes(V::bad_input_shape());
    const P dec = V::template make<double>(shapes[0], 98), other = V::template make<double>(shapes[1], 97);
    const Dims e = V::dims(dec), f = V::dims(other);
    auto on_decoder = [&](const std::string& what, std::function<void(const P&)> call, const std::string& first,
                          std::vector<std::string> more = {}, Throws t = Throws::shape_error) {
      k.add(what, [call, dec](P&) { call(dec); }, first, std::move(more), t);
    };
    on_decoder("step_cache_batch_not_input_batch", [e](const P& q) {
      headmix::SequenceCache<double> cache(e.B + 1, 8);
      step(q, e, cache, 1, e.D, 1);
    }, "cache batch: expected " + shape_text({e.B}) + ", got " + shape_text({e.B + 1}));
    on_decoder("step_cache_full", [e](const P& q) {
      headmix::SequenceCache<double> cache(e.B, 2);
      step(q, e, cache, 3, e.D, 3);
    }, "cache: 3 new positions do not fit (0 of 2 used)", {}, Throws::cache_full_error);
    on_decoder("step_cache_of_another_layer", [e, f, other](const P& q) {
      headmix::SequenceCache<double> cache(e.B, 4);
      step(other, f, cache, 1, f.D, 1);
      step(q, e, cache, 1, e.D, 1);
    }, "cache stream widths: expected [", {"got ["});
    on_decoder("step_output_length", [e](const P& q) {
      headmix::SequenceCache<double> cache(e.B, 4);
      step(q, e, cache, 2, e.D, 1);
    }, "output: expected " + shape_text({e.B, 2, e.out}) + ", got " + shape_text({e.B, 1, e.out}));
    on_decoder("step_query_width", [e](const P& q) {
      headmix::SequenceCache<double> cache(e.B, 4);
      step(q, e, cache, 1, e.D - 1, 1);
    }, "input.query: expected " + shape_text({e.B, 1, e.D}) + ", got " + shape_text({e.B, 1, e.D - 1}));
  }
}

template <class... Vs>
void add_shared_cases(std::vector<BadCase>& c, ::testing::Types<Vs...>*) {
  (shared_cases<Vs>(c), ...);
}
template <class... Vs>
std::vector<std::string> variant_names(::testing::Types<Vs...>*) {
  return {Vs::name...};
}

// ---------------------------------------------------------------------------
// Variant-specific cases: each variant's own weights, options and entry points

void mha_cases(std::vector<BadCase>& c) {
  using P = Setup<Mha>::P;
  const Setup<Mha> k(c);
  const auto& s = k.p.s;  // q [H·Dk, D], k [H·Dk, Dkv], v [H·Dv, Dkv]
  const Index qk = s.H * s.Dk, v = s.H * s.Dv;
  const std::string Dkv = std::to_string(s.Dkv);
  k.ctor("ctor_heads_do_not_divide_q_rows", [](auto& o) { o.num_heads = 3; },
         "q.weight: expected [num_heads * head_dim, D] with num_heads = 3, got " + shape_text({qk, s.D}));
  k.weights("ctor_zero_width_embedding", [](P& q) { q.w.q.weight.resize(q.w.q.weight.rows(), 0); },
            "q.weight columns (D): expected >= 1, got 0");
  k.weights("ctor_zero_width_values", [](P& q) {
    q.w.v.weight.resize(0, q.w.v.weight.cols());
    q.w.v.bias.resize(0);
  }, "v.weight: expected [num_heads * v_head_dim, Dkv] with num_heads = 2, got [0, " + Dkv + "]");

  // Weights from a file (from_tensors).
  auto file = [](const P& q) {
    headmix::io::TensorFile f;
    put_linears(f, "attn.", {{"q", &q.w.q}, {"k", &q.w.k}, {"v", &q.w.v}, {"o", &q.w.o}});
    return f;
  };
  auto from_file = [&k, file](const std::string& what, std::function<void(headmix::io::TensorFile&)> edit,
                              std::vector<std::string> mentions, Throws t) {
    k.untagged(what, [file, edit](P& q) {
      auto f = file(q);
      edit(f);
      headmix::Mha<double>::from_tensors(f, "attn.", q.options());
    }, std::move(mentions), t);
  };
  from_file("from_tensors_missing_weight", [](auto& f) { f.tensors.erase("attn.k.weight"); },
            {"missing tensor 'attn.k.weight'"}, Throws::io_error);
  from_file("from_tensors_weight_of_rank_1", [](auto& f) { put_vector(f, "attn.q.weight", Vector<double>::Zero(36)); },
            {"[io] attn.q.weight: expected a rank-2 tensor, got [36]"}, Throws::shape_error);
  from_file("from_tensors_bias_of_rank_2", [](auto& f) { put_matrix(f, "attn.v.bias", Matrix<double>::Zero(4, 1)); },
            {"[io] attn.v.bias: expected a rank-1 tensor, got [4, 1]"}, Throws::shape_error);
  from_file("from_tensors_weight_shape", [v, s](auto& f) { put_matrix(f, "attn.v.weight", Matrix<double>::Zero(v, s.Dkv - 1)); },
            {"[mha] attn.v.weight: expected " + shape_text({v, s.Dkv}) + ", got " + shape_text({v, s.Dkv - 1})},
            Throws::shape_error);
  // An o.bias that has lost its o.weight is a broken checkpoint, as the
  // constructor says for weights built in code.
  from_file("from_tensors_output_bias_without_weight", [](auto& f) { f.tensors.erase("attn.o.weight"); },
            {"missing tensor 'attn.o.weight'"}, Throws::io_error);
  // A zero-sized o.weight is a shape mismatch, not "no output projection"
  // (that is an absent tensor).
  from_file("from_tensors_output_weight_without_columns", [s](auto& f) {
    f.tensors.erase("attn.o.bias");
    put_matrix(f, "attn.o.weight", Matrix<double>(s.out, 0));
  }, {"[io] attn.o.weight: expected a tensor with at least one element", "got " + shape_text({s.out, 0})},
            Throws::shape_error);

  // MHA to CollabHead (decomp): the shared dimension R is 1 ..= H·Dk.
  const std::string rank_want = "[mha_to_collab] shared_dim: expected 1 <= R <= num_heads * head_dim = " +
                                std::to_string(qk) + ", got ";
  k.untagged("to_collab_rank_too_large", [qk](P& q) { headmix::decomp::mha_to_collab(q.layer(), qk + 1); },
             {rank_want + std::to_string(qk + 1)}, Throws::shape_error);
  k.untagged("to_collab_rank_zero", [](P& q) { headmix::decomp::mha_to_collab(q.layer(), 0); }, {rank_want + "0"},
             Throws::shape_error);
}

void talking_heads_cases(std::vector<BadCase>& c) {
  using P = Setup<TalkingHeads>::P;
  const Setup<TalkingHeads> k(c);
  const auto& s = k.p.s;  // three different head counts: pre [H, Hk], post [Hv, H]
  k.weights("ctor_pre_mix_transposed", [](P& q) { q.w.pre_softmax.transposeInPlace(); },
            "pre_softmax.weight: expected " + shape_text({s.H, s.Hk}) + ", got " + shape_text({s.Hk, s.H}));
  k.weights("ctor_missing_post_mix_with_unequal_heads", [](P& q) { q.w.post_softmax.resize(0, 0); },
            "post_softmax.weight: expected " + shape_text({s.Hv, s.H}) + " (num_heads = " + std::to_string(s.H) +
                " differs from value_heads = " + std::to_string(s.Hv),
            {"got none"});
  k.ctor("ctor_key_heads_do_not_divide", [](auto& o) { o.key_heads = 3; },
         "q.weight: expected [key_heads * head_dim, D] with key_heads = 3, got " + shape_text({s.Hk * s.Dk, s.D}));
  k.set_options("set_options_value_heads_do_not_divide", [](auto& o) { o.value_heads = 4; },
                "v.weight: expected [value_heads * v_head_dim, Dkv] with value_heads = 4, got " +
                    shape_text({s.Hv * s.Dv, s.Dkv}));
  auto from_file = [](std::function<void(headmix::io::TensorFile&)> edit) {
    return [edit](P& q) {
      headmix::io::TensorFile f;
      put_linears(f, "", {{"q", &q.w.q}, {"k", &q.w.k}, {"v", &q.w.v}, {"o", &q.w.o}});
      put_matrix(f, "pre_softmax.weight", q.w.pre_softmax);
      put_matrix(f, "post_softmax.weight", q.w.post_softmax);
      edit(f);
      headmix::TalkingHeads<double>::from_tensors(f, "", q.options());
    };
  };
  k.untagged("from_tensors_mix_of_rank_3", from_file([](auto& f) {
    Tensor<double> t({1, 3, 2});
    t.set_zero();
    f.put("pre_softmax.weight", headmix::io::StoredTensor::from(t));
  }), {"[io] pre_softmax.weight: expected a rank-2 tensor, got [1, 3, 2]"}, Throws::shape_error);
  k.untagged("from_tensors_output_bias_without_weight", from_file([](auto& f) { f.tensors.erase("o.weight"); }),
             {"missing tensor 'o.weight'"});
}

void collab_head_cases(std::vector<BadCase>& c) {
  using P = Setup<CollabHead>::P;
  const Setup<CollabHead> k(c);
  const auto& s = k.p.s;  // mixing [H, R], content bias [H, Dkv]
  k.weights("ctor_mixing_columns_not_shared_dim", [](P& q) { q.w.mixing.conservativeResize(Eigen::NoChange, 5); },
            "mixing: expected " + shape_text({s.H, s.R}) + ", got " + shape_text({s.H, 5}));
  k.ctor("ctor_mixing_rows_not_heads", [](auto& o) { o.num_heads = 1; },  // v still splits, mixing has H rows
         "mixing: expected " + shape_text({1, s.R}) + ", got " + shape_text({s.H, s.R}));
  k.weights("ctor_zero_shared_dim", [](P& q) { q.w.q.resize(0, q.w.q.cols()); },
            "q.weight: expected [R >= 1, D >= 1], got " + shape_text({0, s.D}));
  k.weights("ctor_content_bias_width", [](P& q) { q.w.content_bias.conservativeResize(Eigen::NoChange, q.s.Dkv + 1); },
            "content_bias.weight: expected " + shape_text({s.H, s.Dkv}) + ", got " + shape_text({s.H, s.Dkv + 1}));
  // LayerNorm(Xq + y): valid only with out_dim == D.
  auto with_layer_norm = [](P& q, Index out) {
    q.w.layer_norm.weight = Vector<double>::Ones(q.s.D);
    q.w.layer_norm.bias = Vector<double>::Zero(q.s.D);
    q.w.o.weight = Matrix<double>::Zero(out, q.w.o.weight.cols());
    q.w.o.bias = Vector<double>::Zero(out);
  };
  k.weights("ctor_layer_norm_needs_out_dim_of_embedding", [with_layer_norm](P& q) { with_layer_norm(q, q.s.D - 1); },
            "out_dim: expected " + std::to_string(s.D) + " (LayerNorm(Xq + y) needs out_dim == D), got " +
                std::to_string(s.D - 1));
  k.weights("ctor_layer_norm_eps_negative", [with_layer_norm](P& q) {
    with_layer_norm(q, q.s.D);
    q.w.layer_norm.eps = -1e-5;
  }, "layer_norm.eps: expected a finite number >= 0, got -0.000010");
}

void lsh_cases(std::vector<BadCase>& c) {
  using P = Setup<Lsh>::P;
  const Setup<Lsh> k(c);
  const auto& s = k.p.s;  // rotations [1, dh, NH, NB / 2] for the setup's length
  const std::string rot = "[1, " + std::to_string(s.dh) + ", ";
  const std::string rot_given = rot + std::to_string(s.NH) + ", " + std::to_string(s.n_buckets() / 2) + "]";
  k.weights("ctor_odd_bucket_count", [](P& q) {
    q.w.rotations = Tensor<double>();
    q.s.NB = 3;
  }, "n_buckets: expected 0 (padded length / bucket_size) or an even number >= 2, got 3");
  k.ctor("ctor_zero_bucket_size", [](auto& o) { o.bucket_size = 0; }, "bucket_size: expected >= 1, got 0");
  k.weights("ctor_zero_hash_rounds", [](P& q) {
    q.w.rotations = Tensor<double>();
    q.s.NH = 0;
  }, "n_hashes: expected >= 1, got 0");
  k.ctor("ctor_heads_do_not_divide_qk_rows", [](auto& o) { o.num_heads = 3; },
         "qk.weight: expected [num_heads * head_dim, D] with num_heads = 3, got " + shape_text({s.H * s.dh, s.D}));
  k.ctor("ctor_rotations_for_other_rounds", [](auto& o) { o.n_hashes = 3; }, "rotations: expected " + rot + "3, ",
         {"got " + rot_given});
  // A length that pads to another bucket count needs other rotations.
  const Index T2 = s.T + 2 * s.bs, nb2 = (T2 + 2 * s.bs - 1) / (2 * s.bs) * 2;
  k.forward("forward_rotations_for_another_length", [s, T2](auto& in, auto& out, Scratch& z) {
    in = {z.in(1, T2, s.D), {}, {}};
    out = z.out(1, T2, s.out_dim());
  }, "rotations: expected " + rot + std::to_string(s.NH) + ", " + std::to_string(nb2 / 2) + "], got " + rot_given);
  k.add("buckets_query_width", [](P& q) {
    Scratch z;
    headmix::Workspace<double> ws;
    q.layer().buckets({z.in(q.s.B, q.s.T, q.s.D - 1), {}, {}}, ws);
  }, "input.query: expected " + shape_text({s.B, s.T, s.D}) + ", got " + shape_text({s.B, s.T, s.D - 1}));
  k.add("flops_cross_lengths", [](P& q) { q.layer().flops(1, q.s.T, q.s.T + 1); },
        "keys: expected " + std::to_string(s.T) + " (self-attention: S == T), got " + std::to_string(s.T + 1));
}

void dcmha_cases(std::vector<BadCase>& c) {
  using P = Setup<Dcmha>::P;
  const Setup<Dcmha> k(c);
  const auto& s = k.p.c;  // H heads in G groups of M, rank R, hidden width K
  const Index G = s.G, M = s.M(), K = s.K;
  k.ctor("ctor_groups_do_not_divide_heads", [](auto& o) { o.groups = 3; },
         "groups: expected a divisor of num_heads = " + std::to_string(s.H) + ", got 3");
  k.ctor("ctor_rank_not_qkw", [](auto& o) { o.rank = 1; },  // qkw was drawn for rank 2
         "dc.qkw: expected " + shape_text({G, 4, K, 2, M}) + ", got " + shape_text({G, 4, K, 2 * s.R, M}));
  k.ctor("ctor_zero_rank", [](auto& o) { o.rank = 0; }, "rank: expected >= 1, got 0");
  k.weights("ctor_dw1_zero_hidden_width", [](P& q) { q.w.dw1 = Tensor<double>({q.c.D, q.c.G, 4, 0}); },
            "dc.dw1: expected [" + std::to_string(s.D) + ", " + std::to_string(G) + ", 4, K >= 1], got " +
                shape_text({s.D, G, 4, 0}));
  k.weights("ctor_dd_gate_width", [](P& q) { q.w.dd = Tensor<double>({q.c.D, q.c.G, 3}); },
            "dc.dd: expected " + shape_text({s.D, G, 4 * M}) + ", got " + shape_text({s.D, G, 3}));
  k.ctor("ctor_static_terms_without_option", [](auto& o) { o.static_w = false; },
         "dc.pre_w: expected none (static_w is false), got " + shape_text({G, M, M}));
  k.set_options("set_options_zero_eps", [](auto& o) { o.dw_norm_eps = 0; },
                "dw_norm_eps: expected a finite number > 0, got 0.000000");
  k.add("flops_negative_keys", [](P& q) { q.layer().flops(1, q.c.T, -1); }, "flops S: expected >= 0, got -1");
}

// The safetensors accessors and reader.

// A tiny valid safetensors file: one F32 [2, 3] tensor "w" and one F32 [3] tensor "b".
std::vector<unsigned char> small_file() {
  headmix::io::TensorFile f;
  Tensor<float> w({2, 3}), b({3});
  for (Index i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) - 2.5f;
  for (Index i = 0; i < b.size(); ++i) b[i] = 0.5f * static_cast<float>(i);
  f.put("w", headmix::io::StoredTensor::from(w));
  f.put("b", headmix::io::StoredTensor::from(b));
  return headmix::io::serialize_safetensors(f);
}

// The same bytes with the header replaced (the data buffer kept).
std::vector<unsigned char> with_header(const std::string& header, std::size_t data_bytes) {
  std::vector<unsigned char> bytes(8);
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<unsigned char>((header.size() >> (8 * i)) & 0xFF);
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + data_bytes, 0);
  return bytes;
}

void io_cases(std::vector<BadCase>& c) {
  auto add = [&](std::string name, Throws t, std::function<void()> fn, std::string mention, std::string more = "") {
    c.push_back({"io_" + name, t, std::move(fn), {std::move(mention), std::move(more)}});
  };
  using S = Throws;
  auto parsed = [] {
    static const auto bytes = small_file();
    return headmix::io::parse_safetensors(bytes.data(), bytes.size());
  };
  // An F64 value beyond float's range becomes inf in float (IEEE), but an
  // integer tensor read as int8 must fit: a weight read as integers fails.
  add("matrix_value_not_representable", S::io_error, [] {
    headmix::io::TensorFile f;
    Tensor<double> t({2, 2});
    t.set_zero();
    t[3] = 300.0;
    f.put("w", headmix::io::StoredTensor::from(t));
    f.matrix<std::int8_t>("w");
  }, "tensor 'w': element 3 (300) does not fit int8");
  add("matrix_of_rank_1_tensor", S::shape_error, [parsed] { parsed().matrix<float>("b"); },
      "[io] b: expected a rank-2 tensor, got [3]");
  add("vector_of_rank_2_tensor", S::shape_error, [parsed] { parsed().vector<double>("w"); },
      "[io] w: expected a rank-1 tensor, got [2, 3]");
  add("matrix_of_missing_tensor", S::io_error, [parsed] { parsed().matrix<float>("q.weight"); },
      "missing tensor 'q.weight'");
  add("parse_shorter_than_length_field", S::io_error, [] { headmix::io::parse_safetensors(small_file().data(), 5); },
      "safetensors: file is 5 bytes, shorter than the 8-byte header length");
  add("parse_truncated_data", S::io_error, [] {
    const auto bytes = small_file();
    headmix::io::parse_safetensors(bytes.data(), bytes.size() - 4);
  }, "safetensors: tensor ", "run past the");
  add("parse_offsets_not_matching_shape", S::io_error, [] {
    const auto bytes = with_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24);
    headmix::io::parse_safetensors(bytes.data(), bytes.size());
  }, "safetensors: tensor 'w': data_offsets [0, 20] hold 20 bytes, but shape [2, 3] of F32 needs 24");
  add("parse_overflowing_shape", S::io_error, [] {
    const auto bytes =
        with_header(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
    headmix::io::parse_safetensors(bytes.data(), bytes.size());
  }, "safetensors: tensor 'w': shape [4294967296, 4294967296] of F64 elements is too large");
  add("load_missing_file", S::io_error, [] { headmix::io::load_safetensors("/nonexistent/headmix.safetensors"); },
      "/nonexistent/headmix.safetensors: no such file");
}

std::vector<BadCase> catalogue() {
  std::vector<BadCase> c;
  add_shared_cases(c, static_cast<AllVariants*>(nullptr));
  mha_cases(c);
  talking_heads_cases(c);
  collab_head_cases(c);
  lsh_cases(c);
  dcmha_cases(c);
  io_cases(c);
  return c;
}

const std::vector<BadCase>& all_cases() {
  static const std::vector<BadCase> cases = catalogue();
  return cases;
}

// What `call` threw, as (type matched, message).
std::pair<bool, std::string> run_case(const BadCase& c) {
  try {
    c.call();
  } catch (const headmix::cache_full_error& e) {
    return {c.expected == Throws::cache_full_error, e.what()};
  } catch (const headmix::shape_error& e) {
    return {c.expected == Throws::shape_error, e.what()};
  } catch (const headmix::io::io_error& e) {
    return {c.expected == Throws::io_error, e.what()};
  } catch (const std::exception& e) {
    return {false, std::string("another exception: ") + e.what()};
  }
  return {false, "no exception"};
}

class BadInputCatalogue : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInputCatalogue, ThrowsDocumentedTypeNamingArgumentAndShapes) {
  const BadCase& c = GetParam();
  const auto [type_ok, message] = run_case(c);
  EXPECT_TRUE(type_ok) << "expected " << name_of(c.expected) << ", got: " << message;
  for (const std::string& part : c.mentions)
    EXPECT_NE(message.find(part), std::string::npos) << "message \"" << message << "\"\nlacks \"" << part << "\"";
}

INSTANTIATE_TEST_SUITE_P(EveryEntryPoint, BadInputCatalogue, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

// The table is the deliverable: at least 40 cases, every variant and the
// file reader covered.
TEST(BadInputCatalogueCoverage, AtLeastFortyCasesOverEveryVariant) {
  const auto& cases = all_cases();
  EXPECT_GE(cases.size(), 40u);
  std::set<std::string> names;
  for (const auto& c : cases) EXPECT_TRUE(names.insert(c.name).second) << "duplicate case " << c.name;
  auto prefixes = variant_names(static_cast<AllVariants*>(nullptr));
  prefixes.push_back("io");
  for (const std::string& prefix : prefixes) {
    int n = 0;
    for (const auto& c : cases) n += c.name.rfind(prefix + "_", 0) == 0;
    EXPECT_GE(n, 5) << prefix;
  }
  RecordProperty("cases", static_cast<int>(cases.size()));
}

// Each setup's unbroken calls succeed, so that each failure above is the one
// thing the case broke.
template <class V>
class BadInputSetup : public ::testing::Test {};
TYPED_TEST_SUITE(BadInputSetup, AllVariants, VariantName);

TYPED_TEST(BadInputSetup, ValidAsGiven) {
  using V = TypeParam;
  const auto p = V::template make<double>(V::bad_input_shape(), 99);
  const Dims d = V::dims(p);
  Scratch z;
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(p.layer().forward(p.input(), z.out(d.B, d.T, d.out), ws));
  if constexpr (V::decodes) {
    for (const auto& shape : V::decoder_shapes(V::bad_input_shape())) {
      const auto dec = V::template make<double>(shape, 98);
      const Dims e = V::dims(dec);
      headmix::SequenceCache<double> cache(e.B, 4);
      EXPECT_NO_THROW(step(dec, e, cache, 2, e.D, 2));
      EXPECT_NO_THROW(step(dec, e, cache, 2, e.D, 2));
    }
  }
}

TEST(BadInputSetupCoverage, OwnEntryPointsValidAsGiven) {
  const auto mha = Mha::make<double>(Mha::bad_input_shape(), 99);
  headmix::io::TensorFile f;
  put_linears(f, "attn.", {{"q", &mha.w.q}, {"k", &mha.w.k}, {"v", &mha.w.v}, {"o", &mha.w.o}});
  EXPECT_NO_THROW(headmix::Mha<double>::from_tensors(f, "attn.", mha.options()));
  EXPECT_NO_THROW(headmix::decomp::mha_to_collab(mha.layer(), mha.s.H * mha.s.Dk));
  const auto th = TalkingHeads::make<double>(TalkingHeads::bad_input_shape(), 99);
  headmix::io::TensorFile g;
  put_linears(g, "", {{"q", &th.w.q}, {"k", &th.w.k}, {"v", &th.w.v}, {"o", &th.w.o}});
  put_matrix(g, "pre_softmax.weight", th.w.pre_softmax);
  put_matrix(g, "post_softmax.weight", th.w.post_softmax);
  EXPECT_NO_THROW(headmix::TalkingHeads<double>::from_tensors(g, "", th.options()));
  const auto lsh = Lsh::make<double>(Lsh::bad_input_shape(), 99);
  headmix::Workspace<double> ws;
  EXPECT_NO_THROW(lsh.layer().buckets(lsh.input(), ws));
  const auto bytes = small_file();
  EXPECT_NO_THROW(headmix::io::parse_safetensors(bytes.data(), bytes.size()).matrix<float>("w"));
}

// ---------------------------------------------------------------------------
// Non-finite input (see the file comment for the contract), over every
// variant's V::non_finite_shapes(), float and double

template <class T>
bool row_identical(const Tensor<T>& a, const Tensor<T>& b, Index row, Index width) {
  return std::memcmp(a.data() + row * width, b.data() + row * width, sizeof(T) * static_cast<std::size_t>(width)) == 0;
}
template <class T>
bool row_all_nonfinite(const Tensor<T>& a, Index row, Index width) {
  for (Index c = 0; c < width; ++c)
    if (std::isfinite(static_cast<double>(a[row * width + c]))) return false;
  return true;
}

// A reordering variant's affected rows against its reference: non-finite
// where it is, else within float 2e-4 / 2e-5, double 1e-10 / 1e-12.
template <class T>
void expect_reference_row(const Tensor<T>& got, const std::vector<double>& want, Index row, Index width,
                          const std::string& what) {
  bool want_finite = true;
  for (Index c = 0; c < width; ++c) want_finite = want_finite && std::isfinite(want[row * width + c]);
  if (!want_finite) {
    EXPECT_TRUE(row_all_nonfinite(got, row, width)) << what << ": flat row " << row
                                                     << " is NaN in the reference but has a finite entry";
    return;
  }
  const double rtol = std::is_same_v<T, float> ? 2e-4 : 1e-10, atol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  for (Index c = 0; c < width; ++c) {
    const double g = static_cast<double>(got[row * width + c]), w = want[row * width + c];
    EXPECT_LE(std::abs(g - w), atol + rtol * std::abs(w)) << what << ": flat row " << row << " col " << c;
  }
}

// The contract for output [B, T, out], given which rows of bad_item must
// come out non-finite (or, for a reordering variant, its reference output).
// Returns the number of rows that came out non-finite.
template <class T>
Index expect_contract(const Dims& d, const Tensor<T>& clean, const Tensor<T>& got, Index bad_item,
                      const std::function<bool(Index)>& must_be_bad, const std::string& what,
                      const std::vector<double>* reference = nullptr) {
  Index bad_rows = 0;
  EXPECT_EQ(got.shape(), clean.shape()) << what;
  if (got.shape() != clean.shape()) return 0;
  for (Index b = 0; b < d.B; ++b)
    for (Index i = 0; i < d.T; ++i) {
      const Index row = b * d.T + i;
      const bool same = row_identical(got, clean, row, d.out), bad = row_all_nonfinite(got, row, d.out);
      bad_rows += bad;
      if (b != bad_item) {
        EXPECT_TRUE(same) << what << ": item " << b << " row " << i << " changed (another item held the bad value)";
      } else if (reference) {
        expect_reference_row(got, *reference, row, d.out, what);
      } else if (must_be_bad(i)) {
        EXPECT_TRUE(bad) << what << ": row " << i << " uses the bad value but has a finite entry";
      } else {
        EXPECT_TRUE(same || bad) << what << ": row " << i << " is finite but differs from the clean run";
      }
    }
  return bad_rows;
}

template <class T>
std::vector<T> bad_values() {
  return {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
          -std::numeric_limits<T>::infinity()};
}

template <class Param>
struct NonFiniteInput : ::testing::Test {
  using V = typename Param::Variant;
  using T = typename Param::Scalar;
  using P = typename V::template Problem<T>;

  // The variant's problems with `threads` threads and no padding.
  static std::vector<P> problems(int threads) {
    std::vector<P> all;
    unsigned seed = 2024;
    for (const auto& shape : V::non_finite_shapes()) {
      P p = V::template make<T>(shape, seed++);
      V::set_threads(p, threads);
      p.padding.clear();
      all.push_back(p);
    }
    return all;
  }
  // p's queries, and its keys (the queries again for self-attention), as matrices to poison.
  static Matrix<T> queries(const P& p) { return V::query(p); }
  static Matrix<T> keys(const P& p) {
    const auto in = p.input();
    const auto& k = in.keys();
    return Eigen::Map<const Matrix<T>>(k.data(), k.batch() * k.length(), k.width());
  }
  // p's layer on other queries and keys (xk unused for self-attention), with `padding` (empty: none).
  static Tensor<T> run(const P& p, const Matrix<T>& xq, const Matrix<T>& xk,
                       const std::vector<std::uint8_t>& padding = {}) {
    auto in = p.input();
    const Dims d = V::dims(p);
    in.query = ConstBatchView<T>(xq.data(), d.B, d.T, d.D);
    if (!in.self_attention()) in.key = ConstBatchView<T>(xk.data(), d.B, d.S, d.Dkv);
    in.key_padding = padding.empty() ? KeyPadding{} : KeyPadding{padding.data(), d.B, d.S};
    headmix::Workspace<T> ws;
    return p.layer().forward(in, ws);
  }
  // The naive reference's output for p with queries xq (self-attention) and padding.
  static std::vector<double> reference(P p, const Matrix<T>& xq, const std::vector<std::uint8_t>& padding) {
    const_cast<Matrix<T>&>(V::query(p)) = xq;  // our copy; problems show their queries read-only
    p.padding = padding;
    return p.reference().output;
  }
  // Row i of item b sees key j in p's clean reference (any head's weight is non-zero).
  static std::function<bool(Index)> sees_key(const P& p, Index b, Index j) {
    const auto probs = p.reference().probs;
    const Dims d = V::dims(p);
    return [probs, d, b, j](Index i) {
      for (Index h = 0; h < d.probs_heads; ++h)
        if (probs[static_cast<std::size_t>(((b * d.probs_heads + h) * d.T + i) * d.S + j)] != 0) return true;
      return false;
    };
  }
  static std::string describe(const P& p, const char* what, T v) {
    return V::describe(p) + ": " + what + " " + std::to_string(v);
  }
};
TYPED_TEST_SUITE(NonFiniteInput, AllVariantsInBothScalars, VariantInName);

// A bad value in a query row that is not also a key (cross-attention): only
// that output row changes, and it is non-finite throughout.
TYPED_TEST(NonFiniteInput, InQueryRowReachesOnlyThatRow) {
  using F = TestFixture;
  using T = typename F::T;
  int ran = 0;
  for (int threads : {1, 2})
    for (const auto& p : F::problems(threads)) {
      if (p.input().self_attention()) continue;
      ++ran;
      const Dims d = F::V::dims(p);
      const Matrix<T> xq = F::queries(p), xk = F::keys(p);
      const Tensor<T> clean = F::run(p, xq, xk);
      for (T v : bad_values<T>()) {
        Matrix<T> poisoned = xq;
        poisoned(1 * d.T + 2, 0) = v;
        const std::string what = F::describe(p, "query value", v);
        const Index bad = expect_contract<T>(d, clean, F::run(p, poisoned, xk), 1, [](Index i) { return i == 2; }, what);
        EXPECT_EQ(bad, 1) << what;
      }
    }
  if (ran == 0) GTEST_SKIP() << "no cross-attention problem";
}

// A bad value in key 3 of item 1 (a key row of cross-attention, or a
// position of self-attention): every row that attends to it (in the clean
// reference) is non-finite, other items are untouched. A reordering
// variant's rows are held to its reference instead.
template <class F>
void bad_key_test() {
  using T = typename F::T;
  for (int threads : {1, 2})
    for (const auto& p : F::problems(threads)) {
      const Dims d = F::V::dims(p);
      const bool self = p.input().self_attention();
      const Matrix<T> xq = F::queries(p), xk = F::keys(p);
      const Tensor<T> clean = F::run(p, xq, xk);
      const auto sees = F::sees_key(p, 1, 3);
      for (T v : bad_values<T>()) {
        Matrix<T> q = xq, k = xk;
        (self ? q : k)(1 * d.S + 3, 0) = v;
        const std::string what = F::describe(p, "key value", v) + " threads=" + std::to_string(threads);
        std::vector<double> want;
        if constexpr (F::V::non_finite_reorders) want = F::reference(p, q, {});
        expect_contract<T>(d, clean, F::run(p, q, k), 1, [&](Index i) { return (self && i == 3) || sees(i); }, what,
                           F::V::non_finite_reorders ? &want : nullptr);
      }
    }
}

TYPED_TEST(NonFiniteInput, InKeyReachesTheRowsThatSeeIt) {
  if constexpr (TestFixture::V::non_finite_reorders) {
    GTEST_SKIP() << "a bad position re-sorts the sequence: the next test";
  } else {
    bad_key_test<TestFixture>();
  }
}

// LSH rows attend within their chunks, over several hash rounds; the
// reference decides which rows see the bad position.
TYPED_TEST(NonFiniteInput, ReorderedRoundThatSeesTheBadKeyIsNotDropped) {
  if constexpr (!TestFixture::V::non_finite_reorders) {
    GTEST_SKIP() << "the previous test";
  } else {
    bad_key_test<TestFixture>();
  }
}

// A bad value in a padded key must not crash or reach other items. Padding
// does not clean it: rows of its item may come out NaN, never finite and
// wrong.
TYPED_TEST(NonFiniteInput, InPaddedKeyStaysInItsItem) {
  using F = TestFixture;
  using T = typename F::T;
  for (const auto& p : F::problems(2)) {
    const Dims d = F::V::dims(p);
    const bool self = p.input().self_attention();
    const Matrix<T> xq = F::queries(p), xk = F::keys(p);
    std::vector<std::uint8_t> padding(static_cast<std::size_t>(d.B * d.S), 0);
    padding[static_cast<std::size_t>(1 * d.S + 3)] = 1;
    const Tensor<T> clean = F::run(p, xq, xk, padding);
    for (T v : bad_values<T>()) {
      Matrix<T> q = xq, k = xk;
      (self ? q : k)(1 * d.S + 3, 0) = v;
      std::vector<double> want;
      if constexpr (F::V::non_finite_reorders) want = F::reference(p, q, padding);
      expect_contract<T>(d, clean, F::run(p, q, k, padding), 1, [&](Index i) { return self && i == 3; },
                         F::describe(p, "padded key value", v), F::V::non_finite_reorders ? &want : nullptr);
    }
  }
}

// All-NaN and all-Inf input: every output entry non-finite, promptly.
TYPED_TEST(NonFiniteInput, EverythingBadGivesNonFiniteEverywhere) {
  using F = TestFixture;
  using T = typename F::T;
  for (const auto& p : F::problems(2))
    for (T v : bad_values<T>()) {
      const Matrix<T> xq = F::queries(p), xk = F::keys(p);
      const Tensor<T> got = F::run(p, Matrix<T>::Constant(xq.rows(), xq.cols(), v),
                                   Matrix<T>::Constant(xk.rows(), xk.cols(), v));
      for (Index i = 0; i < got.size(); ++i)
        ASSERT_FALSE(std::isfinite(static_cast<double>(got[i]))) << F::describe(p, "value", v) << " at " << i;
    }
}

// Decoding: a bad position cached by step() reaches every later step of its
// item; reset() forgets it, and the next steps equal a fresh cache's.
TYPED_TEST(NonFiniteInput, DecodingCachesItUntilReset) {
  using F = TestFixture;
  if constexpr (!F::V::decodes) {
    GTEST_SKIP() << "no step()";
  } else {
    using V = typename F::V;
    using T = typename F::T;
    const auto p = V::template make<T>(V::decoder_shapes(V::non_finite_shapes()[0])[0], 10);
    const Dims d = V::dims(p);
    const auto layer = p.layer();
    const Index steps = 4;
    Rng rng(10);
    const Matrix<T> x = random_matrix<T>(rng, d.B * steps, d.D, 1.0);  // step t of item b: row b * steps + t
    auto step_input = [&](Index t, bool poison) {
      Matrix<T> xt(d.B, d.D);
      for (Index b = 0; b < d.B; ++b) xt.row(b) = x.row(b * steps + t);
      if (poison) xt(1, 0) = std::numeric_limits<T>::quiet_NaN();
      return xt;
    };
    headmix::SequenceCache<T> cache(d.B, steps);
    headmix::Workspace<T> ws;
    // `steps` single-position steps, item 1 poisoned at step 1 when asked,
    // reset() before step 3 when asked; every step's output [B, out].
    auto decode = [&](bool poison, bool reset_before_3) {
      cache.reset();
      std::vector<Matrix<T>> outs;
      for (Index t = 0; t < steps; ++t) {
        if (reset_before_3 && t == 3) cache.reset();
        const Matrix<T> xt = step_input(t, poison && t == 1);
        Matrix<T> y(d.B, d.out);
        layer.step({xt.data(), d.B, 1, d.D}, cache, {y.data(), d.B, 1, d.out}, ws);
        outs.push_back(y);
      }
      return outs;
    };
    const auto clean = decode(false, false), bad = decode(true, false), reset_run = decode(true, true);
    for (Index t = 0; t < steps; ++t)
      for (Index b = 0; b < d.B; ++b) {
        if (b != 1 || t == 0) {
          EXPECT_TRUE(clean[t].row(b) == bad[t].row(b)) << "step " << t << ": item " << b << " changed";
        } else {
          for (Index c = 0; c < d.out; ++c) EXPECT_FALSE(std::isfinite(static_cast<double>(bad[t](1, c)))) << t;
        }
      }
    // After reset() at step 3 the cache holds only step 3: it equals a fresh
    // cache that decodes step 3 as its first position.
    cache.reset();
    const Matrix<T> x3 = step_input(3, false);
    Matrix<T> y(d.B, d.out);
    layer.step({x3.data(), d.B, 1, d.D}, cache, {y.data(), d.B, 1, d.out}, ws);
    EXPECT_TRUE(reset_run[3] == y) << "reset() did not forget the bad position";
  }
}

}  // namespace
