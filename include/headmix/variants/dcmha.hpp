// DCMHA: dynamically composable multi-head attention (Xiao et al., ICML
// 2024, "DCFormer"), with the math of the reference code as pinned down in
// shared/conformance/dcmha.md:
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
// where the factors come from the layer input through a small GELU MLP
// (W1 rows RMS-normalised over the group's heads) and a tanh gate, once per
// position: the query-wise ones (W1q, W2q, ddq) from the query rows, the
// key-wise ones from the key rows. The keys are the queries (self-attention)
// or a separate key sequence of the same width (the options' causal_offset
// aligns the two), which is how a slice of query rows attends to the whole
// sequence (sequence parallelism).
//
// The [T, S, H, H] transform is never built: on a tile [H, rows, cols] the
// query-wise factors are constants along a row and the key-wise ones are
// coefficient rows along the columns, so every branch is a rank-R
// projection plus a diagonal scaling done with vectorised multiply-adds,
// and the static part is too, or core mix_heads (one GEMM).
//
// Incremental decoding: a SequenceCache keeps K, V and the key-side
// factors; step() appends n positions and attends to everything cached,
// O(S) per head per new token.
//
// Memory: besides the caller's output, a forward keeps in its Workspace
//   Q [B·T, H·dk] + K [B·S, Hkv·dk] + V [B·S, Hkv·dv] + context [B·T, H·dv]
//   + factors (B·T + B·S) · G·(2R+1)·M per used stage (S padded)
//   + a forward: K and V again, copied head-major (DotProductStages::packed)
//   + per worker: a tile H · block_rows · S (its key chunks, one after the
//     other: core/pipeline.hpp), the dynamic-weight scratch (64 rows ×
//     G·slots·(K+M)), (M + 2R) KiB of compose scratch and, with a static
//     term that runs as a GEMM (below), that term for a group's chunk,
//     M · block_rows · 128,
// so attention memory grows with block_rows · S, never T · S.
//
// Files: dcmha/options.hpp (options, weights, multiply-add counts),
// dcmha/factors.hpp (the dynamic-weight MLP), dcmha/compose.hpp (the
// Compose kernels, fast and reference); this one, the layer.
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
#include "headmix/variants/dcmha/compose.hpp"
#include "headmix/variants/dcmha/factors.hpp"
#include "headmix/variants/dcmha/options.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace headmix {


template <class T>
class Dcmha : public LayerForms<Dcmha<T>, T> {
 public:
  using LayerForms<Dcmha<T>, T>::forward;  // the allocating forms
  using LayerForms<Dcmha<T>, T>::step;
  static constexpr const char* kName = "dcmha";

  Dcmha(DcmhaWeights<T> weights, DcmhaOptions options) : w_(std::move(weights)), opt_(options) {
    validate(opt_);
    prepare();
    prepare_projections(opt_.bfloat16_weights, w_.q, w_.k, w_.v, w_.o);
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
    // Repack the weights only when the heads' grouping or the branches
    // change: a masking change (a sequence-parallel chunk's causal_offset,
    // per call) allocates nothing.
    const bool repack = options.num_heads != opt_.num_heads || options.groups != opt_.groups ||
                        options.use_pre != opt_.use_pre || options.use_post != opt_.use_post ||
                        options.query_wise != opt_.query_wise || options.key_wise != opt_.key_wise ||
                        options.static_w != opt_.static_w;
    if (options.bfloat16_weights != opt_.bfloat16_weights)
      prepare_projections(options.bfloat16_weights, w_.q, w_.k, w_.v, w_.o);
    opt_ = options;
    if (repack)
      prepare();
    else
      factors_.set_options(opt_);
  }

