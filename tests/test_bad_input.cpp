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
// what was given ("[mha] k.weight: expected [6, 5], got [4, 5]"). The
// per-variant BadInput suites test each check in depth; this table is the
// cross-section: one place that shows every entry point is guarded, and
// that the messages follow one format.
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
// LSH is the exception to "identical or non-finite": a bad position hashes
// to another bucket, which re-sorts the sequence and legitimately changes
// what other rows attend to. For LSH the rows of the affected item are held
// to the naive reference instead (tests/reference/lsh_reference.hpp): where
// the reference row is NaN / Inf the layer's must be non-finite, elsewhere
// it must match it.

#include "headmix/decomp.hpp"
#include "headmix/headmix.hpp"
#include "test_util.hpp"
#include "headmix/io/safetensors.hpp"
#include "reference/lsh_reference.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;

// ---------------------------------------------------------------------------
// Random valid parts

// The catalogue's Linear: biases in [-0.2, 0.2).
template <class T>
headmix::Linear<T> rand_linear(Rng& rng, Index out, Index in, bool bias = true) {
  return random_linear<T>(rng, out, in, bias, 0.2);
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

// ---------------------------------------------------------------------------
// Valid setups ("kits"), one per variant. A catalogue case copies a kit,
// breaks one thing and calls one entry point.

// What every kit does with its weights (w, opt) and inputs: the cross-attention
// kits hold xq and xk, the self-attention kits x.
template <class Kit, class Layer>
struct KitOps {
  headmix::AttentionInput<double> input() const {
    const Kit& k = static_cast<const Kit&>(*this);
    if constexpr (Kit::cross) {
      return {{k.xq.data(), Kit::B, Kit::T, Kit::D},
              {k.xk.data(), Kit::B, Kit::S, k.Dkv},
              {k.padding.data(), Kit::B, Kit::S}};
    } else {
      return {{k.x.data(), Kit::B, Kit::T, Kit::D}, {}, {k.padding.data(), Kit::B, Kit::T}};
    }
  }
  headmix::BatchView<double> out_view() { return {static_cast<Kit&>(*this).out.data(), Kit::B, Kit::T, Kit::Out}; }
  Layer layer() const {
    const Kit& k = static_cast<const Kit&>(*this);
    return Layer(k.w, k.opt);
  }
  void forward(const headmix::AttentionInput<double>& in, headmix::BatchView<double> dst) const {
    headmix::Workspace<double> ws;
    layer().forward(in, dst, ws);
  }
  void forward() { forward(input(), out_view()); }
};

// The named Linears' weights and biases as prefix + name + ".weight" / ".bias".
void put_linears(headmix::io::TensorFile& f, const std::string& prefix,
                 std::initializer_list<std::pair<const char*, const headmix::Linear<double>*>> parts) {
  for (const auto& [name, lin] : parts) {
    put_matrix(f, prefix + name + ".weight", lin->weight);
    put_vector(f, prefix + name + ".bias", lin->bias);
  }
}

// MHA, cross-attention (D != Dkv, Dk != Dv, out != D) or self-attention.
struct MhaKit : KitOps<MhaKit, headmix::Mha<double>> {
  static constexpr bool cross = true;
  static constexpr Index B = 2, T = 5, S = 7, D = 6, H = 2, Dk = 3, Dv = 2, Out = 4;
  Index Dkv;
  headmix::MhaWeights<double> w;
  headmix::MhaOptions opt;
  Matrix<double> xq, xk, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * S, 0);

  explicit MhaKit(bool self = false) : Dkv(self ? D : 5) {
    Rng rng(1);
    w.q = rand_linear<double>(rng, H * Dk, D);
    w.k = rand_linear<double>(rng, H * Dk, Dkv);
    w.v = rand_linear<double>(rng, H * Dv, Dkv);
    w.o = rand_linear<double>(rng, Out, H * Dv);
    opt.num_heads = H;
    xq = random_matrix<double>(rng, B * T, D, 1.0);
    xk = random_matrix<double>(rng, B * S, Dkv, 1.0);
    out.resize(B * T, Out);
  }
  // The layer's tensors as a file, for from_tensors.
  headmix::io::TensorFile file() const {
    headmix::io::TensorFile f;
    put_linears(f, "attn.", {{"q", &w.q}, {"k", &w.k}, {"v", &w.v}, {"o", &w.o}});
    return f;
  }
};

// Talking-Heads with three different head counts (h_k 2, h 3, h_v 2).
struct ThKit : KitOps<ThKit, headmix::TalkingHeads<double>> {
  static constexpr bool cross = true;
  static constexpr Index B = 2, T = 5, S = 7, D = 6, Dkv = 5, Hk = 2, H = 3, Hv = 2, Dk = 2, Dv = 2, Out = 4;
  headmix::TalkingHeadsWeights<double> w;
  headmix::TalkingHeadsOptions opt;
  Matrix<double> xq, xk, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * S, 0);

  ThKit() {
    Rng rng(2);
    w.q = rand_linear<double>(rng, Hk * Dk, D);
    w.k = rand_linear<double>(rng, Hk * Dk, Dkv);
    w.v = rand_linear<double>(rng, Hv * Dv, Dkv);
    w.o = rand_linear<double>(rng, Out, Hv * Dv);
    w.pre_softmax = random_matrix<double>(rng, H, Hk, 0.5);
    w.post_softmax = random_matrix<double>(rng, Hv, H, 0.5);
    opt.num_heads = H, opt.key_heads = Hk, opt.value_heads = Hv;
    xq = random_matrix<double>(rng, B * T, D, 1.0);
    xk = random_matrix<double>(rng, B * S, Dkv, 1.0);
    out.resize(B * T, Out);
  }
  headmix::io::TensorFile file() const {
    headmix::io::TensorFile f;
    put_linears(f, "", {{"q", &w.q}, {"k", &w.k}, {"v", &w.v}, {"o", &w.o}});
    put_matrix(f, "pre_softmax.weight", w.pre_softmax);
    put_matrix(f, "post_softmax.weight", w.post_softmax);
    return f;
  }
};

// CollabHead with a content bias and LayerNorm (out_dim == D).
struct CollabKit : KitOps<CollabKit, headmix::CollabHead<double>> {
  static constexpr bool cross = true;
  static constexpr Index B = 2, T = 5, S = 7, D = 6, Dkv = 5, H = 2, R = 4, Dv = 2, Out = D;
  headmix::CollabHeadWeights<double> w;
  headmix::CollabHeadOptions opt;
  Matrix<double> xq, xk, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * S, 0);

  CollabKit() {
    Rng rng(3);
    w.q = random_matrix<double>(rng, R, D, 0.5);
    w.k = random_matrix<double>(rng, R, Dkv, 0.5);
    w.mixing = random_matrix<double>(rng, H, R, 1.0);
    w.content_bias = random_matrix<double>(rng, H, Dkv, 0.5);
    w.v = rand_linear<double>(rng, H * Dv, Dkv);
    w.o = rand_linear<double>(rng, Out, H * Dv);
    w.layer_norm.weight = random_vector<double>(rng, D, 1.0);
    w.layer_norm.bias = random_vector<double>(rng, D, 0.2);
    opt.num_heads = H;
    xq = random_matrix<double>(rng, B * T, D, 1.0);
    xk = random_matrix<double>(rng, B * S, Dkv, 1.0);
    out.resize(B * T, Out);
  }
};

