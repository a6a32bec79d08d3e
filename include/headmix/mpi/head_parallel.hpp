// Head-parallel layers over MPI (Megatron-style tensor parallelism), written
// once for every variant whose heads, or head groups, run independently of
// the other ranks' heads: HeadParallel<Mha, T> (head_parallel_mha.hpp),
// HeadParallel<Dcmha, T> (head_parallel_dcmha.hpp), HeadParallel<CollabHead, T>
// (head_parallel_collab.hpp) and HeadParallel<Lsh, T> (head_parallel_lsh.hpp).
//
// Rank r of P holds heads [r·H/P, (r+1)·H/P) and KV heads
// [r·Hkv/P, (r+1)·Hkv/P): with contiguous KV groups these are exactly the KV
// heads its query heads read. It keeps those rows of q, k and v, the
// matching H/P·Dv columns of o without o's bias, and the variant's own
// per-head weights (HeadShard<Layer> says which), as an ordinary one-process
// layer over H/P heads. A call runs that local layer into the output, sums
// the P partial outputs with one in-place MPI_Allreduce (o is row-parallel:
// Y = Σ_r C_r W_o,rᵀ) and adds o's bias once. Without an o the output is the
// concatenated heads, gathered with one MPI_Allgather instead. A variant
// whose output ends in a row-wise step over the summed output (CollabHead's
// LayerNorm(Xq + y)) runs it after the sum, replicated (HeadShard::epilogue).
//
// Replicated on every rank: the input, the output, o's bias. Sharded: the
// weights above, the attention work and the decoding cache. Every rank
// passes the same input and gets the full output; or, with forward_scatter,
// only its rows of every sequence (RowSplit: contiguous, as SequenceSplit
// without causal), the sum then one MPI_Reduce_scatter instead of an
// all-reduce (about half the traffic of a ring all-reduce).
//
// Collectives per call. forward (and forward_scatter, and a step on an
// empty cache, which binds it): first the ranks agree (Communicator::agree,
// 56 or 72 bytes) that every rank's local part succeeded and that all
// passed the same batch, lengths and probs request, then the data
// collective: two collectives, the first latency only. A step on a
// non-empty cache is ONE collective: the batch was agreed when the cache
// was bound, so each rank appends its status (failed or not, its cached
// positions and probs request: Communicator::write_status) to the summed
// buffer, and every rank throws the same error after the sum if any failed
// or they differ (without o, that sum is over a zeroed full-width buffer
// holding each rank's heads, not a gather). Asking for probs adds their
// gather. Either way a bad input on one rank throws on every rank and
// leaves no rank waiting; what the in-band step cannot check is the number
// of new positions, which sizes its collective: every rank must pass the
// same x length, as it passes the same tokens.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/mpi/communicator.hpp"

#include <climits>
#include <cstdint>
#include <exception>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace headmix::mpi {

/// A contiguous split of `length` rows over `processes` ranks: rank r holds
/// rows [first(r), first(r + 1)), first(r) = r·length/P, so counts differ by
/// at most one and are 0 for some ranks when length < P. The rows
/// SequenceSplit gives without causal.
struct RowSplit {
  Index length = 0;
  int processes = 1;
  Index first(int rank) const { return rank * length / processes; }
  Index rows(int rank) const { return first(rank + 1) - first(rank); }
};

/// How a variant splits over ranks, specialised per variant: `kName`,
/// `Options`, `check_split(options, P)` (the counts that must divide by P),
/// `local_options(options, rank, P)` (optionally also `local_options(options,
/// rank, P, local)` for options whose defaults depend on the weights),
/// `same_split(current, next)` (set_options may not move heads between
/// ranks), `slice(full, options, rank, P)`, which returns this rank's layer
/// with its o columns and no o bias, and `kSplit`, the same split by tensor
/// name for from_tensors (SplitTensor; tensors it does not list are read
/// whole). Optionally `epilogue(full)`: an object with `empty()` and
/// `apply(xq, y, out, threads)` (out ← f(xq, y) row by row, y scratch) run
/// on the summed output, replicated; then also `read_epilogue(tensors,
/// prefix, local, P, extra...)` for from_tensors, reading its tensors
/// (`kAfterSum`, hidden from the local layer) whole.
template <template <class> class Layer, class T>
struct HeadShard;

