// Sequence-parallel layers over MPI: the query rows of a self-attention
// sequence split across the P ranks of a communicator, the keys gathered.
// One template, SequenceParallel<Layer, T>, for the variants whose forward
// takes the queries and the key sequence separately, with a causal offset:
// MHA (grouped-query included), CollabHead, Talking-Heads and DCMHA (whose
// key-wise dynamic factors come from the gathered key rows), the mixing ones
// among them spanning all heads or head groups, so that splitting the
// sequence, not the heads, is what shards them.
//
// The split (SequenceSplit): without causal, rank r holds the contiguous
// near-equal positions [r·T/P, (r+1)·T/P). With causal, the sequence is cut
// into 2P near-equal chunks and rank r holds chunks r and 2P-1-r, in that
// order (zig-zag): an early chunk sees few keys and a late one many, so
// every rank gets about the same share of the visible pairs (and of the
// keys it projects), where contiguous shards would leave the last rank
// ~(2P-1) times the first's work.
//
// A call: every rank passes its shard [B, rows(r), D] of the sequence, the
// full length T and, optionally, the key padding [B, T] of the whole
// sequence (the same on every rank); it gets its shard [B, rows(r),
// out_dim] of the output. The ranks agree (Communicator::agree) that every
// shard and buffer is right and all passed the same B, T, padding and
// probs requests; then one MPI_Allgather of the shards, padded to the longest
// (B · max_rows · D values per rank), gives every rank the whole sequence,
// which it uses as the key/value input of its local layer:
//  - without causal: one forward, queries = its rows, keys = all T;
//  - with causal: one forward per chunk starting at global position g,
//    with causal_offset g - k0 over the keys [k0, g + n) (k0 = 0, or the
//    window's first key), so the mask is that of the true positions and
//    keys no row of the chunk can see are never projected.
// Asked for the weights (`probs`), every rank gets the whole [B, H, T, T]:
// each rank puts its chunks' weights (over the keys each read) into its
// rows, zeros elsewhere (the keys its rows cannot see: masked, exactly 0
// in one process too), and one more MPI_Allgather (B · H · max_rows · T
// values per rank) gives every rank all rows, put back in global order.
// Each rank projects K and V (DCMHA: and the key-wise factors) of the keys
// it reads itself (T rows without causal; about T(1 + 1/2P) with causal): P
// times the one-process K/V projection work in all. Gathering projected K/V
// instead would save it, but needs a layer entry point that takes projected
// keys, which the variants do not have.
//
// Replicated on every rank: all weights (each rank holds the full layer)
// and the gathered sequence. Sharded: the queries, the output, the
// attention work. Every rank's rows compute the same math as one process;
// only the order of some sums differs (see the tests' tolerance).
//
// Not run by this template: LSH, whose buckets sort the whole sequence: a
// row's keys depend on every other row's hash, so every rank needs the full
// sort. It fails to compile with SequenceParallel, with a message pointing
// to SequenceParallelLsh.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/mask.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/mpi/communicator.hpp"
#include "headmix/variants/collab_head.hpp"
#include "headmix/variants/dcmha.hpp"
#include "headmix/variants/mha.hpp"
#include "headmix/variants/talking_heads.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace headmix {
// Named only to refuse it (below); its header is not needed.
template <class T>
class Lsh;
}  // namespace headmix

namespace headmix::mpi {

/// Which positions of a length-T sequence each of P ranks holds (see the
/// file comment): one contiguous chunk per rank, or with `causal` the
/// zig-zag pair r, 2P-1-r. Chunks differ in length by at most one and may
/// be empty when T < P (or 2P).
class SequenceSplit {
 public:
  struct Chunk {
    Index start = 0, length = 0;  ///< global positions [start, start + length)
  };

  SequenceSplit(Index length, int processes, bool causal) : length_(length), processes_(processes), causal_(causal) {
    check_value(length >= 1, "sequence split", "length", ">= 1", length);
    check_value(processes >= 1, "sequence split", "processes", ">= 1", processes);
  }

  Index length() const { return length_; }
  int processes() const { return processes_; }
  bool causal() const { return causal_; }

  /// Rank r's chunks, in the order its rows hold them (causal: two).
  std::vector<Chunk> chunks(int rank) const {
    const Index cuts = causal_ ? 2 * processes_ : processes_;
    auto chunk = [&](Index c) { return Chunk{bound(c, cuts), bound(c + 1, cuts) - bound(c, cuts)}; };
    if (!causal_) return {chunk(rank)};
    return {chunk(rank), chunk(2 * processes_ - 1 - rank)};
  }
  /// Rows rank r holds.
  Index rows(int rank) const {
    Index n = 0;
    for (const Chunk& c : chunks(rank)) n += c.length;
    return n;
  }
  /// The most rows any rank holds (what the gather sends per sequence).
  Index max_rows() const {
    Index n = 0;
    for (int r = 0; r < processes_; ++r) n = std::max(n, rows(r));
    return n;
  }

