// Head-parallel CollabHead and LSH over MPI, run by ctest under
// `mpiexec -n 2` and `-n 3`. H = P or 2P heads, so the same program shards
// differently on 2 and 3 processes; CollabHead's shared q and k [R, D] are
// replicated, LSH's one rotation too.
//
// The contract: the sharded layer equals the one-process layer on the same
// full weights and input (forward, gathered attention weights, decoding
// token by token, forward_scatter's rows) with dense mixing, block mixing
// (an exact MHA conversion's), without o and with the LayerNorm (after o,
// and on the gathered heads); each rank holds its heads' rows of mixing,
// content_bias and v and columns of o; the scale stays the full layer's
// across set_options; the bytes handed to MPI are comm_bytes(); every error
// is an error on every rank (ctest's timeout fails a hang). LSH: forward
// and gathered weights equal one process with a seeded and with a given
// rotation, shared or per head. The one-process layers are checked against the naive loops in
// test_collab_head.cpp and test_lsh.cpp.

#include "test_util.hpp"

#include "headmix/mpi/head_parallel_collab.hpp"
#include "headmix/mpi/head_parallel_lsh.hpp"
#include "mpi/mpi_test_util.hpp"
#include "mpi/sharded_checkpoint.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <limits>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_mpi_test;

constexpr Index kBatch = 2, kLength = 7, kKeys = 9, kWidth = 10, kKeyWidth = 6, kDv = 3, kOut = 5;

// As in test_head_parallel.cpp: o's dot products over n = H·Dv <= 18 terms
// become P partial sums added by MPI (Q̃ and K̃ are computed alike on every
// rank; V's GEMM has another height). Two orders of an n-term sum differ by
// at most 2·n·u·Σ|terms|, with Σ|terms| <= 2√n: below 864·u for n <= 36,
// absolute (the outputs are O(1)). Measured: a few u.
template <class T>
Tolerance sharded_tolerance() {
  return {0.0, 864 * std::numeric_limits<T>::epsilon() / 2};
}

struct Case {
  const char* name;
  Index heads_per_rank, shared_per_head;  // R = H · shared_per_head
  bool block_mixing, content_bias, cross, padded, causal, o, o_bias, v_bias;
  int threads;
  bool layer_norm = false;  // out_dim = D: o [D, H·Dv], or without o D = H·Dv
};

const Case kCases[] = {
    {"dense mixing, content bias, causal", 2, 3, false, true, false, false, true, true, true, true, 1},
    {"block mixing (an MHA conversion), cross-attention, key padding", 1, 2, true, false, true, true, false, true, true,
     false, 2},
    {"no o (gathered heads), content bias, causal, key padding", 2, 2, false, true, false, true, true, false, false,
     true, 1},
    {"LayerNorm after o, dense mixing, content bias, causal", 2, 2, false, true, false, false, true, true, true, true,
     1, true},
    {"LayerNorm on the gathered heads (no o), key padding", 1, 2, false, false, false, true, false, false, false, true,
     2, true},
};

// The full layer's weights, options and input.
template <class T>
using Problem = LayerProblem<headmix::CollabHead, T, headmix::CollabHeadWeights<T>, headmix::CollabHeadOptions>;

