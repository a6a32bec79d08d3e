// Sequence-parallel LSH attention over MPI, run by ctest under `mpiexec -n
// 2` and `-n 3`. Lengths follow the process count P (T = 4P+1, 5P+2,
// 3P-1, ...), so the same program splits differently on 2 and 3
// processes, with lengths that neither P nor 2·bucket_size divides, and
// T = 1 and 2, where some ranks hold no rows.
//
// The contract: each rank's output rows, reassembled on every rank, equal
// the one-process Lsh forward on the same weights and the whole sequence
// (causal or not, key padding, 1 and several rounds, without duplicate
// attention, within buckets only, per-head and seeded rotations), the
// ranks' work adds up to one process's plus the replicated projections
// and hashing, the bytes handed to MPI are comm_bytes(), and every error
// is an error on every rank with no rank left in a collective (ctest's
// 120 s timeout fails a hang).

#include "test_util.hpp"

#include "cases/lsh.hpp"
#include "headmix/io/safetensors.hpp"
#include "headmix/mpi/sequence_parallel_lsh.hpp"
#include "mpi/mpi_test_util.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_mpi_test;
using lsh_case::Problem;
using lsh_case::Shape;

// Sharded against one process. Every position's qk and v come from the
// same projection of the same gathered x, so the buckets, sort and masks
// are one process's exactly; a row's logits, softmax and round merge are
// the same operations in the same order. Only a chunk's score and readout
// GEMMs span fewer rows (this rank's rows of the chunk), as does o's, and
// the GEMM kernels may sum a row's dot products (<= 32 terms here) in
// another order for another row count: each such sum moves by at most
// 2·n·u·Σ|terms|, which through the softmax and o (O(1) weights and
// inputs) stays below 1024·u absolute: 6.1e-5 in float, 1.1e-13 in double.
// (Eigen evaluates products with rows + 2·bs + dh < 20 coefficient by
// coefficient, in another order than its GEMM: dh = dv = 16 keeps every
// tile here, whole or part, on the GEMM.) How many cases come out
// bit-identical is printed by rank 0.
template <class T>
Tolerance sharded_tolerance() {
  return {0.0, 1024 * std::numeric_limits<T>::epsilon() / 2};
}

// Per type: cases compared, cases bit-identical on every rank, the largest
// |sharded - one process|.
template <class T>
struct Record {
  int cases = 0, identical = 0;
  double worst = 0;
};
template <class T>
Record<T>& record() {
  static Record<T> r;
  return r;
}

// ---------------------------------------------------------------------------
// Problems

struct Case {
  const char* name;
  Index per_process, extra;  // T = per_process · P + extra
  Shape shape;               // its T is set from the above
  bool seeded = false;       // drop the explicit rotations: drawn from the seed
  Index length() const { return per_process * world_size() + extra; }
};

Shape shape(int bs, int NH, bool causal, double pad_rate) {
  Shape s;
  s.B = 2, s.D = 8, s.H = 2, s.dh = 16, s.dv = 16, s.out = 5;  // dh, dv: see sharded_tolerance
  s.bs = bs, s.NH = NH, s.causal = causal, s.pad_rate = pad_rate;
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"T = 4P+1, 2 rounds", 4, 1, shape(2, 2, false, 0)});
  c.push_back({"causal, key padding, T = 5P+2, 3 rounds", 5, 2, shape(2, 3, true, 0.25)});
  c.push_back({"causal, 1 round, bs 3, T = 3P-1", 3, -1, shape(3, 1, true, 0)});
  c.push_back({"no duplicate attention, key padding, T = 4P+3", 4, 3, shape(2, 2, false, 0.2)});
  c.push_back({"within buckets, causal, 4 buckets, T = 6P+1", 6, 1, shape(2, 2, true, 0)});
  c[4].shape.across = false, c[4].shape.NB = 4;
  c.push_back({"no duplicates within buckets, causal, per-head, 2 threads, T = 4P", 4, 0, shape(2, 3, true, 0.2)});
  c[5].shape.dup = false, c[5].shape.across = false, c[5].shape.per_head = true, c[5].shape.threads = 2;
  c[3].shape.dup = false;
  c.push_back({"seeded rotations, qk/v biases, no o, T = 3P+2", 3, 2, shape(2, 2, false, 0)});
  c[6].seeded = true, c[6].shape.qkv_bias = true, c[6].shape.out_proj = false;
  c.push_back({"T = 1 (one rank holds it), causal, 2 rounds", 0, 1, shape(2, 2, true, 0)});
  c.push_back({"T = 2 (a rank without rows on 3), no duplicates", 0, 2, shape(2, 2, false, 0)});
  c[8].shape.dup = false;
  return c;
}