  /// Rank r's rows of a full [B, T, W] batch, as its [B, rows(r), W] shard.
  template <class T>
  Tensor<std::remove_const_t<T>> take(BatchView<T> full, int rank) const {
    check_shape("sequence split", "full sequence", {-1, length_, -1}, full.shape());
    Tensor<std::remove_const_t<T>> part({full.batch(), rows(rank), full.width()});
    Index at = 0;
    for (const Chunk& c : chunks(rank)) {
      copy_rows(full, c.start, part.batch(), at, c.length);
      at += c.length;
    }
    return part;
  }
  /// Write rank r's shard [B, rows(r), W] into its rows of `full` [B, T, W].
  template <class S, class T>
  void put(BatchView<S> part, int rank, BatchView<T> full) const {
    check_shape("sequence split", "full sequence", {part.batch(), length_, part.width()}, full.shape());
    check_shape("sequence split", "shard", {full.batch(), rows(rank), full.width()}, part.shape());
    Index at = 0;
    for (const Chunk& c : chunks(rank)) {
      copy_rows(part, at, full, c.start, c.length);
      at += c.length;
    }
  }

  /// Rows [from, from + n) of every sequence of `src` to rows [to, to + n) of `dst`.
  template <class S, class D>
  static void copy_rows(BatchView<S> src, Index from, BatchView<D> dst, Index to, Index n) {
    if (n == 0) return;
    for (Index b = 0; b < src.batch(); ++b) dst.item(b).middleRows(to, n) = src.item(b).middleRows(from, n);
  }

  /// Every rank's shard as an all-gather of shards padded to max_rows
  /// leaves them, `blocks` [N, P · max_rows, W] (rank r's rows from
  /// r · max_rows), to their positions in `full` [N, T, W].
  template <class S, class D>
  void place(BatchView<S> blocks, BatchView<D> full) const {
    const Index n = max_rows();
    for (int r = 0; r < processes_; ++r) {
      Index at = r * n;
      for (const Chunk& c : chunks(r)) {
        copy_rows(blocks, at, full, c.start, c.length);
        at += c.length;
      }
    }
  }

  /// The whole sequence [B, T, width] on every rank from each rank's shard
  /// `mine` [B, rows(rank), width]: one all-gather of the shards padded to
  /// max_rows, then (unless the padded blocks are already in order) place().
  /// Scratch: the Workspace's shared slots first_slot, +1 and +2.
  template <class T>
  ConstBatchView<T> gather(const Communicator& comm, ConstBatchView<T> mine, Index width, Workspace<T>& ws,
                           std::size_t first_slot) const {
    const Index B = mine.batch(), n = max_rows(), P = processes_;
    const BatchView<T> send(ws.shared(first_slot, B * n * width), B, n, width);
    send.rows().setZero();  // the padding rows travel too
    copy_rows(mine, 0, send, 0, mine.length());
    T* blocks = ws.shared(first_slot + 1, B * P * n * width);  // [B, P, n, width]
    comm.all_gather_blocks(send.data(), B, n * width, 1, blocks);
    if (!causal_ && n * P == length_) return {blocks, B, length_, width};
    const BatchView<T> x(ws.shared(first_slot + 2, B * length_ * width), B, length_, width);
    place(BatchView<T>(blocks, B, P * n, width), x);
    return x;
  }

  /// A local forward's weights `part` [B, H, n, keys] into rows [at, at + n)
  /// and columns [first, first + keys) of this rank's rows of the weights,
  /// `mine` [B, H, max_rows, T].
  template <class T>
  static void put_weights(const Tensor<T>& part, Index at, Index first, Tensor<T>& mine) {
    const Index planes = part.dim(0) * part.dim(1), n = part.dim(2), keys = part.dim(3);
    const Index rows = mine.dim(2), width = mine.dim(3);
    for (Index h = 0; h < planes; ++h)
      for (Index i = 0; i < n; ++i)
        std::copy_n(part.data() + (h * n + i) * keys, keys, mine.data() + (h * rows + at + i) * width + first);
  }

