// Collaborative multi-head attention, "CollabHead" (Cordonnier, Loukas,
// Jaggi 2020, "Multi-Head Attention: Collaborate Instead of Concatenate"),
// with the math of epfml/collaborative-attention's CollaborativeAttention:
//
//   Q̃ = Xq Wqᵀ [T, R],  K̃ = Xk Wkᵀ [S, R]         shared by all heads, no bias
//   cb = Xk content_biasᵀ [S, H]                   one scalar per key and head
//   logit_h = scale · ((Q̃ ⊙ m_h) K̃ᵀ + cb[:, h]ᵀ)   m_h = mixing[h, :] (broadcast over rows)
//   P_h = softmax(logit_h + mask),  C_h = P_h V_h,  V = Xk Wvᵀ + bv  (head h: columns h·Dv..)
//   y = concat_h(C_h) Woᵀ + bo   (or the concatenated heads without o)
//   out = LayerNorm(Xq + y)      (optional; needs out_dim == D)
//
// scale defaults to 1/sqrt(R/H), computed in double (R/H need not be an
// integer). Self- and cross-attention, causal with an offset, key padding;
// masked rows give zero weights and zero context, as everywhere in headmix.
//
// The score stage (why it costs what it costs)
// --------------------------------------------
// The reference builds the mixed queries of every head at once, an
// [H, T, R] tensor: H copies of Q̃. Here the mixing is applied per head and
// per query block only: for head h and a block of `rows` queries the pipeline
// asks for one [rows, S] tile, computed as
//   (Q̃_block[:, span_h] ⊙ scale·m_h[span_h]) · K̃[:, span_h]ᵀ   (one GEMM)
// with the mixed block in a per-worker buffer of rows·R values that is
// reused for every head. Scaling the query side rather than the key side is
// the cheaper choice: a block has at most block_rows queries but S keys.
// span_h = [first, last] non-zero column of mixing row h, found once at
// construction. With dense mixing it is all R columns; with block
// (CONCATENATE) mixing, as an exact MHA conversion produces, it is the head's
// own R/H columns, so each head costs what an MHA head of width R/H costs
// instead of H times that.
//
// Memory: besides the caller's output, a call keeps in its Workspace
//   Q̃ [B·T, R] + K̃ [B·S, R] + V [B·S, H·Dv] + context [B·T, H·Dv]
//   + content bias [B·S, H] + scaled mixing [H, R] + with the LayerNorm,
//   its input [B·T, out_dim]
//   + per worker thread: block_rows · S (one head's tile) + block_rows · R
//     (one head's mixed queries) + 2·S (padding bias, one head's content bias)
// values: attention memory grows with block_rows · (S + R), never H · T · S.
//
// Decoding: step() caches, per position, what the keys contribute — the
// shared keys K̃ [R] (transposed in Panels, as a forward packs them), each
// head's values [Dv] (head-major) and the scaled content bias [H] — in a
// SequenceCache, and runs the same pipeline over the cached rows. Memory:
// a one-row step's tile holds all S keys for the H heads it scores at once.
// The step's score product, [H, R] x [R, S], is arithmetic, not a read: in
// panels its GEMM tiles read contiguous memory, where rows of K̃ᵀ a
// capacity apart put each of a tile's 64 rows on a page of its own (a step
// at S = 8192, D = 1024, H = 16, R = 512 took 0.93-0.94x the time on the
// Zen 3 machine; the product alone 0.55-0.6x).
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/parallel.hpp"
#include "headmix/core/options.hpp"
#include "headmix/core/pipeline.hpp"
#include "headmix/core/sequence_cache.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace headmix {

/// As MhaOptions; `scale` defaults to 1/sqrt(shared_dim / num_heads).
struct CollabHeadOptions : DenseOptions {
  Index num_heads = 1;
  // scale (DenseOptions) defaults to 1/sqrt(R / H), in double
};

