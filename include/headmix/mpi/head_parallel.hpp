// Head-parallel layers over MPI (Megatron-style tensor parallelism), written
// once for every variant whose heads, or head groups, run independently of
// the other ranks' heads: HeadParallel<Mha, T> (head_parallel_mha.hpp) and
// HeadParallel<Dcmha, T> (head_parallel_dcmha.hpp).
//
// Rank r of P holds heads [r·H/P, (r+1)·H/P) and KV heads
// [r·Hkv/P, (r+1)·Hkv/P): with contiguous KV groups these are exactly the KV
// heads its query heads read. It keeps those rows of q, k and v, the
// matching H/P·Dv columns of o without o's bias, and the variant's own
// per-head weights (HeadShard<Layer> says which), as an ordinary one-process
// layer over H/P heads. A call runs that local layer into the output, sums
// the P partial outputs with one in-place MPI_Allreduce (o is row-parallel:
// Y = Σ_r C_r W_o,rᵀ) and adds o's bias once. Without an o the output is the
// concatenated heads, gathered with one MPI_Allgather instead.
//
// Replicated on every rank: the input, the output, o's bias. Sharded: the
// weights above, the attention work and the decoding cache. Every rank
// passes the same input and gets the full output.
//
// Per call, before the data collective, the ranks agree (Communicator::agree,
// 72 bytes) that every rank's local part succeeded and that all passed the
// same batch, lengths and probs request: a bad input on one rank throws on
// every rank and leaves no rank waiting. So a call is two collectives: the
// agreement (latency only) and the data.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/mpi/communicator.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace headmix::mpi {

/// How a variant splits over ranks, specialised per variant: `kName`,
/// `Options`, `check_split(options, P)` (the counts that must divide by P),
/// `local_options(options, P)` (or `local_options(options, P, local)`),
/// `same_split(current, next)` (set_options may not move heads between
/// ranks) and `slice(full, options, rank, P)`, which returns this rank's
/// layer with its o columns and no o bias.
template <template <class> class Layer, class T>
struct HeadShard;

namespace detail {

inline Index kv_heads_of(Index heads, Index kv_heads) { return kv_heads > 0 ? kv_heads : heads; }

/// `count` (an option named `name`) must be a multiple of P; counts below
/// 1 are left to the layer's own checks.
inline void check_multiple(const char* variant, const char* name, Index count, int P, const char* why = "") {
  check_value(count < 1 || count % P == 0, variant, name,
              "a multiple of the process count " + std::to_string(P) + why, count);
}

/// Rows [first, first + n) of a Linear, with its bias.
template <class T>
Linear<T> linear_rows(const Linear<T>& lin, Index first, Index n) {
  Linear<T> part;
  part.weight = lin.weight.middleRows(first, n);
  if (lin.has_bias()) part.bias = lin.bias.segment(first, n);
  return part;
}

/// Rank r's q, k, v rows and o columns (without o's bias) of heads of
/// `dk`/`dv` columns: `h` query heads and `hkv` KV heads per rank.
template <class Weights>
void slice_projections(const Weights& full, Weights& local, Index rank, Index h, Index hkv, Index dk, Index dv) {
  local.q = linear_rows(full.q, rank * h * dk, h * dk);
  local.k = linear_rows(full.k, rank * hkv * dk, hkv * dk);
  local.v = linear_rows(full.v, rank * hkv * dv, hkv * dv);
  if (!full.o.empty()) local.o.weight = full.o.weight.middleCols(rank * h * dv, h * dv);  // bias: after the sum
}

/// Whether Shard::local_options also takes the local layer, for options
/// whose defaults depend on its weights (CollabHead's scale, from R and H).
template <class Shard, class Options, class Local, class = void>
struct local_options_take_layer : std::false_type {};
template <class Shard, class Options, class Local>
struct local_options_take_layer<Shard, Options, Local,
                                std::void_t<decltype(Shard::local_options(std::declval<const Options&>(), 1,
                                                                          std::declval<const Local&>()))>>
    : std::true_type {};

}  // namespace detail

template <template <class> class Layer, class T>
class HeadParallel : public LayerForms<HeadParallel<Layer, T>, T> {
  using Shard = HeadShard<Layer, T>;