  /// Every rank's rows of the attention weights, on every rank: `mine` is
  /// this rank's [B, H, max_rows, T] (its rows in chunk order, then zero
  /// rows); `probs` gets [B, H, T, T], rows in global positions. One
  /// all-gather of B · H · max_rows · T values per rank.
  template <class T>
  void gather_weights(const Communicator& comm, const Tensor<T>& mine, Tensor<T>& probs) const {
    const Index B = mine.dim(0), H = mine.dim(1), n = max_rows(), P = processes_;
    probs.resize({B, H, length_, length_});
    if (!causal_ && n * P == length_) {  // equal contiguous shards: already in order
      comm.all_gather_blocks(mine.data(), B * H, n * length_, 1, probs.data());
      return;
    }
    Tensor<T> blocks({B, H, P * n, length_});
    comm.all_gather_blocks(mine.data(), B * H, n * length_, 1, blocks.data());
    place(ConstBatchView<T>(blocks.data(), B * H, P * n, length_), BatchView<T>(probs.data(), B * H, length_, length_));
  }

 private:
  // Near-equal cuts: chunk c starts at ⌊c·T/cuts⌋.
  Index bound(Index c, Index cuts) const { return c * length_ / cuts; }

  Index length_;
  int processes_;
  bool causal_;
};

/// Layers SequenceParallel runs: those whose forward takes a separate key
/// sequence and a causal offset.
template <template <class> class Layer>
struct SequenceShardable : std::false_type {};
template <>
struct SequenceShardable<Mha> : std::true_type {};
template <>
struct SequenceShardable<CollabHead> : std::true_type {};
template <>
struct SequenceShardable<TalkingHeads> : std::true_type {};
template <>
struct SequenceShardable<Dcmha> : std::true_type {};

template <template <class> class Layer, class T>
class SequenceParallel {
  static_assert(!std::is_same_v<Layer<T>, Lsh<T>>,
                "LSH attention is sequence-parallel as SequenceParallelLsh (headmix/mpi/sequence_parallel_lsh.hpp): "
                "its buckets sort the whole sequence, so every rank hashes and sorts all of it");
  static_assert(SequenceShardable<Layer>::value, "SequenceParallel runs Mha, CollabHead, TalkingHeads and Dcmha");

 public:
  using Local = Layer<T>;
  using Options = std::decay_t<decltype(std::declval<const Local&>().options())>;
  /// Values the per-call agreement compares (batch, length, padding, probs).
  static constexpr std::size_t kAgreed = 4;
  static constexpr const char* kName = "sequence-parallel";

  /// Every rank passes the same full weights and options and keeps the
  /// whole layer. An error on any rank throws on every rank.
  template <class Weights>
  SequenceParallel(Weights weights, const Options& options, Communicator comm)
      : SequenceParallel(build(std::move(comm), options, [&] { return Local(std::move(weights), options); })) {}

  /// Load the whole layer on every rank: Local::from_tensors(tensors,
  /// prefix, options, extra...). A missing or misshapen tensor on any rank
  /// throws on every rank.
  template <class Source, class... Extra>
  static SequenceParallel from_tensors(const Source& tensors, const std::string& prefix, const Options& options,
                                       Communicator comm, Extra&&... extra) {
    return build(std::move(comm), options, [&] { return Local::from_tensors(tensors, prefix, options, extra...); });
  }

  /// The split of a length-T sequence over this communicator's ranks (the
  /// layer's causal option picks contiguous or zig-zag).
  SequenceSplit split(Index length) const { return SequenceSplit(length, comm_.size(), opt_.causal); }

  Index embed_dim() const { return local_.embed_dim(); }
  Index out_dim() const { return local_.out_dim(); }
  const Options& options() const { return opt_; }
  /// The whole layer, as every rank holds it (its causal_offset is the
  /// last chunk's; options() has the caller's).
  const Local& local() const { return local_; }
  const Communicator& communicator() const { return comm_; }
  Communicator& communicator() { return comm_; }

