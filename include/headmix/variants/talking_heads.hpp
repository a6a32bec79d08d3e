// Talking-Heads attention (Shazeer, Lan, Cheng, Ding, Hou 2020): multi-head
// attention with a learned static mix across heads before and after the
// softmax. Three head counts may all differ: h_k heads for Q and K, h logit
// (softmax) heads, h_v heads for V.
//
//   Q = Xq Wqᵀ + bq [.., h_k·Dk],  K = Xk Wkᵀ + bk [.., h_k·Dk],  V = Xk Wvᵀ + bv [.., h_v·Dv]
//   J_a = scale · Q_a K_aᵀ                                   a < h_k
//   L_g = Σ_a pre[g, a] · J_a                                g < h      (no pre:  L = J, h_k == h)
//   W_g = softmax(L_g + mask)                                mask AFTER the mix
//   U_c = Σ_g post[c, g] · W_g                               c < h_v    (no post: U = W, h == h_v)
//   Y   = concat_c(U_c V_c) Woᵀ + bo
//
// Both mixing matrices use PyTorch's [out, in] orientation: pre is [h, h_k],
// post is [h_v, h]. The mask has to come after the pre mix: a -inf mixed over
// heads of mixed sign is NaN, and a large negative additive mask mixed by a
// row of negative sum becomes a large positive logit. U is not renormalised:
// its rows sum to Σ_g post[c, g] and may be negative. The weights returned on
// request are U, [B, h_v, T, S].
//
// The dense pipeline (core/pipeline.hpp) computes the h_k score heads of a
// [heads, block_rows, S] tile with one GEMM each. Then one fused stage
// (core/head_mix.hpp, mix_softmax_mix) walks the tile a row or two at a
// time: pre mix (a product over the head axis), mask + softmax and post mix
// run while that chunk is in cache, and U overwrites J in place. The
// readout is then one GEMM per value head, as in MHA.
//
// Grouped-query attention (num_kv_heads): K and V store fewer heads, each
// read by a contiguous group of score (value) heads; below, K_a and V_c
// then stand for the stored head of a's (c's) group.
//
// Decoding: step() appends new positions to a SequenceCache holding each
// position's stored K and V heads, and runs the same pipeline
// over the cached rows with a bottom-right causal mask. Nothing else is
// cached: the mixes act on each (query, key) entry on its own.
//
// Memory: besides the caller's output, a call keeps in its Workspace
//   Q [B·T, h_k·Dk] + K [B·S, h_k·Dk] + V [B·S, h_v·Dv] + context [B·T, h_v·Dv]
//   (K and V with num_kv_heads heads instead, when set)
//   + a forward: K and V again, copied head-major (DotProductStages::packed)
//   + per worker thread: max(h_k, h, h_v) · block_rows · S (the tile)
//     + h · max(S, ~64 KiB worth) (a chunk of logits) + S (padding bias) values.
#pragma once

#include "headmix/core/dot_product.hpp"
#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/head_mix.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/options.hpp"
#include "headmix/core/pipeline.hpp"
#include "headmix/core/sequence_cache.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

namespace headmix {

struct TalkingHeadsOptions : DenseOptions {
  Index num_heads = 1;           ///< h, the logit (softmax) heads
  Index key_heads = 0;           ///< h_k, the heads of Q and K; 0 means num_heads
  Index value_heads = 0;         ///< h_v, the heads of V and of the output; 0 means num_heads
  /// Grouped-query attention: K and V store this many heads (a divisor of
  /// h_k and of h_v); score head a reads K head a / (h_k / num_kv_heads),
  /// value head c reads V head c / (h_v / num_kv_heads). 0: K has h_k heads
  /// and V h_v.
  Index num_kv_heads = 0;
};

/// Parameters in PyTorch layout. `o` may be empty: the output is then the
/// concatenated value heads [B, T, h_v·Dv]. An empty mixing matrix means no
/// mix (the identity), which needs equal head counts on both sides.
template <class T>
struct TalkingHeadsWeights {
  Linear<T> q;              ///< [h_k·Dk, D]
  Linear<T> k;              ///< [h_k·Dk, Dkv]
  Linear<T> v;              ///< [h_v·Dv, Dkv]
  Linear<T> o;              ///< [out_dim, h_v·Dv], optional
  Matrix<T> pre_softmax;    ///< [h, h_k], optional
  Matrix<T> post_softmax;   ///< [h_v, h], optional
};

template <class T>
class TalkingHeads : public LayerForms<TalkingHeads<T>, T> {
 public:
  using LayerForms<TalkingHeads<T>, T>::forward;  // the allocating forms
  using LayerForms<TalkingHeads<T>, T>::step;
  static constexpr const char* kName = "talking_heads";