/// A checkpoint tensor that head-parallel layers split: rank r of P reads
/// entries [r·n/P, (r+1)·n/P) along `axis`, n being its extent there.
struct SplitTensor {
  const char* name;  ///< relative to the layer's prefix
  std::size_t axis;
};

namespace detail {

/// The tensors a shard reads whole after the sum (Shard::kAfterSum, e.g.
/// CollabHead's LayerNorm), hidden from its local layer; none by default.
template <class Shard, class = void>
struct after_sum_tensors {
  static constexpr const char* const* names = nullptr;
  static constexpr std::size_t count = 0;
};
template <class Shard>
struct after_sum_tensors<Shard, std::void_t<decltype(Shard::kAfterSum)>> {
  static constexpr const char* const* names = Shard::kAfterSum;
  static constexpr std::size_t count = std::size(Shard::kAfterSum);
};

/// A FULL checkpoint seen as one rank's shard, for Local::from_tensors: the
/// tensors of Shard::kSplit are read sliced (AxisSlice), those of
/// Shard::kAfterSum are hidden, the others read whole. The source needs
/// what io::TensorFile and io::SafetensorsReader have: contains,
/// shape(name), matrix / vector / get<T>(name[, AxisSlice]) and the
/// `tensors` map (so stray names are still refused). A split tensor whose
/// extent is not a multiple of P is a shape_error (the caller then lets the
/// one-process checks name it).
template <class Shard, class Source>
class ShardSource {
 public:
  ShardSource(const Source& full, std::string prefix, int rank, int P)
      : tensors(full.tensors), full_(full), prefix_(std::move(prefix)), rank_(rank), P_(P) {}

  const decltype(std::declval<const Source&>().tensors)& tensors;

  bool contains(const std::string& name) const {
    const std::string_view rest = relative(name);
    for (std::size_t i = 0; i < after_sum_tensors<Shard>::count; ++i)
      if (rest == after_sum_tensors<Shard>::names[i]) return false;
    return full_.contains(name);
  }
  template <class T>
  Matrix<T> matrix(const std::string& name) const {
    const auto part = part_of(name);
    return part ? full_.template matrix<T>(name, *part) : full_.template matrix<T>(name);
  }
  template <class T>
  Vector<T> vector(const std::string& name) const {
    const auto part = part_of(name);
    return part ? full_.template vector<T>(name, *part) : full_.template vector<T>(name);
  }
  template <class T>
  Tensor<T> get(const std::string& name) const {
    const auto part = part_of(name);
    return part ? full_.template get<T>(name, *part) : full_.template get<T>(name);
  }

 private:
  // `name` past the prefix ("" for names outside it).
  std::string_view relative(const std::string& name) const {
    if (name.compare(0, prefix_.size(), prefix_) != 0) return {};
    return std::string_view(name).substr(prefix_.size());
  }

  std::optional<AxisSlice> part_of(const std::string& name) const {
    const std::string_view rest = relative(name);
    for (const SplitTensor& split : Shard::kSplit) {
      if (rest != split.name) continue;
      const std::vector<Index>& shape = full_.shape(name);
      const std::size_t axis = split.axis;
      if (axis >= shape.size() || shape[axis] % P_ != 0)
        headmix::detail::throw_shape(
            "io", name, "axis " + std::to_string(axis) + " a multiple of the process count " + std::to_string(P_),
            headmix::detail::format_shape(shape));
      const Index n = shape[axis] / P_;
      return AxisSlice{axis, rank_ * n, n};
    }
    return std::nullopt;
  }