// The same seed gives the same weights and input on every rank.
template <class T>
Problem<T> make_problem(const Case& c, unsigned seed) {
  const Index H = c.heads_per_rank * world_size(), R = H * c.shared_per_head;
  const Index D = c.layer_norm && !c.o ? H * kDv : kWidth;  // LayerNorm(Xq + y) needs out_dim == D
  const Index Dkv = c.cross ? kKeyWidth : D, S = c.cross ? kKeys : kLength;
  Rng rng(seed);
  Problem<T> p;
  p.opt.num_heads = H;
  p.opt.causal = c.causal;
  p.opt.threads = c.threads;
  p.opt.block_rows = 3;
  p.w.q = random_matrix<T>(rng, R, D, 1.0 / std::sqrt(double(D)));
  p.w.k = random_matrix<T>(rng, R, Dkv, 1.0 / std::sqrt(double(Dkv)));
  p.w.mixing = random_matrix<T>(rng, H, R, 1.0);
  if (c.block_mixing)  // head h reads only its own shared dimensions
    for (Index h = 0; h < H; ++h)
      for (Index j = 0; j < R; ++j)
        if (j / c.shared_per_head != h) p.w.mixing(h, j) = T(0);
  if (c.content_bias) p.w.content_bias = random_matrix<T>(rng, H, Dkv, 1.0 / std::sqrt(double(Dkv)));
  p.w.v = random_linear<T>(rng, H * kDv, Dkv, c.v_bias);
  if (c.o) p.w.o = random_linear<T>(rng, c.layer_norm ? D : kOut, H * kDv, c.o_bias);
  if (c.layer_norm) {
    p.w.layer_norm.weight = random_vector<T>(rng, D, 0.5).array() + T(1);
    p.w.layer_norm.bias = random_vector<T>(rng, D, 0.5);
  }
  p.x = random_tensor<T>(rng, {kBatch, kLength, D}, 1.0);
  if (c.cross) p.kv = random_tensor<T>(rng, {kBatch, kKeys, Dkv}, 1.0);
  if (c.padded) p.padding = padding_every_third(kBatch, S);
  return p;
}

// check(case, problem, one-process layer, sharded layer) for every case,
// seeds counting up from `seed`.
template <class T, class Check>
void for_each_case(unsigned seed, Check check) {
  for_each_sharded_case(kCases, seed, make_problem<T>, check);
}

template <class T>
class HeadParallelCollabTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(HeadParallelCollabTest, Scalars, ScalarName);

TYPED_TEST(HeadParallelCollabTest, ForwardEqualsOneProcess) {
  using T = TypeParam;
  for_each_case<T>(100, [](const Case&, const Problem<T>& p, const auto& one, const auto& sharded) {
    expect_forward_equal<T>(p, one, sharded, sharded_tolerance<T>());
  });
}

TYPED_TEST(HeadParallelCollabTest, ForwardScatterIsTheRanksRowsOfOneProcess) {
  using T = TypeParam;
  for_each_case<T>(150, [](const Case& c, const Problem<T>& p, const auto& one, auto& sharded) {
    if (c.o) expect_scatter_equal<T>(p, one, sharded, sharded_tolerance<T>());
  });
}

TYPED_TEST(HeadParallelCollabTest, DecodingTokenByTokenEqualsOneProcess) {
  using T = TypeParam;
  for_each_case<T>(200, [](const Case& c, const Problem<T>& p, const auto& one, const auto& sharded) {
    if (c.cross) return;  // decoding is self-attention
    headmix::SequenceCache<T> cache1(kBatch, kLength), cache(kBatch, kLength);
    expect_steps_equal(p, one, sharded, cache1, cache, sharded_tolerance<T>());
    EXPECT_EQ(cache.size(), kLength);
  });
}

TYPED_TEST(HeadParallelCollabTest, ShardsAreTheRanksHeadsWithSharedProjectionsReplicated) {
  using T = TypeParam;
  const Case& c = kCases[0];  // dense mixing, content bias, every bias
  const Problem<T> p = make_problem<T>(c, 7);
  const HeadParallelCollabHead<T> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  const headmix::CollabHead<T> one(p.w, p.opt);
  const Index first = world_rank() * c.heads_per_rank, h = c.heads_per_rank;
  const auto& w = sharded.local().weights();
  EXPECT_EQ(sharded.first_head(), first);
  EXPECT_TRUE(w.q == p.w.q);
  EXPECT_TRUE(w.k == p.w.k);
  EXPECT_TRUE(w.mixing == p.w.mixing.middleRows(first, h));
  EXPECT_TRUE(w.content_bias == p.w.content_bias.middleRows(first, h));
  EXPECT_TRUE(w.v.weight == p.w.v.weight.middleRows(first * kDv, h * kDv));
  EXPECT_TRUE(w.v.bias == p.w.v.bias.segment(first * kDv, h * kDv));
  EXPECT_TRUE(w.o.weight == p.w.o.weight.middleCols(first * kDv, h * kDv));
  EXPECT_FALSE(w.o.has_bias());  // added once, after the sum
  EXPECT_TRUE(sharded.output_bias() == p.w.o.bias);
  // The full layer's default scale 1/sqrt(R/H), not the local 1/sqrt(R/(H/P)).
  EXPECT_EQ(sharded.local().scale_value(), one.scale_value());
}

