// The MPI communicator that headmix's sharded layers run over, and the only
// collectives they use: an in-place sum, a reduce-scatter, a gather of
// column blocks, and an agreement on errors (separate, or riding in a sum).
//
// The caller owns MPI: it calls MPI_Init (MPI_THREAD_FUNNELED is enough:
// headmix's worker threads never call MPI) and MPI_Finalize, and passes an
// MPI_Comm, which headmix neither duplicates nor frees. Collectives on one
// communicator must be called in the same order on every rank, so a
// Communicator, and a layer holding one, serves one call at a time.
//
// Errors: a sharded call first runs its rank-local part (validation and the
// local heads), then the ranks agree with one small MPI_Allreduce whether
// every rank succeeded and passed the same extents. Only then does the data
// collective run, so a bad input on one rank is an error on every rank and
// no rank waits forever in a collective that others skipped. A call whose
// data collective is a sum of a buffer every rank sizes alike can instead
// append status() elements to it (write_status / check_status): the same
// agreement, in the one collective.
#pragma once

// headmix uses MPI's C API; Open MPI's and MPICH's C++ bindings (removed in
// MPI-3) would need libmpi_cxx.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include "headmix/core/error.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/types.hpp"
#include "headmix/io/io_error.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace headmix::mpi {

/// A value every rank must pass alike (a batch size, a sequence length),
/// named for the error when they differ.
struct Agreed {
  const char* name;
  long long value;
};

class Communicator {
 public:
  /// The most Agreed values one agree() compares.
  static constexpr std::size_t kMaxAgreed = 8;

  /// `comm` stays the caller's. MPI must be initialised.
  explicit Communicator(MPI_Comm comm) : comm_(comm) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
      throw std::logic_error(
          "headmix::mpi::Communicator: MPI is not running (the caller calls MPI_Init; headmix never does)");
    if (comm == MPI_COMM_NULL) throw std::invalid_argument("headmix::mpi::Communicator: MPI_COMM_NULL");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  /// Bytes of the buffers this Communicator (this copy) has handed to MPI
  /// collectives: per call, each rank's send buffer, not what the network
  /// carries (a ring all-reduce moves about 2(P-1)/P times its buffer).
  std::uint64_t bytes() const { return bytes_; }
  void reset_bytes() { bytes_ = 0; }
  /// MPI collective calls this Communicator (this copy) has made.
  std::uint64_t collectives() const { return collectives_; }
  /// Zero both counters.
  void reset_counts() { bytes_ = 0, collectives_ = 0; }

  /// Bytes that agree() hands to MPI for `agreed` values.
  static constexpr std::uint64_t agreement_bytes(std::size_t agreed) { return (1 + 2 * agreed) * sizeof(long long); }

  /// data[0, count) = the sum over ranks of every rank's data[0, count), in place.
  template <class T>
  void all_reduce_sum(T* data, Index count) const {
    for (Index done = 0; done < count;) {  // MPI counts are int
      const int n = static_cast<int>(std::min<Index>(count - done, INT_MAX));
      MPI_Allreduce(MPI_IN_PLACE, data + done, n, datatype<T>(), MPI_SUM, comm_);
      ++collectives_;
      done += n;
    }
    bytes_ += static_cast<std::uint64_t>(count) * sizeof(T);
  }

  /// Sum every rank's `send` (its blocks for ranks 0, 1, … of counts[0],
  /// counts[1], … elements, back to back) and give rank r the sum of the
  /// blocks for r in `recv`, counts[r] elements: one MPI_Reduce_scatter.
  /// `counts` has size() entries, the same on every rank, each below 2^31
  /// (the caller checks: MPI counts are int).
  template <class T>
  void reduce_scatter_sum(const T* send, T* recv, const int* counts) const {
    MPI_Reduce_scatter(send, recv, counts, datatype<T>(), MPI_SUM, comm_);
    ++collectives_;
    std::uint64_t sent = 0;
    for (int r = 0; r < size_; ++r) sent += static_cast<std::uint64_t>(counts[r]);
    bytes_ += sent * sizeof(T);
  }