template <class T>
Problem<T> problem(const Case& c, unsigned seed) {
  Shape s = c.shape;
  s.T = static_cast<int>(c.length());
  Problem<T> p = lsh_case::make_problem<T>(s, seed);
  if (c.seeded) p.w.rotations = Tensor<T>();
  return p;
}

// The work every rank with rows repeats (per call): the qk and v
// projections of all T positions, and the key norms and hashing of all Tp.
struct Replicated {
  long long projection, attention;
};
Replicated replicated(const Problem<double>& p) {
  const Shape& s = p.s;
  const long long Tp = s.Tp(), half = s.n_buckets() / 2;
  return {1LL * s.B * s.T * s.D * s.H * (s.dh + s.dv), 1LL * s.B * s.H * (Tp * s.dh + Tp * s.dh * s.NH * half)};
}

// ---------------------------------------------------------------------------
// Tests

HEADMIX_TYPED_OVER_SCALARS(SequenceParallelLshTest);

// check(case, problem, one-process layer, sequence-parallel layer, this
// rank's input) for every case, seeds counting up from `seed`.
template <class T, class Check>
void for_each_lsh_case(unsigned seed, Check check) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Problem<T> p = problem<T>(c, seed++);
    SequenceParallelLsh<T> sharded(p.w, p.options(), Communicator(MPI_COMM_WORLD));
    const Tensor<T> shard = sharded.split(c.length()).take(p.input().query, world_rank());
    const headmix::AttentionInput<T> mine{shard.batch(), {}, p.input().key_padding};
    check(c, p, p.layer(), sharded, mine);
  }
}

// Output rows (reassembled), a second call with the same workspace, the
// counted bytes, per case.
TYPED_TEST(SequenceParallelLshTest, EqualsOneProcess) {
  using T = TypeParam;
  for_each_lsh_case<T>(500, [](const Case& c, const Problem<T>& p, const auto& one, auto& sharded, const auto& mine) {
    headmix::Workspace<T> ws1, ws;
    const Tensor<T> want = one.forward(p.input(), ws1);
    const SequenceSplit split = sharded.split(c.length());
    Communicator& comm = sharded.communicator();
    comm.reset_bytes();
    const Tensor<T> got = sharded.forward(mine, c.length(), ws);
    EXPECT_EQ(comm.bytes(), sharded.comm_bytes(p.s.B, c.length()));
    EXPECT_EQ(got.shape(), (std::vector<Index>{p.s.B, split.rows(world_rank()), one.out_dim()}));

    const Tensor<T> whole = reassemble(got, split);
    EXPECT_TRUE(all_close("reassembled output vs one process", whole, widen(want), sharded_tolerance<T>()));
    Record<T>& r = record<T>();
    for (Index i = 0; i < whole.size(); ++i) r.worst = std::max(r.worst, std::abs(double(whole[i]) - double(want[i])));
    r.cases += 1;
    r.identical += bit_identical("", whole, want) ? 1 : 0;
    EXPECT_TRUE(bit_identical("a second call, same workspace", sharded.forward(mine, c.length(), ws), got));
  });
}