 public:
  using LayerForms<HeadParallel<Layer, T>, T>::forward;
  using LayerForms<HeadParallel<Layer, T>, T>::step;
  using Local = Layer<T>;
  using Options = typename Shard::Options;
  static constexpr const char* kName = Shard::kName;
  /// Values the per-call agreement compares (batch, two lengths, probs).
  static constexpr std::size_t kAgreed = 4;

  /// Shard full weights: every rank passes the same weights and options
  /// (for all heads, as for the one-process layer) and keeps its slice.
  /// Shapes are checked as the one-process layer checks them, plus the
  /// counts that must divide by comm.size(); an error on any rank throws on
  /// every rank.
  template <class Weights>
  HeadParallel(Weights weights, const Options& options, Communicator comm)
      : HeadParallel(build(std::move(comm), options, [&] { return Local(std::move(weights), options); })) {}

  /// Build this rank's shard from a FULL checkpoint, with the one-process
  /// layer's from_tensors names and checks. Each rank reads the full
  /// tensors through Local::from_tensors and keeps its slices; the rest is
  /// freed before this returns (so loading briefly holds the whole layer).
  template <class Source>
  static HeadParallel from_tensors(const Source& tensors, const std::string& prefix, const Options& options,
                                   Communicator comm) {
    return build(std::move(comm), options, [&] { return Local::from_tensors(tensors, prefix, options); });
  }

  Index num_heads() const { return opt_.num_heads; }
  Index num_kv_heads() const { return detail::kv_heads_of(opt_.num_heads, opt_.num_kv_heads); }
  Index local_heads() const { return local_.num_heads(); }
  Index local_kv_heads() const { return local_.num_kv_heads(); }
  /// This rank's first query head (its first KV head is first_head() / group).
  Index first_head() const { return comm_.rank() * local_heads(); }
  Index head_dim() const { return local_.head_dim(); }
  Index v_head_dim() const { return local_.v_head_dim(); }
  Index embed_dim() const { return local_.embed_dim(); }
  Index out_dim() const { return has_o_ ? local_.out_dim() : num_heads() * v_head_dim(); }
  bool has_output_projection() const { return has_o_; }
  /// The options as given (all heads); local().options() has the local counts.
  const Options& options() const { return opt_; }
  /// This rank's heads as a one-process layer (its o without bias).
  const Local& local() const { return local_; }
  /// The bias added after the sum, the same on every rank (empty: none).
  const Vector<T>& output_bias() const { return o_bias_; }
  const Communicator& communicator() const { return comm_; }
  Communicator& communicator() { return comm_; }

  /// Change masking, blocks or threads on every rank; the split into heads
  /// (and groups) is fixed by the shards. Left unchanged on every rank if
  /// invalid on any.
  void set_options(const Options& options) {
    try {
      comm_.agree(kName, [&] {
        Shard::same_split(opt_, options);
        local_.set_options(local_options(options));
      });
    } catch (...) {
      local_.set_options(local_options(opt_));  // another rank failed after this one changed
      throw;
    }
    opt_ = options;
  }

  /// As the one-process forward, on every rank with the same input; `out`
  /// [B, T, out_dim] is the full output on every rank. With `probs`, every
  /// rank gets all heads' weights [B, H, T, S], gathered (probs_comm_bytes
  /// more traffic, and a temporary for the local heads' weights).
  void forward(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    const Index B = in.query.batch(), T_ = in.query.length(), S = in.keys().length();
    Tensor<T> local_probs;
    BatchView<T> partial;
    comm_.agree(
        kName,
        [&] {
          check_output(kName, out, B, T_, out_dim());
          partial = partial_output(out, ws, B, T_);
          local_.forward(in, partial, ws, probs ? &local_probs : nullptr);
        },
        {{"batch", B}, {"query length", T_}, {"key length", S}, {"probs", probs != nullptr}});
    combine(partial, out, local_probs, probs);
  }

  /// As the one-process step, on every rank with the same `x`; each rank's
  /// `cache` holds what its local heads need (1/P of a one-process cache).
  /// One data collective per step. If any rank fails, every rank throws and
  /// every cache keeps its size.
  void step(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
            Tensor<T>* probs = nullptr) const {
    const Index past = cache.size();
    Tensor<T> local_probs;
    BatchView<T> partial;
    try {
      comm_.agree(
          kName,
          [&] {
            check_output(kName, out, x.batch(), x.length(), out_dim());
            partial = partial_output(out, ws, x.batch(), x.length());
            local_.step(x, cache, partial, ws, probs ? &local_probs : nullptr);
          },
          {{"batch", x.batch()},
           {"new positions", x.length()},
           {"cached positions", past},
           {"probs", probs != nullptr}});
    } catch (...) {
      cache.truncate(past);  // this rank may have stepped while another failed: every cache stays in step
      throw;
    }
    combine(partial, out, local_probs, probs);
  }