  /// Gather column blocks: `local` is this rank's [rows, cols] (in units of
  /// `unit` contiguous elements), `full` is [rows, size() * cols] units, and
  /// rank r's block lands at columns [r * cols, (r + 1) * cols). One
  /// MPI_Allgather whose receive type scatters the blocks, so nothing is
  /// copied afterwards.
  template <class T>
  void all_gather_blocks(const T* local, Index rows, Index cols, Index unit, T* full) const {
    const Index widest = std::max({rows, unit, cols * size_});
    if (widest > INT_MAX)
      detail::throw_shape("mpi", "gathered block", "extents below 2^31 (MPI counts are int)", std::to_string(widest));
    MPI_Datatype element = MPI_DATATYPE_NULL, sent = MPI_DATATYPE_NULL, strided = MPI_DATATYPE_NULL,
                 block = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(static_cast<int>(unit), datatype<T>(), &element);
    MPI_Type_contiguous(static_cast<int>(cols), element, &sent);  // one row of this rank's block
    MPI_Type_vector(static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(cols * size_), element, &strided);
    // Rank r's block starts r * cols units in: shrink the extent to one block's width.
    MPI_Type_create_resized(strided, 0, static_cast<MPI_Aint>(cols * unit * static_cast<Index>(sizeof(T))), &block);
    MPI_Type_commit(&sent);
    MPI_Type_commit(&block);
    MPI_Allgather(local, static_cast<int>(rows), sent, full, 1, block, comm_);
    ++collectives_;
    for (MPI_Datatype* t : {&block, &strided, &sent, &element}) MPI_Type_free(t);
    bytes_ += static_cast<std::uint64_t>(rows * cols * unit) * sizeof(T);
  }

  /// Run `check` (this rank's part of a call: validation, local work), then
  /// agree with every rank, in one MPI_Allreduce, that all succeeded and
  /// passed the same `agreed` values. If a rank failed, every rank throws:
  /// the failing rank its own exception, the others the same type of error
  /// (shape_error: same variant and argument) with "on rank r" added; if
  /// several failed, the lowest rank's. If the values differ, every rank
  /// throws the same shape_error naming them. Returns normally on every
  /// rank or on none.
  template <class Check>
  void agree(const char* variant, Check&& check, std::initializer_list<Agreed> agreed = {}) const {
    std::exception_ptr failure;
    try {
      check();
    } catch (...) {
      failure = std::current_exception();
    }
    const std::size_t n = agreed.size();
    HEADMIX_ASSERT(n <= kMaxAgreed);
    // [lowest failing rank, or size() if none; each value; each value negated]:
    // one MIN gives the lowest failing rank and both ends of every value.
    std::array<long long, 1 + 2 * kMaxAgreed> v{};
    v[0] = failure ? rank_ : size_;
    std::size_t i = 0;
    for (const Agreed& a : agreed) {
      v[1 + i] = a.value;
      v[1 + n + i] = -a.value;
      ++i;
    }
    const int count = static_cast<int>(1 + 2 * n);
    MPI_Allreduce(MPI_IN_PLACE, v.data(), count, MPI_LONG_LONG, MPI_MIN, comm_);
    ++collectives_;
    bytes_ += agreement_bytes(n);
    if (v[0] < size_) throw_agreed_failure(failure, static_cast<int>(v[0]));
    std::array<long long, kMaxAgreed> low{}, high{};
    for (std::size_t j = 0; j < n; ++j) low[j] = v[1 + j], high[j] = -v[1 + n + j];
    throw_if_different(variant, agreed, low.data(), high.data());
  }

  /// Elements of T that write_status() appends to a summed buffer for
  /// `agreed` values: one per rank for its failure flag, two per rank and
  /// value (a value v >= 0 as v mod 2^12 and v / 2^12, exact in float below
  /// 2^36). Each rank writes only its own entries, so the sum holds every
  /// rank's.
  Index status_count(std::size_t agreed) const { return static_cast<Index>((1 + 2 * agreed)) * size_; }

  /// This rank's status: whether its part failed, and its `agreed` values
  /// (>= 0), into status[0, status_count(agreed.size())), zeros elsewhere.
  template <class T>
  void write_status(T* status, bool failed, std::initializer_list<Agreed> agreed) const {
    std::fill_n(status, status_count(agreed.size()), T(0));
    status[rank_] = failed ? T(1) : T(0);
    std::size_t i = 0;
    for (const Agreed& a : agreed) {
      HEADMIX_ASSERT(a.value >= 0 && a.value < (1LL << 36));
      status[(1 + 2 * i) * size_ + rank_] = static_cast<T>(a.value % kStatusBase);
      status[(2 + 2 * i) * size_ + rank_] = static_cast<T>(a.value / kStatusBase);
      ++i;
    }
  }

  /// After the sum of every rank's write_status(): throw on every rank as
  /// agree() would (`failure` is this rank's own exception, if any; the
  /// same `agreed` names, in the same order, on every rank), or return on
  /// every rank.
  template <class T>
  void check_status(const char* variant, const T* status, const std::exception_ptr& failure,
                    std::initializer_list<Agreed> agreed) const {
    for (int r = 0; r < size_; ++r)
      if (status[r] != T(0)) throw_agreed_failure(failure, r);
    const std::size_t n = agreed.size();
    HEADMIX_ASSERT(n <= kMaxAgreed);
    std::array<long long, kMaxAgreed> low{}, high{};
    for (std::size_t i = 0; i < n; ++i)
      for (int r = 0; r < size_; ++r) {
        const long long v = static_cast<long long>(status[(1 + 2 * i) * size_ + r]) +
                            kStatusBase * static_cast<long long>(status[(2 + 2 * i) * size_ + r]);
        low[i] = r == 0 ? v : std::min(low[i], v);
        high[i] = r == 0 ? v : std::max(high[i], v);
      }
    throw_if_different(variant, agreed, low.data(), high.data());
  }