// Work per rank: its rows' scores, readout, round merge and o, plus the
// replicated projections and hashing (Replicated, counted by hand). Over
// the A ranks that hold rows: Σ flops = one process's + (A - 1) · replicated,
// in projection and attention multiply-adds separately; a rank without
// rows does nothing. And the attention proper is split: with T a multiple
// of P and of 2·bs, every rank's share is the same.
TEST(SequenceParallelLshFlops, RanksAddUpToOneProcess) {
  unsigned seed = 600;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Problem<double> p = problem<double>(c, seed++);
    const SequenceParallelLsh<double> sharded(p.w, p.options(), Communicator(MPI_COMM_WORLD));
    const Index T_ = c.length();
    const headmix::FlopCount f = sharded.flops(p.s.B, T_), f1 = p.layer().flops(p.s.B, T_, T_);
    const long long active = sum_over_ranks(sharded.split(T_).rows(world_rank()) > 0 ? 1 : 0);
    const Replicated rep = replicated(p);
    EXPECT_EQ(sum_over_ranks(f.projection_macs), f1.projection_macs + (active - 1) * rep.projection);
    EXPECT_EQ(sum_over_ranks(f.attention_macs), f1.attention_macs + (active - 1) * rep.attention);
    if (sharded.split(T_).rows(world_rank()) == 0) {
      EXPECT_EQ(f.attention_macs + f.projection_macs, 0);
    }
  }
  Case even{"T = 8P", 8, 0, shape(4, 2, true, 0)};  // Tp = T: no autopad rows for the last rank
  const Problem<double> p = problem<double>(even, 650);
  const SequenceParallelLsh<double> sharded(p.w, p.options(), Communicator(MPI_COMM_WORLD));
  const long long mine = sharded.flops(p.s.B, even.length()).attention_macs;
  expect_same_across_ranks(mine);
  const long long attention = p.layer().flops(p.s.B, even.length(), even.length()).attention_macs;
  EXPECT_EQ((mine - replicated(p).attention) * world_size(), attention - replicated(p).attention);
}

// comm_bytes against a count by hand: the agreement's 9 long longs, then
// B · max_rows · D values of T. T = 4P+1: one shard has 5 rows.
TEST(SequenceParallelLshBytes, CommBytesByHand) {
  const Problem<float> p = problem<float>(cases()[0], 700);
  const SequenceParallelLsh<float> sharded(p.w, p.options(), Communicator(MPI_COMM_WORLD));
  const int P = world_size();
  EXPECT_EQ(sharded.comm_bytes(2, 4 * P + 1), 9 * 8 + 2 * 5 * 8 * 4u);
  EXPECT_EQ(sharded.comm_bytes(2, 4 * P), 9 * 8 + 2 * 4 * 8 * 4u);
  EXPECT_EQ(sharded.comm_bytes(1, 1), 9 * 8 + 1 * 1 * 8 * 4u);
  // With probs, B · H · max_rows · T values more (H = 2).
  EXPECT_EQ(sharded.probs_comm_bytes(2, 4 * P + 1), 2 * 2 * 5 * (4 * P + 1) * 4u);
  EXPECT_EQ(sharded.probs_comm_bytes(1, 1), 1 * 2 * 1 * 1 * 4u);
}

// ---------------------------------------------------------------------------
// Errors: each on every rank, no rank left in a collective.