/// out = (z − mean(z)) / sqrt(var(z) + eps) ⊙ weight + bias over the last
/// dimension of z = Xq + y, with the biased variance (torch.nn.LayerNorm).
/// Empty weight and bias: no LayerNorm.
template <class T>
struct CollabLayerNorm {
  Vector<T> weight;   ///< [D]
  Vector<T> bias;     ///< [D]
  double eps = 1e-5;  ///< torch's default

  bool empty() const { return weight.size() == 0 && bias.size() == 0; }

  /// `<name>.weight` and `<name>.bias` from a source of named tensors, when
  /// either is stored (then both must be); else none.
  template <class Source>
  static CollabLayerNorm read(const Source& tensors, const std::string& name, double eps) {
    CollabLayerNorm ln;
    if (!tensors.contains(name + ".weight") && !tensors.contains(name + ".bias")) return ln;
    ln.weight = detail::read_vector<T>(tensors, name + ".weight");
    ln.bias = detail::read_vector<T>(tensors, name + ".bias");
    ln.eps = eps;
    return ln;
  }

  /// Its shapes for `variant`'s output of `out` columns over an input of D.
  void check(const char* variant, Index D, Index out) const {
    if (empty()) return;
    if (out != D)
      detail::throw_shape(variant, "out_dim", std::to_string(D) + " (LayerNorm(Xq + y) needs out_dim == D)",
                          std::to_string(out));
    check_vector(variant, "layer_norm.weight", weight, D);
    check_vector(variant, "layer_norm.bias", bias, D);
    if (!(eps >= 0) || !std::isfinite(eps))
      detail::throw_shape(variant, "layer_norm.eps", "a finite number >= 0", std::to_string(eps));
  }

  /// out ← LayerNorm(xq + y), row by row (rows are independent, so any thread
  /// split gives the same bits); y is scratch and may be `out`. Public for a
  /// head-parallel layer, which applies it after summing its heads.
  void apply(const ConstMatrixMap<T>& xq, MatrixMap<T>& y, MatrixMap<T> out, int threads) const {
    constexpr Index chunk = 64;  // as project_rows: a short input still splits
    const Index n = y.rows();
    const T e = static_cast<T>(eps), inv_width = T(1) / static_cast<T>(y.cols());
    parallel_for((n + chunk - 1) / chunk, threads, [&](Index c, int) {
      const Index r0 = c * chunk, rows = std::min(chunk, n - r0);
      auto z = y.middleRows(r0, rows);
      z += xq.middleRows(r0, rows);
      for (Index r = 0; r < rows; ++r) {
        auto row = z.row(r).array();
        const T mean = row.sum() * inv_width;
        row -= mean;  // two passes: the variance of the centred row does not cancel
        const T inv_std = T(1) / std::sqrt(row.square().sum() * inv_width + e);
        out.row(r0 + r).array() = row * inv_std * weight.array().transpose() + bias.array().transpose();
      }
    });
  }
};

/// Parameters in PyTorch layout (tensor names of the epfml layer in
/// conformance/collab.md in the comments).
template <class T>
struct CollabHeadWeights {
  Matrix<T> q;             ///< [R, D]       query.weight: shared query projection, no bias
  Matrix<T> k;             ///< [R, Dkv]     key.weight: shared key projection, no bias
  Matrix<T> mixing;        ///< [H, R]       mixing: head h scales the shared dimensions by row h
  Matrix<T> content_bias;  ///< [H, Dkv]     content_bias.weight; empty for none
  Linear<T> v;             ///< [H·Dv, Dkv]  value
  Linear<T> o;             ///< [out_dim, H·Dv], optional (dense); without it the output is [B, T, H·Dv]
  CollabLayerNorm<T> layer_norm;  ///< optional LayerNorm(Xq + y); needs out_dim == D
};

template <class T>
class CollabHead : public LayerForms<CollabHead<T>, T> {
 public:
  using LayerForms<CollabHead<T>, T>::forward;  // the allocating forms
  using LayerForms<CollabHead<T>, T>::step;
  static constexpr const char* kName = "collab";