TYPED_TEST(HeadParallelCollabTest, CommBytesAndFlops) {
  using T = TypeParam;
  for_each_case<T>(300, [](const Case& c, const Problem<T>& p, const auto& one, auto& sharded) {
    const Index S = p.input().keys().length(), R = p.w.q.rows(), D = p.w.q.cols(), Dkv = p.w.k.cols();
    const Index values = c.o ? kBatch * kLength * one.out_dim() : kBatch * kLength * c.heads_per_rank * kDv;
    EXPECT_EQ(sharded.comm_bytes(kBatch, kLength), 9 * sizeof(long long) + values * sizeof(T));
    headmix::Workspace<T> ws;
    sharded.communicator().reset_bytes();
    sharded.forward(p.input(), ws);
    EXPECT_EQ(sharded.communicator().bytes(), sharded.comm_bytes(kBatch, kLength));
    // The attention work splits; every rank repeats the shared projections Q̃ and K̃.
    const headmix::FlopCount f = sharded.flops(kBatch, kLength, S), f1 = one.flops(kBatch, kLength, S);
    EXPECT_EQ(sum_over_ranks(f.attention_macs), f1.attention_macs);
    const Index replicated = kBatch * (kLength * D + S * Dkv) * R;
    EXPECT_EQ(sum_over_ranks(f.projection_macs), f1.projection_macs + (world_size() - 1) * replicated);
  });
}

// A full CollabHead checkpoint under `prefix`.
template <class T>
headmix::io::TensorFile checkpoint(const headmix::CollabHeadWeights<T>& w, const std::string& prefix) {
  headmix::io::TensorFile file;
  put(file, prefix + "q.weight", w.q);
  put(file, prefix + "k.weight", w.k);
  put(file, prefix + "mixing", w.mixing);
  if (w.content_bias.size() != 0) put(file, prefix + "content_bias.weight", w.content_bias);
  put_linear(file, prefix + "v", w.v);
  put_linear(file, prefix + "o", w.o);
  if (w.layer_norm.weight.size() != 0) {
    put(file, prefix + "layer_norm.weight", w.layer_norm.weight);
    put(file, prefix + "layer_norm.bias", w.layer_norm.bias);
  }
  return file;
}

// The shared q and k, o's bias and the LayerNorm are read whole; mixing,
// content_bias, v and o are split by heads.
TYPED_TEST(HeadParallelCollabTest, FromTensorsReadsOnlyItsShard) {
  using T = TypeParam;
  for_each_case<T>(950, [](const Case&, const auto& p, const auto&, const auto&) {
    expect_loads_only_its_shard<HeadParallelCollabHead<T>>(
        p.w, p.opt, checkpoint(p.w, "enc.attn."), "enc.attn.",
        {"q.weight", "k.weight", "o.bias", "layer_norm.weight", "layer_norm.bias"}, p.input());
  });
}

// The LayerNorm, read apart from the local layer, is checked as one process
// checks it: the same message on every rank.
TEST(HeadParallelCollabErrors, CheckpointLayerNormOfTheWrongWidth) {
  for (const Case& c : {kCases[3], kCases[4]}) {
    SCOPED_TRACE(c.name);
    Problem<double> p = make_problem<double>(c, 960);
    p.w.layer_norm.bias.conservativeResize(p.w.layer_norm.bias.size() - 1);
    const auto file = checkpoint(p.w, "attn.");
    const std::string one_process =
        thrown([&] { headmix::CollabHead<double>::from_tensors(file, "attn.", p.opt); }).second;
    EXPECT_NE(one_process.find("attn.layer_norm.bias"), std::string::npos) << one_process;
    expect_error_everywhere(
        "shape_error", -1,
        [&] { HeadParallelCollabHead<double>::from_tensors(file, "attn.", p.opt, Communicator(MPI_COMM_WORLD)); },
        {one_process});
  }
}

