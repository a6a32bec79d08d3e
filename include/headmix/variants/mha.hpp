// Standard multi-head attention (Vaswani et al. 2017), with the math of
// torch.nn.MultiheadAttention:
//
//   Q = Xq Wqᵀ + bq,  K = Xk Wkᵀ + bk,  V = Xk Wvᵀ + bv     (head h: columns h·Dk.., h·Dv..)
//   P_h = softmax(scale · Q_h K_g(h)ᵀ + mask),  C_h = P_h V_g(h),  Y = concat_h(C_h) Woᵀ + bo
//
// Grouped-query attention: K and V have Hkv = num_kv_heads heads (a divisor
// of H) and query head h reads KV head g(h) = h / (H / Hkv), contiguous
// groups as in Hugging Face's repeat_kv and PyTorch's enable_gqa. Hkv = H
// is standard MHA, Hkv = 1 multi-query attention. Dk and Dv are independent
// of D / H; out_dim need not equal D.
//
// Memory: besides the caller's output, a call keeps in its Workspace
//   Q [B·T, H·Dk] + K [B·S, Hkv·Dk] + V [B·S, Hkv·Dv] + context [B·T, H·Dv]
//   + a forward: K and V again, copied head-major (DotProductStages::packed)
//   + per worker thread: block_rows · min(S, key_block) (one head's tile) + S (padding bias)
// values, so attention memory grows with block_rows · S, never H · T · S.
#pragma once

#include "headmix/core/dot_product.hpp"
#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/options.hpp"
#include "headmix/core/pipeline.hpp"
#include "headmix/core/sequence_cache.hpp"

#include <cmath>
#include <optional>

namespace headmix {

struct MhaOptions : DenseOptions {
  Index num_heads = 1;
  Index num_kv_heads = 0;  ///< heads of K and V, a divisor of num_heads; 0 = num_heads
};

/// Parameters in PyTorch layout. `o` may be empty: the output is then the
/// concatenated heads [B, T, H·Dv].
template <class T>
struct MhaWeights {
  Linear<T> q;  ///< [H·Dk, D]
  Linear<T> k;  ///< [Hkv·Dk, Dkv]
  Linear<T> v;  ///< [Hkv·Dv, Dkv]
  Linear<T> o;  ///< [out_dim, H·Dv], optional
};

template <class T>
class Mha : public LayerForms<Mha<T>, T> {
 public:
  using LayerForms<Mha<T>, T>::forward;  // the allocating forms
  using LayerForms<Mha<T>, T>::step;
  static constexpr const char* kName = "mha";

  Mha(MhaWeights<T> weights, MhaOptions options) : w_(std::move(weights)), opt_(options) {
    validate(w_, opt_);
    prepare_projections(opt_.bfloat16_weights, w_.q, w_.k, w_.v, w_.o);
  }

  /// Build from named tensors (an io::TensorFile, or anything with the same
  /// contains/matrix/vector accessors): `<prefix>q.weight`, `<prefix>q.bias`,
  /// ... `<prefix>o.bias`, as in conformance/mha.md. Biases and `o` are
  /// optional. Stored F16/BF16/F32/F64 are converted to T.
  template <class Source>
  static Mha from_tensors(const Source& tensors, const std::string& prefix, const MhaOptions& options) {
    MhaWeights<T> w{read_linear<T>(tensors, prefix + "q"), read_linear<T>(tensors, prefix + "k"),
                    read_linear<T>(tensors, prefix + "v"), {}};
    w.o = detail::read_optional_linear<T>(tensors, prefix + "o");
    return with_tensor_prefix(
        tensors, prefix, {"q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight", "o.bias"},
        [&] { return Mha(std::move(w), options); });
  }

