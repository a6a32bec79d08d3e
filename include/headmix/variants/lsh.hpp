// Reformer LSH self-attention (Kitaev, Kaiser, Levskaya, "Reformer: The
// Efficient Transformer", ICLR 2020), with the semantics of reformer-pytorch
// 1.4.4's LSHSelfAttention behind its Autopadder, as written out step by
// step in shared/conformance/lsh.md. Per head h, with shared query/key:
//
//   qk = x W_qk[h]ᵀ, v = x W_v[h]ᵀ; T is padded to Tp, a multiple of 2·bs
//   bucket_r(i) = argmax [qk_i A_r, −qk_i A_r]        (NB buckets, NH rounds)
//   each round: positions sorted by (bucket, position), cut into chunks of bs;
//   chunk c attends to chunks c and c − 1 (cyclic over all rounds' chunks)
//   logit = qk_i · k̂_j / sqrt(dh), k̂ = qk / ‖qk‖; masks: invalid pair,
//   causal, self = −5e4, other bucket, − log(duplicate count)
//   softmax per round; rounds weighted by their log-partition (logsumexp)
//   y = concat_h(head_h) W_oᵀ + b_o, sliced back to T rows
//
// One deliberate difference from the reference: without
// allow_duplicate_attention, a key's count N(i, j) is the number of slots
// holding j that query i really attends over all rounds (lsh.md step 6f);
// the reference miscounts in the first chunk of every round.
//
// Lengths. Any T >= 1 works: the sequence is padded with zero rows of x
// (so qk and v there are the biases, or 0) to Tp = T rounded up to a
// multiple of 2·bucket_size; padded positions are hashed and sorted like
// the others but masked as keys and as queries (step 6b), and the output is
// sliced back to T rows. A sequence of at most 2·bucket_size positions is
// therefore one padded length Tp = 2·bs; there, every query's windows over
// the rounds cover all Tp positions, so when attending across buckets (the
// default) with n_hashes = 1, or without duplicate attention, the layer
// computes full shared-QK attention (self −5e4, the same masks): exactly
// with one round, and to within the 1e-9 of step 6f's log(N + 1e-9)
// without duplicates. Unlike LSHSelfAttention, headmix never
// switches silently to a separate full-attention path for short inputs (the
// reference's Reformer model does not either: it passes full_attn_thres = 0).
//
// Buckets. n_buckets = 0 (the default) takes the reference's Tp / bs, so
// the rotation tensor's last extent depends on the length; a nonzero even
// n_buckets fixes it (bucket_size then stays the chunk length).
//
// Rotations. Either given in weights.rotations as [R, dh, NH, NB/2]
// (R = 1 shared by every batch item and head, or R = B·H with index
// b·H + h when rotations_per_head; with options.rotation_heads = N > 0,
// R = B·N and index b·N + rotation_head_offset + h, the layer's heads being
// a slice of N, as a head-parallel shard's are), or drawn from options.seed with the
// platform-independent generator of variants/lsh/rotations.hpp (the same
// R and index; rotation ρ depends only on (seed, ρ)). The reference draws
// fresh rotations on every call; headmix keeps them fixed for a seed, so a
// call is a deterministic function of its inputs. Change the seed for a new draw.
//
// Memory: besides the caller's output, a call keeps in its Workspace
//   qk [B·T, H·dh] + v [B·T, H·dv] + context [B·T, H·dv] (+ the rotation when seeded)
//   + per worker thread: 128 × NH·NB/2 (hash block) + O(bs · (bs + dh + dv))
//     (one chunk's tiles) + O(NH · Tp) integers (buckets and sort)
//     + T · (dh + 2·dv) (its head's qk, v and context rows)
// so attention memory grows with NH · Tp, never T². Asking for the dense
// weights [B, H, T, T] (for inspection at small T) also keeps every chunk's
// weights, NH · Tp · 2·bs values per worker.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/parallel.hpp"
#include "headmix/core/pipeline.hpp"
#include "headmix/variants/lsh/head.hpp"
#include "headmix/variants/lsh/rotations.hpp"