TEST(HeadParallelCollabErrors, SetOptionsKeepsTheFullLayersScale) {
  const Problem<double> p = make_problem<double>(kCases[0], 400);
  HeadParallelCollabHead<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  headmix::CollabHeadOptions opt = p.opt;
  opt.causal = false;  // scale left to its default
  sharded.set_options(opt);
  const headmix::CollabHead<double> one(p.w, opt);
  EXPECT_EQ(sharded.local().scale_value(), one.scale_value());
  headmix::Workspace<double> ws;
  EXPECT_TRUE(all_close("output after set_options", sharded.forward(p.input(), ws), widen(one.forward(p.input(), ws)),
                        sharded_tolerance<double>()));
  // An explicit scale is kept as given.
  opt.scale = 0.25;
  sharded.set_options(opt);
  EXPECT_EQ(sharded.local().scale_value(), 0.25);
  // The head count is the shards'.
  opt.num_heads *= 2;
  expect_error_everywhere("shape_error", -1, [&] { sharded.set_options(opt); },
                          {"[head-parallel collab] num_heads", "the sharded layer's"});
}

TEST(HeadParallelCollabErrors, ShapesThatDoNotShard) {
  const int P = world_size();
  const Problem<double> p = make_problem<double>(kCases[2], 401);
  headmix::CollabHeadOptions opt = p.opt;
  opt.num_heads = P + 1;
  expect_error_everywhere("shape_error", -1,
                          [&] { HeadParallelCollabHead<double>(p.w, opt, Communicator(MPI_COMM_WORLD)); },
                          {"[head-parallel collab] num_heads", "a multiple of the process count " + std::to_string(P),
                           "got " + std::to_string(P + 1)});
  // The full weights are checked as one process checks them.
  headmix::CollabHeadWeights<double> w = p.w;
  w.mixing.conservativeResize(Eigen::NoChange, w.mixing.cols() - 1);
  expect_error_everywhere("shape_error", -1,
                          [&] { HeadParallelCollabHead<double>(w, p.opt, Communicator(MPI_COMM_WORLD)); },
                          {"[collab] mixing"});
  // A LayerNorm (run after the sum) still needs out_dim == D, as one process checks.
  w = p.w;
  w.layer_norm.weight = headmix::Vector<double>::Ones(kWidth);
  w.layer_norm.bias = headmix::Vector<double>::Zero(kWidth);
  expect_error_everywhere("shape_error", -1,
                          [&] { HeadParallelCollabHead<double>(w, p.opt, Communicator(MPI_COMM_WORLD)); },
                          {"[collab] out_dim", "LayerNorm(Xq + y) needs out_dim == D"});
}

TEST(HeadParallelCollabErrors, BadInputOnOneRankThrowsOnEveryRank) {
  ErrorTestLayer t(make_problem<double>(kCases[0], 402));
  t.expect_wide_query_on_last_rank_throws("[collab] input.query");
  // A cache that is full on rank 0 only: every rank throws, every cache keeps its size.
  headmix::SequenceCache<double> cache(kBatch, world_rank() == 0 ? 2 : kLength);
  Tensor<double> out3({kBatch, 3, kOut});
  expect_error_everywhere("cache_full_error", 0,
                          [&] { t.sharded.step(positions(t.p.x, 0, 3).batch(), cache, out3.batch(), t.ws); },
                          {"cache"});
  EXPECT_EQ(cache.size(), 0);
  t.expect_still_works();
}

// ---------------------------------------------------------------------------
// LSH

struct LshCase {
  const char* name;
  Index heads_per_rank;
  bool given_rotation, causal, padded, o, biases;
  int threads;
  bool per_head = false;  // rotations_per_head: rotation b·H + h over all H heads
};

const LshCase kLshCases[] = {
    {"seeded rotation, causal, o with bias", 2, false, true, false, true, true, 1},
    {"given rotation, key padding, no o", 1, true, false, true, false, false, 2},
    {"seeded rotations per head, causal, o with bias", 2, false, true, false, true, true, 1, true},
    {"given rotations per head, key padding, no o", 1, true, false, true, false, false, 2, true},
};

constexpr Index kLshDk = 4, kLshBuckets = 4;