  const Source& full_;
  std::string prefix_;
  int rank_, P_;
};

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
                                std::void_t<decltype(Shard::local_options(std::declval<const Options&>(), 0, 1,
                                                                          std::declval<const Local&>()))>>
    : std::true_type {};

/// The options of rank `rank`'s layer `local` for all-head `options`.
template <class Shard, class Options, class Local>
Options settled_local_options(const Options& options, int rank, int P, const Local& local) {
  if constexpr (local_options_take_layer<Shard, Options, Local>::value)
    return Shard::local_options(options, rank, P, local);
  else
    return Shard::local_options(options, rank, P);
}

/// No step after the sum (every variant but CollabHead with a LayerNorm).
struct NoEpilogue {
  bool empty() const { return true; }
  template <class T>
  void apply(const ConstMatrixMap<T>&, MatrixMap<T>&, MatrixMap<T>, int) const {}
};
template <class Shard, class Local, class = void>
struct epilogue_of {
  using type = NoEpilogue;
  static type from(const Local&) { return {}; }
  template <class Source, class... Extra>
  static type read(const Source&, const std::string&, const Local&, int, Extra&&...) {
    return {};
  }
};
template <class Shard, class Local>
struct epilogue_of<Shard, Local, std::void_t<decltype(Shard::epilogue(std::declval<const Local&>()))>> {
  using type = std::decay_t<decltype(Shard::epilogue(std::declval<const Local&>()))>;
  static type from(const Local& full) { return Shard::epilogue(full); }
  template <class Source, class... Extra>
  static type read(const Source& tensors, const std::string& prefix, const Local& local, int P, Extra&&... extra) {
    return Shard::read_epilogue(tensors, prefix, local, P, std::forward<Extra>(extra)...);
  }
};

}  // namespace detail

template <template <class> class Layer, class T>
class HeadParallel : public LayerForms<HeadParallel<Layer, T>, T> {
  using Shard = HeadShard<Layer, T>;
  using Epilogue = typename detail::epilogue_of<Shard, Layer<T>>::type;

 public:
  using LayerForms<HeadParallel<Layer, T>, T>::forward;
  using LayerForms<HeadParallel<Layer, T>, T>::step;
  using Local = Layer<T>;
  using Options = typename Shard::Options;
  static constexpr const char* kName = Shard::kName;
  /// Values the per-call agreement compares (batch, two lengths, probs);
  /// forward_scatter's has no probs, an in-band step's are the cached
  /// positions and probs.
  static constexpr std::size_t kAgreed = 4, kScatterAgreed = 3, kStepAgreed = 2;

  /// Shard full weights: every rank passes the same weights and options
  /// (for all heads, as for the one-process layer) and keeps its slice.
  /// Shapes are checked as the one-process layer checks them, plus the
  /// counts that must divide by comm.size(); an error on any rank throws on
  /// every rank.
  template <class Weights>
  HeadParallel(Weights weights, const Options& options, Communicator comm)
      : HeadParallel(build(std::move(comm), options, [&] { return Local(std::move(weights), options); })) {}

  /// Build this rank's shard from a FULL checkpoint, with the one-process
  /// layer's from_tensors names: each rank reads only its own rows and
  /// columns of the split tensors (Shard::kSplit) and the replicated ones
  /// whole, so with an io::SafetensorsReader a rank never holds more of the
  /// file than its shard (an io::TensorFile already holds all of it). A
  /// shape the shard's checks refuse is re-checked as one process would, so
  /// the shape_error (on every rank) is the one-process layer's.
  /// `extra` goes to Local::from_tensors (CollabHead's layer_norm_eps).
  template <class Source, class... Extra>
  static HeadParallel from_tensors(const Source& tensors, const std::string& prefix, const Options& options,
                                   Communicator comm, const Extra&... extra) {
    std::optional<Parts> parts;
    comm.agree(kName, [&] {
      const int rank = comm.rank(), P = comm.size();
      Shard::check_split(options, P);
      try {
        const detail::ShardSource<Shard, Source> shard(tensors, prefix, rank, P);
        const Local loaded = Local::from_tensors(shard, prefix, Shard::local_options(options, rank, P), extra...);
        auto weights = loaded.weights();
        Vector<T> o_bias = std::move(weights.o.bias);  // added once, after the sum
        weights.o.bias = Vector<T>();
        const bool has_o = !weights.o.empty();
        const Options local_opt = detail::settled_local_options<Shard>(options, rank, P, loaded);
        parts.emplace(Parts{options, Local(std::move(weights), local_opt), std::move(o_bias), has_o,
                            detail::epilogue_of<Shard, Local>::read(tensors, prefix, loaded, P, extra...)});
      } catch (const shape_error&) {
        // The shard's checks see its own extents: name the problem as the
        // one-process layer does (reading everything, on this error only).
        (void)Local::from_tensors(tensors, prefix, options, extra...);
        throw;
      }
    });
    return HeadParallel(std::move(comm), std::move(*parts));
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
    combine(in.query, partial, out, ws);
    gather_probs(local_probs, probs);
  }