TEST(SequenceParallelLshErrors, BadCallOnOneRankThrowsOnEveryRank) {
  const Case c = cases()[1];  // causal, key padding
  const Problem<double> p = problem<double>(c, 800);
  headmix::LshWeights<double> seeded = p.w;  // rotations for any length: see the last two cases
  seeded.rotations = Tensor<double>();
  const SequenceParallelLsh<double> sharded(seeded, p.options(), Communicator(MPI_COMM_WORLD));
  const Index length = c.length(), B = p.s.B, out_dim = sharded.out_dim();
  const SequenceSplit split = sharded.split(length);
  const int me = world_rank(), last = world_size() - 1;
  const Tensor<double> shard = split.take(p.input().query, me);
  const headmix::AttentionInput<double> mine{shard.batch(), {}, p.input().key_padding};
  headmix::Workspace<double> ws;
  const Tensor<double> want = sharded.forward(mine, length, ws);
  Tensor<double> out({B, split.rows(me), out_dim});

  // The last rank passes one row more than its shard.
  const Tensor<double> longer({B, split.rows(last) + 1, p.s.D});
  auto bad = mine;
  if (me == last) bad.query = longer.batch();
  expect_error_everywhere(
      "shape_error", last, [&] { sharded.forward(bad, length, out.batch(), ws); },
      {"[sequence-parallel lsh] input.query",
       "this rank's " + std::to_string(split.rows(last)) + " of " + std::to_string(length) + " positions"});

  // Rank 0 passes its own rows' padding, not the whole sequence's.
  const std::vector<std::uint8_t> short_padding(static_cast<std::size_t>(B * split.rows(0)), 0);
  bad = mine;
  if (me == 0) bad.key_padding = {short_padding.data(), B, split.rows(0)};
  expect_error_everywhere(
      "shape_error", 0, [&] { sharded.forward(bad, length, out.batch(), ws); },
      {"input.key_padding_mask (the whole sequence's)", std::to_string(length)});

  // The last rank passes a key sequence.
  bad = mine;
  if (me == last) bad.key = p.input().query;
  expect_error_everywhere(
      "shape_error", last, [&] { sharded.forward(bad, length, out.batch(), ws); }, {"input.key", "gathered"});

  // Rank 0's output is one column narrow.
  Tensor<double> narrow({B, split.rows(me), out_dim - 1});
  expect_error_everywhere(
      "shape_error", 0, [&] { sharded.forward(mine, length, (me == 0 ? narrow : out).batch(), ws); },
      {"[sequence-parallel lsh] output"});

  // A length of 0 on every rank.
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.forward(mine, 0, out.batch(), ws); }, {"length", ">= 1"});

  // Valid on each rank, but only rank 0 passes padding: the others would mask differently.
  bad = mine;
  if (me != 0) bad.key_padding = {};
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.forward(bad, length, out.batch(), ws); },
      {"arguments across ranks", "key padding from 0 to 1"});

  // Valid on each rank, but the last rank passes one sequence fewer.
  bad = mine;
  Tensor<double> fewer({B - 1, split.rows(me), out_dim});
  if (me == last) bad = {{shard.data(), B - 1, split.rows(me), p.s.D}, {}, {p.padding.data(), B - 1, length}};
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.forward(bad, length, (me == last ? fewer : out).batch(), ws); },
      {"batch from " + std::to_string(B - 1) + " to " + std::to_string(B)});

  // The last rank's sequence is 2·bs·P positions longer (a longer padded
  // length).
  const Index other_length = length + 2 * p.s.bs * world_size();
  Rng rng(801);
  const Tensor<double> other = random_tensor<double>(rng, {B, other_length, p.s.D}, 1.0);
  const Tensor<double> other_shard = expect_longer_sequence_on_last_rank_throws(sharded, shard, length, out, other, ws);

  // With explicit rotations, the same longer sequence on every rank: they
  // have NB/2 = Tp/(2·bs) columns for `length`, not for it. The local
  // layer's check, agreed before the gather.
  const SequenceParallelLsh<double> fixed(p.w, p.options(), Communicator(MPI_COMM_WORLD));
  Tensor<double> other_out({B, other_shard.dim(1), out_dim});
  expect_error_everywhere(
      "shape_error", -1,
      [&] { fixed.forward({other_shard.batch(), {}, {}}, other_length, other_out.batch(), ws); },
      {"[lsh] rotations"});

  // The layer still works on every rank.
  sharded.forward(mine, length, out.batch(), ws);
  EXPECT_TRUE(bit_identical("output after the errors", out, want));
}

TEST(SequenceParallelLshErrors, BadWeightsOrOptionsThrowOnEveryRank) {
  const Problem<double> p = problem<double>(cases()[0], 900);
  headmix::LshOptions odd = p.options();
  odd.n_buckets = 3;
  expect_error_everywhere(
      "shape_error", -1, [&] { SequenceParallelLsh<double>(p.w, odd, Communicator(MPI_COMM_WORLD)); },
      {"[lsh] n_buckets", "got 3"});
  // Options bad on the last rank only.
  headmix::LshOptions mixed = p.options();
  if (world_rank() == world_size() - 1) mixed.bucket_size = 0;
  expect_error_everywhere(
      "shape_error", world_size() - 1,
      [&] { SequenceParallelLsh<double>(p.w, mixed, Communicator(MPI_COMM_WORLD)); }, {"[lsh] bucket_size"});
  // A checkpoint that lacks v.weight on the last rank only.
  headmix::io::TensorFile full, lacking;
  for (auto* f : {&full, &lacking})
    f->put("attn.qk.weight", headmix::io::StoredTensor::from(Tensor<double>({p.s.H * p.s.dh, p.s.D})));
  full.put("attn.v.weight", headmix::io::StoredTensor::from(Tensor<double>({p.s.H * p.s.dv, p.s.D})));
  const int last = world_size() - 1;
  headmix::LshOptions seeded = p.options();
  expect_error_everywhere(
      "io_error", last,
      [&] {
        SequenceParallelLsh<double>::from_tensors(world_rank() == last ? lacking : full, "attn.", seeded,
                                                  Communicator(MPI_COMM_WORLD));
      },
      {"attn.v.weight"});
  // The same checkpoint everywhere loads.
  const auto loaded = SequenceParallelLsh<double>::from_tensors(full, "attn.", seeded, Communicator(MPI_COMM_WORLD));
  EXPECT_EQ(loaded.local().num_heads(), p.s.H);
}