// LSH with explicit rotations for T = 8 (padded length 8, NB = 8 / 2 = 4).
struct LshKit : KitOps<LshKit, headmix::Lsh<double>> {
  static constexpr bool cross = false;
  static constexpr Index B = 2, T = 8, D = 6, H = 2, dh = 2, dv = 2, Out = 4, bs = 2, NH = 2, NB = 4;
  headmix::LshWeights<double> w;
  headmix::LshOptions opt;
  Matrix<double> x, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * T, 0);

  LshKit() {
    Rng rng(4);
    w.qk = rand_linear<double>(rng, H * dh, D, false);
    w.v = rand_linear<double>(rng, H * dv, D, false);
    w.o = rand_linear<double>(rng, Out, H * dv);
    w.rotations = random_tensor<double>(rng, {1, dh, NH, NB / 2}, 0.5);
    opt.num_heads = H, opt.bucket_size = bs, opt.n_hashes = NH;
    x = random_matrix<double>(rng, B * T, D, 1.0);
    out.resize(B * T, Out);
  }
};

// DCMHA, causal, H 4 in G 2 groups (M 2), rank 1, hidden width K 3, static terms.
struct DcmhaKit : KitOps<DcmhaKit, headmix::Dcmha<double>> {
  static constexpr bool cross = false;
  static constexpr Index B = 2, T = 5, D = 6, H = 4, G = 2, M = 2, R = 1, K = 3, dk = 2, dv = 2, Out = 4;
  headmix::DcmhaWeights<double> w;
  headmix::DcmhaOptions opt;
  Matrix<double> x, out;
  std::vector<std::uint8_t> padding = std::vector<std::uint8_t>(B * T, 0);

  DcmhaKit() {
    Rng rng(5);
    w.q = rand_linear<double>(rng, H * dk, D);
    w.k = rand_linear<double>(rng, H * dk, D);
    w.v = rand_linear<double>(rng, H * dv, D);
    w.o = rand_linear<double>(rng, Out, H * dv);
    w.dw1 = random_tensor<double>(rng, {D, G, 4, K}, 0.5);
    w.qkw = random_tensor<double>(rng, {G, 4, K, 2 * R, M}, 0.5);
    w.dd = random_tensor<double>(rng, {D, G, 4 * M}, 0.5);
    w.pre_w = random_tensor<double>(rng, {G, M, M}, 0.5);
    w.post_w = random_tensor<double>(rng, {G, M, M}, 0.5);
    opt.num_heads = H, opt.groups = G, opt.rank = R, opt.static_w = true, opt.causal = true;
    x = random_matrix<double>(rng, B * T, D, 1.0);
    out.resize(B * T, Out);
  }
};

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