  CollabHead(CollabHeadWeights<T> weights, CollabHeadOptions options) : w_(std::move(weights)), opt_(options) {
    validate(w_, opt_);
    prepare_weights(opt_.bfloat16_weights);
    // Head h only needs the columns between its first and last non-zero
    // mixing entry; an all-zero row needs none (its logits are the content
    // bias alone).
    const Index H = w_.mixing.rows(), R = w_.mixing.cols();
    span_.assign(static_cast<std::size_t>(H), {0, 0});
    for (Index h = 0; h < H; ++h) {
      Index lo = 0, hi = R;
      while (lo < hi && w_.mixing(h, lo) == T(0)) ++lo;
      while (hi > lo && w_.mixing(h, hi - 1) == T(0)) --hi;
      span_[static_cast<std::size_t>(h)] = {lo, hi - lo};
    }
  }

  /// Build from named tensors (an io::TensorFile, or anything with the same
  /// contains/matrix/vector accessors), with the names of conformance/collab.md
  /// after `prefix`: `q.weight`, `k.weight`, `mixing`, `content_bias.weight`,
  /// `v.weight`, `v.bias`, `o.weight`, `o.bias`, `layer_norm.weight`,
  /// `layer_norm.bias`. The content bias, biases, `o` and the LayerNorm are
  /// optional (a LayerNorm needs both tensors). Stored F16/BF16/F32/F64 are
  /// converted to T; `layer_norm_eps` is the LayerNorm's eps.
  template <class Source>
  static CollabHead from_tensors(const Source& tensors, const std::string& prefix, const CollabHeadOptions& options,
                                 double layer_norm_eps = 1e-5) {
    CollabHeadWeights<T> w;
    w.q = detail::read_matrix<T>(tensors, prefix + "q.weight");
    w.k = detail::read_matrix<T>(tensors, prefix + "k.weight");
    w.mixing = detail::read_matrix<T>(tensors, prefix + "mixing");
    if (tensors.contains(prefix + "content_bias.weight"))
      w.content_bias = detail::read_matrix<T>(tensors, prefix + "content_bias.weight");
    w.v = read_linear<T>(tensors, prefix + "v");
    w.o = detail::read_optional_linear<T>(tensors, prefix + "o");
    w.layer_norm = CollabLayerNorm<T>::read(tensors, prefix + "layer_norm", layer_norm_eps);
    return with_tensor_prefix(tensors, prefix,
                              {"q.weight", "k.weight", "mixing", "content_bias.weight", "v.weight", "v.bias",
                               "o.weight", "o.bias", "layer_norm.weight", "layer_norm.bias"},
                              [&] { return CollabHead(std::move(w), options); });
  }

  Index num_heads() const { return opt_.num_heads; }
  Index shared_dim() const { return w_.q.rows(); }
  Index v_head_dim() const { return w_.v.out_features() / opt_.num_heads; }
  Index embed_dim() const { return w_.q.cols(); }
  Index key_dim() const { return w_.k.cols(); }
  Index out_dim() const { return w_.o.empty() ? w_.v.out_features() : w_.o.out_features(); }
  bool has_content_bias() const { return w_.content_bias.size() != 0; }
  bool has_layer_norm() const { return !w_.layer_norm.empty(); }
  /// The logit scale as a double: options().scale, or 1/sqrt(R/H).
  double scale_value() const {
    return opt_.scale.value_or(1.0 / std::sqrt(static_cast<double>(shared_dim()) / static_cast<double>(num_heads())));
  }
  T scale() const { return static_cast<T>(scale_value()); }
  /// Columns [first, first + count) of the shared dimension that head h uses.
  std::pair<Index, Index> head_span(Index h) const { return span_.at(static_cast<std::size_t>(h)); }
  const CollabHeadWeights<T>& weights() const { return w_; }
  const CollabHeadOptions& options() const { return opt_; }
  /// Change masking, block size, threads (or the scale) between calls;
  /// validated like the constructor, and left unchanged if invalid. The
  /// head count is fixed by the mixing matrix.
  void set_options(const CollabHeadOptions& options) {
    validate(w_, options);
    if (options.bfloat16_weights != opt_.bfloat16_weights) prepare_weights(options.bfloat16_weights);
    opt_ = options;
  }

