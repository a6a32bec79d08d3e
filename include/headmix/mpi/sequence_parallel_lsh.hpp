// Sequence-parallel LSH attention over MPI: the query rows of a
// self-attention sequence split across the P ranks of a communicator.
//
// LSH's buckets sort the whole sequence, so a row's keys depend on every
// position's hash: no rank can pick its keys from its own rows. Hence:
//  - rank r holds the contiguous positions [r·T/P, (r+1)·T/P)
//    (SequenceSplit without causal: every LSH query attends to 2·bs slots
//    per round, causal or not, so contiguous shards are balanced);
//  - one MPI_Allgather of the shards (padded to the longest, B · max_rows ·
//    D values per rank) gives every rank the whole sequence x [B, T, D];
//  - replicated on every rank: the weights, the qk and v projections of all
//    T positions, the padding to Tp (the whole sequence's: T rounded up to
//    2·bucket_size), and the hashing and sorting of every position in
//    every round. Per head and sequence that is T·D·(dh + dv) +
//    Tp·dh·(1 + NH·NB/2) multiply-adds against NH·Tp·2bs·(dh + dv) for the
//    attention, which is split. Not small: at D = 1024, H = 16, dh = dv =
//    64, bs = 64, NH = 8, T = 4096 it is 604 M against 537 M, so P ranks
//    take at best (604 + 537/P) / 1141 of one process's time (0.76 at
//    P = 2). Gathering projected qk and v instead of x would split the
//    projections for 2·H·dh/D times the bytes; not done;
//  - sharded: the attention (each chunk tile's rows of the rank's queries
//    only, every lsh.md mask as one process applies it, then the
//    logsumexp combination over the rounds) and the output projection of
//    the rank's rows: Lsh::forward_rows. The last rank also computes the
//    autopad query rows, as one process does (and discards them), so the
//    ranks' tile rows add up to exactly one process's.
// A rank's rows do one process's per-row arithmetic; only a chunk's score
// and readout GEMMs span fewer rows (its rows in this rank's range), which
// may change the last bits (see the tests for what is measured).
//
// A call: every rank passes its shard [B, rows(r), D], the full length T
// and, optionally, the key padding [B, T] of the whole sequence (the same
// on every rank); it gets its rows [B, rows(r), out_dim] of the output.
// The ranks first agree (Communicator::agree) that every shard, buffer and
// the rotations fit and that all passed the same B, T and padding request,
// so a bad input on one rank is the same error on every rank and no rank
// waits in the gather. A rank with no rows (T < P) still takes part.
// Asked for the dense weights (`probs`, on every rank or on none), every
// rank gets the whole [B, H, T, T], the one-process layer's: each rank's
// rows come from forward_rows, and one more MPI_Allgather (B · H ·
// max_rows · T values per rank) gives every rank all rows.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/mpi/communicator.hpp"
#include "headmix/mpi/sequence_parallel.hpp"
#include "headmix/variants/lsh.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace headmix::mpi {

template <class T>
class SequenceParallelLsh {
 public:
  using Local = Lsh<T>;
  using Options = LshOptions;
  /// Values the per-call agreement compares (batch, length, padding, probs).
  static constexpr std::size_t kAgreed = 4;
  static constexpr const char* kName = "sequence-parallel lsh";

  /// Every rank passes the same full weights and options and keeps the
  /// whole layer. An error on any rank throws on every rank.
  SequenceParallelLsh(LshWeights<T> weights, const LshOptions& options, Communicator comm)
      : SequenceParallelLsh(build(std::move(comm), [&] { return Local(std::move(weights), options); })) {}

  /// Load the whole layer on every rank (Lsh::from_tensors). A missing or
  /// misshapen tensor on any rank throws on every rank.
  template <class Source>
  static SequenceParallelLsh from_tensors(const Source& tensors, const std::string& prefix, const LshOptions& options,
                                          Communicator comm) {
    return build(std::move(comm), [&] { return Local::from_tensors(tensors, prefix, options); });
  }

  /// The split of a length-T sequence over this communicator's ranks:
  /// contiguous, causal or not.
  SequenceSplit split(Index length) const { return SequenceSplit(length, comm_.size(), false); }

  Index embed_dim() const { return local_.embed_dim(); }
  Index out_dim() const { return local_.out_dim(); }
  const LshOptions& options() const { return local_.options(); }
  /// The whole layer, as every rank holds it.
  const Local& local() const { return local_; }
  const Communicator& communicator() const { return comm_; }
  Communicator& communicator() { return comm_; }

