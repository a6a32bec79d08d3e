// Helpers shared by the MPI test programs: the world's rank and size,
// checks across ranks (an error on every rank, the same text on every
// rank, forward_scatter against one process's rows, gathered probs), the
// sequence-parallel output put back together (reassemble), the
// head-parallel problems and their checks against one process, and the
// body of main(): run_all_tests() owns MPI_Init / MPI_Finalize and prints
// other ranks' failures with their rank.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/io/io_error.hpp"
#include "headmix/mpi/communicator.hpp"
#include "headmix/mpi/head_parallel.hpp"
#include "reference/mha_reference.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace headmix_mpi_test {

// The MPI tests name the sharded layers and their parts (Communicator,
// HeadParallelMha, SequenceSplit, ...) through `using namespace
// headmix_mpi_test`, as they name headmix's through headmix_test.
using namespace headmix::mpi;

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// `text` is the same on every rank (rank 0's, broadcast, is compared).
inline ::testing::AssertionResult same_on_every_rank(const std::string& text) {
  long long n = static_cast<long long>(text.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  std::string root(static_cast<std::size_t>(n), '\0');
  if (world_rank() == 0) root = text;
  MPI_Bcast(root.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
  if (root == text) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rank " << world_rank() << " has \"" << text << "\", rank 0 \"" << root
                                       << "\"";
}

inline long long sum_over_ranks(long long v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return v;
}

/// `v` is the same on every rank (its least and its most agree).
inline void expect_same_across_ranks(long long v) {
  long long least = v, most = v;
  MPI_Allreduce(MPI_IN_PLACE, &least, 1, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(least, most);
}

/// Every rank reaches this point and MPI's collectives are still matched.
inline void expect_all_ranks_here() { EXPECT_EQ(sum_over_ranks(1), world_size()); }

template <class T>
MPI_Datatype mpi_type() {
  return sizeof(T) == sizeof(float) ? MPI_FLOAT : MPI_DOUBLE;
}

/// `t` with its values converted to `To`.
template <class To, class From>
headmix::Tensor<To> converted(const headmix::Tensor<From>& t) {
  headmix::Tensor<To> out(t.shape());
  for (headmix::Index i = 0; i < t.size(); ++i) out[i] = static_cast<To>(t[i]);
  return out;
}

// Every rank's shard [B, rows(r), W] of a sequence split (a
// headmix::mpi::SequenceSplit), broadcast by its rank, put back in place:
// the whole output [B, T, W] on every rank.
template <class T, class Split>
headmix::Tensor<T> reassemble(const headmix::Tensor<T>& mine, const Split& split) {
  headmix::Tensor<T> whole({mine.dim(0), split.length(), mine.dim(2)});
  for (int r = 0; r < world_size(); ++r) {
    headmix::Tensor<T> part({mine.dim(0), split.rows(r), mine.dim(2)});
    if (r == world_rank()) part = mine;
    if (part.size() > 0) MPI_Bcast(part.data(), static_cast<int>(part.size()), mpi_type<T>(), r, MPI_COMM_WORLD);
    split.put(part.batch(), r, whole.batch());
  }
  return whole;
}

/// What `fn` threw: the exception's kind and message.
template <class Fn>
std::pair<std::string, std::string> thrown(Fn&& fn) {
  try {
    fn();
  } catch (const headmix::shape_error& e) {
    return {"shape_error", e.what()};
  } catch (const headmix::cache_full_error& e) {
    return {"cache_full_error", e.what()};
  } catch (const headmix::io::io_error& e) {
    return {"io_error", e.what()};
  } catch (const std::exception& e) {
    return {"other", e.what()};
  }
  return {"none", ""};
}

/// `fn` throws `type` on every rank; the message names every one of `parts`
/// and, on the ranks other than `failing` (-1: every rank fails alike and
/// the messages are identical), "on rank <failing>".
template <class Fn>
void expect_error_everywhere(const std::string& type, int failing, Fn&& fn, const std::vector<std::string>& parts) {
  const auto [got, message] = thrown(fn);
  EXPECT_EQ(got, type) << message;
  EXPECT_TRUE(headmix_test::mentions(message, parts));
  if (failing < 0)
    EXPECT_TRUE(same_on_every_rank(message));
  else if (world_rank() == failing)
    EXPECT_EQ(message.find("on rank"), std::string::npos) << message;
  else
    EXPECT_NE(message.find("on rank " + std::to_string(failing)), std::string::npos) << message;
  expect_all_ranks_here();
}

/// A [B, T, W] tensor as the naive references' batch, in double.
template <class T>
headmix_ref::RefBatch ref_batch(const headmix::Tensor<T>& t) {
  headmix_ref::RefBatch r;
  r.batch = static_cast<int>(t.dim(0)), r.length = static_cast<int>(t.dim(1)), r.width = static_cast<int>(t.dim(2));
  r.data = headmix_test::widen(t);
  return r;
}

/// Positions [at, at + n) of every sequence of `x`.
template <class T>
headmix::Tensor<T> positions(const headmix::Tensor<T>& x, headmix::Index at, headmix::Index n) {
  headmix::Tensor<T> part({x.dim(0), n, x.dim(2)});
  for (headmix::Index b = 0; b < x.dim(0); ++b) part.batch().item(b) = x.batch().item(b).middleRows(at, n);
  return part;
}

/// A head-parallel problem: a layer's full weights, options and input (the
/// same on every rank for the same seed), and the one-process and sharded
/// layers they make.
template <template <class> class Layer, class T, class Weights, class Options>
struct LayerProblem {
  using Scalar = T;
  using One = Layer<T>;
  using Sharded = headmix::mpi::HeadParallel<Layer, T>;
  Weights w;
  Options opt;
  headmix::Tensor<T> x, kv;
  std::vector<std::uint8_t> padding;  ///< [B, keys], empty: none

  headmix::AttentionInput<T> input() const {
    headmix::AttentionInput<T> in;
    in.query = x.batch();
    if (kv.rank() != 0) in.key = kv.batch();
    if (!padding.empty()) in.key_padding = {padding.data(), x.dim(0), in.keys().length()};
    return in;
  }
};

/// Keys padded in a fixed pattern, none fully: key j of sequence b when
/// j % 3 == b + 1. [batch, keys].
inline std::vector<std::uint8_t> padding_every_third(headmix::Index batch, headmix::Index keys) {
  std::vector<std::uint8_t> padding;
  for (headmix::Index b = 0; b < batch; ++b)
    for (headmix::Index j = 0; j < keys; ++j) padding.push_back(j % 3 == b + 1 ? 1 : 0);
  return padding;
}

/// check(case, problem, one-process layer, sharded layer) for every case,
/// the problem make(case, seed) with seeds counting up from `seed`.
template <class Cases, class Make, class Check>
void for_each_sharded_case(const Cases& cases, unsigned seed, Make make, Check check) {
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto p = make(c, seed++);
    using Problem_ = std::decay_t<decltype(p)>;
    const typename Problem_::One one(p.w, p.opt);
    typename Problem_::Sharded sharded(p.w, p.opt, headmix::mpi::Communicator(MPI_COMM_WORLD));
    check(c, p, one, sharded);
  }
}

/// The bad-input tests' layer: problem `p` sharded, an output buffer, and
/// the output before the errors, which the layer must still give after
/// them.
template <class Problem_>
struct ErrorTestLayer {
  using T = typename Problem_::Scalar;
  const Problem_ p;
  const typename Problem_::Sharded sharded;
  headmix::Workspace<T> ws;
  headmix::Tensor<T> out;
  const headmix::Tensor<T> want;

  explicit ErrorTestLayer(Problem_ problem)
      : p(std::move(problem)),
        sharded(p.w, p.opt, headmix::mpi::Communicator(MPI_COMM_WORLD)),
        out({p.x.dim(0), p.x.dim(1), sharded.out_dim()}),
        want(sharded.forward(p.input(), ws)) {}

  /// The last rank's query is one column too wide: every rank throws, that
  /// rank's message naming `what`.
  void expect_wide_query_on_last_rank_throws(const std::string& what) {
    const int last = world_size() - 1;
    const headmix::Tensor<T> wide({p.x.dim(0), p.x.dim(1), p.x.dim(2) + 1});
    auto in = p.input();
    if (world_rank() == last) in.query = wide.batch();
    expect_error_everywhere("shape_error", last, [&] { sharded.forward(in, out.batch(), ws); }, {what});
  }

  /// After the errors, the layer still works on every rank.
  void expect_still_works() {
    sharded.forward(p.input(), out.batch(), ws);
    EXPECT_TRUE(headmix_test::bit_identical("output after the errors", out, want));
  }
};

/// The sharded forward, output and gathered probs, against one process.
/// Returns the sharded output.
template <class T, class Problem_, class One, class Sharded>
headmix::Tensor<T> expect_forward_equal(const Problem_& p, const One& one, const Sharded& sharded,
                                        headmix_test::Tolerance tol) {
  using headmix_test::all_close, headmix_test::widen;
  EXPECT_EQ(sharded.local_heads() * world_size(), p.opt.num_heads);
  EXPECT_EQ(sharded.out_dim(), one.out_dim());
  headmix::Workspace<T> ws1, ws;
  headmix::Tensor<T> probs1, probs;
  const headmix::Tensor<T> want = one.forward(p.input(), ws1, &probs1);
  const headmix::Tensor<T> got = sharded.forward(p.input(), ws, &probs);
  EXPECT_EQ(got.shape(), want.shape());
  EXPECT_EQ(probs.shape(), probs1.shape());
  EXPECT_TRUE(all_close("output vs one process", got, widen(want), tol));
  EXPECT_TRUE(all_close("probs vs one process", probs, widen(probs1), tol));
  // Without probs, the same output (no probs gather in between).
  EXPECT_TRUE(headmix_test::bit_identical("output without probs", sharded.forward(p.input(), ws), got));
  return got;
}

/// A 2-token prompt, then one token at a time through `cache1` (one
/// process) and `cache` (sharded), both empty: every step's output and
/// probs against one process.
template <class T, class Problem_, class One, class Sharded>
void expect_steps_equal(const Problem_& p, const One& one, const Sharded& sharded, headmix::SequenceCache<T>& cache1,
                        headmix::SequenceCache<T>& cache, headmix_test::Tolerance tol) {
  using headmix_test::all_close, headmix_test::widen;
  headmix::Workspace<T> ws1, ws;
  for (headmix::Index at = 0; at < p.x.dim(1);) {
    const headmix::Index n = at == 0 ? 2 : 1;
    const headmix::Tensor<T> x = positions(p.x, at, n);
    headmix::Tensor<T> probs1, probs;
    const headmix::Tensor<T> want = one.step(x.batch(), cache1, ws1, &probs1);
    const headmix::Tensor<T> got = sharded.step(x.batch(), cache, ws, &probs);
    EXPECT_TRUE(all_close("step output", got, widen(want), tol)) << "position " << at;
    EXPECT_TRUE(all_close("step probs", probs, widen(probs1), tol)) << "position " << at;
    at += n;
    EXPECT_EQ(cache.size(), at);
  }
}

/// forward_scatter: this rank's contiguous rows of the one-process output,
/// and scatter_comm_bytes() is what the Communicator counted. Lengths: the
/// problem's and P - 1 (one rank gets no row). `Problem_` has x, kv,
/// padding (of the keys) and input().
template <class T, class Problem_, class One, class Sharded>
void expect_scatter_equal(const Problem_& p, const One& one, Sharded& sharded, headmix_test::Tolerance tol) {
  const int P = world_size(), r = world_rank();
  for (const headmix::Index length : {p.x.dim(1), headmix::Index(P - 1)}) {
    SCOPED_TRACE("length " + std::to_string(length));
    Problem_ q = p;
    q.x = positions(p.x, 0, length);
    if (p.kv.rank() == 0) q.padding.clear();  // self-attention: the padding follows the length
    headmix::Workspace<T> ws1, ws;
    const headmix::Tensor<T> full = one.forward(q.input(), ws1);
    const auto split = sharded.output_split(length);
    EXPECT_EQ(split.first(r), r * length / P);
    sharded.communicator().reset_counts();
    const headmix::Tensor<T> got = sharded.forward_scatter(q.input(), ws);
    EXPECT_EQ(sharded.communicator().bytes(), sharded.scatter_comm_bytes(p.x.dim(0), length));
    EXPECT_EQ(sharded.communicator().collectives(), 2u);  // the agreement, the reduce-scatter
    EXPECT_EQ(got.shape(), (std::vector<headmix::Index>{p.x.dim(0), split.rows(r), one.out_dim()}));
    const headmix::Tensor<T> mine = positions(full, split.first(r), split.rows(r));
    EXPECT_TRUE(headmix_test::all_close("this rank's rows", got, headmix_test::widen(mine), tol));
    EXPECT_EQ(sum_over_ranks(split.rows(r)), length);
  }
}

/// A sequence-parallel forward with probs: it hands comm_bytes() +
/// probs_comm_bytes() to MPI in three collectives (the agreement, the
/// sequence, the weights). Returns this rank's output rows.
template <class T, class Sharded>
headmix::Tensor<T> forward_with_probs(Sharded& sharded, const headmix::AttentionInput<T>& mine, headmix::Index length,
                                      headmix::Workspace<T>& ws, headmix::Tensor<T>& probs) {
  const headmix::Index B = mine.query.batch();
  sharded.communicator().reset_counts();
  headmix::Tensor<T> out = sharded.forward(mine, length, ws, &probs);
  EXPECT_EQ(sharded.communicator().bytes(), sharded.comm_bytes(B, length) + sharded.probs_comm_bytes(B, length));
  EXPECT_EQ(sharded.communicator().collectives(), 3u);
  return out;
}

/// Gathered weights `got` against one process's `want` [B, H, T, T]: the
/// same shape, close within `tol`, and exactly 0 on both wherever
/// masked(b, i, j) (key j hidden from query i of sequence b).
template <class T, class Masked>
void expect_probs_equal(const headmix::Tensor<T>& got, const headmix::Tensor<T>& want, headmix_test::Tolerance tol,
                        Masked&& masked) {
  ASSERT_EQ(got.shape(), want.shape());
  EXPECT_TRUE(headmix_test::all_close("gathered probs vs one process", got, headmix_test::widen(want), tol));
  const headmix::Index B = want.dim(0), H = want.dim(1), T_ = want.dim(2);
  long long hidden = 0, nonzero_got = 0, nonzero_want = 0;
  for (headmix::Index b = 0; b < B; ++b)
    for (headmix::Index h = 0; h < H; ++h)
      for (headmix::Index i = 0; i < T_; ++i)
        for (headmix::Index j = 0; j < T_; ++j) {
          if (!masked(b, i, j)) continue;
          const headmix::Index at = ((b * H + h) * T_ + i) * T_ + j;
          ++hidden;
          nonzero_got += got[at] != T(0);
          nonzero_want += want[at] != T(0);
        }
  EXPECT_EQ(nonzero_got, 0) << "masked entries not exactly 0 in the gathered probs, of " << hidden;
  EXPECT_EQ(nonzero_want, 0) << "masked entries not exactly 0 in one process's probs, of " << hidden;
}

/// Probs asked for on rank 0 only: every rank throws the same shape_error
/// (the agreed probs request differs) and none waits in the weights' gather.
template <class T, class Sharded>
void expect_probs_on_one_rank_throw(const Sharded& sharded, const headmix::AttentionInput<T>& mine,
                                    headmix::Index length, headmix::BatchView<T> out, headmix::Workspace<T>& ws) {
  headmix::Tensor<T> probs;
  expect_error_everywhere(
      "shape_error", -1,
      [&] { sharded.forward(mine, length, out, ws, world_rank() == 0 ? &probs : nullptr); },
      {"arguments across ranks", "probs from 0 to 1"});
}

/// Each rank's shard fits the length it passes, but the last rank passes
/// its shard of `other`, a longer sequence, while the others pass `shard`
/// of `length` (and `out`, its output): every rank throws the same
/// shape_error. Returns this rank's shard of `other`.
template <class T, class Sharded>
headmix::Tensor<T> expect_longer_sequence_on_last_rank_throws(Sharded& sharded, const headmix::Tensor<T>& shard,
                                                              headmix::Index length, headmix::Tensor<T>& out,
                                                              const headmix::Tensor<T>& other,
                                                              headmix::Workspace<T>& ws) {
  const int me = world_rank(), last = world_size() - 1;
  const headmix::Index other_length = other.dim(1);
  headmix::Tensor<T> other_shard = sharded.split(other_length).take(other.batch(), me);
  headmix::Tensor<T> other_out({other.dim(0), other_shard.dim(1), out.dim(2)});
  expect_error_everywhere(
      "shape_error", -1,
      [&] {
        if (me == last)
          sharded.forward({other_shard.batch(), {}, {}}, other_length, other_out.batch(), ws);
        else
          sharded.forward({shard.batch(), {}, {}}, length, out.batch(), ws);
      },
      {"sequence length from " + std::to_string(length) + " to " + std::to_string(other_length)});
  return other_shard;
}

/// Rank 0 prints GoogleTest's usual output; the others only their failures.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

/// A test program's main(): MPI_Init, 2 or more processes (the error cases
/// need a rank that fails while another does not), the tests, MPI_Finalize.
inline int run_all_tests(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (world_size() < 2) {
    std::fprintf(stderr, "run this under mpiexec with 2 or more processes (ctest does)\n");
    MPI_Finalize();
    return 1;
  }
  if (world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(world_rank()));
  }
  const int result = RUN_ALL_TESTS();
  MPI_Finalize();
  return result;
}

}  // namespace headmix_mpi_test