#include <cmath>
#include <optional>
#include <cstdint>
#include <limits>
#include <string>

namespace headmix {

struct LshOptions {
  Index num_heads = 1;
  Index bucket_size = 64;     ///< chunk length after sorting (reference default 64)
  Index n_hashes = 8;         ///< hash rounds (reference default 8)
  Index n_buckets = 0;        ///< 0: padded length / bucket_size; else even, >= 2
  bool causal = false;
  bool attend_across_buckets = true;       ///< false: only keys of the query's own bucket and round
  bool allow_duplicate_attention = true;   ///< false: divide out keys seen more than once (step 6f)
  bool rotations_per_head = false;         ///< one rotation per (batch item, head) instead of one shared
  std::uint64_t seed = 0;                  ///< rotations when weights.rotations is empty
  /// With rotations_per_head: index the rotations over `rotation_heads`
  /// heads (0: num_heads), this layer's being heads [rotation_head_offset,
  /// rotation_head_offset + num_heads) of them, so head h of batch item b
  /// uses rotation b·rotation_heads + rotation_head_offset + h (how a
  /// head-parallel shard uses the full layer's). Unused without it.
  Index rotation_heads = 0;
  Index rotation_head_offset = 0;
  /// The logit scale on q · k̂ (k̂ the unit key): default 1/sqrt(head_dim),
  /// the spec's (conformance/lsh.md). Any positive scale leaves the hashing
  /// as it is (the buckets depend on qk's direction only).
  std::optional<double> scale;
  int threads = 1;                         ///< worker threads over (batch, head); results do not depend on it
};

/// Parameters in PyTorch layout (reformer-pytorch: toqk, tov, to_out).
template <class T>
struct LshWeights {
  Linear<T> qk;  ///< [H·dh, D], shared query/key; bias optional (the reference has none)
  Linear<T> v;   ///< [H·dv, D]; bias optional
  Linear<T> o;   ///< [out_dim, H·dv], optional: without it the output is the concatenated heads
  Tensor<T> rotations;  ///< optional [R, dh, NH, NB/2]; empty: drawn from options.seed
};

template <class T>
class Lsh : public LayerForms<Lsh<T>, T> {
 public:
  using LayerForms<Lsh<T>, T>::forward;  // the allocating forms
  static constexpr const char* kName = "lsh";

  Lsh(LshWeights<T> weights, LshOptions options) : w_(std::move(weights)), opt_(options) {
    validate(opt_);
    prepare_projections(false, w_.qk, w_.v, w_.o);
  }

  /// Build from named tensors (an io::TensorFile, or anything with its
  /// contains/matrix/vector/get accessors), as in conformance/lsh.md:
  /// `<prefix>qk.weight`, `<prefix>v.weight`, `<prefix>o.weight`,
  /// `<prefix>o.bias`, `<prefix>rotations`. Biases, `o` and the rotations are
  /// optional (without rotations they are drawn from options.seed). Stored
  /// F16/BF16/F32/F64 are converted to T.
  template <class Source>
  static Lsh from_tensors(const Source& tensors, const std::string& prefix, const LshOptions& options) {
    LshWeights<T> w;
    w.qk = read_linear<T>(tensors, prefix + "qk");
    w.v = read_linear<T>(tensors, prefix + "v");
    w.o = detail::read_optional_linear<T>(tensors, prefix + "o");
    if (tensors.contains(prefix + "rotations")) w.rotations = detail::read_tensor<T>(tensors, prefix + "rotations");
    return with_tensor_prefix(tensors, prefix,
                              {"qk.weight", "qk.bias", "v.weight", "v.bias", "o.weight", "o.bias", "rotations"},
                              [&] { return Lsh(std::move(w), options); });
  }

  Index num_heads() const { return opt_.num_heads; }
  Index head_dim() const { return w_.qk.out_features() / opt_.num_heads; }
  Index v_head_dim() const { return w_.v.out_features() / opt_.num_heads; }
  Index embed_dim() const { return w_.qk.in_features(); }
  Index out_dim() const { return w_.o.empty() ? w_.v.out_features() : w_.o.out_features(); }
  const LshWeights<T>& weights() const { return w_; }
  const LshOptions& options() const { return opt_; }
  /// Change options between calls (masking, rounds, seed, threads);
  /// validated like the constructor, and left unchanged if invalid.
  void set_options(const LshOptions& options) {
    validate(options);
    opt_ = options;
  }