  /// The rows of the output this rank keeps in forward_scatter.
  RowSplit output_split(Index length) const { return {length, comm_.size()}; }

  /// As forward, but `out` [B, output_split(T).rows(rank), out_dim] gets
  /// only this rank's rows [first(rank), first(rank + 1)) of every
  /// sequence: the partial outputs are summed with one MPI_Reduce_scatter
  /// (for a sequence-parallel layer next). o's bias (and CollabHead's
  /// LayerNorm) apply to those rows only. Needs o: the concatenated heads
  /// of a layer without one are not a sum (use forward, which gathers
  /// them). No probs (forward gathers them).
  void forward_scatter(const AttentionInput<T>& in, BatchView<T> out, Workspace<T>& ws) const {
    const Index B = in.query.batch(), T_ = in.query.length(), S = in.keys().length(), W = out_dim();
    const RowSplit split = output_split(T_);
    const int P = comm_.size(), me = comm_.rank();
    BatchView<T> partial;
    comm_.agree(
        kName,
        [&] {
          if (!has_o_)
            headmix::detail::throw_shape(kName, "o",
                                         "an output projection (forward_scatter sums o's row-parallel parts; "
                                         "without o, forward gathers the heads)",
                                         "none");
          if (split.rows(me) > 0)
            check_output(kName, out, B, split.rows(me), W);
          else  // no rows here (T < P): an empty tensor has no buffer
            check_shape(kName, "output", {B, 0, W}, out.shape());
          check_value(B * (split.rows(0) + 1) * W <= INT_MAX, kName, "input.query",
                      "B * (T / P + 1) * out_dim below 2^31 (MPI counts are int)", B * T_ * W);
          partial = {ws.shared(kGatherSlot, B * T_ * W), B, T_, W};
          local_.forward(in, partial, ws);
        },
        {{"batch", B}, {"query length", T_}, {"key length", S}});
    // Rank-major for MPI: rank r's rows of every sequence, back to back
    // (already so for one sequence).
    const T* send = partial.data();
    if (B > 1) {
      T* packed = ws.shared(kPackSlot, B * T_ * W);
      for (int r = 0; r < P; ++r)
        for (Index b = 0; b < B; ++b)
          MatrixMap<T>(packed + (split.first(r) * B + b * split.rows(r)) * W, split.rows(r), W) =
              partial.item(b).middleRows(split.first(r), split.rows(r));
      send = packed;
    }
    for (int r = 0; r < P; ++r) scatter_counts_[static_cast<std::size_t>(r)] = static_cast<int>(B * split.rows(r) * W);
    comm_.reduce_scatter_sum(send, out.data(), scatter_counts_.data());
    if (o_bias_.size() != 0) out.rows().rowwise() += o_bias_.transpose();
    if (epilogue_.empty()) return;
    const Index D = in.query.width(), n = split.rows(me);
    for (Index b = 0; b < B; ++b) {
      MatrixMap<T> y = out.item(b);
      epilogue_.apply(ConstMatrixMap<T>(in.query.item(b).data() + split.first(me) * D, n, D), y, y, threads());
    }
  }
  /// Allocating form: returns [B, output_split(T).rows(rank), out_dim].
  Tensor<T> forward_scatter(const AttentionInput<T>& in, Workspace<T>& ws) const {
    Tensor<T> out({in.query.batch(), output_split(in.query.length()).rows(comm_.rank()), out_dim()});
    forward_scatter(in, out.batch(), ws);
    return out;
  }