  /// Multiply-adds this process does in one call (its H/P heads); the P
  /// processes' counts add up to the one-process layer's.
  FlopCount flops(Index B, Index T_, Index S) const { return local_.flops(B, T_, S); }

  /// Bytes each rank hands to MPI per forward or step call over B sequences
  /// of `length` queries, without probs: the agreement, then the all-reduce
  /// of the [B, length, out_dim] output (or, without o, the gather of this
  /// rank's B·length·H/P·Dv values). Communicator::bytes() counts the same.
  std::uint64_t comm_bytes(Index B, Index length) const {
    const Index values = has_o_ ? B * length * out_dim() : B * length * local_heads() * v_head_dim();
    return Communicator::agreement_bytes(kAgreed) + static_cast<std::uint64_t>(values) * sizeof(T);
  }
  /// What asking for probs adds to comm_bytes: this rank's heads' weights.
  std::uint64_t probs_comm_bytes(Index B, Index length, Index keys) const {
    return static_cast<std::uint64_t>(B * local_heads() * length * keys) * sizeof(T);
  }

 private:
  struct Parts {
    Options options;  // all heads
    Local local;
    Vector<T> o_bias;
    bool has_o;
  };

  HeadParallel(Communicator comm, Parts parts)
      : comm_(std::move(comm)),
        opt_(parts.options),
        local_(std::move(parts.local)),
        o_bias_(std::move(parts.o_bias)),
        has_o_(parts.has_o) {}

  // Check the split, load the full layer (which checks its shapes), keep
  // this rank's slice; all inside one agreement.
  template <class Load>
  static HeadParallel build(Communicator comm, const Options& options, Load&& load) {
    std::optional<Parts> parts;
    comm.agree(kName, [&] {
      Shard::check_split(options, comm.size());
      const Local full = load();
      const auto& o = full.weights().o;
      parts.emplace(Parts{options, Shard::slice(full, options, comm.rank(), comm.size()), o.bias, !o.empty()});
    });
    return HeadParallel(std::move(comm), std::move(*parts));
  }

  // The local layer's options for all-head `options`.
  Options local_options(const Options& options) const {
    if constexpr (detail::local_options_take_layer<Shard, Options, Local>::value)
      return Shard::local_options(options, comm_.size(), local_);
    else
      return Shard::local_options(options, comm_.size());
  }

  // Where the local heads write: the output itself when o sums into it,
  // else Workspace scratch for this rank's [B, T, H/P·Dv] columns (a slot
  // past every variant's own, so it never aliases the local layer's).
  BatchView<T> partial_output(BatchView<T> out, Workspace<T>& ws, Index B, Index T_) const {
    if (has_o_) return out;
    const Index width = local_heads() * v_head_dim();
    return {ws.shared(kGatherSlot, B * T_ * width), B, T_, width};
  }
  static constexpr std::size_t kGatherSlot = slot::variant + 16;

  // The call's data collective (and the probs gather): the same on every
  // rank, after the agreement.
  void combine(BatchView<T> partial, BatchView<T> out, const Tensor<T>& local_probs, Tensor<T>* probs) const {
    if (has_o_) {
      comm_.all_reduce_sum(out.data(), out.rows().size());
      if (o_bias_.size() != 0) out.rows().rowwise() += o_bias_.transpose();
    } else {
      comm_.all_gather_blocks(partial.data(), partial.batch() * partial.length(), partial.width(), 1, out.data());
    }
    if (!probs) return;
    // [B, H/P, T, S] per rank -> [B, H, T, S]: rank r's heads are block r of each batch item.
    const Index B = local_probs.dim(0), h = local_probs.dim(1), T_ = local_probs.dim(2), S = local_probs.dim(3);
    probs->resize({B, h * comm_.size(), T_, S});
    comm_.all_gather_blocks(local_probs.data(), B, h, T_ * S, probs->data());
  }

  Communicator comm_;
  Options opt_;
  Local local_;
  Vector<T> o_bias_;
  bool has_o_;
};

}  // namespace headmix::mpi