  /// Run the layer. `out` must be [B, T, out_dim]. With `probs`, the
  /// attention weights are written there as [B, H, T, S].
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    check_input(kName, in, embed_dim(), key_dim());
    const Index B = in.query.batch(), T_ = in.query.length(), S = in.keys().length();
    check_output(kName, out, B, T_, out_dim());
    const Index H = num_heads(), R = shared_dim(), dv = v_head_dim();

    MatrixMap<T> k = ws.shared_matrix(slot::key, B * S, R);
    MatrixMap<T> v = ws.shared_matrix(slot::value, B * S, H * dv);
    MatrixMap<T> cb = ws.shared_matrix(kBiasSlot, B * S, has_content_bias() ? H : 0);
    const auto xk = in.keys().rows();
    project_rows<T>(key_, xk, k, opt_.threads);
    project_rows<T>(w_.v, xk, v, opt_.threads);
    project_content_bias(xk, cb);
    reserve_scratch(ws, std::min(block_rows(S), T_), S);
    // Kᵀ once per batch item, [R, S] in Panels: the GEMM multiplies it
    // untransposed, in the order it reads it.
    T* kt = ws.shared(slot::packed_key, B * R * S);
    parallel_for(B, opt_.threads, [&](Index b, int) {
      Panels<T>::write_transposed(k.middleRows(b * S, S), kt + b * R * S);
    });
    attend(in.query, {kt, S, v.data(), S * H * dv, dv, H * dv, cb, S}, S, opt_.mask(), in.key_padding, out, ws, probs);
  }

  /// Incremental decoding, with the contract of Mha::step. Attends n new
  /// positions `x` [B, n, D] to every position in `cache` and to
  /// themselves, and appends what later positions need of them to the
  /// cache: shared keys [R], values [H·Dv] and the scaled content bias [H].
  /// Alignment is bottom-right causal whatever options().causal says: new
  /// position k sees cached positions 0 … size + k. `out` must be
  /// [B, n, out_dim]; with `probs`, the weights are written as
  /// [B, H, n, size + n]. The LayerNorm residual is `x`. Self-attention
  /// layers only (key width == D). Allocates nothing once `ws` and `cache`
  /// are sized; throws cache_full_error (and changes nothing) when n
  /// positions do not fit.
  void step(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
            Tensor<T>* probs = nullptr) const {
    check_input(kName, AttentionInput<T>{x, {}, {}}, embed_dim(), key_dim());
    const Index B = x.batch(), n = x.length(), past = cache.size(), H = num_heads();
    check_shape(kName, "cache batch", {B}, {cache.batch()});
    check_output(kName, out, B, n, out_dim());
    const Index R = shared_dim(), dv = v_head_dim(), cap = cache.capacity();
    // The shared keys transposed in panels ([R, capacity] per batch item)
    // and each head's values contiguous ([capacity, dv]): a step's products
    // read both as a forward's packed operands, in float only.
    cache.bind(kName, {R, H * dv, has_content_bias() ? H : 0}, {1, H, 1}, 2, /*half_streams=*/0, KeyLayout::panels);
    cache.check_room(kName, n);
    reserve_scratch(ws, std::min(block_rows(cap), n), cap);
    MatrixMap<T> k = ws.shared_matrix(slot::key, n, R), v = ws.shared_matrix(slot::value, n, H * dv);
    for (Index b = 0; b < B; ++b) {
      const auto xb = x.item(b);
      key_.apply(xb, k);
      cache.write(0, b, past, k);
      w_.v.apply(xb, v);
      cache.write(1, b, past, v);
      project_content_bias(xb, MatrixMap<T>(cache.stream(2, b).data() + past * cache.stream(2, b).cols(), n,
                                            cache.stream(2, b).cols()));
    }
    attend(x, {cache.stream_data(0), cap, cache.stream_data(1), H * cap * dv, cap * dv, dv, cache.stream(2), cap},
           past + n, opt_.step_mask(past), {}, out, ws, probs);
    cache.advance(n);
  }

  /// Multiply-adds of one call on B sequences of T queries and S keys.
  ///
  /// With w_h = head_span(h).second and W = Σ_h w_h (H·R for dense mixing):
  ///   projection: B·(T·D·R + S·Dkv·(R + H·Dv + H [content bias]) + T·H·Dv·out_dim [o])
  ///   attention:  B·(T·W [mixed queries] + visible·(W + H·Dv) [scores, readout])
  /// where visible = (query, key) pairs the causal mask leaves (padding does
  /// not change the work). Scale, softmax and LayerNorm are element-wise and
  /// not counted, as in Mha::flops.
  ///
  /// Against MHA (Mha::flops: B·(T·D·H·Dk + S·Dkv·H·(Dk + Dv) + T·H·Dv·out
  /// + visible·H·(Dk + Dv))) with the same values and output, CollabHead
  /// saves (T·D + S·Dkv)·(H·Dk − R) on the query/key projections and pays
  /// visible·(W − H·Dk) more on the scores, plus S·Dkv·H + T·W. So:
  ///   * block (CONCATENATE) mixing with R = H·Dk (the exact MHA copy):
  ///     W = H·Dk, the cost of MHA plus ~1% (content bias, mixing);
  ///   * dense mixing, R = H·Dk/2: cheaper only for short sequences. For
  ///     BERT-base (D = 768, H = 12, Dk = 64, R = 384, self-attention,
  ///     non-causal) the break-even is T ≈ 150; at T = 1024 CollabHead does
  ///     ~1.9× MHA's work, at R = 768 ~3.2×. Its win is parameters
  ///     (2·D·R instead of 2·D·H·Dk) and short-context cost.
  FlopCount flops(Index B, Index T_, Index S) const {
    const Index H = num_heads(), R = shared_dim(), dv = v_head_dim();
    Index W = 0;
    for (const auto& sp : span_) W += sp.second;
    FlopCount f;
    f.projection_macs = B * (T_ * embed_dim() * R + S * key_dim() * (R + H * dv + (has_content_bias() ? H : 0)) +
                             (w_.o.empty() ? 0 : T_ * H * dv * out_dim()));
    f.attention_macs = B * (T_ * W + opt_.mask().visible_pairs(T_, S) * (W + H * dv));
    return f;
  }

 private:
  // The projections as Linears, prepared (rounded to bfloat16 when asked,
  // and the held weights with them, so that weights() is what runs).
  void prepare_weights(bool bfloat16_weights) {
    query_.weight = w_.q, key_.weight = w_.k, content_bias_.weight = w_.content_bias;
    prepare_projections(bfloat16_weights, query_, key_, content_bias_, w_.v, w_.o);
    if (bfloat16_weights) w_.q = query_.weight, w_.k = key_.weight, w_.content_bias = content_bias_.weight;
  }

  enum : std::size_t { kMixSlot = slot::variant, kBiasSlot, kPreNormSlot };
  enum : std::size_t { kMixedQuerySlot = slot::local_variant, kHeadBiasSlot };

  // Where attend() reads the keys, values and content bias of S positions:
  // Kᵀ as [R, kt_stride] per batch item in Panels (a forward's packed keys,
  // or a cache's, kt_stride its capacity); V's element (b, h, s, j) at
  // v + b·v_batch + h·v_head + s·v_row + j (heads side by side in a
  // forward's projection, head-major in a cache); the scaled content bias
  // as [H] rows, key_stride per batch item.
  struct KeyValues {
    const T* kt;
    Index kt_stride;
    const T* v;
    Index v_batch, v_head, v_row;
    MatrixMap<T> cb;
    Index key_stride;
  };

  // Project the queries and run the pipeline over `kv`'s first S positions,
  // then the output projection and LayerNorm.
  void attend(ConstBatchView<T> x, const KeyValues& kv, Index S, const PositionMask& mask, const KeyPadding& padding,
              BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs) const {
    const Index B = x.batch(), T_ = x.length(), H = num_heads(), R = shared_dim(), dv = v_head_dim();
    MatrixMap<T> q = ws.shared_matrix(slot::query, B * T_, R);
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * T_, H * dv);
    MatrixMap<T> mix = ws.shared_matrix(kMixSlot, H, R);
    project_rows<T>(query_, x.rows(), q, opt_.threads);
    mix = scale() * w_.mixing;  // the scale rides on the mixing and the content bias, never on a [T, S] tile

    const DenseRun<T> run{B, T_, S, mask, padding, block_rows(S), opt_.threads, ctx.data(), probs, opt_.keys_per_block()};
    run_dense_pipeline(Policy{q, mix, kv, span_.data(), T_, H, dv, has_content_bias()}, run, ws);

    // With a LayerNorm, the pre-norm rows go to the Workspace: its buffers'
    // alignment is fixed, the caller's output's is not, and the norm's row
    // sums peel to an aligned address (their order would follow it).
    MatrixMap<T> y = has_layer_norm() ? ws.shared_matrix(kPreNormSlot, B * T_, out_dim()) : out.rows();
    if (w_.o.empty())
      y = ctx;
    else
      project_rows<T>(w_.o, ConstMatrixMap<T>(ctx.data(), ctx.rows(), ctx.cols()), y, opt_.threads);
    if (has_layer_norm()) w_.layer_norm.apply(x.rows(), y, out.rows(), opt_.threads);
  }

  // cb = scale · xk · content_biasᵀ, one row of H per key position.
  void project_content_bias(const ConstMatrixMap<T>& xk, MatrixMap<T> cb) const {
    if (!has_content_bias()) return;
    project_rows<T>(content_bias_, xk, cb, opt_.threads);
    cb *= scale();
  }

  // Every worker's scratch at full size before the parallel region, for
  // tiles of up to `rows` queries over up to `keys` keys: no allocation
  // inside it, and none in decoding steps over a sized cache.
  void reserve_scratch(Workspace<T>& ws, Index rows, Index keys) const {
    Index widest = 0;
    for (const auto& sp : span_) widest = std::max(widest, sp.second);
    const int workers = std::max(1, opt_.threads);
    reserve_dense_tiles(ws, workers, 1, false, rows, keys, opt_.keys_per_block(), num_heads());
    // score_group holds all heads' span at once
    ws.reserve_local(workers, kMixedQuerySlot, std::max(rows * widest, num_heads() * shared_dim()));
    if (has_content_bias()) ws.reserve_local(workers, kHeadBiasSlot, keys);
  }

  // The score and readout stages; no mixing over heads after the score.
  struct Policy {
    MatrixMap<T> q, mix;
    KeyValues kv;
    const std::pair<Index, Index>* span;
    Index T_, H, dv;
    bool content_bias;

    Index score_heads() const { return H; }
    Index softmax_heads() const { return H; }
    Index value_heads() const { return H; }
    Index value_dim() const { return dv; }

    void score(Index b, Index h, Eigen::Map<Matrix<T>> out, Index q0, Index k0, Workspace<T>& ws, int worker) const {
      const Index rows = out.rows(), cols = out.cols();
      const auto [first, width] = span[h];
      if (width > 0) {
        MatrixMap<T> mixed(ws.local(worker, kMixedQuerySlot, rows * width), rows, width);
        mixed.array() = q.block(b * T_ + q0, first, rows, width).array().rowwise() *
                        mix.row(h).segment(first, width).array();
        times_keys(mixed, b, first, k0, out);
      } else {
        out.setZero();
      }
      if (content_bias) {  // head h's bias is a strided column of cb: gather it once per tile
        Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> bias(ws.local(worker, kHeadBiasSlot, cols), cols);
        bias = kv.cb.block(b * kv.key_stride + k0, h, cols, 1).transpose();
        out.rowwise() += bias;
      }
    }
    ConstStridedMap<T> values(Index b, Index h, Index k0, Index count, Workspace<T>&, int) const {
      return {kv.v + b * kv.v_batch + h * kv.v_head + k0 * kv.v_row, count, dv, Eigen::OuterStride<>(kv.v_row)};
    }

    // Every head scores against the same shared keys, so a one-query block
    // (a decoding step) scores `count` heads in one product that reads K
    // once: row i = (q ∘ mix_{h0+i}) · Kᵀ over the heads' joint span of
    // shared columns (outside a head's span its mixing is zero).
    Index key_sharing_heads() const { return H; }
    void score_group(Index b, Index h0, Index count, Eigen::Map<Matrix<T>> out, Index q0, Index k0,
                     Workspace<T>& ws, int worker) const {
      const Index cols = out.cols();
      Index first = q.cols(), last = 0;
      for (Index h = h0; h < h0 + count; ++h)
        if (span[h].second > 0) first = std::min(first, span[h].first), last = std::max(last, span[h].first + span[h].second);
      if (first < last) {
        const Index width = last - first;
        MatrixMap<T> mixed(ws.local(worker, kMixedQuerySlot, count * width), count, width);
        mixed.array() = mix.block(h0, first, count, width).array().rowwise() *
                        q.row(b * T_ + q0).segment(first, width).array();
        times_keys(mixed, b, first, k0, out);
      } else {
        out.setZero();
      }
      if (content_bias)  // out += the heads' bias columns, transposed in registers
        detail::transpose_into(kv.cb.block(b * kv.key_stride + k0, h0, cols, count), out.data(), cols, true);
    }

   private:
    // out = mixed · K[k0 .. k0 + out.cols(), first .. first + mixed.cols())ᵀ,
    // from Kᵀ's panels.
    void times_keys(const MatrixMap<T>& mixed, Index b, Index first, Index k0, Eigen::Map<Matrix<T>> out) const {
      const Index R = q.cols();
      const Panels<T> keys(kv.kt + b * R * kv.kt_stride, R, kv.kt_stride);
      gemm(mixed, keys.middle_rows(first, mixed.cols()).middle_cols(k0, out.cols()), out);
    }
  };

  // Heads run one at a time, so one tile is resident per worker.
  Index block_rows(Index keys) const { return opt_.rows_per_block(1, keys, sizeof(T)); }

  static void validate(const CollabHeadWeights<T>& w, const CollabHeadOptions& opt) {
    check_value(opt.num_heads >= 1, kName, "num_heads", ">= 1", opt.num_heads);
    opt.validate(kName);
    const Index H = opt.num_heads, R = w.q.rows(), D = w.q.cols(), Dkv = w.k.cols();
    if (R < 1 || D < 1)
      detail::throw_shape(kName, "q.weight", "[R >= 1, D >= 1]", detail::format_shape(shape_of(w.q)));
    if (Dkv < 1)
      detail::throw_shape(kName, "k.weight", "[" + std::to_string(R) + ", Dkv >= 1]",
                          detail::format_shape(shape_of(w.k)));
    check_matrix(kName, "k.weight", w.k, R, Dkv);
    check_matrix(kName, "mixing", w.mixing, H, R);
    if (w.content_bias.size() != 0) check_matrix(kName, "content_bias.weight", w.content_bias, H, Dkv);
    const Index hdv = w.v.out_features();
    if (hdv == 0 || hdv % H != 0)
      detail::throw_shape(kName, "v.weight", "[num_heads * v_head_dim, Dkv] with num_heads = " + std::to_string(H),
                          detail::format_shape(shape_of(w.v.weight)));
    w.v.check(kName, "v", hdv, Dkv);
    w.o.check_optional(kName, "o", hdv);
    w.layer_norm.check(kName, D, w.o.empty() ? hdv : w.o.out_features());
  }

  CollabHeadWeights<T> w_;
  Linear<T> query_, key_, content_bias_;  ///< w_.q, w_.k, w_.content_bias as bias-free projections
  CollabHeadOptions opt_;
  std::vector<std::pair<Index, Index>> span_;  ///< per head: first shared column, count
};

}  // namespace headmix
