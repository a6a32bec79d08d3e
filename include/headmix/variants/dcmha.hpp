// DCMHA: dynamically composable multi-head attention (Xiao et al., ICML
// 2024, "DCFormer"), self-attention, with the math of the reference code as
// pinned down in shared/conformance/dcmha.md:
//
//   A[h,t,s] = scale · q[t,h]·k[s,h]
//   L  = compose_pre(A)   (optional), masked (causal / window / padding)
//   P0 = softmax_s(L),   P = compose_post(P0)  (optional, no renormalisation)
//   O[t,h] = Σ_s P[h,t,s] v[s,h],   Y = O · Woᵀ
//
// A compose maps the M = H/G head values z of one group at one (t, s) to
//
//   z' = z · ( I + P_static + W1q(t)ᵀW2q(t) + diag(ddq(t)) + W1k(s)ᵀW2k(s) + diag(ddk(s)) )
//
// where the factors come from the layer input X through a small GELU MLP
// (W1 rows RMS-normalised over the group's heads) and a tanh gate, once per
// position. The [T, S, H, H] transform is never built: on a tile
// [H, rows, cols] the query-wise factors are constants along a row and the
// key-wise ones are coefficient rows along the columns, so every branch is a
// rank-R projection plus a diagonal scaling done with vectorised
// multiply-adds, and the static part is core mix_heads (one GEMM).
//
// Incremental decoding: a SequenceCache keeps K, V and the key-side
// factors; step() appends n positions and attends to everything cached,
// O(S) per head per new token.
//
// Memory: besides the caller's output, a forward keeps in its Workspace
//   Q, K [B·T, H·dk] + V, context [B·T, H·dv] + factors 2 · B·T · G·(2R+1)·M per used stage (T padded)
//   + a forward: K and V again, copied head-major (DotProductStages::packed)
//   + per worker: two tiles H · block_rows · S, the dynamic-weight scratch
//     (64 rows × G·slots·(K+M)) and (M + 2R) KiB of compose scratch,
// so attention memory grows with block_rows · S, never T · S.
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
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace headmix {

/// GELU of the dynamic-weight MLP: the exact erf form (PyTorch reference)
/// or the tanh approximation (flax default, which the JAX training used).
enum class DcmhaGelu { erf, tanh };

struct DcmhaOptions : DenseOptions {
  Index num_heads = 1;
  Index groups = 1;          ///< G: heads compose only within contiguous groups of M = H/G
  Index num_kv_heads = 0;    ///< heads of K and V, a divisor of num_heads (grouped-query attention); 0 = num_heads
  Index rank = 2;            ///< R of each dynamic low-rank term (the reference hard-codes 2)
  bool use_pre = true;       ///< compose the scores before the softmax
  bool use_post = true;      ///< compose the weights after the softmax
  bool query_wise = true;    ///< the W1q/W2q/ddq terms, indexed by the query
  bool key_wise = true;      ///< the W1k/W2k/ddk terms, indexed by the key
  bool static_w = false;     ///< the static term P (dc.pre_w / dc.post_w); C then holds I + P
  double dw_norm_eps = 1e-6; ///< epsilon of the scale-free RMSNorm on W1
  DcmhaGelu gelu = DcmhaGelu::erf;
};

/// Parameters. q, k, v, o in PyTorch layout (o may be empty: the output is
/// then the concatenated heads); the dc.* tensors in the reference's raw
/// layout, where the size-4 slot axis is 0 pre/query, 1 pre/key,
/// 2 post/query, 3 post/key.
template <class T>
struct DcmhaWeights {
  Linear<T> q;      ///< [H·dk, D]
  Linear<T> k;      ///< [H·dk, D]
  Linear<T> v;      ///< [H·dv, D]
  Linear<T> o;      ///< [out_dim, H·dv], optional
  Tensor<T> dw1;    ///< dc.dw1 [D, G, 4, K]
  Tensor<T> qkw;    ///< dc.qkw [G, 4, K, 2R, M]; rows 0..R-1 of the 2R axis make W1, R..2R-1 make W2
  Tensor<T> dd;     ///< dc.dd  [D, G, 4·M]
  Tensor<T> pre_w;  ///< dc.pre_w  [G, M, M], only with static_w
  Tensor<T> post_w; ///< dc.post_w [G, M, M], only with static_w
};

/// Multiply-adds of one call, by kind.
struct DcmhaFlops {
  std::int64_t projection_macs = 0;  ///< q, k, v and o projections
  std::int64_t dynamic_macs = 0;     ///< dynamic weights: dw1, qkw, the RMS sums of squares, dd
  std::int64_t score_macs = 0;       ///< q·k and P·v over visible pairs
  std::int64_t compose_macs = 0;     ///< pre- and post-compose over visible pairs
  /// Per-position work counts as projection, per-pair work as attention.
  FlopCount total() const { return {projection_macs + dynamic_macs, score_macs + compose_macs}; }
};

namespace detail {
// Row stride for rows of n positions that are read side by side: padded so
// that it is not a multiple of 4 KiB, which would put every row in the same
// cache sets.
inline Index dcmha_padded_stride(Index n) { return (n + 15) / 16 * 16 + 16; }
}  // namespace detail

template <class T>
class Dcmha : public LayerForms<Dcmha<T>, T> {
 public:
  using LayerForms<Dcmha<T>, T>::forward;  // the allocating forms
  using LayerForms<Dcmha<T>, T>::step;
  static constexpr const char* kName = "dcmha";

  Dcmha(DcmhaWeights<T> weights, DcmhaOptions options) : w_(std::move(weights)), opt_(options) {
    validate(opt_);
    prepare();
    prepare_projections(w_.q, w_.k, w_.v, w_.o);
  }

  /// Build from named tensors (an io::TensorFile, or anything with its
  /// contains/matrix/vector/get accessors), with the names of
  /// conformance/dcmha.md after `prefix`: `q.weight` … `o.bias`, `dc.dw1`,
  /// `dc.qkw`, `dc.dd`, and `dc.pre_w` / `dc.post_w` with static_w, each
  /// exactly when its stage is used. Biases and `o` are optional. Stored
  /// F16/BF16/F32/F64 are converted to T.
  template <class Source>
  static Dcmha from_tensors(const Source& tensors, const std::string& prefix, const DcmhaOptions& options) {
    DcmhaWeights<T> w;
    w.q = read_linear<T>(tensors, prefix + "q");
    w.k = read_linear<T>(tensors, prefix + "k");
    w.v = read_linear<T>(tensors, prefix + "v");
    w.o = detail::read_optional_linear<T>(tensors, prefix + "o");
    w.dw1 = detail::read_tensor<T>(tensors, prefix + "dc.dw1");
    w.qkw = detail::read_tensor<T>(tensors, prefix + "dc.qkw");
    w.dd = detail::read_tensor<T>(tensors, prefix + "dc.dd");
    // A static term a used stage applies is read unconditionally (missing, it
    // is the source's io_error naming it). One stored for a stage the options
    // leave out would be kept and never applied: refused (without static_w,
    // the constructor refuses it).
    const char* statics[2] = {"dc.pre_w", "dc.post_w"};
    const char* stage_options[2] = {"use_pre", "use_post"};
    const bool used[2] = {options.use_pre, options.use_post};
    Tensor<T>* targets[2] = {&w.pre_w, &w.post_w};
    for (int st = 0; st < 2; ++st) {
      const std::string name = prefix + statics[st];
      if (!(options.static_w && used[st]) && !tensors.contains(name)) continue;
      *targets[st] = detail::read_tensor<T>(tensors, name);
      if (options.static_w && !used[st])
        detail::throw_shape(kName, name,
                            std::string("none (") + stage_options[st] + " is false, so it would never be applied)",
                            detail::format_shape(targets[st]->shape()));
    }
    return with_tensor_prefix(tensors, prefix,
                              {"q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight", "o.bias",
                               "dc.dw1", "dc.qkw", "dc.dd", "dc.pre_w", "dc.post_w"},
                              [&] { return Dcmha(std::move(w), options); });
  }

  Index num_heads() const { return opt_.num_heads; }
  Index groups() const { return opt_.groups; }
  Index group_heads() const { return opt_.num_heads / opt_.groups; }  ///< M
  Index rank() const { return opt_.rank; }
  Index dw_hidden_dim() const { return w_.dw1.dim(3); }  ///< K
  Index head_dim() const { return w_.q.out_features() / opt_.num_heads; }
  Index num_kv_heads() const { return kv_heads_of(opt_); }
  Index v_head_dim() const { return w_.v.out_features() / num_kv_heads(); }
  Index embed_dim() const { return w_.q.in_features(); }
  Index out_dim() const { return w_.o.empty() ? num_heads() * v_head_dim() : w_.o.out_features(); }
  T scale() const { return static_cast<T>(opt_.scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim())))); }
  const DcmhaWeights<T>& weights() const { return w_; }
  const DcmhaOptions& options() const { return opt_; }
  /// Change options (masking, branches, block size, threads); checked
  /// against the weights like the constructor does.
  void set_options(const DcmhaOptions& options) {
    validate(options);
    opt_ = options;
    prepare();
  }

  /// Self-attention over `in.query` [B, T, D] (in.key must be empty; key
  /// padding [B, T] is allowed). `out` must be [B, T, out_dim]. With
  /// `probs`, the final attention weights (after post-compose) are written
  /// there as [B, H, T, T].
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    if (!in.self_attention())
      detail::throw_shape(kName, "input.key", "none (DCMHA is self-attention: keys come from input.query)",
                          detail::format_shape(in.key.shape()));
    check_input(kName, in, embed_dim(), embed_dim());
    const Index B = in.query.batch(), T_ = in.query.length();
    check_output(kName, out, B, T_, out_dim());
    const Index H = num_heads(), dk = head_dim(), dv = v_head_dim();

    MatrixMap<T> q = ws.shared_matrix(slot::query, B * T_, H * dk);
    MatrixMap<T> k = ws.shared_matrix(slot::key, B * T_, num_kv_heads() * dk);
    MatrixMap<T> v = ws.shared_matrix(slot::value, B * T_, num_kv_heads() * dv);
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * T_, H * dv);
    project_rows<T>(w_.q, in.query.rows(), q, opt_.threads);
    project_rows<T>(w_.k, in.query.rows(), k, opt_.threads);
    project_rows<T>(w_.v, in.query.rows(), v, opt_.threads);
    q *= scale();  // composition is linear, so the scale folds into Q

    Sources src;
    src.q = q.data();
    src.queries = T_;
    src.k = k.data();
    src.v = v.data();
    src.kv_stride = T_;
    for (int st = 0; st < 2; ++st) {
      if (needs_query_factors(st)) src.qf[st] = ws.shared(shared_query_factors + st, B * T_ * factor_width());
      if (needs_key_factors(st))
        src.kf[st] = ws.shared(shared_key_factors + st, B * factor_width() * detail::dcmha_padded_stride(T_));
    }
    src.qf_stride = factor_width();
    src.kf_row_stride = detail::dcmha_padded_stride(T_);
    src.kf_batch_stride = factor_width() * src.kf_row_stride;
    dynamic_factors(in.query.rows(), T_, 0, src, ws);

    const DenseRun<T> run{B, T_, T_, opt_.mask(), in.key_padding,
                          block_rows_for(T_), opt_.threads, ctx.data(), probs, opt_.keys_per_block()};
    run_dense_pipeline(Policy{stages(src).packed(B, T_, ws, opt_.threads), this, src, run.mask, T_}, run, ws);
    finish(ctx, out);
  }

  /// Incremental decoding. Attends n new positions `x` [B, n, D] to every
  /// position in `cache` and to themselves, and appends what later
  /// positions need of them (K, V, key-side dynamic factors) to the cache.
  /// Alignment is bottom-right causal whatever options().causal says (the
  /// window still applies): new position k sees cached positions
  /// 0 … size + k, so a step equals the causal forward at those positions.
  /// `out` must be [B, n, out_dim]; with `probs`, the weights are written as
  /// [B, H, n, size + n]. Allocates nothing once `ws` and `cache` are sized;
  /// throws cache_full_error (and changes nothing) when n positions do not fit.
  void step(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
            Tensor<T>* probs = nullptr) const {
    check_input(kName, AttentionInput<T>{x, {}, {}}, embed_dim(), embed_dim());
    const Index B = x.batch(), n = x.length();
    check_shape(kName, "cache batch", {B}, {cache.batch()});
    check_output(kName, out, B, n, out_dim());
    const Index H = num_heads(), dk = head_dim(), dv = v_head_dim();
    const Index cap = cache.capacity(), past = cache.size(), S = past + n;
    cache.bind(kName, cache_widths(cap), {num_kv_heads(), num_kv_heads(), 1, 1}, 2);  // K and V head-major
    cache.check_room(kName, n);
    // Size the tiles for a full cache now, so that later steps of as many
    // positions find every buffer big enough.
    reserve_dense_tiles(ws, opt_.threads, has_mix() ? H : 1, has_mix(), std::min(n, block_rows_for(S)), cap);

    MatrixMap<T> q = ws.shared_matrix(slot::query, B * n, H * dk);
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * n, H * dv);
    project_rows<T>(w_.q, x.rows(), q, opt_.threads);
    q *= scale();
    append_kv(w_.k, w_.v, x, cache, past, ws);

    Sources src;
    src.q = q.data();
    src.queries = n;
    src.kv_stride = cap;  // K and V: the cache's (stages(src).reading below)
    for (int st = 0; st < 2; ++st) {
      if (needs_query_factors(st)) src.qf[st] = ws.shared(shared_query_factors + st, B * n * factor_width());
      if (needs_key_factors(st)) src.kf[st] = cache.stream(2 + static_cast<std::size_t>(st)).data();
    }
    src.qf_stride = factor_width();
    src.kf_row_stride = detail::dcmha_padded_stride(cap);
    src.kf_batch_stride = cap * factor_stream_width(cap);
    dynamic_factors(x.rows(), n, past, src, ws);

    // Bottom-right: the last new position sees all.
    const DenseRun<T> run{B, n, S, opt_.step_mask(past), {}, block_rows_for(S), opt_.threads,
                          ctx.data(), probs, opt_.keys_per_block()};
    run_dense_pipeline(Policy{stages(src).reading(cache, ws, opt_.threads), this, src, run.mask, S}, run, ws);
    finish(ctx, out);
    cache.advance(n);
  }

  /// Multiply-adds of a call that adds T new positions to S - T cached ones
  /// (S = T: a forward), by kind.
  DcmhaFlops flop_breakdown(Index B, Index T_, Index S) const {
    check_value(S >= T_, kName, "flops S", ">= T = " + std::to_string(T_), S);
    const Index D = embed_dim(), H = num_heads(), dk = head_dim(), dv = v_head_dim();
    const Index G = groups(), M = group_heads(), R = rank(), K = dw_hidden_dim();
    const PositionMask mask = S > T_ ? opt_.step_mask(S - T_) : opt_.mask();
    const std::int64_t pairs = mask.visible_pairs(T_, S);
    DcmhaFlops f;
    f.projection_macs =
        B * T_ * (D * (H * dk + num_kv_heads() * (dk + dv)) + (w_.o.empty() ? 0 : H * dv * out_dim()));
    f.dynamic_macs = B * T_ * G * static_cast<Index>(slots_.size()) * (D * K + 2 * R * M * K + R * M + D * M);
    f.score_macs = B * H * pairs * (dk + dv);
    std::int64_t per_pair = 0;  // per (t, s, group)
    for (int st = 0; st < 2; ++st) {
      if (!stage_used(st)) continue;
      if (opt_.static_w) per_pair += M * M;
      if (opt_.query_wise) per_pair += 2 * R * M + M;
      if (opt_.key_wise) per_pair += 2 * R * M + M;
    }
    f.compose_macs = B * pairs * G * per_pair;
    return f;
  }
  FlopCount flops(Index B, Index T_, Index S) const { return flop_breakdown(B, T_, S).total(); }

 private:
  // Where the pipeline finds its operands: Q of the new positions, K/V of a
  // forward (a step reads the cache's: DotProductStages::reading), the
  // key-side factors of all positions (the workspace's, or the cache's) and
  // the query-side factors of the new positions.
  struct Sources {
    const T* q = nullptr;
    Index queries = 0;  // rows of Q per batch item
    const T* k = nullptr;
    const T* v = nullptr;
    Index kv_stride = 0;  // rows between batch items of K and V
    T* qf[2] = {nullptr, nullptr};  // [B·queries, G·(2R+1)·M] per stage
    T* kf[2] = {nullptr, nullptr};  // per stage: batch b, factor row j, position s at b·batch_stride + j·row_stride + s
    Index qf_stride = 0, kf_batch_stride = 0, kf_row_stride = 0;
  };

  // Dot-product scores and readout over Q, K and V of `src`, with KV heads
  // shared by contiguous groups of query heads.
  DotProductStages<T> stages(const Sources& src) const {
    const Index H = num_heads(), Hkv = num_kv_heads();
    return {src.q,   src.k,   src.v, src.queries, src.kv_stride, H, Hkv, Hkv, head_dim(), v_head_dim(), H / Hkv,
            H / Hkv};
  }

  // The pipeline stages of DCMHA: dot-product scores and readout, and the
  // two Compose stages as its mixes.
  struct Policy : DotProductStages<T> {
    const Dcmha* layer;
    Sources src;
    PositionMask mask;
    Index keys;

    Index score_heads() const { return layer->num_heads(); }
    Index softmax_heads() const { return layer->num_heads(); }
    Index value_heads() const { return layer->num_heads(); }
    Index value_dim() const { return layer->v_head_dim(); }
    bool has_pre_mix() const { return layer->opt_.use_pre; }
    bool has_post_mix() const { return layer->opt_.use_post; }

    void pre_mix(Index b, const AttentionTensor<T>& in, const AttentionTensor<T>& out, Workspace<T>& ws,
                 int w) const {
      layer->compose(0, *this, b, in, out, ws, w);
    }
    void post_mix(Index b, const AttentionTensor<T>& in, const AttentionTensor<T>& out, Workspace<T>& ws,
                  int w) const {
      layer->compose(1, *this, b, in, out, ws, w);
    }
  };

  // Column chunk of the compose loops (1 KiB of one head's row): a row's M
  // head segments are gathered into L1 scratch, and the key-side coefficient
  // rows of a chunk ((2R+1)·M of them) stay in L2 while every row of the
  // tile uses them.
  static constexpr Index kComposeChunk = 1024 / static_cast<Index>(sizeof(T));
  // Rows per task of the dynamic-weight GEMMs (fixed, so results do not
  // depend on the thread count).
  static constexpr Index kFactorRows = 64;
  // Workspace slots: per stage (pre, post), the query-side and key-side
  // factors; per worker, the compose scratch.
  enum : std::size_t {
    shared_query_factors = slot::variant,
    shared_key_factors = slot::variant + 2,
  };
  enum : std::size_t { local_u = slot::local_variant, local_f, local_compose };

  bool has_mix() const { return opt_.use_pre || opt_.use_post; }
  bool stage_used(int st) const { return st == 0 ? opt_.use_pre : opt_.use_post; }
  bool needs_query_factors(int st) const { return stage_used(st) && opt_.query_wise; }
  bool needs_key_factors(int st) const { return stage_used(st) && opt_.key_wise; }
  // Per position, group and stage: W1 [R, M], W2 [R, M], dd [M].
  Index group_factor_width() const { return (2 * rank() + 1) * group_heads(); }
  Index factor_width() const { return groups() * group_factor_width(); }

  // Cache streams: 0 K [H·dk], 1 V [H·dv], 2 and 3 the pre and post
  // key-side factors. A factor stream holds, per batch item, factor_width()
  // rows along the positions (row j at j · padded capacity, so that the
  // compose reads each coefficient row contiguously); its per-position
  // width is whatever makes that block fit.
  Index factor_stream_width(Index capacity) const {
    if (capacity <= 0) return factor_width();
    return (factor_width() * detail::dcmha_padded_stride(capacity) + capacity - 1) / capacity;
  }
  Shape cache_widths(Index capacity) const {
    return {num_kv_heads() * head_dim(), num_kv_heads() * v_head_dim(),
            needs_key_factors(0) ? factor_stream_width(capacity) : 0,
            needs_key_factors(1) ? factor_stream_width(capacity) : 0};
  }

  // With a Compose, all H planes of a block are resident; without one,
  // heads run one at a time, as in MHA.
  Index block_rows_for(Index S) const { return opt_.rows_per_block(has_mix() ? num_heads() : 1, S, sizeof(T)); }

  void finish(const MatrixMap<T>& ctx, BatchView<T> out) const {
    if (w_.o.empty())
      out.rows() = ctx;
    else
      project_rows<T>(w_.o, ConstMatrixMap<T>(ctx.data(), ctx.rows(), ctx.cols()), out.rows(), opt_.threads);
  }

  // Dynamic factors of the rows of `x` (sequences of `len` rows each): the
  // query side into src.qf rows, the key side into src.kf columns
  // first_pos + (row mod len). One GEMM X·[dw1 | dd] over the used slots,
  // then one [rows, K]·[K, 2R·M] GEMM per (group, slot).
  void dynamic_factors(const ConstMatrixMap<T>& x, Index len, Index first_pos, const Sources& src,
                       Workspace<T>& ws) const {
    if (slots_.empty()) return;
    const Index N = x.rows(), G = groups(), M = group_heads(), R = rank(), K = dw_hidden_dim();
    const Index units = G * static_cast<Index>(slots_.size()), hidden_cols = units * K, ucols = dyn_in_.cols();
    const Index FW = group_factor_width();
    const T eps = static_cast<T>(opt_.dw_norm_eps);
    ws.reserve_workers(std::max(1, opt_.threads));
    parallel_for((N + kFactorRows - 1) / kFactorRows, opt_.threads, [&](Index task, int w) {
      const Index r0 = task * kFactorRows, rows = std::min(kFactorRows, N - r0);
      MatrixMap<T> u(ws.local(w, local_u, rows * ucols), rows, ucols);
      MatrixMap<T> f(ws.local(w, local_f, rows * 2 * R * M), rows, 2 * R * M);
      u.noalias() = x.middleRows(r0, rows) * dyn_in_;
      if (opt_.gelu == DcmhaGelu::erf)
        u.leftCols(hidden_cols) = u.leftCols(hidden_cols).unaryExpr([](T z) {
          return T(0.5) * z * (T(1) + std::erf(z * T(0.70710678118654752440)));
        });
      else
        u.leftCols(hidden_cols) = u.leftCols(hidden_cols).unaryExpr([](T z) {
          return T(0.5) * z * (T(1) + std::tanh(T(0.79788456080286535588) * (z + T(0.044715) * z * z * z)));
        });
      u.rightCols(ucols - hidden_cols).array() = u.rightCols(ucols - hidden_cols).array().tanh();

      for (Index unit = 0; unit < units; ++unit) {
        const Index g = unit / static_cast<Index>(slots_.size());
        const int c = slots_[static_cast<std::size_t>(unit % static_cast<Index>(slots_.size()))];
        const int st = c / 2;
        const bool query_side = c % 2 == 0;
        f.noalias() = u.middleCols(unit * K, K) * qkw_[static_cast<std::size_t>(unit)];
        for (Index i = 0; i < rows; ++i) {
          for (Index r = 0; r < R; ++r) {  // scale-free RMSNorm of each W1 row over the M heads
            auto w1 = f.row(i).segment(r * M, M);
            w1 *= T(1) / std::sqrt(w1.squaredNorm() / static_cast<T>(M) + eps);
          }
          const T* fr = &f(i, 0);
          const T* dd = &u(i, hidden_cols + unit * M);
          const Index p = r0 + i;
          if (query_side) {
            T* dst = src.qf[st] + p * src.qf_stride + g * FW;
            std::copy_n(fr, 2 * R * M, dst);
            std::copy_n(dd, M, dst + 2 * R * M);
          } else {
            const Index rs = src.kf_row_stride;
            T* dst = src.kf[st] + (p / len) * src.kf_batch_stride + g * FW * rs + first_pos + p % len;
            for (Index j = 0; j < 2 * R * M; ++j) dst[j * rs] = fr[j];
            for (Index m = 0; m < M; ++m) dst[(2 * R * M + m) * rs] = dd[m];
          }
        }
      }
    });
  }

  // What compose_lines needs about one tile row, from its first column on.
  struct Line_args {
    const T* z;  // head m's values at z + m·plane
    T* o;        // head n's output at o + n·plane
    Index plane;
    const T* qf;  // query-side factors of this row and group: W1 [R, M], W2 [R, M], dd [M]
    const T* kf;  // key-side factor row j at kf + j·rs (or null)
    Index rs;
    const Matrix<T>* mix;  // (I + P)ᵀ of the group, or null
    Index M;
    bool qw, kw, static_loop, accumulate;  // accumulate: out already holds the static GEMM's I + P term
    T identity;
    T* scratch;  // M · kLine values
  };
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(T));  // one cache line

  // Compose the first (len / kLine) · kLine columns of a row, one cache
  // line of every head at a time: the line is read once (into a scratch
  // line, which the second pass reads back from L1), and the 2R rank
  // projections stay in registers. Returns the number of columns done.
  template <int R_>
  static Index compose_lines(const Line_args& a, Index len) {
    using Line = Eigen::Array<T, kLine, 1>;
    using CLine = Eigen::Map<const Line>;
    using WLine = Eigen::Map<Line>;
    const Index M = a.M, RM = R_ * M;
    Index x = 0;
    for (; x + kLine <= len; x += kLine) {
      const T* z = a.z + x;
      T* o = a.o + x;
      const T* kf = a.kf ? a.kf + x : nullptr;
      Line qa[R_], kb[R_];
      for (int i = 0; i < R_; ++i) qa[i].setZero(), kb[i].setZero();
      for (Index m = 0; m < M; ++m) {
        const Line zm = CLine(z + m * a.plane);
        WLine(a.scratch + m * kLine) = zm;
        for (int i = 0; i < R_; ++i) {
          if (a.qw) qa[i] += a.qf[i * M + m] * zm;
          if (a.kw) kb[i] += CLine(kf + (i * M + m) * a.rs) * zm;
        }
      }
      for (Index n = 0; n < M; ++n) {
        const CLine zn(a.scratch + n * kLine);
        const T diag = a.identity + (a.qw ? a.qf[2 * RM + n] : T(0));
        Line on = a.kw ? ((CLine(kf + (2 * RM + n) * a.rs) + diag) * zn).eval() : (diag * zn).eval();
        if (a.static_loop) {
          for (Index m = 0; m < M; ++m) on += (*a.mix)(n, m) * CLine(a.scratch + m * kLine);
        } else if (a.accumulate) {
          on += CLine(o + n * a.plane);
        }
        for (int i = 0; i < R_; ++i) {
          if (a.qw) on += a.qf[RM + i * M + n] * qa[i];
          if (a.kw) on += CLine(kf + (RM + i * M + n) * a.rs) * kb[i];
        }
        WLine(o + n * a.plane) = on;
      }
    }
    return x;
  }

  // Ask for the next row's lines early: the tile is bigger than L2, and its
  // rows are too short for the hardware prefetcher to pick them up.
  static void prefetch_row(const T* z, T* o, Index len, Index M, Index plane) {
#if defined(__GNUC__) || defined(__clang__)
    for (Index m = 0; m < M; ++m)
      for (Index c = 0; c < len; c += kLine) {
        __builtin_prefetch(z + m * plane + c, 0, 3);
        __builtin_prefetch(o + m * plane + c, 1, 3);
      }
#else
    (void)z, (void)o, (void)len, (void)M, (void)plane;
#endif
  }

  // One compose stage on a tile: out = in · C(t, s) per group, on the
  // visible keys of each row (others are set to 0).
  void compose(int st, const Policy& pol, Index b, const AttentionTensor<T>& in, const AttentionTensor<T>& out,
               Workspace<T>& ws, int w) const {
    using Arr = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
    using CArr = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
    const Index rows = in.rows(), cols = in.cols(), plane = rows * cols;
    const Index q0 = in.first_query(), k0 = in.first_key();
    const Index G = groups(), M = group_heads(), R = rank(), RM = R * M, FW = group_factor_width();
    const bool qw = opt_.query_wise, kw = opt_.key_wise, sw = opt_.static_w;
    const Sources& src = pol.src;
    const Index rs = src.kf_row_stride;
    // Scratch: the gathered head segments of one row chunk, then the 2R
    // rank projections. The tile's head planes lie rows·cols apart, often a
    // multiple of 4 KiB (same cache sets), so they are read once, in order,
    // into this contiguous buffer and used from there.
    constexpr Index CH = kComposeChunk;
    T* zbuf = ws.local(w, local_compose, (M + 2 * R) * CH);  // also holds compose_lines' M·kLine scratch
    T* acc = zbuf + M * CH;  // a_i at acc + i·CH (query-wise), b_i at acc + (R + i)·CH (key-wise)
    // The static term I + P: one mix_heads GEMM over the group's tile, except
    // on single-row tiles (decoding), where Eigen's GEMM would pack (and for
    // long caches heap-allocate) more than the M² multiply-adds per key it
    // saves; those take it in the loop below.
    const bool static_gemm = sw && rows > 1, static_loop = sw && rows == 1;
    const T identity = sw ? T(0) : T(1);  // with a static term, I is part of its weights

    // Visible columns [lo, hi) of tile row r.
    auto visible = [&](Index r) {
      auto [lo, hi] = pol.mask.key_range(q0 + r, pol.keys);
      lo = std::clamp<Index>(lo - k0, 0, cols);
      hi = std::clamp<Index>(hi - k0, lo, cols);
      return std::pair<Index, Index>(lo, hi);
    };

    for (Index g = 0; g < G; ++g) {
      T* zg = in.data() + g * M * plane;
      T* og = out.data() + g * M * plane;
      const Matrix<T>* mix = sw ? &static_mix_[st][static_cast<std::size_t>(g)] : nullptr;
      if (static_gemm) mix_heads(*mix, in.like(zg, M), out.like(og, M));
      for (Index r = 0; r < rows; ++r) {
        const auto [lo, hi] = visible(r);
        for (Index n = 0; n < M; ++n) {
          T* o = og + n * plane + r * cols;
          std::fill(o, o + lo, T(0));
          std::fill(o + hi, o + cols, T(0));
        }
      }
      const T* kfg = kw ? src.kf[st] + b * src.kf_batch_stride + g * FW * rs + k0 : nullptr;

      for (Index c0 = 0; c0 < cols; c0 += CH) {
        const Index c1 = std::min(cols, c0 + CH);
        for (Index r = 0; r < rows; ++r) {
          auto [lo, hi] = visible(r);
          lo = std::max(lo, c0);
          hi = std::min(hi, c1);
          if (lo >= hi) continue;
          if (r + 1 < rows) prefetch_row(zg + (r + 1) * cols + lo, og + (r + 1) * cols + lo, hi - lo, M, plane);
          const T* qf = qw ? src.qf[st] + (b * src.queries + q0 + r) * src.qf_stride + g * FW : nullptr;
          Line_args la{zg + r * cols + lo, og + r * cols + lo, plane, qf, kw ? kfg + lo : nullptr, rs, mix, M,
                       qw, kw, static_loop, sw, identity, zbuf};
          // Whole cache lines in registers (R = 1, 2); the rest, and other ranks, in the loops below.
          const Index done = R == 2 ? compose_lines<2>(la, hi - lo) : R == 1 ? compose_lines<1>(la, hi - lo) : 0;
          lo += done;
          if (lo >= hi) continue;
          const Index len = hi - lo;
          const T* z = zg + r * cols + lo;  // head m at z + m·plane
          T* o = og + r * cols + lo;
          const T* kf = kw ? kfg + lo : nullptr;  // factor row j at kf + j·rs

          // Gather, and the rank projections a_i = Σ_m W1q[i,m] z_m (scalar
          // weights), b_i = Σ_m W1k[i,m](s) ⊙ z_m (weights along the keys).
          for (Index m = 0; m < M; ++m) {
            Arr zm(zbuf + m * CH, len);
            zm = CArr(z + m * plane, len);
            for (Index i = 0; i < R; ++i) {
              if (qw) {
                Arr a(acc + i * CH, len);
                if (m == 0) a = qf[i * M + m] * zm; else a += qf[i * M + m] * zm;
              }
              if (kw) {
                Arr bk(acc + (R + i) * CH, len);
                const CArr c(kf + (i * M + m) * rs, len);
                if (m == 0) bk = c * zm; else bk += c * zm;
              }
            }
          }
          // out_n (+)= [Σ_m (I + P)[m,n] z_m] + z_n (I + ddq + ddk)_n + Σ_i W2q[i,n] a_i + Σ_i W2k[i,n](s) ⊙ b_i
          for (Index n = 0; n < M; ++n) {
            const CArr zn(zbuf + n * CH, len);
            Arr on(o + n * plane, len);
            if (static_loop) {
              on = (*mix)(n, 0) * CArr(zbuf, len);
              for (Index m = 1; m < M; ++m) on += (*mix)(n, m) * CArr(zbuf + m * CH, len);
            }
            const T diag = identity + (qw ? qf[2 * RM + n] : T(0));
            if (kw) {
              const CArr ddk(kf + (2 * RM + n) * rs, len);
              if (sw) on += (ddk + diag) * zn; else on = (ddk + diag) * zn;
            } else {
              if (sw) on += diag * zn; else on = diag * zn;
            }
            for (Index i = 0; i < R; ++i) {
              if (qw) on += qf[RM + i * M + n] * CArr(acc + i * CH, len);
              if (kw) on += CArr(kf + (RM + i * M + n) * rs, len) * CArr(acc + (R + i) * CH, len);
            }
          }
        }
      }
    }
  }

  // Pack the used slots of dc.dw1 / dc.dd into one input matrix and each
  // (group, slot) of dc.qkw into a [K, 2R·M] matrix; the static terms into
  // mix_heads weights (I + P)ᵀ.
  void prepare() {
    const Index D = embed_dim(), G = groups(), M = group_heads(), R = rank(), K = dw_hidden_dim();
    slots_.clear();
    for (int c = 0; c < 4; ++c)
      if (c % 2 == 0 ? needs_query_factors(c / 2) : needs_key_factors(c / 2)) slots_.push_back(c);
    const Index ns = static_cast<Index>(slots_.size()), units = G * ns;
    dyn_in_.setZero(D, units * (K + M));
    qkw_.assign(static_cast<std::size_t>(units), Matrix<T>());
    for (Index g = 0; g < G; ++g)
      for (Index si = 0; si < ns; ++si) {
        const Index unit = g * ns + si, c = slots_[static_cast<std::size_t>(si)];
        for (Index d = 0; d < D; ++d) {
          for (Index kk = 0; kk < K; ++kk) dyn_in_(d, unit * K + kk) = w_.dw1[((d * G + g) * 4 + c) * K + kk];
          for (Index m = 0; m < M; ++m) dyn_in_(d, units * K + unit * M + m) = w_.dd[(d * G + g) * 4 * M + c * M + m];
        }
        Matrix<T>& q = qkw_[static_cast<std::size_t>(unit)];
        q.resize(K, 2 * R * M);
        for (Index kk = 0; kk < K; ++kk)
          for (Index j = 0; j < 2 * R * M; ++j) q(kk, j) = w_.qkw[((g * 4 + c) * K + kk) * 2 * R * M + j];
      }
    for (int st = 0; st < 2; ++st) {
      static_mix_[st].clear();
      if (!opt_.static_w || !stage_used(st)) continue;
      const Tensor<T>& p = st == 0 ? w_.pre_w : w_.post_w;
      for (Index g = 0; g < G; ++g) {
        Matrix<T> mix = Matrix<T>::Identity(M, M);
        for (Index n = 0; n < M; ++n)
          for (Index m = 0; m < M; ++m) mix(n, m) += p[(g * M + m) * M + n];  // out n takes in m through P[m, n]
        static_mix_[st].push_back(std::move(mix));
      }
    }
  }

  static Index kv_heads_of(const DcmhaOptions& o) { return o.num_kv_heads > 0 ? o.num_kv_heads : o.num_heads; }

  void validate(const DcmhaOptions& o) const {
    check_value(o.num_heads >= 1, kName, "num_heads", ">= 1", o.num_heads);
    check_value(o.groups >= 1, kName, "groups", ">= 1", o.groups);
    check_value(o.num_heads % o.groups == 0, kName, "groups",
                "a divisor of num_heads = " + std::to_string(o.num_heads), o.groups);
    check_value(o.rank >= 1, kName, "rank", ">= 1", o.rank);
    o.validate(kName);
    if (!(std::isfinite(o.dw_norm_eps) && o.dw_norm_eps > 0))
      detail::throw_shape(kName, "dw_norm_eps", "a finite number > 0", std::to_string(o.dw_norm_eps));

    check_value(o.num_kv_heads >= 0, kName, "num_kv_heads", ">= 1 (or 0 for num_heads)", o.num_kv_heads);
    const Index H = o.num_heads, G = o.groups, M = H / G, R = o.rank, Hkv = kv_heads_of(o);
    check_value(H % Hkv == 0, kName, "num_kv_heads", "a divisor of num_heads = " + std::to_string(H), Hkv);
    const Index hdk = w_.q.out_features(), hdv = w_.v.out_features(), D = w_.q.in_features();
    if (hdk == 0 || hdk % H != 0)
      detail::throw_shape(kName, "q.weight", "[num_heads * head_dim, D] with num_heads = " + std::to_string(H),
                          detail::format_shape(shape_of(w_.q.weight)));
    check_value(D >= 1, kName, "q.weight columns (D)", ">= 1", D);
    w_.q.check(kName, "q", hdk, D);
    w_.k.check(kName, "k", hdk / H * Hkv, D);
    if (hdv == 0 || hdv % Hkv != 0)
      detail::throw_shape(kName, "v.weight", detail::heads_times("v_head_dim, D", o.num_kv_heads, H),
                          detail::format_shape(shape_of(w_.v.weight)));
    w_.v.check(kName, "v", hdv, D);
    w_.o.check_optional(kName, "o", hdv / Hkv * H);

    const auto& dw1 = w_.dw1.shape();
    if (dw1.size() != 4 || dw1[3] < 1)
      detail::throw_shape(kName, "dc.dw1", "[" + std::to_string(D) + ", " + std::to_string(G) + ", 4, K >= 1]",
                          detail::format_shape(dw1));
    check_shape(kName, "dc.dw1", {D, G, 4, -1}, dw1);
    const Index K = dw1[3];
    check_shape(kName, "dc.qkw", {G, 4, K, 2 * R, M}, w_.qkw.shape());
    check_shape(kName, "dc.dd", {D, G, 4 * M}, w_.dd.shape());
    const char* names[2] = {"dc.pre_w", "dc.post_w"};
    const Tensor<T>* statics[2] = {&w_.pre_w, &w_.post_w};
    for (int st = 0; st < 2; ++st) {
      const bool present = statics[st]->rank() != 0;
      const bool used = st == 0 ? o.use_pre : o.use_post;
      if (!o.static_w) {
        if (present)
          detail::throw_shape(kName, names[st], "none (static_w is false)", detail::format_shape(statics[st]->shape()));
      } else if (present || used) {
        check_shape(kName, names[st], {G, M, M}, statics[st]->shape());
      }
    }
  }

  DcmhaWeights<T> w_;
  DcmhaOptions opt_;
  std::vector<int> slots_;             // used slots c (0 pre/q, 1 pre/k, 2 post/q, 3 post/k)
  Matrix<T> dyn_in_;                   // [D, G·slots·K | G·slots·M]: dw1 then dd columns
  std::vector<Matrix<T>> qkw_;         // per (group, slot): [K, 2R·M]
  std::vector<Matrix<T>> static_mix_[2];  // per stage and group: (I + P)ᵀ, [M, M]
};

}  // namespace headmix