// Ranges and layer-specific values below refer to the kits above.
std::vector<BadCase> catalogue() {
  using headmix::BatchView;
  using headmix::ConstBatchView;
  using headmix::KeyPadding;
  using S = Throws;
  std::vector<BadCase> c;
  auto add = [&](std::string name, Throws t, std::function<void()> fn, std::vector<std::string> parts) {
    c.push_back({std::move(name), t, std::move(fn), std::move(parts)});
  };

  // ---- MHA: constructor / set_options ------------------------------------
  add("mha_ctor_heads_do_not_divide_q_rows", S::shape_error, [] {
    MhaKit k;
    k.opt.num_heads = 4;  // q has H·Dk = 6 rows
    k.layer();
  }, {"[mha] q.weight: expected [num_heads * head_dim, D] with num_heads = 4, got [6, 6]"});
  add("mha_ctor_zero_heads", S::shape_error, [] {
    MhaKit k;
    k.opt.num_heads = 0;
    k.layer();
  }, {"[mha] num_heads: expected >= 1, got 0"});
  add("mha_ctor_key_rows_not_query_rows", S::shape_error, [] {
    MhaKit k;
    k.w.k.weight.conservativeResize(4, Eigen::NoChange);
    k.w.k.bias.conservativeResize(4);
    k.layer();
  }, {"[mha] k.weight: expected [6, 5], got [4, 5]"});
  add("mha_ctor_zero_width_embedding", S::shape_error, [] {
    MhaKit k;
    k.w.q.weight.resize(6, 0);
    k.layer();
  }, {"[mha] q.weight columns (D): expected >= 1, got 0"});
  add("mha_ctor_zero_width_values", S::shape_error, [] {
    MhaKit k;
    k.w.v.weight.resize(0, 5);
    k.w.v.bias.resize(0);
    k.layer();
  }, {"[mha] v.weight: expected [num_heads * v_head_dim, Dkv] with num_heads = 2, got [0, 5]"});
  add("mha_ctor_output_columns", S::shape_error, [] {
    MhaKit k;
    k.w.o.weight.conservativeResize(Eigen::NoChange, 5);
    k.layer();
  }, {"[mha] o.weight: expected [4, 4], got [4, 5]"});
  add("mha_ctor_value_bias_length", S::shape_error, [] {
    MhaKit k;
    k.w.v.bias.conservativeResize(3);
    k.layer();
  }, {"[mha] v.bias: expected [4], got [3]"});
  add("mha_set_options_negative_block_rows", S::shape_error, [] {
    MhaKit k;
    auto layer = k.layer();
    auto o = k.opt;
    o.block_rows = -1;
    layer.set_options(o);
  }, {"[mha] block_rows: expected >= 0 (0 = automatic), got -1"});
  add("mha_set_options_infinite_scale", S::shape_error, [] {
    MhaKit k;
    auto layer = k.layer();
    auto o = k.opt;
    o.scale = std::numeric_limits<double>::infinity();
    layer.set_options(o);
  }, {"[mha] scale: expected a finite number, got inf"});

  // ---- MHA: forward ------------------------------------------------------
  add("mha_forward_key_batch_not_query_batch", S::shape_error, [] {
    MhaKit k;
    auto in = k.input();
    in.key = ConstBatchView<double>(k.xk.data(), 1, MhaKit::S, 5);
    in.key_padding = {};
    k.forward(in, k.out_view());
  }, {"[mha] input.key: expected [2, 7, 5], got [1, 7, 5]"});
  add("mha_forward_padding_mask_keys", S::shape_error, [] {
    MhaKit k;
    auto in = k.input();
    in.key_padding = KeyPadding{k.padding.data(), 2, 6};
    k.forward(in, k.out_view());
  }, {"[mha] input.key_padding_mask: expected [2, 7], got [2, 6]"});
  add("mha_forward_zero_batch", S::shape_error, [] {
    MhaKit k;
    auto in = k.input();
    in.query = ConstBatchView<double>(k.xq.data(), 0, MhaKit::T, MhaKit::D);
    k.forward(in, BatchView<double>(k.out.data(), 0, MhaKit::T, MhaKit::Out));
  }, {"[mha] input.query: expected [B >= 1, T >= 1, 6], got [0, 5, 6]"});
  add("mha_forward_zero_keys", S::shape_error, [] {
    MhaKit k;
    auto in = k.input();
    in.key = ConstBatchView<double>(k.xk.data(), 2, 0, 5);
    in.key_padding = {};
    k.forward(in, k.out_view());
  }, {"[mha] input.key: expected [2, S >= 1, 5], got [2, 0, 5]"});
  add("mha_forward_negative_length", S::shape_error, [] {
    MhaKit k;
    auto in = k.input();
    in.query = ConstBatchView<double>(k.xq.data(), 2, -3, MhaKit::D);
    k.forward(in, k.out_view());
  }, {"[mha] input.query: expected [B >= 1, T >= 1, 6], got [2, -3, 6]"});
  add("mha_forward_output_width", S::shape_error, [] {
    MhaKit k;
    k.forward(k.input(), BatchView<double>(k.out.data(), 2, 5, 3));
  }, {"[mha] output: expected [2, 5, 4], got [2, 5, 3]"});
  add("mha_forward_self_attention_needs_key_width_of_queries", S::shape_error, [] {
    MhaKit k;  // Dkv 5 != D 6
    auto in = k.input();
    in.key = {};
    in.key_padding = {};
    k.forward(in, k.out_view());
  }, {"[mha] input.key: expected a key sequence of width 5 (self-attention needs key width == query width), got none"});

  // ---- MHA: step (decoding) ----------------------------------------------
  add("mha_step_cache_batch_not_input_batch", S::shape_error, [] {
    MhaKit k(true);
    headmix::SequenceCache<double> cache(3, 8);
    headmix::Workspace<double> ws;
    k.layer().step({k.xq.data(), 2, 1, MhaKit::D}, cache, {k.out.data(), 2, 1, MhaKit::Out}, ws);
  }, {"[mha] cache batch: expected [2], got [3]"});
  add("mha_step_cache_full", S::cache_full_error, [] {
    MhaKit k(true);
    headmix::SequenceCache<double> cache(2, 4);
    headmix::Workspace<double> ws;
    k.layer().step({k.xq.data(), 2, 5, MhaKit::D}, cache, {k.out.data(), 2, 5, MhaKit::Out}, ws);
  }, {"[mha] cache: 5 new positions do not fit (0 of 4 used)"});
  add("mha_step_cache_of_another_layer", S::shape_error, [] {
    MhaKit k(true), other(true);
    Rng rng(7);
    other.w.v = rand_linear<double>(rng, 2 * 3, MhaKit::D);  // v head width 3, not 2
    other.w.o = rand_linear<double>(rng, MhaKit::Out, 2 * 3);
    headmix::SequenceCache<double> cache(2, 4);
    headmix::Workspace<double> ws;
    Matrix<double> y(2, 4);
    other.layer().step({k.xq.data(), 2, 1, MhaKit::D}, cache, {y.data(), 2, 1, MhaKit::Out}, ws);
    k.layer().step({k.xq.data(), 2, 1, MhaKit::D}, cache, {k.out.data(), 2, 1, MhaKit::Out}, ws);
  }, {"[mha] cache stream widths: expected [6, 4], got [6, 6]"});
  add("mha_step_on_cross_attention_layer", S::shape_error, [] {
    MhaKit k;  // key width 5: a decoder step has no key sequence
    headmix::SequenceCache<double> cache(2, 4);
    headmix::Workspace<double> ws;
    k.layer().step({k.xq.data(), 2, 1, MhaKit::D}, cache, {k.out.data(), 2, 1, MhaKit::Out}, ws);
  }, {"[mha] input.key: expected a key sequence of width 5", "got none"});
  add("mha_step_output_length", S::shape_error, [] {
    MhaKit k(true);
    headmix::SequenceCache<double> cache(2, 4);
    headmix::Workspace<double> ws;
    k.layer().step({k.xq.data(), 2, 2, MhaKit::D}, cache, {k.out.data(), 2, 1, MhaKit::Out}, ws);
  }, {"[mha] output: expected [2, 2, 4], got [2, 1, 4]"});

  // ---- MHA: from_tensors (weights from a file) ---------------------------
  add("mha_from_tensors_missing_weight", S::io_error, [] {
    auto f = MhaKit().file();
    f.tensors.erase("attn.k.weight");
    headmix::Mha<double>::from_tensors(f, "attn.", MhaKit().opt);
  }, {"missing tensor 'attn.k.weight'"});
  add("mha_from_tensors_weight_of_rank_1", S::shape_error, [] {
    auto f = MhaKit().file();
    put_vector(f, "attn.q.weight", Vector<double>::Zero(36));
    headmix::Mha<double>::from_tensors(f, "attn.", MhaKit().opt);
  }, {"[io] attn.q.weight: expected a rank-2 tensor, got [36]"});
  add("mha_from_tensors_bias_of_rank_2", S::shape_error, [] {
    auto f = MhaKit().file();
    put_matrix(f, "attn.v.bias", Matrix<double>::Zero(4, 1));
    headmix::Mha<double>::from_tensors(f, "attn.", MhaKit().opt);
  }, {"[io] attn.v.bias: expected a rank-1 tensor, got [4, 1]"});
  add("mha_from_tensors_weight_shape", S::shape_error, [] {
    auto f = MhaKit().file();
    put_matrix(f, "attn.v.weight", Matrix<double>::Zero(4, 4));
    headmix::Mha<double>::from_tensors(f, "attn.", MhaKit().opt);
  }, {"[mha] attn.v.weight: expected [4, 5], got [4, 4]"});
  // A file whose o.bias has lost its o.weight is a broken checkpoint, as the
  // constructor says for weights built in code; Lsh::from_tensors reads `o`
  // when either tensor is there and reports the missing weight.
  add("mha_from_tensors_output_bias_without_weight", S::io_error, [] {
    auto f = MhaKit().file();
    f.tensors.erase("attn.o.weight");
    headmix::Mha<double>::from_tensors(f, "attn.", MhaKit().opt);
  }, {"missing tensor 'attn.o.weight'"});
  // A zero-sized o.weight [4, 0] is a shape mismatch ([4, H·Dv] expected),
  // not "no output projection" (that is an absent tensor).
  add("mha_from_tensors_output_weight_without_columns", S::shape_error, [] {
    auto f = MhaKit().file();
    f.tensors.erase("attn.o.bias");
    put_matrix(f, "attn.o.weight", Matrix<double>(MhaKit::Out, 0));
    headmix::Mha<double>::from_tensors(f, "attn.", MhaKit().opt);
  }, {"[io] attn.o.weight: expected a tensor with at least one element", "got [4, 0]"});
  add("io_matrix_value_not_representable", S::io_error, [] {
    // An F64 value beyond float's range becomes inf in float (IEEE), but an
    // integer tensor read as int8 must fit: a weight read as integers fails.
    headmix::io::TensorFile f;
    Tensor<double> t({2, 2});
    t.set_zero();
    t[3] = 300.0;
    f.put("w", headmix::io::StoredTensor::from(t));
    f.matrix<std::int8_t>("w");
  }, {"tensor 'w': element 3 (300) does not fit int8"});

  // ---- Talking-Heads ------------------------------------------------------
  add("talking_heads_ctor_pre_mix_transposed", S::shape_error, [] {
    ThKit k;
    k.w.pre_softmax.transposeInPlace();
    k.layer();
  }, {"[talking_heads] pre_softmax.weight: expected [3, 2], got [2, 3]"});
  add("talking_heads_ctor_missing_post_mix_with_unequal_heads", S::shape_error, [] {
    ThKit k;
    k.w.post_softmax.resize(0, 0);
    k.layer();
  }, {"[talking_heads] post_softmax.weight: expected [2, 3] (num_heads = 3 differs from value_heads = 2",
      "got none"});
  add("talking_heads_ctor_key_heads_do_not_divide", S::shape_error, [] {
    ThKit k;
    k.opt.key_heads = 3;  // q has 4 rows
    k.layer();
  }, {"[talking_heads] q.weight: expected [key_heads * head_dim, D] with key_heads = 3, got [4, 6]"});
  add("talking_heads_set_options_value_heads_do_not_divide", S::shape_error, [] {
    ThKit k;
    auto layer = k.layer();
    auto o = k.opt;
    o.value_heads = 3;  // v has 4 rows
    layer.set_options(o);
  }, {"[talking_heads] v.weight: expected [value_heads * v_head_dim, Dkv] with value_heads = 3, got [4, 5]"});
  add("talking_heads_forward_zero_length_query", S::shape_error, [] {
    ThKit k;
    auto in = k.input();
    in.query = ConstBatchView<double>(k.xq.data(), 2, 0, ThKit::D);
    k.forward(in, BatchView<double>(k.out.data(), 2, 0, ThKit::Out));
  }, {"[talking_heads] input.query: expected [B >= 1, T >= 1, 6], got [2, 0, 6]"});
  add("talking_heads_forward_padding_mask_batch", S::shape_error, [] {
    ThKit k;
    auto in = k.input();
    in.key_padding = KeyPadding{k.padding.data(), 1, ThKit::S};
    k.forward(in, k.out_view());
  }, {"[talking_heads] input.key_padding_mask: expected [2, 7], got [1, 7]"});
  add("talking_heads_forward_key_width", S::shape_error, [] {
    ThKit k;
    auto in = k.input();
    in.key = ConstBatchView<double>(k.xk.data(), 2, ThKit::S, 4);
    k.forward(in, k.out_view());
  }, {"[talking_heads] input.key: expected [2, 7, 5], got [2, 7, 4]"});
  add("talking_heads_from_tensors_mix_of_rank_3", S::shape_error, [] {
    auto f = ThKit().file();
    Tensor<double> t({1, 3, 2});
    t.set_zero();
    f.put("pre_softmax.weight", headmix::io::StoredTensor::from(t));
    headmix::TalkingHeads<double>::from_tensors(f, "", ThKit().opt);
  }, {"[io] pre_softmax.weight: expected a rank-2 tensor, got [1, 3, 2]"});
  add("talking_heads_from_tensors_output_bias_without_weight", S::io_error, [] {
    auto f = ThKit().file();
    f.tensors.erase("o.weight");
    headmix::TalkingHeads<double>::from_tensors(f, "", ThKit().opt);
  }, {"missing tensor 'o.weight'"});

  // ---- CollabHead ---------------------------------------------------------
  add("collab_ctor_mixing_columns_not_shared_dim", S::shape_error, [] {
    CollabKit k;
    k.w.mixing.conservativeResize(Eigen::NoChange, 5);
    k.layer();
  }, {"[collab] mixing: expected [2, 4], got [2, 5]"});
  add("collab_ctor_mixing_rows_not_heads", S::shape_error, [] {
    CollabKit k;
    k.opt.num_heads = 1;  // v still splits (4 rows), mixing has 2 rows
    k.layer();
  }, {"[collab] mixing: expected [1, 4], got [2, 4]"});
  add("collab_ctor_zero_shared_dim", S::shape_error, [] {
    CollabKit k;
    k.w.q.resize(0, CollabKit::D);
    k.layer();
  }, {"[collab] q.weight: expected [R >= 1, D >= 1], got [0, 6]"});
  add("collab_ctor_content_bias_width", S::shape_error, [] {
    CollabKit k;
    k.w.content_bias.conservativeResize(Eigen::NoChange, 6);
    k.layer();
  }, {"[collab] content_bias.weight: expected [2, 5], got [2, 6]"});
  add("collab_ctor_layer_norm_needs_out_dim_of_embedding", S::shape_error, [] {
    CollabKit k;
    Rng rng(8);
    k.w.o = rand_linear<double>(rng, 5, CollabKit::H * CollabKit::Dv);
    k.layer();
  }, {"[collab] out_dim: expected 6 (LayerNorm(Xq + y) needs out_dim == D), got 5"});
  add("collab_ctor_layer_norm_eps_negative", S::shape_error, [] {
    CollabKit k;
    k.w.layer_norm.eps = -1e-5;
    k.layer();
  }, {"[collab] layer_norm.eps: expected a finite number >= 0, got -0.000010"});
  add("collab_set_options_checks_options", S::shape_error, [] {
    CollabKit k;
    auto layer = k.layer();
    auto options = layer.options();
    options.threads = 0;
    layer.set_options(options);
  }, {"[collab] threads: expected >= 1, got 0"});
  add("collab_forward_key_length_zero", S::shape_error, [] {
    CollabKit k;
    auto in = k.input();
    in.key = ConstBatchView<double>(k.xk.data(), 2, 0, CollabKit::Dkv);
    in.key_padding = {};
    k.forward(in, k.out_view());
  }, {"[collab] input.key: expected [2, S >= 1, 5], got [2, 0, 5]"});
  add("collab_forward_output_batch", S::shape_error, [] {
    CollabKit k;
    k.forward(k.input(), BatchView<double>(k.out.data(), 1, CollabKit::T, CollabKit::Out));
  }, {"[collab] output: expected [2, 5, 6], got [1, 5, 6]"});
  add("collab_mha_to_collab_rank_too_large", S::shape_error, [] {
    MhaKit k;
    headmix::decomp::mha_to_collab(k.layer(), MhaKit::H * MhaKit::Dk + 1);
  }, {"[mha_to_collab] shared_dim: expected 1 <= R <= num_heads * head_dim = 6, got 7"});
  add("collab_mha_to_collab_rank_zero", S::shape_error, [] {
    MhaKit k;
    headmix::decomp::mha_to_collab(k.layer(), 0);
  }, {"[mha_to_collab] shared_dim: expected 1 <= R <= num_heads * head_dim = 6, got 0"});

  // ---- LSH ---------------------------------------------------------------
  add("lsh_ctor_odd_bucket_count", S::shape_error, [] {
    LshKit k;
    k.w.rotations = Tensor<double>();
    k.opt.n_buckets = 3;
    k.layer();
  }, {"[lsh] n_buckets: expected 0 (padded length / bucket_size) or an even number >= 2, got 3"});
  add("lsh_ctor_zero_bucket_size", S::shape_error, [] {
    LshKit k;
    k.opt.bucket_size = 0;
    k.layer();
  }, {"[lsh] bucket_size: expected >= 1, got 0"});
  add("lsh_ctor_zero_hash_rounds", S::shape_error, [] {
    LshKit k;
    k.w.rotations = Tensor<double>();
    k.opt.n_hashes = 0;
    k.layer();
  }, {"[lsh] n_hashes: expected >= 1, got 0"});
  add("lsh_ctor_heads_do_not_divide_qk_rows", S::shape_error, [] {
    LshKit k;
    k.opt.num_heads = 3;
    k.layer();
  }, {"[lsh] qk.weight: expected [num_heads * head_dim, D] with num_heads = 3, got [4, 6]"});
  add("lsh_ctor_rotations_for_other_rounds", S::shape_error, [] {
    LshKit k;
    k.opt.n_hashes = 3;
    k.layer();
  }, {"[lsh] rotations: expected [1, 2, 3, ", "got [1, 2, 2, 2]"});
  add("lsh_forward_rotations_for_another_length", S::shape_error, [] {
    LshKit k;  // rotations for T = 8 (NB 4); T = 12 pads to 12, NB 6
    Rng rng(9);
    Matrix<double> x = random_matrix<double>(rng, 12, LshKit::D, 0.5);
    Matrix<double> y(12, LshKit::Out);
    k.forward({{x.data(), 1, 12, LshKit::D}, {}, {}}, {y.data(), 1, 12, LshKit::Out});
  }, {"[lsh] rotations: expected [1, 2, 2, 3], got [1, 2, 2, 2]"});
  add("lsh_forward_key_sequence_given", S::shape_error, [] {
    LshKit k;
    auto in = k.input();
    in.key = ConstBatchView<double>(k.x.data(), 2, LshKit::T, LshKit::D);
    k.forward(in, k.out_view());
  }, {"[lsh] input.key: expected none (LSH attention is self-attention with a shared query/key), got [2, 8, 6]"});
  add("lsh_forward_padding_mask_length", S::shape_error, [] {
    LshKit k;
    auto in = k.input();
    in.key_padding = KeyPadding{k.padding.data(), 2, 7};
    k.forward(in, k.out_view());
  }, {"[lsh] input.key_padding_mask: expected [2, 8], got [2, 7]"});
  add("lsh_set_options_checks_options", S::shape_error, [] {
    LshKit k;
    auto layer = k.layer();
    auto options = layer.options();
    options.threads = 0;
    layer.set_options(options);
  }, {"[lsh] threads: expected >= 1, got 0"});
  add("lsh_buckets_query_width", S::shape_error, [] {
    LshKit k;
    headmix::Workspace<double> ws;
    k.layer().buckets({{k.x.data(), 2, LshKit::T, 5}, {}, {}}, ws);
  }, {"[lsh] input.query: expected [2, 8, 6], got [2, 8, 5]"});
  add("lsh_flops_cross_lengths", S::shape_error, [] {
    LshKit k;
    k.layer().flops(1, 8, 9);
  }, {"[lsh] keys: expected 8 (self-attention: S == T), got 9"});

  // ---- DCMHA --------------------------------------------------------------
  add("dcmha_ctor_groups_do_not_divide_heads", S::shape_error, [] {
    DcmhaKit k;
    k.opt.groups = 3;
    k.layer();
  }, {"[dcmha] groups: expected a divisor of num_heads = 4, got 3"});
  add("dcmha_ctor_rank_not_qkw", S::shape_error, [] {
    DcmhaKit k;
    k.opt.rank = 2;  // qkw was drawn for rank 1
    k.layer();
  }, {"[dcmha] dc.qkw: expected [2, 4, 3, 4, 2], got [2, 4, 3, 2, 2]"});
  add("dcmha_ctor_zero_rank", S::shape_error, [] {
    DcmhaKit k;
    k.opt.rank = 0;
    k.layer();
  }, {"[dcmha] rank: expected >= 1, got 0"});
  add("dcmha_ctor_dw1_zero_hidden_width", S::shape_error, [] {
    DcmhaKit k;
    k.w.dw1 = Tensor<double>({DcmhaKit::D, DcmhaKit::G, 4, 0});
    k.layer();
  }, {"[dcmha] dc.dw1: expected [6, 2, 4, K >= 1], got [6, 2, 4, 0]"});
  add("dcmha_ctor_dd_gate_width", S::shape_error, [] {
    DcmhaKit k;
    k.w.dd = Tensor<double>({DcmhaKit::D, DcmhaKit::G, 3});
    k.layer();
  }, {"[dcmha] dc.dd: expected [6, 2, 8], got [6, 2, 3]"});
  add("dcmha_ctor_window_without_causal", S::shape_error, [] {
    DcmhaKit k;
    k.opt.causal = false;
    k.opt.window = 3;
    k.layer();
  }, {"[dcmha] window: expected 0 unless causal (a window needs causal = true), got 3"});
  add("dcmha_ctor_static_terms_without_option", S::shape_error, [] {
    DcmhaKit k;
    k.opt.static_w = false;
    k.layer();
  }, {"[dcmha] dc.pre_w: expected none (static_w is false), got [2, 2, 2]"});
  add("dcmha_set_options_zero_eps", S::shape_error, [] {
    DcmhaKit k;
    auto layer = k.layer();
    auto o = k.opt;
    o.dw_norm_eps = 0;
    layer.set_options(o);
  }, {"[dcmha] dw_norm_eps: expected a finite number > 0, got 0.000000"});
  add("dcmha_forward_key_sequence_width", S::shape_error, [] {
    DcmhaKit k;
    auto in = k.input();
    in.key = ConstBatchView<double>(k.x.data(), 2, DcmhaKit::T, DcmhaKit::D - 1);
    k.forward(in, k.out_view());
  }, {"[dcmha] input.key: expected [2, 5, 6], got [2, 5, 5]"});
  add("dcmha_forward_padding_mask_batch", S::shape_error, [] {
    DcmhaKit k;
    auto in = k.input();
    in.key_padding = KeyPadding{k.padding.data(), 3, DcmhaKit::T};
    k.forward(in, k.out_view());
  }, {"[dcmha] input.key_padding_mask: expected [2, 5], got [3, 5]"});
  add("dcmha_step_query_width", S::shape_error, [] {
    DcmhaKit k;
    headmix::SequenceCache<double> cache(2, 4);
    headmix::Workspace<double> ws;
    k.layer().step({k.x.data(), 2, 1, 5}, cache, {k.out.data(), 2, 1, DcmhaKit::Out}, ws);
  }, {"[dcmha] input.query: expected [2, 1, 6], got [2, 1, 5]"});
  add("dcmha_step_batch_not_cache_batch", S::shape_error, [] {
    DcmhaKit k;
    headmix::SequenceCache<double> cache(3, 4);
    headmix::Workspace<double> ws;
    k.layer().step({k.x.data(), 2, 1, DcmhaKit::D}, cache, {k.out.data(), 2, 1, DcmhaKit::Out}, ws);
  }, {"[dcmha] cache batch: expected [2], got [3]"});
  add("dcmha_step_cache_full", S::cache_full_error, [] {
    DcmhaKit k;
    headmix::SequenceCache<double> cache(2, 2);
    headmix::Workspace<double> ws;
    k.layer().step({k.x.data(), 2, 3, DcmhaKit::D}, cache, {k.out.data(), 2, 3, DcmhaKit::Out}, ws);
  }, {"[dcmha] cache: 3 new positions do not fit (0 of 2 used)"});
  add("dcmha_step_cache_of_another_layer", S::shape_error, [] {
    DcmhaKit k, other;
    Rng rng(10);
    other.w.v = rand_linear<double>(rng, DcmhaKit::H * 3, DcmhaKit::D);  // v head width 3, not 2
    other.w.o = rand_linear<double>(rng, DcmhaKit::Out, DcmhaKit::H * 3);
    headmix::SequenceCache<double> cache(2, 4);
    headmix::Workspace<double> ws;
    Matrix<double> y(2, DcmhaKit::Out);
    other.layer().step({k.x.data(), 2, 1, DcmhaKit::D}, cache, {y.data(), 2, 1, DcmhaKit::Out}, ws);
    k.layer().step({k.x.data(), 2, 1, DcmhaKit::D}, cache, {k.out.data(), 2, 1, DcmhaKit::Out}, ws);
  }, {"[dcmha] cache stream widths: expected [", "got ["});
  add("dcmha_flops_negative_keys", S::shape_error, [] { DcmhaKit().layer().flops(1, 5, -1); },
      {"[dcmha] flops S: expected >= 0, got -1"});

  // ---- safetensors accessors and reader -----------------------------------
  add("io_matrix_of_rank_1_tensor", S::shape_error, [] {
    const auto bytes = small_file();
    headmix::io::parse_safetensors(bytes.data(), bytes.size()).matrix<float>("b");
  }, {"[io] b: expected a rank-2 tensor, got [3]"});
  add("io_vector_of_rank_2_tensor", S::shape_error, [] {
    const auto bytes = small_file();
    headmix::io::parse_safetensors(bytes.data(), bytes.size()).vector<double>("w");
  }, {"[io] w: expected a rank-1 tensor, got [2, 3]"});
  add("io_matrix_of_missing_tensor", S::io_error, [] {
    const auto bytes = small_file();
    headmix::io::parse_safetensors(bytes.data(), bytes.size()).matrix<float>("q.weight");
  }, {"missing tensor 'q.weight'"});
  add("io_parse_shorter_than_length_field", S::io_error, [] {
    const auto bytes = small_file();
    headmix::io::parse_safetensors(bytes.data(), 5);
  }, {"safetensors: file is 5 bytes, shorter than the 8-byte header length"});
  add("io_parse_truncated_data", S::io_error, [] {
    const auto bytes = small_file();
    headmix::io::parse_safetensors(bytes.data(), bytes.size() - 4);
  }, {"safetensors: tensor ", "run past the"});
  add("io_parse_offsets_not_matching_shape", S::io_error, [] {
    const auto bytes = with_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24);
    headmix::io::parse_safetensors(bytes.data(), bytes.size());
  }, {"safetensors: tensor 'w': data_offsets [0, 20] hold 20 bytes, but shape [2, 3] of F32 needs 24"});
  add("io_parse_overflowing_shape", S::io_error, [] {
    const auto bytes =
        with_header(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
    headmix::io::parse_safetensors(bytes.data(), bytes.size());
  }, {"safetensors: tensor 'w': shape [4294967296, 4294967296] of F64 elements is too large"});
  add("io_load_missing_file", S::io_error, [] { headmix::io::load_safetensors("/nonexistent/headmix.safetensors"); },
      {"/nonexistent/headmix.safetensors: no such file"});
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
// file reader covered, and each kit's unbroken call succeeds (so that each
// failure above is the one thing the case broke).
TEST(BadInputCatalogueCoverage, AtLeastFortyCasesOverEveryVariant) {
  const auto& cases = all_cases();
  EXPECT_GE(cases.size(), 40u);
  std::set<std::string> names;
  for (const auto& c : cases) EXPECT_TRUE(names.insert(c.name).second) << "duplicate case " << c.name;
  for (const char* prefix : {"mha_", "talking_heads_", "collab_", "lsh_", "dcmha_", "io_"}) {
    int n = 0;
    for (const auto& c : cases) n += c.name.rfind(prefix, 0) == 0;
    EXPECT_GE(n, 5) << prefix;
  }
  RecordProperty("cases", static_cast<int>(cases.size()));
}

TEST(BadInputCatalogueCoverage, EveryKitIsValidAsGiven) {
  EXPECT_NO_THROW(MhaKit().forward());
  EXPECT_NO_THROW(ThKit().forward());
  EXPECT_NO_THROW(CollabKit().forward());
  EXPECT_NO_THROW(LshKit().forward());
  EXPECT_NO_THROW(DcmhaKit().forward());
  EXPECT_NO_THROW(headmix::Mha<double>::from_tensors(MhaKit().file(), "attn.", MhaKit().opt));
  EXPECT_NO_THROW(headmix::TalkingHeads<double>::from_tensors(ThKit().file(), "", ThKit().opt));
  EXPECT_NO_THROW(headmix::decomp::mha_to_collab(MhaKit().layer(), MhaKit::H * MhaKit::Dk));
  {
    MhaKit k(true);
    headmix::SequenceCache<double> cache(2, 8);
    headmix::Workspace<double> ws;
    EXPECT_NO_THROW(k.layer().step({k.xq.data(), 2, 5, MhaKit::D}, cache, {k.out.data(), 2, 5, MhaKit::Out}, ws));
  }
  {
    DcmhaKit k;
    headmix::SequenceCache<double> cache(2, 5);
    headmix::Workspace<double> ws;
    Matrix<double> x1(2, DcmhaKit::D), y1(2, DcmhaKit::Out);
    x1.row(0) = k.x.row(0), x1.row(1) = k.x.row(DcmhaKit::T);
    EXPECT_NO_THROW(k.layer().step({x1.data(), 2, 1, DcmhaKit::D}, cache, {y1.data(), 2, 1, DcmhaKit::Out}, ws));
  }
  const auto bytes = small_file();
  EXPECT_NO_THROW(headmix::io::parse_safetensors(bytes.data(), bytes.size()).matrix<float>("w"));
}

// ---------------------------------------------------------------------------
// Non-finite input (see the file comment for the contract)

// One variant behind a common face: inputs [B, T, D] (+ keys [B, S, Dkv] for
// cross-attention), optional padding, output [B, T, out].
template <class T>
struct Subject {
  std::string name;
  Index B = 3, Tq = 6, S = 6, D = 5, Dkv = 5, out = 4;
  bool cross = false;
  std::function<Tensor<T>(const Matrix<T>& xq, const Matrix<T>* xk, const std::vector<std::uint8_t>& padding)> run;
  // LSH only: the naive double reference's output [B, T, out] for x.
  std::function<std::vector<double>(const Matrix<T>& x, const std::vector<std::uint8_t>& padding)> reference;
};

template <class T>
headmix::AttentionInput<T> make_input(const Subject<T>& s, const Matrix<T>& xq, const Matrix<T>* xk,
                                      const std::vector<std::uint8_t>& padding) {
  headmix::AttentionInput<T> in;
  in.query = {xq.data(), s.B, s.Tq, s.D};
  if (xk) in.key = {xk->data(), s.B, s.S, s.Dkv};
  if (!padding.empty()) in.key_padding = {padding.data(), s.B, s.S};
  return in;
}

// Every variant, with options that exercise its extra stages; block_rows 2
// so that a row and the bad key can sit in different query blocks.
template <class T>
std::vector<Subject<T>> subjects(int threads) {
  std::vector<Subject<T>> all;
  Rng rng(2024);
  {
    Subject<T> s;
    s.name = "mha", s.cross = true, s.S = 7, s.Dkv = 3;
    headmix::MhaWeights<T> w{rand_linear<T>(rng, 6, s.D), rand_linear<T>(rng, 6, s.Dkv), rand_linear<T>(rng, 4, s.Dkv),
                             rand_linear<T>(rng, s.out, 4)};
    headmix::MhaOptions o;
    o.num_heads = 2, o.block_rows = 2, o.threads = threads;
    auto layer = std::make_shared<headmix::Mha<T>>(w, o);
    s.run = [layer, s](const Matrix<T>& xq, const Matrix<T>* xk, const std::vector<std::uint8_t>& pad) {
      headmix::Workspace<T> ws;
      return layer->forward(make_input(s, xq, xk, pad), ws);
    };
    all.push_back(s);
  }
  {
    Subject<T> s;
    s.name = "talking_heads", s.cross = true, s.S = 7, s.Dkv = 3;
    headmix::TalkingHeadsWeights<T> w;
    w.q = rand_linear<T>(rng, 4, s.D), w.k = rand_linear<T>(rng, 4, s.Dkv), w.v = rand_linear<T>(rng, 6, s.Dkv);
    w.o = rand_linear<T>(rng, s.out, 6);
    w.pre_softmax = random_matrix<T>(rng, 3, 2, 1.0), w.post_softmax = random_matrix<T>(rng, 3, 3, 1.0);
    headmix::TalkingHeadsOptions o;
    o.num_heads = 3, o.key_heads = 2, o.value_heads = 3, o.block_rows = 2, o.threads = threads;
    auto layer = std::make_shared<headmix::TalkingHeads<T>>(w, o);
    s.run = [layer, s](const Matrix<T>& xq, const Matrix<T>* xk, const std::vector<std::uint8_t>& pad) {
      headmix::Workspace<T> ws;
      return layer->forward(make_input(s, xq, xk, pad), ws);
    };
    all.push_back(s);
  }
  for (bool layer_norm : {false, true}) {
    Subject<T> s;
    s.name = layer_norm ? "collab_layer_norm" : "collab", s.cross = true, s.S = 7, s.Dkv = 3;
    if (layer_norm) s.out = s.D;
    headmix::CollabHeadWeights<T> w;
    w.q = random_matrix<T>(rng, 4, s.D, 0.5), w.k = random_matrix<T>(rng, 4, s.Dkv, 0.5), w.mixing = random_matrix<T>(rng, 2, 4, 1.0);
    w.content_bias = random_matrix<T>(rng, 2, s.Dkv, 0.5);
    w.v = rand_linear<T>(rng, 4, s.Dkv), w.o = rand_linear<T>(rng, s.out, 4);
    if (layer_norm) w.layer_norm.weight = random_vector<T>(rng, s.D, 1.0), w.layer_norm.bias = random_vector<T>(rng, s.D, 0.5);
    headmix::CollabHeadOptions o;
    o.num_heads = 2, o.block_rows = 2, o.threads = threads;
    auto layer = std::make_shared<headmix::CollabHead<T>>(w, o);
    s.run = [layer, s](const Matrix<T>& xq, const Matrix<T>* xk, const std::vector<std::uint8_t>& pad) {
      headmix::Workspace<T> ws;
      return layer->forward(make_input(s, xq, xk, pad), ws);
    };
    all.push_back(s);
  }
  {
    Subject<T> s;
    s.name = "lsh", s.Tq = s.S = 8;
    headmix::LshWeights<T> w;
    w.qk = rand_linear<T>(rng, 4, s.D, false), w.v = rand_linear<T>(rng, 4, s.D, false);
    w.o = rand_linear<T>(rng, s.out, 4);
    w.rotations = random_tensor<T>(rng, {1, 2, 3, 2}, 1.0);  // [1, dh, NH, NB / 2]: T = 8 pads to 8, NB = 4
    headmix::LshOptions o;
    o.num_heads = 2, o.bucket_size = 2, o.n_hashes = 3, o.threads = threads;
    auto layer = std::make_shared<headmix::Lsh<T>>(w, o);
    s.run = [layer, s](const Matrix<T>& xq, const Matrix<T>* xk, const std::vector<std::uint8_t>& pad) {
      headmix::Workspace<T> ws;
      return layer->forward(make_input(s, xq, xk, pad), ws);
    };
    auto widen = [](const T* p, Index n) { return std::vector<double>(p, p + n); };
    auto ref_linear = [&](const headmix::Linear<T>& l) {
      headmix_ref::LshRefLinear r;
      r.out = static_cast<int>(l.weight.rows()), r.in = static_cast<int>(l.weight.cols());
      r.weight = widen(l.weight.data(), l.weight.size()), r.bias = widen(l.bias.data(), l.bias.size());
      return r;
    };
    const headmix_ref::LshRefWeights rw{ref_linear(w.qk), ref_linear(w.v), ref_linear(w.o),
                                        widen(w.rotations.data(), w.rotations.size())};
    headmix_ref::LshRefOptions ro;
    ro.num_heads = 2, ro.bucket_size = 2, ro.n_hashes = 3;
    s.reference = [rw, ro, s, widen](const Matrix<T>& x, const std::vector<std::uint8_t>& pad) {
      return headmix_ref::lsh_reference(rw, ro, static_cast<int>(s.B), static_cast<int>(s.Tq),
                                        static_cast<int>(s.D), widen(x.data(), x.size()), pad)
          .output;
    };
    all.push_back(s);
  }
  {
    Subject<T> s;
    s.name = "dcmha";
    const Index H = 4, G = 2, M = 2, R = 1, K = 3;
    headmix::DcmhaWeights<T> w;
    w.q = rand_linear<T>(rng, H * 2, s.D), w.k = rand_linear<T>(rng, H * 2, s.D), w.v = rand_linear<T>(rng, H * 2, s.D);
    w.o = rand_linear<T>(rng, s.out, H * 2);
    w.dw1 = random_tensor<T>(rng, {s.D, G, 4, K}, 0.5), w.qkw = random_tensor<T>(rng, {G, 4, K, 2 * R, M}, 0.5);
    w.dd = random_tensor<T>(rng, {s.D, G, 4 * M}, 0.5);
    w.pre_w = random_tensor<T>(rng, {G, M, M}, 0.5), w.post_w = random_tensor<T>(rng, {G, M, M}, 0.5);
    headmix::DcmhaOptions o;
    o.num_heads = H, o.groups = G, o.rank = R, o.static_w = true, o.causal = true, o.block_rows = 2;
    o.threads = threads;
    auto layer = std::make_shared<headmix::Dcmha<T>>(w, o);
    s.run = [layer, s](const Matrix<T>& xq, const Matrix<T>* xk, const std::vector<std::uint8_t>& pad) {
      headmix::Workspace<T> ws;
      return layer->forward(make_input(s, xq, xk, pad), ws);
    };
    all.push_back(s);
  }
  return all;
}

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

// The contract, given which (item, row) pairs must come out non-finite.
// Returns the number of rows that came out non-finite.
// LSH's affected rows against its reference: non-finite where it is, else
// within float 2e-4 / 2e-5, double 1e-10 / 1e-12 (as test_lsh.cpp).
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

template <class T>
Index expect_contract(const Subject<T>& s, const Tensor<T>& clean, const Tensor<T>& got, Index bad_item,
                      const std::function<bool(Index)>& must_be_bad, const std::string& what,
                      const std::vector<double>* reference = nullptr) {
  Index bad_rows = 0;
  EXPECT_EQ(got.shape(), clean.shape()) << what;
  if (got.shape() != clean.shape()) return 0;
  for (Index b = 0; b < s.B; ++b)
    for (Index i = 0; i < s.Tq; ++i) {
      const Index row = b * s.Tq + i;
      const bool same = row_identical(got, clean, row, s.out), bad = row_all_nonfinite(got, row, s.out);
      bad_rows += bad;
      if (b != bad_item) {
        EXPECT_TRUE(same) << what << ": item " << b << " row " << i << " changed (another item held the bad value)";
      } else if (reference) {
        expect_reference_row(got, *reference, row, s.out, what);
      } else if (must_be_bad(i)) {
        EXPECT_TRUE(bad) << what << ": row " << i << " uses the bad value but has a finite entry";
      } else {
        EXPECT_TRUE(same || bad) << what << ": row " << i << " is finite but differs from the clean run";
      }
    }
  return bad_rows;
}

HEADMIX_TYPED_OVER_SCALARS(NonFiniteInput);

template <class T>
std::vector<T> bad_values() {
  return {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
          -std::numeric_limits<T>::infinity()};
}

// A bad value in a query row that is not also a key (cross-attention): only
// that output row changes, and it is non-finite throughout.
TYPED_TEST(NonFiniteInput, InQueryRowReachesOnlyThatRow) {
  using T = TypeParam;
  for (int threads : {1, 2})
    for (const auto& s : subjects<T>(threads)) {
      if (!s.cross) continue;
      Rng rng(7);
      const Matrix<T> xq = random_matrix<T>(rng, s.B * s.Tq, s.D, 1.0), xk = random_matrix<T>(rng, s.B * s.S, s.Dkv, 1.0);
      const Tensor<T> clean = s.run(xq, &xk, {});
      for (T v : bad_values<T>()) {
        Matrix<T> poisoned = xq;
        poisoned(1 * s.Tq + 2, 0) = v;
        const Tensor<T> got = s.run(poisoned, &xk, {});
        const std::string what = s.name + " threads=" + std::to_string(threads) + " query value " + std::to_string(v);
        const Index bad = expect_contract<T>(s, clean, got, 1, [](Index i) { return i == 2; }, what);
        EXPECT_EQ(bad, 1) << what;
      }
    }
}

// A bad value in a key (a key row of cross-attention, or a position of
// self-attention): every row that attends to it is non-finite, other items
// are untouched. Without masks every dense row attends to every key (from
// the key on, under DCMHA's causal mask). LSH is the next test.
template <class T>
void bad_key_test(bool lsh) {
  for (int threads : {1, 2})
    for (const auto& s : subjects<T>(threads)) {
      if ((s.name == "lsh") != lsh) continue;
      Rng rng(8);
      const Matrix<T> xq = random_matrix<T>(rng, s.B * s.Tq, s.D, 1.0), xk = random_matrix<T>(rng, s.B * s.S, s.Dkv, 1.0);
      const Matrix<T>* keys = s.cross ? &xk : nullptr;
      const Tensor<T> clean = s.run(xq, keys, {});
      const bool causal = s.name == "dcmha";  // DCMHA's subject is causal: rows >= 3 see key 3
      for (T v : bad_values<T>()) {
        Matrix<T> q = xq, k = xk;
        (s.cross ? k : q)(1 * s.S + 3, 0) = v;
        const Tensor<T> got = s.run(q, s.cross ? &k : nullptr, {});
        const std::string what = s.name + " threads=" + std::to_string(threads) + " key value " + std::to_string(v);
        const std::vector<double> want = s.reference ? s.reference(q, {}) : std::vector<double>();
        expect_contract<T>(s, clean, got, 1, [&](Index i) {
          if (!s.cross && i == 3) return true;  // its own query
          return !causal || i >= 3;
        }, what, s.reference ? &want : nullptr);
      }
    }
}

TYPED_TEST(NonFiniteInput, InKeyReachesTheRowsThatSeeIt) { bad_key_test<TypeParam>(false); }

// LSH rows attend within their chunks, over several hash rounds; the
// reference decides which rows see the bad position.
TYPED_TEST(NonFiniteInput, LshRoundThatSeesTheBadKeyIsNotDropped) { bad_key_test<TypeParam>(true); }

// A bad value in a padded key must not crash or reach other items. Padding
// does not clean it: rows of its item may come out NaN, never finite and
// wrong.
TYPED_TEST(NonFiniteInput, InPaddedKeyStaysInItsItem) {
  using T = TypeParam;
  for (const auto& s : subjects<T>(2)) {
    Rng rng(9);
    const Matrix<T> xq = random_matrix<T>(rng, s.B * s.Tq, s.D, 1.0), xk = random_matrix<T>(rng, s.B * s.S, s.Dkv, 1.0);
    std::vector<std::uint8_t> padding(static_cast<std::size_t>(s.B * s.S), 0);
    padding[static_cast<std::size_t>(1 * s.S + 3)] = 1;
    const Matrix<T>* keys = s.cross ? &xk : nullptr;
    const Tensor<T> clean = s.run(xq, keys, padding);
    for (T v : bad_values<T>()) {
      Matrix<T> q = xq, k = xk;
      (s.cross ? k : q)(1 * s.S + 3, 0) = v;
      const Tensor<T> got = s.run(q, s.cross ? &k : nullptr, padding);
      const std::vector<double> want = s.reference ? s.reference(q, padding) : std::vector<double>();
      expect_contract<T>(s, clean, got, 1, [&](Index i) { return !s.cross && i == 3; },
                         s.name + " padded key value " + std::to_string(v), s.reference ? &want : nullptr);
    }
  }
}

// All-NaN and all-Inf input: every output entry non-finite, promptly.
TYPED_TEST(NonFiniteInput, EverythingBadGivesNonFiniteEverywhere) {
  using T = TypeParam;
  for (const auto& s : subjects<T>(2))
    for (T v : bad_values<T>()) {
      const Matrix<T> xq = Matrix<T>::Constant(s.B * s.Tq, s.D, v), xk = Matrix<T>::Constant(s.B * s.S, s.Dkv, v);
      const Tensor<T> got = s.run(xq, s.cross ? &xk : nullptr, {});
      for (Index i = 0; i < got.size(); ++i)
        ASSERT_FALSE(std::isfinite(static_cast<double>(got[i]))) << s.name << " value " << v << " at " << i;
    }
}

// Decoding: a bad position cached by step() reaches every later step that
// sees it; reset() forgets it, and the next steps equal a fresh cache's.
TYPED_TEST(NonFiniteInput, DecodingCachesItUntilReset) {
  using T = TypeParam;
  Rng rng(10);
  const Index B = 2, D = 5, Out = 4, steps = 4;
  const Matrix<T> x = random_matrix<T>(rng, B * steps, D, 1.0);  // step t: rows t and steps + t
  auto step_input = [&](Index t, bool poison) {
    Matrix<T> xt(B, D);
    xt.row(0) = x.row(t), xt.row(1) = x.row(steps + t);
    if (poison) xt(1, 0) = std::numeric_limits<T>::quiet_NaN();
    return xt;
  };
  // Runs `steps` single-position steps, poisoning item 1 at step 1; resets
  // after step 2 when asked. Returns every step's output [B, Out].
  auto decode = [&](auto&& step, auto&& reset, bool poison, bool reset_after_2) {
    std::vector<Matrix<T>> outs;
    for (Index t = 0; t < steps; ++t) {
      if (reset_after_2 && t == 3) reset();
      const Matrix<T> xt = step_input(t, poison && t == 1);
      Matrix<T> y(B, Out);
      step(xt, y);
      outs.push_back(y);
    }
    return outs;
  };
  auto check = [&](const char* name, const std::vector<Matrix<T>>& clean, const std::vector<Matrix<T>>& bad,
                   const std::vector<Matrix<T>>& fresh_after_reset, const std::vector<Matrix<T>>& reset_run) {
    for (Index t = 0; t < steps; ++t) {
      EXPECT_TRUE(clean[t].row(0) == bad[t].row(0)) << name << " step " << t << ": item 0 changed";
      if (t == 0) {
        EXPECT_TRUE(clean[t].row(1) == bad[t].row(1)) << name;
      } else {
        for (Index c = 0; c < Out; ++c) EXPECT_FALSE(std::isfinite(static_cast<double>(bad[t](1, c)))) << name << t;
      }
    }
    // After reset() at step 3 the cache holds only step 3: it equals a fresh
    // cache that decodes step 3 as its first position.
    EXPECT_TRUE(reset_run[3] == fresh_after_reset[0]) << name << ": reset() did not forget the bad position";
  };
  // A clean run, a poisoned one, a poisoned one reset after step 2, and a
  // fresh cache's first step on step 3's input.
  auto check_layer = [&](const char* name, const auto& layer) {
    headmix::SequenceCache<T> cache(B, steps);
    headmix::Workspace<T> ws;
    auto step = [&](const Matrix<T>& xt, Matrix<T>& y) {
      layer.step({xt.data(), B, 1, D}, cache, {y.data(), B, 1, Out}, ws);
    };
    auto reset = [&] { cache.reset(); };
    const auto clean = decode(step, reset, false, false);
    cache.reset();
    const auto bad = decode(step, reset, true, false);
    cache.reset();
    const auto reset_run = decode(step, reset, true, true);
    cache.reset();
    Matrix<T> y(B, Out);
    const Matrix<T> x3 = step_input(3, false);
    step(x3, y);
    check(name, clean, bad, {y}, reset_run);
  };
  {
    headmix::MhaWeights<T> w{rand_linear<T>(rng, 6, D), rand_linear<T>(rng, 6, D), rand_linear<T>(rng, 4, D),
                             rand_linear<T>(rng, Out, 4)};
    headmix::MhaOptions o;
    o.num_heads = 2;
    check_layer("mha", headmix::Mha<T>(w, o));
  }
  {
    const Index H = 2, G = 1, M = 2, R = 1, K = 3;
    headmix::DcmhaWeights<T> w;
    w.q = rand_linear<T>(rng, H * 2, D), w.k = rand_linear<T>(rng, H * 2, D), w.v = rand_linear<T>(rng, H * 2, D);
    w.o = rand_linear<T>(rng, Out, H * 2);
    w.dw1 = random_tensor<T>(rng, {D, G, 4, K}, 0.5), w.qkw = random_tensor<T>(rng, {G, 4, K, 2 * R, M}, 0.5);
    w.dd = random_tensor<T>(rng, {D, G, 4 * M}, 0.5);
    headmix::DcmhaOptions o;
    o.num_heads = H, o.groups = G, o.rank = R, o.causal = true;
    check_layer("dcmha", headmix::Dcmha<T>(w, o));
  }
}

}  // namespace