 private:
  template <class T>
  static MPI_Datatype datatype() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "headmix::mpi sums float or double");
    return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
  }

  static constexpr long long kStatusBase = 1LL << 12;

  // The shape_error every rank throws alike when an agreed value's lowest
  // and highest over the ranks differ.
  static void throw_if_different(const char* variant, std::initializer_list<Agreed> agreed, const long long* low,
                                 const long long* high) {
    std::string names, ranges;
    std::size_t i = 0;
    for (const Agreed& a : agreed) {
      names += (i ? ", " : "") + std::string(a.name);
      if (low[i] != high[i])
        ranges += (ranges.empty() ? "" : ", ") + std::string(a.name) + " from " + std::to_string(low[i]) + " to " +
                  std::to_string(high[i]);
      ++i;
    }
    if (!ranges.empty())
      detail::throw_shape(variant, "arguments across ranks", "the same " + names + " on every rank", ranges);
  }

  // What a rank threw, as the other ranks rebuild it.
  enum class Kind : char { shape, cache_full, io, other };

  // Every rank, the failing `root` included, takes part in its broadcast;
  // then the failing ranks rethrow their own exception and the others
  // rebuild root's.
  [[noreturn]] void throw_agreed_failure(const std::exception_ptr& failure, int root) const {
    std::vector<std::string> fields;  // Kind, then shape_error's four parts or what()
    if (rank_ == root) fields = describe(failure);
    fields = broadcast(fields, root);
    if (failure) std::rethrow_exception(failure);
    const std::string where = " (on rank " + std::to_string(root) + ")";
    switch (static_cast<Kind>(fields.at(0).at(0))) {
      case Kind::shape:
        throw shape_error(fields.at(1), fields.at(2), fields.at(3), fields.at(4) + where);
      case Kind::cache_full:
        throw cache_full_error(fields.at(1) + where);
      case Kind::io:
        throw io::io_error(fields.at(1) + where);
      case Kind::other:
        break;
    }
    throw std::runtime_error(fields.at(1) + where);
  }

  static std::vector<std::string> describe(const std::exception_ptr& failure) {
    auto kind = [](Kind k) { return std::string(1, static_cast<char>(k)); };
    try {
      std::rethrow_exception(failure);
    } catch (const shape_error& e) {
      return {kind(Kind::shape), e.variant(), e.argument(), e.expected(), e.actual()};
    } catch (const cache_full_error& e) {
      return {kind(Kind::cache_full), e.what()};
    } catch (const io::io_error& e) {
      return {kind(Kind::io), e.what()};
    } catch (const std::exception& e) {
      return {kind(Kind::other), e.what()};
    } catch (...) {
      return {kind(Kind::other), "an exception that is not a std::exception"};
    }
  }

  // `fields` of rank `root` on every rank: their lengths, then their bytes.
  std::vector<std::string> broadcast(const std::vector<std::string>& fields, int root) const {
    std::array<long long, 6> lengths{};
    for (std::size_t f = 0; f < fields.size() && f + 1 < lengths.size(); ++f)
      lengths[f + 1] = static_cast<long long>(fields[f].size());
    lengths[0] = static_cast<long long>(fields.size());
    MPI_Bcast(lengths.data(), static_cast<int>(lengths.size()), MPI_LONG_LONG, root, comm_);
    collectives_ += 2;
    std::string text;
    for (const auto& f : fields) text += f;
    long long total = 0;
    for (std::size_t f = 1; f < lengths.size(); ++f) total += lengths[f];
    text.resize(static_cast<std::size_t>(total));
    MPI_Bcast(text.data(), static_cast<int>(total), MPI_CHAR, root, comm_);
    bytes_ += sizeof lengths + static_cast<std::uint64_t>(total);
    std::vector<std::string> out;
    std::size_t at = 0;
    for (long long f = 0; f < lengths[0]; ++f) {
      const auto len = static_cast<std::size_t>(lengths[static_cast<std::size_t>(f) + 1]);
      out.push_back(text.substr(at, len));
      at += len;
    }
    return out;
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  mutable std::uint64_t bytes_ = 0, collectives_ = 0;  // counting is not state a caller sees change a result
};

}  // namespace headmix::mpi