  /// Lengths, buckets and chunks of a call on sequences of length T.
  LshLayout layout(Index T_) const {
    LshLayout L;
    const Index bs = opt_.bucket_size;
    L.length = T_;
    L.bucket_size = bs;
    L.padded_length = (T_ + 2 * bs - 1) / (2 * bs) * (2 * bs);
    L.n_hashes = opt_.n_hashes;
    L.n_buckets = opt_.n_buckets > 0 ? opt_.n_buckets : L.padded_length / bs;
    L.chunks_per_round = L.padded_length / bs;
    L.chunks = L.n_hashes * L.chunks_per_round;
    return L;
  }
  /// The rotations' shape for a call on B sequences of length T (a Shape,
  /// so that checking explicit rotations allocates nothing).
  Shape rotation_shape(Index B, Index T_) const {
    return {opt_.rotations_per_head ? B * rotation_heads() : 1, head_dim(), opt_.n_hashes, layout(T_).n_buckets / 2};
  }
  /// The heads the per-head rotations are indexed over (options().rotation_heads, or H).
  Index rotation_heads() const { return opt_.rotation_heads > 0 ? opt_.rotation_heads : num_heads(); }

  /// Run the layer. `out` must be [B, T, out_dim]. With `probs`, the dense
  /// effective weights are written there as [B, H, T, T] (lsh.md section 4):
  /// O(T²) memory, for inspection at small T.
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    const LshLayout layout = check_call(in);
    check_output(kName, out, in.query.batch(), in.query.length(), out_dim());
    run(in, layout, 0, in.query.length(), out, ws, probs);
  }

  /// Output rows [first, first + count) of forward(in) on the whole
  /// sequence `in`, into `out` [B, count, out_dim]: every position is
  /// projected, hashed and sorted (each is a key), but only these query
  /// rows attend and go through o (lsh/head.hpp, "Query rows"). What one
  /// rank of a sequence-parallel layer computes; forward() is the range
  /// [0, T). A row's arithmetic is forward()'s except that a chunk's
  /// score and readout GEMMs, and o's, span only the range's rows (which
  /// may change the last bits; [0, T) is forward() exactly). With `probs`,
  /// these rows of forward()'s dense weights, [B, H, count, T].
  void forward_rows(const AttentionInput<T>& in, Index first, Index count, BatchView<T> out, Workspace<T>& ws,
                    Tensor<T>* probs = nullptr) const {
    const LshLayout layout = check_call(in);
    const Index T_ = in.query.length();
    check_value(first >= 0 && first <= T_, kName, "first row", "in [0, T = " + std::to_string(T_) + "]", first);
    check_value(count >= 0 && first + count <= T_, kName, "row count",
                ">= 0, with first row + count <= T = " + std::to_string(T_), count);
    if (count > 0 || out.data() != nullptr) check_output(kName, out, in.query.batch(), count, out_dim());
    if (count > 0)
      run(in, layout, first, count, out, ws, probs);
    else if (probs)
      probs->resize({in.query.batch(), num_heads(), 0, T_});
  }

  /// The checks of a call on B sequences of length T that need only the
  /// extents: slot indices fit, and explicit rotations fit B and T. (What
  /// a sharded caller checks before it gathers the sequence.)
  LshLayout check_extents(Index B, Index T_) const {
    const LshLayout L = layout(T_);
    if (L.slots() > std::numeric_limits<lsh_detail::Int>::max() - 2 * L.bucket_size)
      detail::throw_shape(kName, "input.query", "a length T with n_hashes * (T padded to 2 * bucket_size) < 2^31",
                          detail::format_shape({B, T_, embed_dim()}));
    if (!w_.rotations.shape().empty()) check_shape(kName, "rotations", rotation_shape(B, T_), w_.rotations.shape());
    return L;
  }