  TalkingHeads(TalkingHeadsWeights<T> weights, TalkingHeadsOptions options)
      : w_(std::move(weights)), opt_(options) {
    validate(w_, opt_);
    prepare_projections(opt_.bfloat16_weights, w_.q, w_.k, w_.v, w_.o);
  }

  /// Build from named tensors (an io::TensorFile, or anything with the same
  /// contains/matrix/vector accessors), as in conformance/talking_heads.md:
  /// `<prefix>q.weight`, `<prefix>q.bias`, ... `<prefix>o.bias`,
  /// `<prefix>pre_softmax.weight`, `<prefix>post_softmax.weight`. Biases,
  /// `o` and both mixes are optional. Stored F16/BF16/F32/F64 become T.
  template <class Source>
  static TalkingHeads from_tensors(const Source& tensors, const std::string& prefix,
                                   const TalkingHeadsOptions& options) {
    TalkingHeadsWeights<T> w;
    w.q = read_linear<T>(tensors, prefix + "q");
    w.k = read_linear<T>(tensors, prefix + "k");
    w.v = read_linear<T>(tensors, prefix + "v");
    w.o = detail::read_optional_linear<T>(tensors, prefix + "o");
    // A mix is optional only where the head counts on its two sides agree;
    // where they differ it is read unconditionally, so that its absence is
    // the source's missing-tensor error, naming the stored name.
    const Index hk = key_heads_of(options), h = options.num_heads, hv = value_heads_of(options);
    if (hk != h || tensors.contains(prefix + "pre_softmax.weight"))
      w.pre_softmax = detail::read_matrix<T>(tensors, prefix + "pre_softmax.weight");
    if (hv != h || tensors.contains(prefix + "post_softmax.weight"))
      w.post_softmax = detail::read_matrix<T>(tensors, prefix + "post_softmax.weight");
    return with_tensor_prefix(tensors, prefix,
                              {"q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight", "o.bias",
                               "pre_softmax.weight", "post_softmax.weight"},
                              [&] { return TalkingHeads(std::move(w), options); });
  }