struct LshProblem {
  headmix::LshWeights<double> w;
  headmix::LshOptions opt;
  Tensor<double> x;
  std::vector<std::uint8_t> padding;
};

template <class T>
headmix::LshWeights<T> narrowed(const headmix::LshWeights<double>& w) {
  auto cast = [](const headmix::Linear<double>& l) {
    headmix::Linear<T> out;
    out.weight = l.weight.template cast<T>();
    out.bias = l.bias.template cast<T>();
    return out;
  };
  headmix::LshWeights<T> n;
  n.qk = cast(w.qk), n.v = cast(w.v);
  if (!w.o.empty()) n.o = cast(w.o);
  if (w.rotations.rank() != 0) n.rotations = converted<T>(w.rotations);
  return n;
}

LshProblem make_lsh_problem(const LshCase& c, unsigned seed) {
  const Index H = c.heads_per_rank * world_size();
  Rng rng(seed);
  LshProblem p;
  p.opt.num_heads = H;
  p.opt.bucket_size = 2;  // T = 7 pads to 8: 4 chunks of 2 per round
  p.opt.n_hashes = 2;
  p.opt.n_buckets = kLshBuckets;
  p.opt.causal = c.causal;
  p.opt.threads = c.threads;
  p.opt.seed = 11;
  p.opt.rotations_per_head = c.per_head;
  p.w.qk = random_linear<double>(rng, H * kLshDk, kWidth, c.biases);
  p.w.v = random_linear<double>(rng, H * kDv, kWidth, c.biases);
  if (c.o) p.w.o = random_linear<double>(rng, kOut, H * kDv, c.biases);
  if (c.given_rotation)
    p.w.rotations = random_tensor<double>(rng, {c.per_head ? kBatch * H : 1, kLshDk, 2, kLshBuckets / 2}, 1.0);
  p.x = random_tensor<double>(rng, {kBatch, kLength, kWidth}, 1.0);
  if (c.padded) p.padding = padding_every_third(kBatch, kLength);
  return p;
}

template <class T>
headmix::AttentionInput<T> lsh_input(const LshProblem& p, const Tensor<T>& x) {
  headmix::AttentionInput<T> in;
  in.query = x.batch();
  if (!p.padding.empty()) in.key_padding = {p.padding.data(), kBatch, kLength};
  return in;
}

// check(case, problem) for every LSH case, seeds from `seed` up.
template <class Check>
void for_each_lsh_case(unsigned seed, Check check) {
  for (const LshCase& c : kLshCases) {
    SCOPED_TRACE(c.name);
    check(c, make_lsh_problem(c, seed++));
  }
}

template <class T>
class HeadParallelLshTest : public ::testing::Test {};
TYPED_TEST_SUITE(HeadParallelLshTest, Scalars, ScalarName);

TYPED_TEST(HeadParallelLshTest, ForwardEqualsOneProcess) {
  using T = TypeParam;
  for_each_lsh_case(500, [](const LshCase& c, const LshProblem& p) {
    const headmix::Lsh<T> one(narrowed<T>(p.w), p.opt);
    HeadParallelLsh<T> sharded(narrowed<T>(p.w), p.opt, Communicator(MPI_COMM_WORLD));
    const Tensor<T> x = converted<T>(p.x);
    headmix::Workspace<T> ws1, ws;
    Tensor<T> probs1, probs;
    const Tensor<T> want = one.forward(lsh_input(p, x), ws1, &probs1);
    const Tensor<T> got = sharded.forward(lsh_input(p, x), ws, &probs);
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_EQ(probs.shape(), probs1.shape());
    EXPECT_TRUE(all_close("output vs one process", got, widen(want), sharded_tolerance<T>()));
    EXPECT_TRUE(all_close("probs vs one process", probs, widen(probs1), sharded_tolerance<T>()));
    // Each rank's rows of qk and v, columns of o; the bytes; the work adds up.
    const Index first = sharded.first_head(), h = c.heads_per_rank;
    EXPECT_EQ(first, world_rank() * h);
    EXPECT_TRUE(sharded.local().weights().qk.weight == one.weights().qk.weight.middleRows(first * kLshDk, h * kLshDk));
    EXPECT_TRUE(sharded.local().weights().v.weight == one.weights().v.weight.middleRows(first * kDv, h * kDv));
    sharded.communicator().reset_bytes();
    sharded.forward(lsh_input(p, x), ws);
    EXPECT_EQ(sharded.communicator().bytes(), sharded.comm_bytes(kBatch, kLength));
    const headmix::FlopCount f = sharded.flops(kBatch, kLength, kLength), f1 = one.flops(kBatch, kLength, kLength);
    EXPECT_EQ(sum_over_ranks(f.projection_macs), f1.projection_macs);
    EXPECT_EQ(sum_over_ranks(f.attention_macs), f1.attention_macs);
  });
}