  /// As the one-process step, on every rank with the same `x`; each rank's
  /// `cache` holds what its local heads need (1/P of a one-process cache).
  /// On an empty cache (the prompt, which binds it) the ranks agree first,
  /// as forward does; after that a step is one collective (two with
  /// probs), its agreement in-band: every rank must pass the same number of
  /// new positions. If any rank fails, every rank throws and every cache
  /// keeps its size.
  void step(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
            Tensor<T>* probs = nullptr) const {
    const Index past = cache.size();
    if (past > 0) return step_in_band(x, cache, out, ws, probs);
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
    combine(x, partial, out, ws);
    gather_probs(local_probs, probs);
  }

  /// Multiply-adds this process does in one call (its H/P heads); the P
  /// processes' counts add up to the one-process layer's.
  FlopCount flops(Index B, Index T_, Index S) const { return local_.flops(B, T_, S); }

  /// Bytes each rank hands to MPI per forward call, or step on an empty
  /// cache, over B sequences of `length` queries, without probs: the
  /// agreement, then the all-reduce of the [B, length, out_dim] output (or,
  /// without o, the gather of this rank's B·length·H/P·Dv values).
  /// Communicator::bytes() counts the same.
  std::uint64_t comm_bytes(Index B, Index length) const {
    const Index values = has_o_ ? B * length * out_dim() : B * length * local_heads() * v_head_dim();
    return Communicator::agreement_bytes(kAgreed) + static_cast<std::uint64_t>(values) * sizeof(T);
  }
  /// forward_scatter's: the agreement, then the reduce-scatter's send
  /// buffer, the whole [B, length, out_dim] partial output (a ring
  /// reduce-scatter moves about (P-1)/P of it, half an all-reduce's).
  std::uint64_t scatter_comm_bytes(Index B, Index length) const {
    return Communicator::agreement_bytes(kScatterAgreed) + static_cast<std::uint64_t>(B * length * out_dim()) * sizeof(T);
  }
  /// A step's on a non-empty cache, without probs: one all-reduce of the
  /// full [B, n, out_dim] output (also without o) and the status.
  std::uint64_t step_comm_bytes(Index B, Index n) const {
    return static_cast<std::uint64_t>(B * n * out_dim() + comm_.status_count(kStepAgreed)) * sizeof(T);
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
    Epilogue epilogue;
  };

  HeadParallel(Communicator comm, Parts parts)
      : comm_(std::move(comm)),
        opt_(parts.options),
        local_(std::move(parts.local)),
        o_bias_(std::move(parts.o_bias)),
        has_o_(parts.has_o),
        epilogue_(std::move(parts.epilogue)),
        scatter_counts_(static_cast<std::size_t>(comm_.size())) {}

  // Check the split, load the full layer (which checks its shapes), keep
  // this rank's slice; all inside one agreement.
  template <class Load>
  static HeadParallel build(Communicator comm, const Options& options, Load&& load) {
    std::optional<Parts> parts;
    comm.agree(kName, [&] {
      Shard::check_split(options, comm.size());
      const Local full = load();
      const auto& o = full.weights().o;
      parts.emplace(Parts{options, Shard::slice(full, options, comm.rank(), comm.size()), o.bias, !o.empty(),
                          detail::epilogue_of<Shard, Local>::from(full)});
    });
    return HeadParallel(std::move(comm), std::move(*parts));
  }

  // The local layer's options for all-head `options`.
  Options local_options(const Options& options) const {
    return detail::settled_local_options<Shard>(options, comm_.rank(), comm_.size(), local_);
  }

  int threads() const { return local_.options().threads; }
  Index partial_width() const { return has_o_ ? out_dim() : local_heads() * v_head_dim(); }

  // Where the local heads write: the output itself when o sums into it and
  // nothing follows the sum, else Workspace scratch for [B, T, out_dim]
  // partial sums or this rank's [B, T, H/P·Dv] columns (slots past every
  // variant's own, so they never alias the local layer's).
  BatchView<T> partial_output(BatchView<T> out, Workspace<T>& ws, Index B, Index T_) const {
    if (has_o_ && epilogue_.empty()) return out;
    return {ws.shared(kGatherSlot, B * T_ * partial_width()), B, T_, partial_width()};
  }
  static constexpr std::size_t kGatherSlot = slot::variant + 16, kPackSlot = slot::variant + 17,
                               kSummedSlot = slot::variant + 18;