  /// Self-attention over a sequence of `length` positions split as
  /// split(length) says: `in.query` is this rank's shard [B, rows(rank), D]
  /// (in.key empty), `in.key_padding` is empty or [B, length] over the whole
  /// sequence, the same on every rank; `out` [B, rows(rank), out_dim] gets
  /// this rank's rows of the output. A rank with no rows (length < P, or
  /// 2P with causal) still takes part. With `probs` (on every rank or on
  /// none), every rank gets the whole sequence's weights [B, H, T, T] (H:
  /// the heads the local layer's probs have), rows and keys in global
  /// positions, the one-process layer's: each rank's rows are its local
  /// forwards' weights, keys a chunk does not read exactly 0, gathered by
  /// one more all-gather (probs_comm_bytes more).
  void forward(const AttentionInput<T>& in, Index length, BatchView<T> out, Workspace<T>& ws,
               Tensor<T>* probs = nullptr) const {
    const Index B = in.query.batch();
    std::optional<SequenceSplit> split;
    comm_.agree(name(), [&] { split.emplace(check_call(in, length, out)); },
                {{"batch", B},
                 {"sequence length", length},
                 {"key padding", !in.key_padding.empty()},
                 {"probs", probs != nullptr}});
    ws.shared(kLastSlot, 0);  // the slot list is as long as it gets: the local layer's slots never move ours
    const ConstBatchView<T> x = split->gather(comm_, in.query, embed_dim(), ws, kSendSlot);
    Tensor<T> mine, part;  // with probs: this rank's rows of the weights (zeros), one local forward's
    if (probs) mine.resize({B, probs_heads(), split->max_rows(), length});
    Tensor<T>* part_probs = probs ? &part : nullptr;
    if (!opt_.causal) {
      if (split->rows(comm_.rank()) > 0) {
        set_offset(0);
        local_.forward(AttentionInput<T>{in.query, x, in.key_padding}, out, ws, part_probs);
        if (probs) SequenceSplit::put_weights(part, 0, 0, mine);
      }
    } else {
      Index at = 0;
      for (const SequenceSplit::Chunk& c : split->chunks(comm_.rank())) {
        if (c.length > 0) run_chunk(in, x, c, at, out, ws, part_probs, mine);
        at += c.length;
      }
    }
    if (probs) split->gather_weights(comm_, mine, *probs);
  }
  /// Allocating form: returns this rank's [B, rows(rank), out_dim].
  Tensor<T> forward(const AttentionInput<T>& in, Index length, Workspace<T>& ws, Tensor<T>* probs = nullptr) const {
    Tensor<T> out({in.query.batch(), split_rows(length), out_dim()});
    forward(in, length, out.batch(), ws, probs);
    return out;
  }

  /// Multiply-adds this process does in one call on B sequences of length
  /// T: its rows' queries, attention and output, and the K/V projection of
  /// every key its rows read (see the file comment).
  FlopCount flops(Index B, Index length) const {
    FlopCount f;
    const SequenceSplit s = split(length);
    if (!opt_.causal) {
      const Index n = s.rows(comm_.rank());
      set_offset(0);
      return n == 0 ? f : local_.flops(B, n, length);
    }
    for (const SequenceSplit::Chunk& c : s.chunks(comm_.rank())) {
      if (c.length == 0) continue;
      const auto [first, offset] = chunk_keys(c);
      set_offset(offset);
      const FlopCount part = local_.flops(B, c.length, c.start + c.length - first);
      f.projection_macs += part.projection_macs;
      f.attention_macs += part.attention_macs;
    }
    return f;
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
    return static_cast<std::uint64_t>(B * probs_heads() * split(length).max_rows() * length) * sizeof(T);
  }
  /// H of the weights forward() gives (Talking-Heads: its value heads).
  Index probs_heads() const {
    if constexpr (std::is_same_v<Local, TalkingHeads<T>>)
      return local_.value_heads();
    else
      return local_.num_heads();
  }

 private:
  // Scratch slots past every variant's and HeadParallel's own.
  enum : std::size_t {
    kSendSlot = slot::variant + 24,
    kGatherSlot,
    kSequenceSlot,
    kQuerySlot,
    kKeySlot,
    kOutSlot,
    kLastSlot = kOutSlot
  };

  SequenceParallel(Communicator comm, Options options, Local local)
      : comm_(std::move(comm)), opt_(options), local_(std::move(local)) {}

  template <class Load>
  static SequenceParallel build(Communicator comm, const Options& options, Load&& load) {
    std::optional<Local> local;
    comm.agree(name(), [&] {
      check_value(options.causal_offset == 0, name(), "causal_offset",
                  "0 (a sharded sequence is self-attention; the chunks' offsets are set per call)",
                  options.causal_offset);
      local.emplace(load());
    });
    return SequenceParallel(std::move(comm), options, std::move(*local));
  }

  static const char* name() {
    if constexpr (std::is_same_v<Local, Mha<T>>) return "sequence-parallel mha";
    if constexpr (std::is_same_v<Local, CollabHead<T>>) return "sequence-parallel collab";
    if constexpr (std::is_same_v<Local, Dcmha<T>>) return "sequence-parallel dcmha";
    return "sequence-parallel talking_heads";
  }

  Index split_rows(Index length) const { return length >= 1 ? split(length).rows(comm_.rank()) : 0; }