  /// Attention of the queries `in.query` [B, T, D] over the keys `in.key`
  /// [B, S, D] (empty: self-attention, the keys are the queries), with key
  /// padding [B, S] if given. Q and the query-wise factors come from the
  /// query rows; K, V and the key-wise factors from the key rows; the mask
  /// is options().mask() (causal_offset and window included). `out` must be
  /// [B, T, out_dim]. With `probs`, the final attention weights (after
  /// post-compose) are written there as [B, H, T, S].
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    check_input(kName, in, embed_dim(), embed_dim());
    const Index B = in.query.batch(), T_ = in.query.length(), S = in.keys().length();
    check_output(kName, out, B, T_, out_dim());
    const Index H = num_heads(), dk = head_dim(), dv = v_head_dim();

    MatrixMap<T> q = ws.shared_matrix(slot::query, B * T_, H * dk);
    MatrixMap<T> k = ws.shared_matrix(slot::key, B * S, num_kv_heads() * dk);
    MatrixMap<T> v = ws.shared_matrix(slot::value, B * S, num_kv_heads() * dv);
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * T_, H * dv);
    project_rows<T>(w_.q, in.query.rows(), q, opt_.threads);
    project_rows<T>(w_.k, in.keys().rows(), k, opt_.threads);
    project_rows<T>(w_.v, in.keys().rows(), v, opt_.threads);
    q *= scale();  // composition is linear, so the scale folds into Q

    Sources src;
    src.q = q.data();
    src.queries = T_;
    src.k = k.data();
    src.v = v.data();
    src.kv_stride = S;
    for (int st = 0; st < 2; ++st) {
      if (needs_query_factors(st)) src.qf[st] = ws.shared(shared_query_factors + st, B * T_ * factor_width());
      if (needs_key_factors(st))
        src.kf[st] = ws.shared(shared_key_factors + st, B * factor_width() * detail::odd_line_stride<T>(S));
    }
    src.qf_stride = factor_width();
    src.kf_row_stride = detail::odd_line_stride<T>(S);
    src.kf_batch_stride = factor_width() * src.kf_row_stride;
    if (in.self_attention()) {
      factors_.compute(in.query.rows(), T_, 0, src, ws, local_u, local_f);
    } else {
      factors_.compute(in.query.rows(), T_, 0, src, ws, local_u, local_f, Factors::Side::query);
      factors_.compute(in.key.rows(), S, 0, src, ws, local_u, local_f, Factors::Side::key);
    }

    const DenseRun<T> run{B, T_, S, opt_.mask(), in.key_padding,
                          block_rows_for(S), opt_.threads, ctx.data(), probs, opt_.keys_per_block()};
    reserve_compose(ws, std::min(T_, run.block_rows), S);
    run_dense_pipeline(Policy{stages(src).packed(B, S, ws, opt_.threads), this, src, run.mask, S}, run, ws);
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
    const bool half = cache.precision() == CachePrecision::bfloat16;
    // K and V head-major; in a bfloat16 cache, every stream (the key-side factors too) in bfloat16.
    const Shape widths = cache_widths(cap, half);
    cache.bind(kName, widths, {num_kv_heads(), num_kv_heads(), 1, 1}, 2, widths.rank());
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
      const std::size_t stream = 2 + static_cast<std::size_t>(st);
      if (needs_query_factors(st)) src.qf[st] = ws.shared(shared_query_factors + st, B * n * factor_width());
      if (needs_key_factors(st) && half) src.kf_half[st] = cache.half_stream(stream);
      if (needs_key_factors(st) && !half) src.kf[st] = cache.stream(stream).data();
    }
    src.qf_stride = factor_width();
    src.kf_row_stride = SequenceCache<T>::position_stride(cap, half);
    src.kf_batch_stride = cap * factor_stream_width(cap, half);
    factors_.compute(x.rows(), n, past, src, ws, local_u, local_f);

    // Bottom-right: the last new position sees all.
    const DenseRun<T> run{B, n, S, opt_.step_mask(past), {}, block_rows_for(S), opt_.threads,
                          ctx.data(), probs, opt_.keys_per_block()};
    reserve_compose(ws, std::min(n, run.block_rows), cap);
    run_dense_pipeline(Policy{stages(src).reading(cache, ws, opt_.threads), this, src, run.mask, S}, run, ws);
    finish(ctx, out);
    cache.advance(n);
  }

  /// Multiply-adds of one forward of B sequences of T queries against S
  /// keys, as Mha::flops counts them: Q, the output projection and the
  /// query-wise factors over T rows, K, V and the key-wise factors over S
  /// rows, the attention over the pairs options().mask() leaves visible.
  DcmhaFlops flop_breakdown(Index B, Index T_, Index S) const { return count_macs(B, T_, S, S, opt_.mask()); }
  /// Multiply-adds of a step() of n new positions after `past` cached ones:
  /// n rows projected, attention under step's bottom-right causal mask.
  DcmhaFlops step_flop_breakdown(Index B, Index n, Index past) const {
    check_value(past >= 0, kName, "step flops past", ">= 0", past);
    return count_macs(B, n, past + n, n, opt_.step_mask(past));
  }
  FlopCount flops(Index B, Index T_, Index S) const { return flop_breakdown(B, T_, S).total(); }

 private:
  // Multiply-adds of T queries against S keys under `mask`, with K, V and
  // the key-wise factors computed for `key_rows` of the keys (S for a
  // forward, the new positions for a step).
  DcmhaFlops count_macs(Index B, Index T_, Index S, Index key_rows, const PositionMask& mask) const {
    check_value(B >= 0, kName, "flops B", ">= 0", B);
    check_value(T_ >= 0, kName, "flops T", ">= 0", T_);
    check_value(S >= 0, kName, "flops S", ">= 0", S);
    const Index D = embed_dim(), H = num_heads(), dk = head_dim(), dv = v_head_dim();
    const Index G = groups(), M = group_heads(), R = rank(), K = dw_hidden_dim();
    const std::int64_t pairs = mask.visible_pairs(T_, S);
    DcmhaFlops f;
    f.projection_macs = B * (T_ * (D * H * dk + (w_.o.empty() ? 0 : H * dv * out_dim())) +
                             key_rows * D * num_kv_heads() * (dk + dv));
    Index query_slots = 0, key_slots = 0;
    for (const int c : factors_.slots()) ++(c % 2 == 0 ? query_slots : key_slots);
    f.dynamic_macs = B * (T_ * query_slots + key_rows * key_slots) * G * (D * K + 2 * R * M * K + R * M + D * M);
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

  // Where the pipeline finds its operands: Q of the queries, K/V of a
  // forward's keys (a step reads the cache's: DotProductStages::reading), the
  // key-side factors of all keys (the workspace's, or the cache's) and the
  // query-side factors of the queries.
  struct Sources : detail::DcmhaFactorTargets<T> {  // the factors: qf rows of the queries, kf columns of the keys
    const T* q = nullptr;
    Index queries = 0;  // rows of Q per batch item
    const T* k = nullptr;
    const T* v = nullptr;
    Index kv_stride = 0;  // rows between batch items of K and V
  };

  // Dot-product scores and readout over Q, K and V of `src`, with KV heads
  // shared by contiguous groups of query heads; with a Compose, the heads
  // of each chunk of keys in turn (detail::mix_in_key_chunks).
  DotProductStages<T> stages(const Sources& src) const {
    const Index H = num_heads(), Hkv = num_kv_heads();
    DotProductStages<T> s{src.q, src.k, src.v, src.queries, src.kv_stride, H, Hkv, Hkv,
                          head_dim(), v_head_dim(), H / Hkv, H / Hkv};
    s.heads_in_turn = has_mix();
    return s;
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

    void pre_mix(Index b, const AttentionTensor<T>& tile, Workspace<T>& ws, int w) const {
      layer->compose(0, *this, b, tile, ws, w);
    }
    void post_mix(Index b, const AttentionTensor<T>& tile, Workspace<T>& ws, int w) const {
      layer->compose(1, *this, b, tile, ws, w);
    }
  };

  using Factors = detail::DcmhaFactors<T>;
  // Workspace slots: per stage (pre, post), the query-side and key-side
  // factors; per worker, the factor MLP's scratch and the compose scratch.
  enum : std::size_t {
    shared_query_factors = slot::variant,
    shared_key_factors = slot::variant + 2,
  };
  enum : std::size_t { local_u = slot::local_variant, local_f, local_compose, local_static_term };

  bool has_mix() const { return opt_.use_pre || opt_.use_post; }
  bool stage_used(int st) const { return st == 0 ? opt_.use_pre : opt_.use_post; }
  bool needs_query_factors(int st) const { return stage_used(st) && opt_.query_wise; }
  bool needs_key_factors(int st) const { return stage_used(st) && opt_.key_wise; }
  // Per position, group and stage: W1 [R, M], W2 [R, M], dd [M].
  Index group_factor_width() const { return (2 * rank() + 1) * group_heads(); }
  Index factor_width() const { return groups() * group_factor_width(); }

  // Cache streams: 0 K [H·dk], 1 V [H·dv], 2 and 3 the pre and post
  // key-side factors, in T or (`half`) bfloat16. A factor stream holds, per
  // batch item, factor_width() rows along the positions (row j at j ·
  // SequenceCache::position_stride, so that the compose reads each
  // coefficient row contiguously); its per-position width is whatever
  // makes that block fit.
  Index factor_stream_width(Index capacity, bool half) const {
    if (capacity <= 0) return factor_width();
    return (factor_width() * SequenceCache<T>::position_stride(capacity, half) + capacity - 1) / capacity;
  }
  Shape cache_widths(Index capacity, bool half) const {
    return {num_kv_heads() * head_dim(), num_kv_heads() * v_head_dim(),
            needs_key_factors(0) ? factor_stream_width(capacity, half) : 0,
            needs_key_factors(1) ? factor_stream_width(capacity, half) : 0};
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

  // The static term I + P: in the kernels, when they hold the group's heads
  // in registers (the tile is then read once and written once) or on
  // single-row tiles (decoding), where a GEMM would pack (and for long
  // caches heap-allocate) more than the M² multiply-adds per key it saves;
  // else one mix_heads GEMM over the group's planes first, into scratch.
  bool static_in_kernels(Index rows) const { return rows == 1 || detail::compose_holds_heads(group_heads()); }

  // Every worker's compose scratch for tiles of up to `rows` queries over
  // `keys` keys, before the pipeline's tasks: any worker may take a tile, so
  // a call allocates nothing once one has sized it.
  void reserve_compose(Workspace<T>& ws, Index rows, Index keys) const {
    const int workers = std::max(1, opt_.threads);
    ws.reserve_local(workers, local_compose, detail::compose_scratch<T>(group_heads(), rank()));
    if (opt_.static_w && !static_in_kernels(rows))
      ws.reserve_local(workers, local_static_term, group_heads() * rows * mix_chunk_keys(rows, keys));
  }

  // One compose stage on a tile, in place: z ← z · C(t, s) per group, on the
  // visible keys of each row (others are set to 0), a column chunk of every
  // row at a time (dcmha/compose.hpp).
  void compose(int st, const Policy& pol, Index b, const AttentionTensor<T>& tile, Workspace<T>& ws, int w) const {
    const Index rows = tile.rows(), cols = tile.cols(), plane = rows * cols;
    const Index q0 = tile.first_query(), k0 = tile.first_key();
    const Index G = groups(), M = group_heads(), R = rank(), FW = group_factor_width();
    const bool qw = opt_.query_wise, kw = opt_.key_wise, sw = opt_.static_w;
    const Sources& src = pol.src;
    const Index rs = src.kf_row_stride;
    // The tile's head planes lie rows·cols apart, often a multiple of 4 KiB
    // (same cache sets), so the kernels read them once, in order, into
    // registers or this contiguous scratch and use them from there.
    constexpr Index CH = detail::compose_chunk<T>;
    T* scratch = ws.local(w, local_compose, detail::compose_scratch<T>(M, R));  // sized by reserve_compose
    const bool static_loop = sw && static_in_kernels(rows), static_gemm = sw && !static_loop;
    const T identity = sw ? T(0) : T(1);  // with a static term, I is part of its weights

    // Visible columns [lo, hi) of tile row r.
    auto visible = [&](Index r) {
      auto [lo, hi] = pol.mask.key_range(q0 + r, pol.keys);
      lo = std::clamp<Index>(lo - k0, 0, cols);
      hi = std::clamp<Index>(hi - k0, lo, cols);
      return std::pair<Index, Index>(lo, hi);
    };

    for (Index g = 0; g < G; ++g) {
      T* zg = tile.data() + g * M * plane;
      const Matrix<T>* mix = sw ? &static_mix_[st][static_cast<std::size_t>(g)] : nullptr;
      T* term = static_gemm ? ws.local(w, local_static_term, M * plane) : nullptr;  // sized by reserve_compose
      if (static_gemm) mix_heads(*mix, tile.like(zg, M), tile.like(term, M));
      for (Index r = 0; r < rows; ++r) {
        const auto [lo, hi] = visible(r);
        for (Index n = 0; n < M; ++n) {
          T* o = zg + n * plane + r * cols;
          std::fill(o, o + lo, T(0));
          std::fill(o + hi, o + cols, T(0));
        }
      }
      // The group's key-wise factors from the tile's first key, as stored
      // (T, or a bfloat16 cache's bits): a chunk of columns of every row in
      // turn, so that the chunk's (2R+1)·M coefficient rows stay in L2 while
      // every row uses them.
      const auto compose_chunks = [&](const auto* kfg) {
        using Stored = std::remove_const_t<std::remove_pointer_t<decltype(kfg)>>;
        for (Index c0 = 0; c0 < cols; c0 += CH) {
          const Index c1 = std::min(cols, c0 + CH);
          const auto visible_in_chunk = [&](Index r) {
            const auto [lo, hi] = visible(r);
            return std::pair<Index, Index>(std::max(lo, c0), std::min(hi, c1));
          };
          // Consecutive rows that see the same columns of the chunk (all of
          // them without a causal diagonal here) are one segment.
          for (Index r = 0, n = 1; r < rows; r += n) {
            const auto [lo, hi] = visible_in_chunk(r);
            for (n = 1; r + n < rows && visible_in_chunk(r + n) == std::pair(lo, hi);) ++n;
            if (lo >= hi) continue;
            const T* qf = qw ? src.qf[st] + (b * src.queries + q0 + r) * src.qf_stride + g * FW : nullptr;
            const Index at = r * cols + lo;
            detail::ComposeSegment<T, Stored> segment{zg + at, zg + at, plane, qf, kfg ? kfg + lo : nullptr,
                                                      rs, mix, M, R, static_loop, term ? term + at : nullptr,
                                                      identity, scratch};
            segment.rows = n, segment.row_stride = cols, segment.qf_stride = src.qf_stride;
            detail::compose_segment(segment, hi - lo);
          }
        }
      };
      const Index first = b * src.kf_batch_stride + g * FW * rs + k0;
      if (kw && src.kf_half[st])
        compose_chunks(bfloat16_bits(src.kf_half[st] + first));
      else
        compose_chunks(kw ? src.kf[st] + first : static_cast<const T*>(nullptr));
    }
  }

  // The dynamic-weight MLP's packed weights, and the static terms as
  // mix_heads weights (I + P)ᵀ.
  void prepare() {
    factors_.prepare(w_, opt_);
    const Index G = groups(), M = group_heads();
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
  Factors factors_;                    // the dynamic-weight MLP, packed for the used slots
  std::vector<Matrix<T>> static_mix_[2];  // per stage and group: (I + P)ᵀ, [M, M]
};

}  // namespace headmix