  /// The bucket of every position in every round, [B, H, NH, Tp], in
  /// [0, NB) before the round offset, autopad positions included: what
  /// forward() sorts by (lsh.md's expected.buckets; a debugging aid).
  Tensor<std::int64_t> buckets(const AttentionInput<T>& in, Workspace<T>& ws) const {
    const Call call = prepare(in, check_call(in), ws, false);
    const Index H = num_heads(), NH = call.L.n_hashes, Tp = call.L.padded_length;
    Tensor<std::int64_t> out({call.B, H, NH, Tp});
    parallel_for(call.B * H, opt_.threads, [&](Index task, int worker) {
      const lsh_detail::HeadJob<T> job = head_job(call, in, task, ws, worker);
      lsh_detail::Int* b = lsh_detail::local_ints(ws, worker, lsh_detail::s_bucket, NH * Tp);
      lsh_detail::hash_head(job, call.L, ws, worker, b);
      std::copy_n(b, NH * Tp, out.data() + task * NH * Tp);
    });
    return out;
  }

  /// Multiply-adds of one call on B sequences of length T (self-attention:
  /// S must equal T). Per head: key norms and hashing of all Tp positions,
  /// scores and readout over all NH · Tp · 2·bs slots (masked ones
  /// included: they are computed, then masked), and the round combination
  /// of the T real positions.
  FlopCount flops(Index B, Index T_, Index S) const {
    if (S != T_)
      detail::throw_shape(kName, "keys", std::to_string(T_) + " (self-attention: S == T)", std::to_string(S));
    return flops_rows(B, T_, 0, T_);
  }
  /// Multiply-adds of forward_rows(first, count) on B sequences of length
  /// T: the projections and hashing of all positions as above, but scores,
  /// readout, round combination and o only for the count rows (and the
  /// autopad rows when the range ends at T); none when count is 0.
  FlopCount flops_rows(Index B, Index T_, Index first, Index count) const {
    FlopCount f;
    if (count <= 0) return f;
    const LshLayout L = layout(T_);
    const Index H = num_heads(), dh = head_dim(), dv = v_head_dim(), Tp = L.padded_length;
    const Index rows = count + (first + count == T_ ? Tp - T_ : 0);  // the tile rows computed, per round
    f.projection_macs = B * T_ * embed_dim() * H * (dh + dv) + (w_.o.empty() ? 0 : B * count * H * dv * out_dim());
    f.attention_macs = B * H *
                       (Tp * dh + Tp * dh * L.rotation_width() + L.n_hashes * rows * 2 * L.bucket_size * (dh + dv) +
                        count * L.n_hashes * dv);
    return f;
  }