  Index num_heads() const { return opt_.num_heads; }
  Index num_kv_heads() const { return kv_heads_of(opt_); }
  Index head_dim() const { return w_.q.out_features() / opt_.num_heads; }
  Index v_head_dim() const { return w_.v.out_features() / num_kv_heads(); }
  Index embed_dim() const { return w_.q.in_features(); }
  Index key_dim() const { return w_.k.in_features(); }
  Index out_dim() const { return w_.o.empty() ? num_heads() * v_head_dim() : w_.o.out_features(); }
  T scale() const { return static_cast<T>(opt_.scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim())))); }
  const MhaWeights<T>& weights() const { return w_; }
  const MhaOptions& options() const { return opt_; }
  /// Change masking, block size, threads (or even the head split) between
  /// calls; validated like the constructor, and left unchanged if invalid.
  void set_options(const MhaOptions& options) {
    validate(w_, options);
    if (options.bfloat16_weights != opt_.bfloat16_weights)
      prepare_projections(options.bfloat16_weights, w_.q, w_.k, w_.v, w_.o);
    opt_ = options;
  }

  /// Run the layer. `out` must be [B, T, out_dim]. With `probs`, the
  /// attention weights are written there as [B, H, T, S].
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    check_input(kName, in, embed_dim(), key_dim());
    const Index B = in.query.batch(), T_ = in.query.length(), S = in.keys().length();
    check_output(kName, out, B, T_, out_dim());
    const Index Hkv = num_kv_heads(), dk = head_dim(), dv = v_head_dim();

    MatrixMap<T> k = ws.shared_matrix(slot::key, B * S, Hkv * dk);
    MatrixMap<T> v = ws.shared_matrix(slot::value, B * S, Hkv * dv);
    project_rows<T>(w_.k, in.keys().rows(), k, opt_.threads);
    project_rows<T>(w_.v, in.keys().rows(), v, opt_.threads);
    attend(in.query, k.data(), v.data(), S, opt_.mask(), in.key_padding, out, ws, probs);
  }

  /// Incremental decoding. Attends n new positions `x` [B, n, D] to every
  /// position in `cache` and to themselves, and appends their keys and
  /// values (the Hkv KV heads only) to the cache. Alignment is bottom-right
  /// causal whatever options().causal says: new position k sees cached
  /// positions 0 … size + k (the last `window` of them with a window).
  /// `out` must be [B, n, out_dim]. Self-attention layers only (key width == D). Allocates nothing once `ws` and `cache` are sized;
  /// throws cache_full_error (and changes nothing) when n positions do not fit.
  void step(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
            Tensor<T>* probs = nullptr) const {
    check_input(kName, AttentionInput<T>{x, {}, {}}, embed_dim(), key_dim());
    const Index B = x.batch(), n = x.length(), Hkv = num_kv_heads(), past = cache.size();
    check_shape(kName, "cache batch", {B}, {cache.batch()});
    check_output(kName, out, B, n, out_dim());
    const Index dk = head_dim(), dv = v_head_dim();
    // Head-major: a step streams each head's run. A grouped-query step
    // scores a KV group's heads as one GEMM, whose tiles read K in panels
    // as contiguous memory (S = 8192, Zen 3: 0.87-0.95x the step's time
    // over rows from a float cache, 0.85-0.95x from a bfloat16 one).
    const bool panels = Hkv < num_heads();
    cache.bind(kName, {Hkv * dk, Hkv * dv}, {Hkv, Hkv}, 2, 2, panels ? KeyLayout::panels : KeyLayout::rows);
    cache.check_room(kName, n);
    reserve_dense_tiles(ws, opt_.threads, 1, false, std::min(n, block_rows(cache.capacity())), cache.capacity(),
                        opt_.keys_per_block(), num_heads() / Hkv);
    append_kv(w_.k, w_.v, x, cache, past, ws);
    attend(x, nullptr, nullptr, past + n, opt_.step_mask(past), {}, out, ws, probs, &cache);
    cache.advance(n);
  }

  /// Multiply-adds of one call on B sequences of T queries and S keys.
  FlopCount flops(Index B, Index T_, Index S) const {
    const Index H = num_heads(), Hkv = num_kv_heads(), dk = head_dim(), dv = v_head_dim();
    FlopCount f;
    f.projection_macs = B * (T_ * embed_dim() * H * dk + S * key_dim() * Hkv * (dk + dv) +
                             (w_.o.empty() ? 0 : T_ * H * dv * out_dim()));
    f.attention_macs = B * H * opt_.mask().visible_pairs(T_, S) * (dk + dv);
    return f;
  }

 private:
  // Project the queries, run the pipeline over S keys and values: `k`, `v`
  // [B·S, Hkv·dim] (a forward), or the cache's (a step), and project the
  // output.
  void attend(ConstBatchView<T> x, const T* k, const T* v, Index S, const PositionMask& mask,
              const KeyPadding& padding, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs,
              const SequenceCache<T>* cache = nullptr) const {
    const Index B = x.batch(), T_ = x.length(), H = num_heads(), dk = head_dim(), dv = v_head_dim();
    MatrixMap<T> q = ws.shared_matrix(slot::query, B * T_, H * dk);
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * T_, H * dv);
    project_rows<T>(w_.q, x.rows(), q, opt_.threads);
    q *= scale();  // fold the scale into Q once instead of into every score

    const DenseRun<T> run{B, T_, S, mask, padding, block_rows(S), opt_.threads, ctx.data(), probs, opt_.keys_per_block()};
    const Index Hkv = num_kv_heads();
    const DotProductStages<T> stages{q.data(), k, v, T_, S, H, Hkv, Hkv, dk, dv, H / Hkv, H / Hkv};
    run_dense_pipeline(Policy{cache ? stages.reading(*cache, ws, opt_.threads) : stages.packed(B, S, ws, opt_.threads)},
                       run, ws);

    if (w_.o.empty())
      out.rows() = ctx;
    else
      project_rows<T>(w_.o, ConstMatrixMap<T>(ctx.data(), ctx.rows(), ctx.cols()), out.rows(), opt_.threads);
  }

  // Dot-product scores and readout over H heads, no mixing: the pipeline
  // runs each head on its own.
  struct Policy : DotProductStages<T> {
    Index score_heads() const { return this->q_heads; }
    Index softmax_heads() const { return this->q_heads; }
    Index value_heads() const { return this->q_heads; }
    Index value_dim() const { return this->dv; }
  };

  // Heads run one at a time, so one tile is resident per worker.
  Index block_rows(Index keys) const { return opt_.rows_per_block(1, keys, sizeof(T)); }

  static Index kv_heads_of(const MhaOptions& o) { return o.num_kv_heads > 0 ? o.num_kv_heads : o.num_heads; }

  static void validate(const MhaWeights<T>& w, const MhaOptions& opt) {
    opt.validate(kName);
    check_value(opt.num_heads >= 1, kName, "num_heads", ">= 1", opt.num_heads);
    check_value(opt.num_kv_heads >= 0, kName, "num_kv_heads", ">= 1 (or 0 for num_heads)", opt.num_kv_heads);
    const Index H = opt.num_heads, Hkv = kv_heads_of(opt), D = w.q.in_features(), Dkv = w.k.in_features();
    check_value(H % Hkv == 0, kName, "num_kv_heads", "a divisor of num_heads = " + std::to_string(H), Hkv);
    const Index hdk = w.q.out_features(), hdv = w.v.out_features();
    if (hdk == 0 || hdk % H != 0)
      detail::throw_shape(kName, "q.weight", "[num_heads * head_dim, D] with num_heads = " + std::to_string(H),
                          detail::format_shape(shape_of(w.q.weight)));
    if (hdv == 0 || hdv % Hkv != 0)
      detail::throw_shape(kName, "v.weight", detail::heads_times("v_head_dim, Dkv", opt.num_kv_heads, H),
                          detail::format_shape(shape_of(w.v.weight)));
    check_value(D >= 1, kName, "q.weight columns (D)", ">= 1", D);
    w.q.check(kName, "q", hdk, D);
    check_value(Dkv >= 1, kName, "k.weight columns (Dkv)", ">= 1", Dkv);
    w.k.check(kName, "k", hdk / H * Hkv, Dkv);
    // With grouped V and an `o`, o's width H·Dv fixes Dv: a V still stored
    // for every head is then named as the wrong tensor, not o.
    const bool o_fixes_dv = Hkv != H && !w.o.empty() && w.o.in_features() % H == 0;
    w.v.check(kName, "v", o_fixes_dv ? w.o.in_features() / H * Hkv : hdv, Dkv);
    w.o.check_optional(kName, "o", hdv / Hkv * H);
  }

  MhaWeights<T> w_;
  MhaOptions opt_;
};

}  // namespace headmix