// Rank 0 prints how close the sharded rows came to one process's.
TEST(SequenceParallelLshSummary, Deviations) {
  if (world_rank() != 0) return;
  const Record<float>& f = record<float>();
  const Record<double>& d = record<double>();
  std::printf(
      "sharded vs one process: float %d/%d cases bit-identical, largest |diff| %.3g (bound %.3g); "
      "double %d/%d, %.3g (bound %.3g)\n",
      f.identical, f.cases, f.worst, sharded_tolerance<float>().atol, d.identical, d.cases, d.worst,
      sharded_tolerance<double>().atol);
}

// ---------------------------------------------------------------------------
// probs: every rank gets the whole sequence's dense weights [B, H, T, T],
// the one-process layer's (each rank's rows from forward_rows, gathered),
// for every case (causal or not, key padding, several rounds, without
// duplicates, within buckets, T = 1 and 2 where some rank holds no rows);
// causal-masked and padded keys exactly 0 (but its own position: lsh.md
// 6d keeps a padded query's self weight); the output rows as without
// probs; comm_bytes() + probs_comm_bytes() handed to MPI.
TYPED_TEST(SequenceParallelLshTest, ProbsEqualOneProcess) {
  using T = TypeParam;
  for_each_lsh_case<T>(1000, [](const Case& c, const Problem<T>& p, const auto& one, auto& sharded, const auto& mine) {
    headmix::Workspace<T> ws1, ws;
    Tensor<T> want;
    const Tensor<T> want_out = one.forward(p.input(), ws1, &want);
    const SequenceSplit split = sharded.split(c.length());
    Tensor<T> probs;
    const Tensor<T> got = forward_with_probs(sharded, mine, c.length(), ws, probs);
    EXPECT_TRUE(all_close("this rank's output rows, with probs", got,
                          widen(split.take(want_out.batch(), world_rank())), sharded_tolerance<T>()));
    const Index T_ = c.length();
    expect_probs_equal(probs, want, sharded_tolerance<T>(), [&](Index b, Index i, Index j) {
      const bool padded = !p.padding.empty() && p.padding[static_cast<std::size_t>(b * T_ + j)] != 0;
      return j != i && ((p.s.causal && j > i) || padded);
    });
  });
}

// probs asked for on one rank only: the same error on every rank, no rank
// left in the weights' gather; then every rank asking works.
TEST(SequenceParallelLshErrors, ProbsOnOneRankThrowsOnEveryRank) {
  const Case c = cases()[1];  // causal, key padding
  const Problem<double> p = problem<double>(c, 802);
  const SequenceParallelLsh<double> sharded(p.w, p.options(), Communicator(MPI_COMM_WORLD));
  const SequenceSplit split = sharded.split(c.length());
  const Tensor<double> shard = split.take(p.input().query, world_rank());
  const headmix::AttentionInput<double> mine{shard.batch(), {}, p.input().key_padding};
  Tensor<double> out({p.s.B, split.rows(world_rank()), sharded.out_dim()});
  headmix::Workspace<double> ws;
  expect_probs_on_one_rank_throw(sharded, mine, c.length(), out.batch(), ws);
  Tensor<double> probs;
  sharded.forward(mine, c.length(), out.batch(), ws, &probs);
  EXPECT_EQ(probs.shape(), (std::vector<Index>{p.s.B, p.s.H, c.length(), c.length()}));
}

}  // namespace

int main(int argc, char** argv) { return headmix_mpi_test::run_all_tests(argc, argv); }