  // The call's data collective, then o's bias and the epilogue (on `x`'s
  // rows): the same on every rank, after the agreement.
  void combine(ConstBatchView<T> x, BatchView<T> partial, BatchView<T> out, Workspace<T>& ws) const {
    BatchView<T> summed = partial;  // [B, T, out_dim] once summed or gathered
    if (has_o_) {
      comm_.all_reduce_sum(partial.data(), partial.rows().size());
    } else {
      if (!epilogue_.empty()) summed = {ws.shared(kSummedSlot, out.rows().size()), out.batch(), out.length(), out.width()};
      else summed = out;
      comm_.all_gather_blocks(partial.data(), partial.batch() * partial.length(), partial.width(), 1, summed.data());
    }
    finish(x, summed, out);
  }

  // o's bias on the summed output, then the epilogue (or a copy) into `out`.
  void finish(ConstBatchView<T> x, BatchView<T> summed, BatchView<T> out) const {
    MatrixMap<T> y = summed.rows();
    if (o_bias_.size() != 0) y.rowwise() += o_bias_.transpose();
    if (!epilogue_.empty())
      epilogue_.apply(x.rows(), y, out.rows(), threads());
    else if (summed.data() != out.data())
      out.rows() = y;
  }

  // A step on a bound cache: the local step, then one all-reduce of the
  // full-width output with every rank's status appended (without o, each
  // rank writes its heads' columns into a zeroed buffer).
  void step_in_band(ConstBatchView<T> x, SequenceCache<T>& cache, BatchView<T> out, Workspace<T>& ws,
                    Tensor<T>* probs) const {
    // Sized from what every rank shares: the batch agreed when the caches
    // were bound and the new positions, which every rank must pass alike.
    const Index past = cache.size(), B = cache.batch(), n = x.length(), W = out_dim(), data = B * n * W;
    T* buffer = ws.shared(kSummedSlot, data + comm_.status_count(kStepAgreed));
    Tensor<T> local_probs;
    std::exception_ptr failure;
    try {
      check_shape(kName, "input batch", {B}, {x.batch()});  // the cache's (the buffer is sized from it)
      check_output(kName, out, B, n, W);
      if (has_o_) {
        local_.step(x, cache, BatchView<T>(buffer, B, n, W), ws, probs ? &local_probs : nullptr);
      } else {
        const Index width = partial_width();
        BatchView<T> mine(ws.shared(kGatherSlot, B * n * width), B, n, width);
        local_.step(x, cache, mine, ws, probs ? &local_probs : nullptr);
        MatrixMap<T> full(buffer, B * n, W);
        full.setZero();
        full.middleCols(comm_.rank() * width, width) = mine.rows();
      }
    } catch (...) {
      failure = std::current_exception();
      std::fill_n(buffer, data, T(0));
    }
    const std::initializer_list<Agreed> agreed{{"cached positions", past}, {"probs", probs != nullptr}};
    comm_.write_status(buffer + data, failure != nullptr, agreed);
    comm_.all_reduce_sum(buffer, data + comm_.status_count(kStepAgreed));
    try {
      comm_.check_status(kName, buffer + data, failure, agreed);
    } catch (...) {
      cache.truncate(past);  // as in step(): every cache keeps its size
      throw;
    }
    finish(x, BatchView<T>(buffer, B, n, W), out);
    gather_probs(local_probs, probs);
  }

  // The probs gather, after the data collective, when every rank asked.
  void gather_probs(const Tensor<T>& local_probs, Tensor<T>* probs) const {
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
  Epilogue epilogue_;
  // forward_scatter's per-rank element counts, sized once (one call at a
  // time uses a layer, as its Communicator).
  mutable std::vector<int> scatter_counts_;
};

}  // namespace headmix::mpi