  Index num_heads() const { return opt_.num_heads; }
  Index key_heads() const { return key_heads_of(opt_); }
  Index value_heads() const { return value_heads_of(opt_); }
  Index stored_key_heads() const { return stored_key_heads_of(opt_); }      ///< heads in K
  Index stored_value_heads() const { return stored_value_heads_of(opt_); }  ///< heads in V
  Index head_dim() const { return w_.q.out_features() / key_heads(); }
  Index v_head_dim() const { return w_.v.out_features() / stored_value_heads(); }
  Index embed_dim() const { return w_.q.in_features(); }
  Index key_dim() const { return w_.k.in_features(); }
  Index out_dim() const { return w_.o.empty() ? value_heads() * v_head_dim() : w_.o.out_features(); }
  bool has_pre_mix() const { return present(w_.pre_softmax); }
  bool has_post_mix() const { return present(w_.post_softmax); }
  T scale() const { return static_cast<T>(opt_.scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim())))); }
  const TalkingHeadsWeights<T>& weights() const { return w_; }
  const TalkingHeadsOptions& options() const { return opt_; }
  /// Change masking, block size, threads (or the head counts) between
  /// calls; validated like the constructor, and left unchanged if invalid.
  void set_options(const TalkingHeadsOptions& options) {
    validate(w_, options);
    if (options.bfloat16_weights != opt_.bfloat16_weights)
      prepare_projections(options.bfloat16_weights, w_.q, w_.k, w_.v, w_.o);
    opt_ = options;
  }

  /// Run the layer. `out` must be [B, T, out_dim]. With `probs`, the final
  /// attention weights (after the post-softmax mix) are written there as
  /// [B, h_v, T, S].
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    check_input(kName, in, embed_dim(), key_dim());
    const Index B = in.query.batch(), T_ = in.query.length(), S = in.keys().length();
    check_output(kName, out, B, T_, out_dim());
    const Index dk = head_dim(), dv = v_head_dim();

    MatrixMap<T> k = ws.shared_matrix(slot::key, B * S, stored_key_heads() * dk);
    MatrixMap<T> v = ws.shared_matrix(slot::value, B * S, stored_value_heads() * dv);
    project_rows<T>(w_.k, in.keys().rows(), k, opt_.threads);
    project_rows<T>(w_.v, in.keys().rows(), v, opt_.threads);
    attend(in.query, k.data(), v.data(), S, S, opt_.mask(), in.key_padding, out, ws, probs);
  }

  /// Incremental decoding, with the contract of Mha::step. Attends n new
  /// positions `x` [B, n, D] to every position in `cache` and to
  /// themselves, and appends their per-head keys [h_k·Dk] and values
  /// [h_v·Dv] to the cache. Alignment is bottom-right causal whatever
  /// options().causal says: new position k sees cached positions
  /// 0 … size + k. The mixes act per (query, key) entry, so a cached key
  /// needs nothing besides its K and V rows. `out` must be [B, n, out_dim];
  /// with `probs`, the final weights are written as [B, h_v, n, size + n].
  /// Self-attention layers only (key width == D). Allocates nothing once
  /// `ws` and `cache` are sized; throws cache_full_error (and changes
  /// nothing) when n positions do not fit.
  void step(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
            Tensor<T>* probs = nullptr) const {
    check_input(kName, AttentionInput<T>{x, {}, {}}, embed_dim(), key_dim());
    const Index B = x.batch(), n = x.length(), past = cache.size();
    check_shape(kName, "cache batch", {B}, {cache.batch()});
    check_output(kName, out, B, n, out_dim());
    const Index sk = stored_key_heads(), sv = stored_value_heads();
    cache.bind(kName, {sk * head_dim(), sv * v_head_dim()}, {sk, sv}, 2);  // head-major, as MHA's
    cache.check_room(kName, n);
    reserve_step_scratch(ws, std::min(n, block_rows(cache.capacity())), cache.capacity());
    append_kv(w_.k, w_.v, x, cache, past, ws);
    attend(x, nullptr, nullptr, past + n, cache.capacity(), opt_.step_mask(past), {}, out, ws, probs, &cache);
    cache.advance(n);
  }

  /// Multiply-adds of one call on B sequences of T queries and S keys. Per
  /// causally visible (query, key) pair: h_k·Dk for the scores, h·h_k for
  /// the pre mix, h_v·h for the post mix and h_v·Dv for the readout.
  FlopCount flops(Index B, Index T_, Index S) const {
    const Index hk = key_heads(), h = num_heads(), hv = value_heads(), dk = head_dim(), dv = v_head_dim();
    FlopCount f;
    f.projection_macs = B * (T_ * embed_dim() * hk * dk +
                             S * key_dim() * (stored_key_heads() * dk + stored_value_heads() * dv) +
                             (w_.o.empty() ? 0 : T_ * hv * dv * out_dim()));
    const Index per_pair = hk * dk + (has_pre_mix() ? h * hk : 0) + (has_post_mix() ? hv * h : 0) + hv * dv;
    f.attention_macs = B * opt_.mask().visible_pairs(T_, S) * per_pair;
    return f;
  }

 private:
  // Project the queries, run the pipeline over S keys and values: `k`, `v`
  // [B·S, heads·dim] (a forward, key_stride = S) or the cache's (a step,
  // key_stride = its capacity), and project the output.
  void attend(ConstBatchView<T> x, const T* k, const T* v, Index S, Index key_stride, const PositionMask& mask,
              const KeyPadding& padding, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs,
              const SequenceCache<T>* cache = nullptr) const {
    const Index B = x.batch(), T_ = x.length();
    const Index hk = key_heads(), h = num_heads(), hv = value_heads(), dk = head_dim(), dv = v_head_dim();
    MatrixMap<T> q = ws.shared_matrix(slot::query, B * T_, hk * dk);
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * T_, hv * dv);
    project_rows<T>(w_.q, x.rows(), q, opt_.threads);
    q *= scale();  // the mix is linear, so the scale may go on Q before it

    // Blocks sized for key_stride (a decoding cache's capacity), as
    // step() reserved them, so that steps over a growing cache allocate nothing.
    const DenseRun<T> run{B, T_, S, mask, padding, block_rows(key_stride), opt_.threads, ctx.data(), probs,
                          opt_.keys_per_block()};
    const Index sk = stored_key_heads(), sv = stored_value_heads();
    DotProductStages<T> stages{q.data(), k, v, T_, key_stride, hk, sk, sv, dk, dv, hk / sk, hv / sv};
    stages.heads_in_turn = has_pre_mix() || has_post_mix();  // the mixes score a block's heads in turn
    reserve_mix_scratch(ws, key_stride);
    run_dense_pipeline(Policy{cache ? stages.reading(*cache, ws, opt_.threads) : stages.packed(B, S, ws, opt_.threads),
                              w_.pre_softmax, w_.post_softmax, h, hv},
                       run, ws);

    if (w_.o.empty())
      out.rows() = ctx;
    else
      project_rows<T>(w_.o, ConstMatrixMap<T>(ctx.data(), ctx.rows(), ctx.cols()), out.rows(), opt_.threads);
  }

  // Size every worker's scratch for tiles of up to `rows` queries over up
  // to `keys` keys, so that steps over a growing cache allocate nothing:
  // the tile (one plane without mixes, else the fused stage's
  // max(h_k, h, h_v) planes) and the fused stage's chunk of logits, which
  // Policy::mix_softmax keeps at max(kChunkBytes, one row of h heads).
  void reserve_step_scratch(Workspace<T>& ws, Index rows, Index keys) const {
    reserve_dense_tiles(ws, opt_.threads, tile_planes(), false, rows, keys);
    reserve_mix_scratch(ws, keys);
  }
  // Every worker's chunk of logits, before the pipeline's tasks (any worker
  // may take a tile, so none may size its scratch only when it first runs).
  void reserve_mix_scratch(Workspace<T>& ws, Index keys) const {
    if (!has_pre_mix() && !has_post_mix()) return;
    const Index chunk = std::max(kChunkBytes / static_cast<Index>(sizeof(T)), num_heads() * keys);
    ws.reserve_local(std::max(1, opt_.threads), slot::local_variant, chunk);
  }

  // Dot-product scores over h_k heads and readout over h_v, with the two
  // mixes as one fused stage.
  struct Policy : DotProductStages<T> {
    const Matrix<T>& pre;
    const Matrix<T>& post;
    Index h, hv;

    Index score_heads() const { return this->q_heads; }
    Index softmax_heads() const { return h; }
    Index value_heads() const { return hv; }
    Index value_dim() const { return this->dv; }
    bool has_pre_mix() const { return present(pre); }
    bool has_post_mix() const { return present(post); }

    // Pre mix, mask + softmax and post mix a few rows at a time, in place.
    // A chunk's logits (h · rows · cols values) stay within ~kChunkBytes.
    AttentionTensor<T> mix_softmax(Index, const AttentionTensor<T>& scores, Index num_keys, const PositionMask& mask,
                                   const T* key_bias, Workspace<T>& ws, int worker) const {
      const Index per_row = std::max<Index>(1, h * scores.cols());
      const Index chunk = std::clamp<Index>(kChunkBytes / static_cast<Index>(sizeof(T)) / per_row, 1,
                                            std::max<Index>(1, scores.rows()));
      T* scratch = ws.local(worker, slot::local_variant, chunk * per_row);
      return mix_softmax_mix(has_pre_mix() ? &pre : nullptr, has_post_mix() ? &post : nullptr, scores, num_keys,
                             mask, key_bias, scratch, chunk);
    }
  };
  static_assert(fuses_mix_softmax<Policy>::value, "the pipeline should take the fused mix + softmax stage");
  static constexpr Index kChunkBytes = 64 * 1024;

  // With a mix, the fused stage keeps all max(h_k, h, h_v) planes of a
  // block resident; without one, heads run one at a time.
  Index tile_planes() const {
    return has_pre_mix() || has_post_mix() ? std::max({key_heads(), num_heads(), value_heads()}) : 1;
  }
  Index block_rows(Index keys) const { return opt_.rows_per_block(tile_planes(), keys, sizeof(T)); }

  static Index key_heads_of(const TalkingHeadsOptions& o) { return o.key_heads > 0 ? o.key_heads : o.num_heads; }
  static Index value_heads_of(const TalkingHeadsOptions& o) {
    return o.value_heads > 0 ? o.value_heads : o.num_heads;
  }
  static Index stored_key_heads_of(const TalkingHeadsOptions& o) {
    return o.num_kv_heads > 0 ? o.num_kv_heads : key_heads_of(o);
  }
  static Index stored_value_heads_of(const TalkingHeadsOptions& o) {
    return o.num_kv_heads > 0 ? o.num_kv_heads : value_heads_of(o);
  }

  static void validate(const TalkingHeadsWeights<T>& w, const TalkingHeadsOptions& opt) {
    check_value(opt.num_heads >= 1, kName, "num_heads", ">= 1", opt.num_heads);
    check_value(opt.key_heads >= 0, kName, "key_heads", ">= 1 (or 0 for num_heads)", opt.key_heads);
    check_value(opt.value_heads >= 0, kName, "value_heads", ">= 1 (or 0 for num_heads)", opt.value_heads);
    check_value(opt.num_kv_heads >= 0, kName, "num_kv_heads", ">= 1 (or 0 for none)", opt.num_kv_heads);
    opt.validate(kName);
    const Index hk = key_heads_of(opt), h = opt.num_heads, hv = value_heads_of(opt);
    const Index sk = stored_key_heads_of(opt), sv = stored_value_heads_of(opt);
    check_value(hk % sk == 0 && hv % sv == 0, kName, "num_kv_heads",
                "a divisor of key_heads = " + std::to_string(hk) + " and of value_heads = " + std::to_string(hv),
                opt.num_kv_heads);
    const Index D = w.q.in_features(), Dkv = w.k.in_features();
    const Index hdk = w.q.out_features(), hdv = w.v.out_features();
    if (hdk == 0 || hdk % hk != 0)
      detail::throw_shape(kName, "q.weight", "[key_heads * head_dim, D] with key_heads = " + std::to_string(hk),
                          detail::format_shape(shape_of(w.q.weight)));
    if (hdv == 0 || hdv % sv != 0)
      detail::throw_shape(kName, "v.weight",
                          opt.num_kv_heads > 0
                              ? "[num_kv_heads * v_head_dim, Dkv] with num_kv_heads = " + std::to_string(sv)
                              : "[value_heads * v_head_dim, Dkv] with value_heads = " + std::to_string(sv),
                          detail::format_shape(shape_of(w.v.weight)));
    check_value(D >= 1, kName, "q.weight columns (D)", ">= 1", D);
    w.q.check(kName, "q", hdk, D);
    check_value(Dkv >= 1, kName, "k.weight columns (Dkv)", ">= 1", Dkv);
    w.k.check(kName, "k", hdk / hk * sk, Dkv);
    w.v.check(kName, "v", hdv, Dkv);
    w.o.check_optional(kName, "o", hdv / sv * hv);
    check_mix("pre_softmax.weight", w.pre_softmax, h, hk, "key_heads", "num_heads");
    check_mix("post_softmax.weight", w.post_softmax, hv, h, "num_heads", "value_heads");
  }

  // A present mix must be [out, in]; an absent one is the identity, so the
  // head counts on its two sides must agree.
  static void check_mix(const char* name, const Matrix<T>& m, Index out, Index in, const char* in_name,
                        const char* out_name) {
    if (present(m))
      check_matrix(kName, name, m, out, in);
    else if (out != in)
      detail::throw_shape(kName, name,
                          detail::format_shape({out, in}) + " (" + in_name + " = " + std::to_string(in) +
                              " differs from " + out_name + " = " + std::to_string(out) +
                              ", so the mix cannot be left out)",
                          "none");
  }
  // 0 x 0 is "no mix"; any other shape, even an empty [n, 0], is a matrix to check.
  static bool present(const Matrix<T>& m) { return m.rows() != 0 || m.cols() != 0; }

  TalkingHeadsWeights<T> w_;
  TalkingHeadsOptions opt_;
};

}  // namespace headmix