  // This rank's part of the agreement: the shard, padding and output shapes.
  SequenceSplit check_call(const AttentionInput<T>& in, Index length, const BatchView<T>& out) const {
    check_value(length >= 1, name(), "length", ">= 1 (the whole sequence's)", length);
    const SequenceSplit s = split(length);
    const Index rows = s.rows(comm_.rank()), D = embed_dim();
    if (!in.self_attention())
      detail::throw_shape(name(), "input.key", "none (the keys are the gathered shards)",
                          detail::format_shape(in.key.shape()));
    const std::string shard = "this rank's " + std::to_string(rows) + " of " + std::to_string(length) + " positions";
    if (in.query.batch() < 1 || (rows > 0 && in.query.data() == nullptr))
      detail::throw_shape(name(), "input.query", "[B >= 1, " + std::to_string(rows) + ", " + std::to_string(D) +
                                                     "] (" + shard + ")",
                          in.query.data() ? detail::format_shape(in.query.shape()) : "no data");
    if (in.query.length() != rows || in.query.width() != D)
      detail::throw_shape(name(), "input.query",
                          detail::format_shape({in.query.batch(), rows, D}) + " (" + shard + ")",
                          detail::format_shape(in.query.shape()));
    if (!in.key_padding.empty())
      check_shape(name(), "input.key_padding_mask (the whole sequence's)", {in.query.batch(), length},
                  {in.key_padding.batch, in.key_padding.keys});
    if (rows > 0 || out.data() != nullptr) check_output(name(), out, in.query.batch(), rows, out_dim());
    return s;
  }


  // The keys a causal chunk can see start at `first` (the window's first
  // key, else 0); query i of the chunk is at global c.start + i, so it sees
  // local key j iff j <= i + offset with offset = c.start - first.
  std::pair<Index, Index> chunk_keys(const SequenceSplit::Chunk& c) const {
    const Index first = opt_.window > 0 ? std::max<Index>(0, c.start + 1 - opt_.window) : 0;
    return {first, c.start - first};
  }

  // One causal chunk: its rows (local rows [at, at + c.length)) against the
  // keys they can see, into the same rows of `out` (and, with `part`, its
  // weights into the same rows of `mine`, at the keys' columns).
  void run_chunk(const AttentionInput<T>& in, ConstBatchView<T> x, const SequenceSplit::Chunk& c, Index at,
                 BatchView<T> out, Workspace<T>& ws, Tensor<T>* part, Tensor<T>& mine) const {
    const Index B = x.batch(), D = x.width(), W = out.width();
    const auto [first, offset] = chunk_keys(c);
    const Index keys = c.start + c.length - first;
    const BatchView<T> q(ws.shared(kQuerySlot, B * c.length * D), B, c.length, D);
    const BatchView<T> k(ws.shared(kKeySlot, B * keys * D), B, keys, D);
    const BatchView<T> y(ws.shared(kOutSlot, B * c.length * W), B, c.length, W);
    SequenceSplit::copy_rows(in.query, at, q, 0, c.length);
    SequenceSplit::copy_rows(x, first, k, 0, keys);
    KeyPadding padding;
    if (!in.key_padding.empty()) {
      padding_.resize(static_cast<std::size_t>(B * keys));
      for (Index b = 0; b < B; ++b)
        std::copy_n(in.key_padding.item(b) + first, keys, padding_.data() + b * keys);
      padding = {padding_.data(), B, keys};
    }
    set_offset(offset);
    local_.forward(AttentionInput<T>{q, k, padding}, y, ws, part);
    SequenceSplit::copy_rows(ConstBatchView<T>(y), 0, out, at, c.length);
    if (part) SequenceSplit::put_weights(*part, at, first, mine);
  }

  // The local layer's mask for the next call (validated options: only the
  // offset changes).
  void set_offset(Index offset) const {
    if (local_.options().causal_offset == offset) return;
    Options o = opt_;
    o.causal_offset = offset;
    local_.set_options(o);
  }

  Communicator comm_;
  Options opt_;
  // The chunks' causal offsets change per call: a layer, like its
  // Communicator, serves one call at a time.
  mutable Local local_;
  mutable std::vector<std::uint8_t> padding_;
};

/// Sequence-parallel MHA (grouped-query included).
template <class T>
using SequenceParallelMha = SequenceParallel<Mha, T>;
/// Sequence-parallel CollabHead.
template <class T>
using SequenceParallelCollabHead = SequenceParallel<CollabHead, T>;
/// Sequence-parallel Talking-Heads.
template <class T>
using SequenceParallelTalkingHeads = SequenceParallel<TalkingHeads, T>;
/// Sequence-parallel DCMHA (groups and grouped-query K/V included).
template <class T>
using SequenceParallelDcmha = SequenceParallel<Dcmha, T>;

}  // namespace headmix::mpi