 private:
  // forward()'s work for output rows [first, first + count) (count >= 1).
  void run(const AttentionInput<T>& in, const LshLayout& layout, Index first, Index count, BatchView<T> out,
           Workspace<T>& ws, Tensor<T>* probs) const {
    const Call call = prepare(in, layout, ws, true);
    const Index B = call.B, T_ = call.L.length, H = num_heads(), dv = v_head_dim();
    MatrixMap<T> ctx = ws.shared_matrix(slot::context, B * count, H * dv);
    if (probs) {
      probs->resize({B, H, count, T_});
      probs->set_zero();
    }
    lsh_detail::Rules rules;
    rules.pair_mask = !in.key_padding.empty() || call.L.padded_length > T_;
    rules.causal = opt_.causal;
    rules.across = opt_.attend_across_buckets;
    rules.duplicates = opt_.allow_duplicate_attention;
    rules.scale = opt_.scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim())));

    parallel_for(B * H, opt_.threads, [&](Index task, int worker) {
      lsh_detail::HeadJob<T> job = head_job(call, in, task, ws, worker);
      // The head accumulates its rounds in the worker's own rows, then
      // stores them once: accumulating in place, in bucket order, made two
      // workers write neighbouring heads' slices of the same context rows
      // (2 threads ran 7% slower that way at T = 1024).
      T* rows = ws.local(worker, lsh_detail::s_context_rows, count * dv);
      job.context = rows;
      job.context_stride = dv;
      job.row_begin = first, job.row_end = first + count;
      if (probs) job.probs = probs->data() + task * count * T_;
      lsh_detail::attend_head(job, call.L, rules, ws, worker);
      T* out_rows = ctx.data() + (task / H) * count * ctx.cols() + (task % H) * dv;
      for (Index p = 0; p < count; ++p) std::copy_n(rows + p * dv, dv, out_rows + p * ctx.cols());
    });
    ws.even_out_workers();  // the tasks sized their workers' scratch

    if (w_.o.empty())
      out.rows() = ctx;
    else
      project_rows<T>(w_.o, ConstMatrixMap<T>(ctx.data(), ctx.rows(), ctx.cols()), out.rows(), opt_.threads);
  }

  struct Call {
    Index B = 0;
    LshLayout L;
    MatrixMap<T> qk, v;  ///< v: [0, 0] when the call reads no values (buckets())
    const T* rotations;  ///< explicit or seeded-shared [R, dh, NH·NB/2]; null: seeded per head
  };

  // The checks of a call, before any work.
  LshLayout check_call(const AttentionInput<T>& in) const {
    check_input(kName, in, embed_dim(), embed_dim());
    if (!in.self_attention())
      detail::throw_shape(kName, "input.key", "none (LSH attention is self-attention with a shared query/key)",
                          detail::format_shape(in.key.shape()));
    return check_extents(in.query.batch(), in.query.length());
  }

  // Projections and rotations, shared by forward() and buckets() (which
  // hashes only: no values).
  Call prepare(const AttentionInput<T>& in, const LshLayout& L, Workspace<T>& ws, bool values) const {
    const Index B = in.query.batch(), T_ = L.length, H = num_heads(), dh = head_dim(), dv = v_head_dim();
    const T* rotations = nullptr;
    if (!w_.rotations.shape().empty()) {
      rotations = w_.rotations.data();
    } else if (!opt_.rotations_per_head) {  // one shared rotation, drawn once per call
      const Index count = dh * L.rotation_width();
      T* buf = ws.shared(slot::variant, count);
      lsh_rotation<T>(opt_.seed, 0, count, buf);
      rotations = buf;
    }
    MatrixMap<T> qk = ws.shared_matrix(slot::query, B * T_, H * dh);
    MatrixMap<T> v = ws.shared_matrix(slot::value, values ? B * T_ : 0, values ? H * dv : 0);
    project_rows<T>(w_.qk, in.query.rows(), qk, opt_.threads);
    if (values) project_rows<T>(w_.v, in.query.rows(), v, opt_.threads);
    ws.reserve_workers(opt_.threads);
    return {B, L, qk, v, rotations};
  }

  // Where task (b, h)'s inputs are: copies its qk rows (and v rows, when the
  // call has values) and fills its pad rows in the worker's scratch and, for
  // seeded per-head rotations, its rotation.
  lsh_detail::HeadJob<T> head_job(const Call& call, const AttentionInput<T>& in, Index task, Workspace<T>& ws,
                                  int worker) const {
    const Index H = num_heads(), dh = head_dim(), dv = v_head_dim(), T_ = call.L.length;
    const Index b = task / H, h = task % H, per = dh * call.L.rotation_width();
    lsh_detail::HeadJob<T> job;
    job.head_dim = dh;
    job.value_dim = dv;
    // The head's rows, contiguous in the worker's scratch: the chunk loop
    // reads every row once per round in bucket order, which in the shared
    // [T, H · dh] matrices is one scattered cache line per row.
    const T* qk_rows = call.qk.data() + b * T_ * call.qk.cols() + h * dh;
    T* qk = ws.local(worker, lsh_detail::s_qk_rows, T_ * dh);
    for (Index p = 0; p < T_; ++p) std::copy_n(qk_rows + p * call.qk.cols(), dh, qk + p * dh);
    job.qk = qk, job.qk_stride = dh;
    if (call.v.size() > 0) {
      const T* from = call.v.data() + b * T_ * call.v.cols() + h * dv;
      T* v = ws.local(worker, lsh_detail::s_v_rows, T_ * dv);
      for (Index p = 0; p < T_; ++p) std::copy_n(from + p * call.v.cols(), dv, v + p * dv);
      job.v = v, job.v_stride = dv;
    }
    T* pad = ws.local(worker, lsh_detail::s_pad_rows, dh + dv);  // x = 0 gives the bias, or 0
    for (Index e = 0; e < dh; ++e) pad[e] = w_.qk.has_bias() ? w_.qk.bias(h * dh + e) : T(0);
    for (Index e = 0; e < dv; ++e) pad[dh + e] = w_.v.has_bias() ? w_.v.bias(h * dv + e) : T(0);
    job.qk_pad = pad;
    job.v_pad = pad + dh;
    const Index rho = opt_.rotations_per_head ? b * rotation_heads() + opt_.rotation_head_offset + h : 0;
    if (call.rotations) {
      job.rotation = call.rotations + rho * per;
    } else {
      T* rot = ws.local(worker, lsh_detail::s_rotation, per);
      lsh_rotation<T>(opt_.seed, rho, per, rot);
      job.rotation = rot;
    }
    job.padding = in.key_padding.empty() ? nullptr : in.key_padding.item(b);
    return job;
  }

  void validate(const LshOptions& opt) const {
    check_value(opt.num_heads >= 1, kName, "num_heads", ">= 1", opt.num_heads);
    check_value(opt.bucket_size >= 1, kName, "bucket_size", ">= 1", opt.bucket_size);
    check_value(opt.n_hashes >= 1, kName, "n_hashes", ">= 1", opt.n_hashes);
    check_value(opt.n_buckets == 0 || (opt.n_buckets >= 2 && opt.n_buckets % 2 == 0), kName, "n_buckets",
                "0 (padded length / bucket_size) or an even number >= 2", opt.n_buckets);
    check_value(opt.threads >= 1, kName, "threads", ">= 1", opt.threads);
    check_value(opt.rotation_heads >= 0, kName, "rotation_heads", ">= 0 (0: num_heads)", opt.rotation_heads);
    check_value(opt.rotation_head_offset >= 0 &&
                    opt.rotation_head_offset + opt.num_heads <= (opt.rotation_heads > 0 ? opt.rotation_heads : opt.num_heads),
                kName, "rotation_head_offset",
                ">= 0 with rotation_head_offset + num_heads <= rotation_heads (0 without rotation_heads)",
                opt.rotation_head_offset);
    if (opt.scale && !(std::isfinite(*opt.scale) && *opt.scale > 0))
      detail::throw_shape(kName, "scale", "a finite number > 0", std::to_string(*opt.scale));
    const Index H = opt.num_heads, hdk = w_.qk.out_features(), hdv = w_.v.out_features();
    if (hdk == 0 || hdk % H != 0)
      detail::throw_shape(kName, "qk.weight", "[num_heads * head_dim, D] with num_heads = " + std::to_string(H),
                          detail::format_shape(shape_of(w_.qk.weight)));
    check_value(embed_dim() >= 1, kName, "qk.weight columns (D)", ">= 1", embed_dim());
    w_.qk.check(kName, "qk", hdk, embed_dim());
    if (hdv == 0 || hdv % H != 0)
      detail::throw_shape(kName, "v.weight", "[num_heads * v_head_dim, D] with num_heads = " + std::to_string(H),
                          detail::format_shape(shape_of(w_.v.weight)));
    w_.v.check(kName, "v", hdv, embed_dim());
    w_.o.check_optional(kName, "o", hdv);
    if (!w_.rotations.shape().empty()) {  // what is known before the call's B and T
      const Index half = opt.n_buckets > 0 ? opt.n_buckets / 2 : -1;
      check_shape(kName, "rotations", {opt.rotations_per_head ? -1 : 1, hdk / H, opt.n_hashes, half},
                  w_.rotations.shape());
    }
  }

  LshWeights<T> w_;
  LshOptions opt_;
};

}  // namespace headmix