  /// Self-attention over a sequence of `length` positions split as
  /// split(length) says: `in.query` is this rank's shard [B, rows(rank), D]
  /// (in.key empty), `in.key_padding` is empty or [B, length] over the whole
  /// sequence, the same on every rank; `out` [B, rows(rank), out_dim] gets
  /// this rank's rows of the output. With `probs` (on every rank or on
  /// none), every rank gets the whole sequence's dense weights [B, H, T, T]
  /// (probs_comm_bytes more traffic).
  void forward(const AttentionInput<T>& in, Index length, BatchView<T> out, Workspace<T>& ws,
               Tensor<T>* probs = nullptr) const {
    const Index B = in.query.batch();
    std::optional<SequenceSplit> split;
    comm_.agree(kName, [&] { split.emplace(check_call(in, length, out)); },
                {{"batch", B},
                 {"sequence length", length},
                 {"key padding", !in.key_padding.empty()},
                 {"probs", probs != nullptr}});
    ws.shared(kLastSlot, 0);  // the slot list is as long as it gets: the local layer's slots never move ours
    const ConstBatchView<T> x = split->gather(comm_, in.query, embed_dim(), ws, kSendSlot);
    const SequenceSplit::Chunk rows = split->chunks(comm_.rank()).front();
    Tensor<T> mine, part;  // with probs: this rank's rows of the weights (zeros), forward_rows'
    if (probs) mine.resize({B, local_.num_heads(), split->max_rows(), length});
    if (rows.length > 0) {
      local_.forward_rows(AttentionInput<T>{x, {}, in.key_padding}, rows.start, rows.length, out, ws,
                          probs ? &part : nullptr);
      if (probs) SequenceSplit::put_weights(part, 0, 0, mine);
    }
    if (probs) split->gather_weights(comm_, mine, *probs);
  }
  /// Allocating form: returns this rank's [B, rows(rank), out_dim].
  Tensor<T> forward(const AttentionInput<T>& in, Index length, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    Tensor<T> out({in.query.batch(), length >= 1 ? split(length).rows(comm_.rank()) : 0, out_dim()});
    forward(in, length, out.batch(), ws, probs);
    return out;
  }

  /// Multiply-adds this process does in one call on B sequences of length
  /// T: the replicated projections and hashing of all T positions, its
  /// rows' attention and output projection (Lsh::flops_rows); nothing on a
  /// rank without rows.
  FlopCount flops(Index B, Index length) const {
    const SequenceSplit::Chunk mine = split(length).chunks(comm_.rank()).front();
    return local_.flops_rows(B, length, mine.start, mine.length);
  }

  /// Bytes each rank hands to MPI per forward over B sequences of `length`
  /// without probs: the agreement, then its padded shard, B · max_rows · D
  /// values. Communicator::bytes() counts the same.
  std::uint64_t comm_bytes(Index B, Index length) const {
    return Communicator::agreement_bytes(kAgreed) +
           static_cast<std::uint64_t>(B * split(length).max_rows() * embed_dim()) * sizeof(T);
  }
  /// What asking for probs adds to comm_bytes: this rank's rows of the
  /// weights, padded to max_rows, B · H · max_rows · T values.
  std::uint64_t probs_comm_bytes(Index B, Index length) const {
    return static_cast<std::uint64_t>(B * local_.num_heads() * split(length).max_rows() * length) * sizeof(T);
  }

 private:
  // Scratch slots past every variant's own (and clear of SequenceParallel's
  // and HeadParallel's, should one workspace serve several layers).
  enum : std::size_t { kSendSlot = slot::variant + 32, kGatherSlot, kSequenceSlot, kLastSlot = kSequenceSlot };

  SequenceParallelLsh(Communicator comm, Local local) : comm_(std::move(comm)), local_(std::move(local)) {}

  template <class Load>
  static SequenceParallelLsh build(Communicator comm, Load&& load) {
    std::optional<Local> local;
    comm.agree(kName, [&] { local.emplace(load()); });
    return SequenceParallelLsh(std::move(comm), std::move(*local));
  }

  // This rank's part of the agreement: the shard, padding and output
  // shapes, and what the local layer checks of (B, length) alone.
  SequenceSplit check_call(const AttentionInput<T>& in, Index length, const BatchView<T>& out) const {
    check_value(length >= 1, kName, "length", ">= 1 (the whole sequence's)", length);
    const SequenceSplit s = split(length);
    const Index B = in.query.batch(), rows = s.rows(comm_.rank()), D = embed_dim();
    if (!in.self_attention())
      detail::throw_shape(kName, "input.key", "none (the keys are the gathered shards)",
                          detail::format_shape(in.key.shape()));
    const std::string expected = detail::format_shape({B, rows, D}) + " with B >= 1 (this rank's " +
                                 std::to_string(rows) + " of " + std::to_string(length) + " positions)";
    if (B < 1 || in.query.length() != rows || in.query.width() != D || (rows > 0 && in.query.data() == nullptr))
      detail::throw_shape(kName, "input.query", expected,
                          in.query.data() || rows == 0 ? detail::format_shape(in.query.shape()) : "no data");
    if (!in.key_padding.empty())
      check_shape(kName, "input.key_padding_mask (the whole sequence's)", {B, length},
                  {in.key_padding.batch, in.key_padding.keys});
    if (rows > 0 || out.data() != nullptr) check_output(kName, out, B, rows, out_dim());
    local_.check_extents(B, length);
    return s;
  }


  Communicator comm_;
  Local local_;
};

}  // namespace headmix::mpi