// The rotations and o's bias are read whole; qk, v and o split by heads.
TYPED_TEST(HeadParallelLshTest, FromTensorsReadsOnlyItsShard) {
  using T = TypeParam;
  for_each_lsh_case(550, [](const LshCase&, const LshProblem& p) {
    const headmix::LshWeights<T> w = narrowed<T>(p.w);
    headmix::io::TensorFile file;
    put_linear(file, "attn.qk", w.qk);
    put_linear(file, "attn.v", w.v);
    put_linear(file, "attn.o", w.o);
    if (w.rotations.rank() != 0) put(file, "attn.rotations", w.rotations);
    const Tensor<T> x = converted<T>(p.x);
    expect_loads_only_its_shard<HeadParallelLsh<T>>(w, p.opt, file, "attn.", {"o.bias", "rotations"}, lsh_input(p, x));
  });
}

TEST(HeadParallelLshErrors, ShapesThatDoNotShardAndBadInput) {
  const int P = world_size(), last = P - 1;
  const LshProblem p = make_lsh_problem(kLshCases[0], 600);
  headmix::LshOptions opt = p.opt;
  opt.num_heads = P + 1;
  expect_error_everywhere("shape_error", -1, [&] { HeadParallelLsh<double>(p.w, opt, Communicator(MPI_COMM_WORLD)); },
                          {"[head-parallel lsh] num_heads", "a multiple of the process count " + std::to_string(P)});
  // The full layer's rotation indexing is checked as one process checks it.
  opt = p.opt;
  opt.rotations_per_head = true;
  opt.rotation_head_offset = 1;  // without rotation_heads: past the layer's heads
  expect_error_everywhere("shape_error", -1, [&] { HeadParallelLsh<double>(p.w, opt, Communicator(MPI_COMM_WORLD)); },
                          {"[lsh] rotation_head_offset", "got 1"});
  // Cross-attention keys on the last rank only: LSH is self-attention.
  const HeadParallelLsh<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  headmix::Workspace<double> ws;
  Tensor<double> out({kBatch, kLength, kOut});
  headmix::AttentionInput<double> in = lsh_input(p, p.x);
  const Tensor<double> keys = p.x;  // other storage: not the query itself
  if (world_rank() == last) in.key = keys.batch();
  expect_error_everywhere("shape_error", last, [&] { sharded.forward(in, out.batch(), ws); }, {"[lsh]"});
  // set_options may turn per-head rotations on (each rank keeps its heads'
  // indexing), but not move the rotation indexing.
  HeadParallelLsh<double> changeable(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  opt = p.opt;
  opt.rotations_per_head = true;
  changeable.set_options(opt);
  EXPECT_EQ(changeable.local().options().rotation_head_offset, changeable.first_head());
  EXPECT_EQ(changeable.local().rotation_heads(), p.opt.num_heads);
  const headmix::Lsh<double> one(p.w, opt);
  EXPECT_TRUE(all_close("per-head rotations after set_options", changeable.forward(lsh_input(p, p.x), ws),
                        widen(one.forward(lsh_input(p, p.x), ws)), sharded_tolerance<double>()));
  opt.rotation_heads = 2 * p.opt.num_heads;
  expect_error_everywhere("shape_error", -1, [&] { changeable.set_options(opt); },
                          {"[head-parallel lsh] rotation_heads", "the sharded layer's"});
}

}  // namespace

int main(int argc, char** argv) { return headmix_mpi_test::run_all_tests(argc, argv); }
