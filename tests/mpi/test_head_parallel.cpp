// Head-parallel MHA and DCMHA over MPI, run by ctest under `mpiexec -n 2`
// and `-n 3`. Shapes follow the process count P (MHA: H = 2P or P heads,
// Hkv = P or 2P; DCMHA: G = P or 2P groups), so the same program shards
// differently on 2 and 3 processes.
//
// The contract: the sharded layer equals the one-process layer on the same
// full weights and input (forward, gathered attention weights, decoding
// token by token), each rank's share of weights, cache and work is 1/P,
// the bytes it hands to MPI are comm_bytes(), and every error is an error
// on every rank with no rank left in a collective (ctest's 120 s timeout
// fails a hang). Every rank checks its own results; a failure on any rank
// fails the run. MHA outputs are also checked against the naive double
// loops (DCMHA's one-process layer is, in test_dcmha.cpp).

#include "mpi/mpi_test_util.hpp"
#include "mpi/sharded_checkpoint.hpp"
#include "test_util.hpp"

#include "headmix/io/safetensors.hpp"
#include "headmix/mpi/head_parallel_dcmha.hpp"
#include "headmix/mpi/head_parallel_mha.hpp"
#include "reference/mha_reference.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_mpi_test;

constexpr Index kBatch = 2, kLength = 7, kKeys = 9, kWidth = 10, kKeyWidth = 6, kDk = 4, kDv = 3, kOut = 5;

// Sharded against one process. The heads' own arithmetic is the same; what
// changes is the order of sums: o's dot products over n = H·Dv terms become
// P partial sums added by MPI, and Q, K, V (and DCMHA's dynamic factors)
// come from GEMMs of other widths, which may reorder their dot products over
// D = 10. Two orders of an n-term sum differ by at most 2·n·u·Σ|terms|
// (u = unit roundoff); here n <= 36 (DCMHA, 3 ranks), |context| <= 2 and
// |o weights| <= 1/√n, so Σ|terms| <= 2√n = 12 and the bound is
// 2·36·12·u = 864·u: 5.2e-5 in float, 9.6e-14 in double, absolute (the
// outputs are O(1)). Measured: a few u.
template <class T>
Tolerance sharded_tolerance() {
  return {0.0, 864 * std::numeric_limits<T>::epsilon() / 2};
}

// ---------------------------------------------------------------------------
// Problems

struct Case {
  const char* name;
  Index heads_per_rank, kv_heads_per_rank;
  bool cross, padded, causal;
  Index window;
  bool o, o_bias, qkv_bias;
  int threads;
};

const Case kCases[] = {
    {"self-attention, causal", 2, 2, false, false, true, 0, true, true, true, 1},
    {"cross-attention, key padding, grouped-query", 2, 1, true, true, false, 0, true, true, true, 2},
    {"causal grouped-query, key padding, no o (gathered heads)", 2, 1, false, true, true, 0, false, false, true, 1},
    {"one head per rank, window 3, no biases", 1, 1, false, false, true, 3, true, false, false, 1},
};

// The full layers' weights, options and input.
template <class T>
using Problem = LayerProblem<headmix::Mha, T, headmix::MhaWeights<T>, headmix::MhaOptions>;
template <class T>
using DcmhaProblem = LayerProblem<headmix::Dcmha, T, headmix::DcmhaWeights<T>, headmix::DcmhaOptions>;

// The same seed gives the same weights and input on every rank.
template <class T>
Problem<T> make_problem(const Case& c, unsigned seed) {
  const Index P = world_size(), H = c.heads_per_rank * P, Hkv = c.kv_heads_per_rank * P;
  const Index Dkv = c.cross ? kKeyWidth : kWidth, S = c.cross ? kKeys : kLength;
  Rng rng(seed);
  Problem<T> p;
  p.opt.num_heads = H;
  p.opt.num_kv_heads = Hkv == H ? 0 : Hkv;
  p.opt.causal = c.causal;
  p.opt.window = c.window;
  p.opt.threads = c.threads;
  p.opt.block_rows = 3;  // several query blocks
  p.w.q = random_linear<T>(rng, H * kDk, kWidth, c.qkv_bias);
  p.w.k = random_linear<T>(rng, Hkv * kDk, Dkv, c.qkv_bias);
  p.w.v = random_linear<T>(rng, Hkv * kDv, Dkv, c.qkv_bias);
  if (c.o) p.w.o = random_linear<T>(rng, kOut, H * kDv, c.o_bias);
  p.x = random_tensor<T>(rng, {kBatch, kLength, kWidth}, 1.0);
  if (c.cross) p.kv = random_tensor<T>(rng, {kBatch, kKeys, Dkv}, 1.0);
  if (c.padded) p.padding = padding_every_third(kBatch, S);
  return p;
}

struct DcmhaCase {
  const char* name;
  Index groups_per_rank, group_heads, kv_heads_per_rank;  // kv 0: one per head
  bool causal, padded, o, static_w, use_pre, use_post, query_wise, key_wise;
  headmix::DcmhaGelu gelu;
  int threads;
};

const DcmhaCase kDcmhaCases[] = {
    {"one group per rank, causal, every branch, static terms", 1, 2, 0, true, false, true, true, true, true, true,
     true, headmix::DcmhaGelu::erf, 1},
    {"two groups per rank, key padding, grouped-query, no o, post only", 2, 2, 1, false, true, false, false, false,
     true, true, true, headmix::DcmhaGelu::tanh, 2},
    {"three heads per group, causal, pre only, key-wise only", 1, 3, 0, true, false, true, false, true, false, false,
     true, headmix::DcmhaGelu::erf, 1},
};

template <class T>
DcmhaProblem<T> make_problem(const DcmhaCase& c, unsigned seed) {
  const Index P = world_size(), G = c.groups_per_rank * P, M = c.group_heads, H = G * M, R = 2, K = 3;
  Rng rng(seed);
  DcmhaProblem<T> p;
  p.opt.num_heads = H, p.opt.groups = G, p.opt.num_kv_heads = c.kv_heads_per_rank * P;
  p.opt.causal = c.causal, p.opt.threads = c.threads, p.opt.block_rows = 3, p.opt.rank = R;
  p.opt.static_w = c.static_w, p.opt.use_pre = c.use_pre, p.opt.use_post = c.use_post;
  p.opt.query_wise = c.query_wise, p.opt.key_wise = c.key_wise, p.opt.gelu = c.gelu;
  const Index Hkv = c.kv_heads_per_rank == 0 ? H : c.kv_heads_per_rank * P;
  p.w.q = random_linear<T>(rng, H * kDk, kWidth);
  p.w.k = random_linear<T>(rng, Hkv * kDk, kWidth);
  p.w.v = random_linear<T>(rng, Hkv * kDv, kWidth);
  if (c.o) p.w.o = random_linear<T>(rng, kOut, H * kDv);
  const double in_bound = 2.0 / std::sqrt(static_cast<double>(kWidth));
  p.w.dw1 = random_tensor<T>(rng, {kWidth, G, 4, K}, in_bound);
  p.w.qkw = random_tensor<T>(rng, {G, 4, K, 2 * R, M}, 1.0 / std::sqrt(static_cast<double>(K)));
  p.w.dd = random_tensor<T>(rng, {kWidth, G, 4 * M}, in_bound);
  if (c.static_w) {
    if (c.use_pre) p.w.pre_w = random_tensor<T>(rng, {G, M, M}, 0.5);
    if (c.use_post) p.w.post_w = random_tensor<T>(rng, {G, M, M}, 0.5);
  }
  p.x = random_tensor<T>(rng, {kBatch, kLength, kWidth}, 1.0);
  if (c.padded) p.padding = padding_every_third(kBatch, kLength);
  return p;
}

// The naive double loops on the full problem.
template <class T>
headmix_ref::RefMhaResult reference(const Problem<T>& p) {
  using headmix_ref::RefLinear;
  const headmix_ref::RefMhaWeights w{ref_linear_as<RefLinear>(p.w.q), ref_linear_as<RefLinear>(p.w.k),
                                     ref_linear_as<RefLinear>(p.w.v), ref_linear_as<RefLinear>(p.w.o)};
  headmix_ref::RefMhaOptions o;
  o.num_heads = static_cast<int>(p.opt.num_heads), o.num_kv_heads = static_cast<int>(p.opt.num_kv_heads);
  o.causal = p.opt.causal, o.window = p.opt.window;
  const headmix_ref::RefBatch q = ref_batch(p.x);
  if (p.kv.rank() == 0) return headmix_ref::mha_reference(w, o, q, nullptr, p.padding);
  const headmix_ref::RefBatch k = ref_batch(p.kv);
  return headmix_ref::mha_reference(w, o, q, &k, p.padding);
}

// ---------------------------------------------------------------------------
// Tests

// check(case, problem, one-process layer, sharded layer) for every case,
// seeds counting up from `seed`.
template <class T, class Cases, class Check>
void for_each_case(const Cases& cases, unsigned seed, Check check) {
  for_each_sharded_case(cases, seed, [](const auto& c, unsigned s) { return make_problem<T>(c, s); }, check);
}

// Decoding token by token equals one process (expect_steps_equal); each
// rank caches about 1/P.
template <class T, class Problem_, class One, class Sharded>
void expect_decoding_equal(const Problem_& p, const One& one, const Sharded& sharded, Tolerance tol,
                           bool padded_cache = false) {
  headmix::SequenceCache<T> cache1(kBatch, kLength), cache(kBatch, kLength);
  expect_steps_equal(p, one, sharded, cache1, cache, tol);
  // Exactly 1/P, unless the layer pads its cache rows (DCMHA pads each
  // key-factor row to an odd number of cache lines, per cache).
  const std::size_t P = static_cast<std::size_t>(world_size());
  if (!padded_cache) {
    EXPECT_EQ(cache.bytes() * P, cache1.bytes());
  }
  EXPECT_GE(cache.bytes() * P, cache1.bytes());
  EXPECT_LE(cache.bytes() * P, cache1.bytes() + cache1.bytes() / 50);
}

// The P ranks' flops add up to one process's, and the attention work is
// split evenly.
template <class Problem_, class One, class Sharded>
void expect_flops_add_up(const Problem_& p, const One& one, const Sharded& sharded) {
  const Index S = p.input().keys().length();
  const headmix::FlopCount f = sharded.flops(kBatch, kLength, S), f1 = one.flops(kBatch, kLength, S);
  EXPECT_EQ(sum_over_ranks(f.projection_macs), f1.projection_macs);
  EXPECT_EQ(sum_over_ranks(f.attention_macs), f1.attention_macs);
  EXPECT_EQ(f.attention_macs * world_size(), f1.attention_macs);
}

// comm_bytes() against a count by hand, then against what the
// Communicator counted in a forward, a forward with probs and a step: the
// 9 long longs of the agreement, then the output sum (with o) or this
// rank's gathered heads (without), plus the probs gather.
template <class T, class Problem_, class Sharded>
void expect_comm_bytes(const Problem_& p, Sharded& sharded, bool o, Index local_heads) {
  const Index S = p.input().keys().length();
  const Index values = o ? kBatch * kLength * kOut : kBatch * kLength * local_heads * kDv;
  EXPECT_EQ(sharded.comm_bytes(kBatch, kLength), 9 * sizeof(long long) + values * sizeof(T));
  EXPECT_EQ(sharded.probs_comm_bytes(kBatch, kLength, S), kBatch * local_heads * kLength * S * sizeof(T));

  headmix::Workspace<T> ws;
  sharded.communicator().reset_bytes();
  sharded.forward(p.input(), ws);
  EXPECT_EQ(sharded.communicator().bytes(), sharded.comm_bytes(kBatch, kLength));
  Tensor<T> probs;
  sharded.communicator().reset_bytes();
  sharded.forward(p.input(), ws, &probs);
  EXPECT_EQ(sharded.communicator().bytes(),
            sharded.comm_bytes(kBatch, kLength) + sharded.probs_comm_bytes(kBatch, kLength, S));
  if (!p.input().self_attention()) return;
  headmix::SequenceCache<T> cache(kBatch, kLength);
  sharded.communicator().reset_bytes();
  sharded.step(positions(p.x, 0, 3).batch(), cache, ws);
  EXPECT_EQ(sharded.communicator().bytes(), sharded.comm_bytes(kBatch, 3));
}

template <class T>
class HeadParallelMhaTest : public ::testing::Test {};
template <class T>
class HeadParallelDcmhaTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(HeadParallelMhaTest, Scalars, ScalarName);
TYPED_TEST_SUITE(HeadParallelDcmhaTest, Scalars, ScalarName);

TYPED_TEST(HeadParallelMhaTest, ForwardEqualsOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kCases, 100, [](const Case&, const Problem<T>& p, const headmix::Mha<T>& one,
                                   const HeadParallelMha<T>& sharded) {
    const Tensor<T> got = expect_forward_equal<T>(p, one, sharded, sharded_tolerance<T>());
    const headmix_ref::RefMhaResult ref = reference(p);
    EXPECT_TRUE(all_close("output vs naive loops", got, ref.output, default_tolerance<T>()));
    headmix::Workspace<T> ws;
    Tensor<T> probs;
    sharded.forward(p.input(), ws, &probs);
    EXPECT_TRUE(all_close("probs vs naive loops", probs, ref.probs, default_tolerance<T>()));
  });
}

TYPED_TEST(HeadParallelMhaTest, ShardsAreTheRanksRowsAndColumns) {
  using T = TypeParam;
  const Case& c = kCases[1];  // grouped-query, with every bias
  const Problem<T> p = make_problem<T>(c, 7);
  const HeadParallelMha<T> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  const Index r = world_rank(), h = c.heads_per_rank, hkv = c.kv_heads_per_rank;
  const auto& w = sharded.local().weights();
  EXPECT_EQ(sharded.first_head(), r * h);
  EXPECT_EQ(sharded.local_kv_heads(), hkv);
  EXPECT_TRUE(w.q.weight == p.w.q.weight.middleRows(r * h * kDk, h * kDk));
  EXPECT_TRUE(w.q.bias == p.w.q.bias.segment(r * h * kDk, h * kDk));
  EXPECT_TRUE(w.k.weight == p.w.k.weight.middleRows(r * hkv * kDk, hkv * kDk));
  EXPECT_TRUE(w.v.bias == p.w.v.bias.segment(r * hkv * kDv, hkv * kDv));
  EXPECT_TRUE(w.o.weight == p.w.o.weight.middleCols(r * h * kDv, h * kDv));
  EXPECT_FALSE(w.o.has_bias());  // added once, after the sum
  EXPECT_TRUE(sharded.output_bias() == p.w.o.bias);
}

TYPED_TEST(HeadParallelMhaTest, DecodingTokenByTokenEqualsOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kCases, 200, [](const Case& c, const Problem<T>& p, const auto& one, const auto& sharded) {
    if (!c.cross) expect_decoding_equal<T>(p, one, sharded, sharded_tolerance<T>());  // decoding is self-attention
  });
}

TYPED_TEST(HeadParallelMhaTest, CommBytesAreWhatIsHandedToMpi) {
  using T = TypeParam;
  for_each_case<T>(kCases, 300, [](const Case& c, const Problem<T>& p, const auto&, auto& sharded) {
    expect_comm_bytes<T>(p, sharded, c.o, c.heads_per_rank);
  });
}

TYPED_TEST(HeadParallelMhaTest, ForwardScatterIsTheRanksRowsOfOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kCases, 1000, [](const Case& c, const auto& p, const auto& one, auto& sharded) {
    if (c.o) expect_scatter_equal<T>(p, one, sharded, sharded_tolerance<T>());
  });
}

TYPED_TEST(HeadParallelDcmhaTest, ForwardScatterIsTheRanksRowsOfOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kDcmhaCases, 1100, [](const DcmhaCase& c, const auto& p, const auto& one, auto& sharded) {
    if (c.o) expect_scatter_equal<T>(p, one, sharded, sharded_tolerance<T>());
  });
}

// After the prompt (which binds the caches: agreement, then data), a step
// is one collective, two with probs; step_comm_bytes() is what it hands
// to MPI.
TYPED_TEST(HeadParallelMhaTest, OneCollectivePerDecodingStep) {
  using T = TypeParam;
  for_each_case<T>(kCases, 1200, [](const Case& c, const auto& p, const auto&, auto& sharded) {
    if (c.cross) return;
    headmix::SequenceCache<T> cache(kBatch, kLength);
    headmix::Workspace<T> ws;
    Communicator& comm = sharded.communicator();
    comm.reset_counts();
    sharded.step(positions(p.x, 0, 2).batch(), cache, ws);
    EXPECT_EQ(comm.collectives(), 2u);
    EXPECT_EQ(comm.bytes(), sharded.comm_bytes(kBatch, 2));
    comm.reset_counts();
    sharded.step(positions(p.x, 2, 1).batch(), cache, ws);
    EXPECT_EQ(comm.collectives(), 1u);
    EXPECT_EQ(comm.bytes(), sharded.step_comm_bytes(kBatch, 1));
    // The status: a failure flag and two entries for each of 2 values, per rank.
    EXPECT_EQ(sharded.step_comm_bytes(kBatch, 1), (kBatch * sharded.out_dim() + 5 * world_size()) * sizeof(T));
    Tensor<T> probs;
    comm.reset_counts();
    sharded.step(positions(p.x, 3, 2).batch(), cache, ws, &probs);
    EXPECT_EQ(comm.collectives(), 2u);
    EXPECT_EQ(comm.bytes(), sharded.step_comm_bytes(kBatch, 2) + sharded.probs_comm_bytes(kBatch, 2, 5));
    EXPECT_EQ(cache.size(), 5);
  });
}

TYPED_TEST(HeadParallelMhaTest, FlopsAddUpToOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kCases, 400, [](const Case&, const auto& p, const auto& one, const auto& sharded) {
    expect_flops_add_up(p, one, sharded);
  });
}

TYPED_TEST(HeadParallelDcmhaTest, ForwardEqualsOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kDcmhaCases, 700, [](const DcmhaCase&, const auto& p, const auto& one, const auto& sharded) {
    expect_forward_equal<T>(p, one, sharded, sharded_tolerance<T>());
  });
}

TYPED_TEST(HeadParallelDcmhaTest, ShardsAreTheRanksGroups) {
  using T = TypeParam;
  const DcmhaCase& c = kDcmhaCases[0];  // static terms
  const DcmhaProblem<T> p = make_problem<T>(c, 17);
  const HeadParallelDcmha<T> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  const auto& w = sharded.local().weights();
  const Index r = world_rank(), g = c.groups_per_rank, M = c.group_heads;
  EXPECT_EQ(sharded.local().groups(), g);
  EXPECT_EQ(sharded.local().num_heads(), g * M);
  // Entries of each per-group tensor at group r·g + i equal the local ones at i.
  auto same_group = [&](const Tensor<T>& local, const Tensor<T>& full, std::size_t axis, Index i) {
    Index outer = 1, inner = 1;
    for (std::size_t a = 0; a < axis; ++a) outer *= full.dim(a);
    for (std::size_t a = axis + 1; a < full.shape().size(); ++a) inner *= full.dim(a);
    for (Index o = 0; o < outer; ++o)
      for (Index e = 0; e < inner; ++e)
        if (local[(o * g + i) * inner + e] != full[(o * full.dim(axis) + r * g + i) * inner + e]) return false;
    return true;
  };
  for (Index i = 0; i < g; ++i) {
    EXPECT_TRUE(same_group(w.dw1, p.w.dw1, 1, i)) << "dc.dw1 group " << i;
    EXPECT_TRUE(same_group(w.qkw, p.w.qkw, 0, i)) << "dc.qkw group " << i;
    EXPECT_TRUE(same_group(w.dd, p.w.dd, 1, i)) << "dc.dd group " << i;
    EXPECT_TRUE(same_group(w.pre_w, p.w.pre_w, 0, i)) << "dc.pre_w group " << i;
    EXPECT_TRUE(same_group(w.post_w, p.w.post_w, 0, i)) << "dc.post_w group " << i;
  }
  EXPECT_EQ(w.dw1.dim(1), g);
  EXPECT_TRUE(w.q.weight == p.w.q.weight.middleRows(r * g * M * kDk, g * M * kDk));
  EXPECT_TRUE(w.o.weight == p.w.o.weight.middleCols(r * g * M * kDv, g * M * kDv));
}

TYPED_TEST(HeadParallelDcmhaTest, DecodingTokenByTokenEqualsOneProcess) {
  using T = TypeParam;
  for_each_case<T>(kDcmhaCases, 800, [](const DcmhaCase&, const auto& p, const auto& one, const auto& sharded) {
    expect_decoding_equal<T>(p, one, sharded, sharded_tolerance<T>(), true);
  });
}

TYPED_TEST(HeadParallelDcmhaTest, CommBytesAndFlops) {
  using T = TypeParam;
  for_each_case<T>(kDcmhaCases, 900, [](const DcmhaCase& c, const auto& p, const auto& one, auto& sharded) {
    expect_comm_bytes<T>(p, sharded, c.o, c.groups_per_rank * c.group_heads);
    expect_flops_add_up(p, one, sharded);
  });
}

// A full checkpoint, read by every rank, each keeping its slice: q, k, v
// and o of either variant's weights.
template <class T, class Weights>
headmix::io::TensorFile checkpoint(const Weights& w, const std::string& prefix) {
  headmix::io::TensorFile file;
  put_linear(file, prefix + "q", w.q);
  put_linear(file, prefix + "k", w.k);
  put_linear(file, prefix + "v", w.v);
  put_linear(file, prefix + "o", w.o);
  return file;
}

// DCMHA's: q, k, v, o and the dc.* tensors.
template <class T>
headmix::io::TensorFile checkpoint(const headmix::DcmhaWeights<T>& w, const std::string& prefix) {
  headmix::io::TensorFile file = checkpoint<T, headmix::DcmhaWeights<T>>(w, prefix);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor<T>*>{"dc.dw1", &w.dw1}, {"dc.qkw", &w.qkw},
                                {"dc.dd", &w.dd}, {"dc.pre_w", &w.pre_w}, {"dc.post_w", &w.post_w}})
    if (t->rank() != 0) put(file, prefix + name, *t);
  return file;
}

TYPED_TEST(HeadParallelMhaTest, FromTensorsEqualsShardedWeights) {
  using T = TypeParam;
  const Problem<T> p = make_problem<T>(kCases[2], 500);  // grouped-query, no o
  const auto file = checkpoint<T>(p.w, "layer.3.attn.");
  const auto loaded = HeadParallelMha<T>::from_tensors(file, "layer.3.attn.", p.opt, Communicator(MPI_COMM_WORLD));
  const HeadParallelMha<T> direct(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  headmix::Workspace<T> ws;
  EXPECT_TRUE(bit_identical("output", loaded.forward(p.input(), ws), direct.forward(p.input(), ws)));
  EXPECT_TRUE(loaded.local().weights().v.weight == direct.local().weights().v.weight);
}

// Every tensor but o's bias is split: a rank reads a P-th of each.
TYPED_TEST(HeadParallelMhaTest, FromTensorsReadsOnlyItsShard) {
  using T = TypeParam;
  for_each_case<T>(kCases, 510, [](const Case&, const Problem<T>& p, const auto&, const auto&) {
    expect_loads_only_its_shard<HeadParallelMha<T>>(p.w, p.opt, checkpoint<T>(p.w, "layer.1.attn."), "layer.1.attn.",
                                                    {"o.bias"}, p.input());
  });
}

TYPED_TEST(HeadParallelDcmhaTest, FromTensorsEqualsShardedWeights) {
  using T = TypeParam;
  const DcmhaProblem<T> p = make_problem<T>(kDcmhaCases[0], 501);  // static terms
  const auto file = checkpoint<T>(p.w, "blocks.0.attn.");
  const auto loaded = HeadParallelDcmha<T>::from_tensors(file, "blocks.0.attn.", p.opt, Communicator(MPI_COMM_WORLD));
  const HeadParallelDcmha<T> direct(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  headmix::Workspace<T> ws;
  EXPECT_TRUE(bit_identical("output", loaded.forward(p.input(), ws), direct.forward(p.input(), ws)));
  EXPECT_TRUE(bit_identical("dc.qkw", loaded.local().weights().qkw, direct.local().weights().qkw));
}

// The dc.* tensors are split by groups, the projections by heads.
TYPED_TEST(HeadParallelDcmhaTest, FromTensorsReadsOnlyItsShard) {
  using T = TypeParam;
  for_each_case<T>(kDcmhaCases, 520, [](const DcmhaCase&, const auto& p, const auto&, const auto&) {
    expect_loads_only_its_shard<HeadParallelDcmha<T>>(p.w, p.opt, checkpoint<T>(p.w, "blocks.2.attn."),
                                                      "blocks.2.attn.", {"o.bias"}, p.input());
  });
}

TEST(HeadParallelMhaErrors, HeadsThatDoNotShard) {
  const int P = world_size();
  const Problem<double> p = make_problem<double>(kCases[0], 600);
  // H = P + 1 is not a multiple of P (P >= 2).
  headmix::MhaOptions opt = p.opt;
  opt.num_heads = P + 1;
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelMha<double>(p.w, opt, Communicator(MPI_COMM_WORLD)); },
      {"[head-parallel mha] num_heads", "a multiple of the process count " + std::to_string(P),
       "got " + std::to_string(P + 1)});
  // Multi-query attention (one KV head) does not split over P >= 2 ranks.
  opt = p.opt;
  opt.num_kv_heads = 1;
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelMha<double>(p.w, opt, Communicator(MPI_COMM_WORLD)); },
      {"num_kv_heads", "whole KV heads", "got 1"});
  // The full weights are checked as the one-process layer checks them.
  headmix::MhaWeights<double> w = p.w;
  w.o.weight.conservativeResize(kOut, w.o.weight.cols() - 1);
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelMha<double>(w, p.opt, Communicator(MPI_COMM_WORLD)); }, {"[mha] o.weight"});
}

TEST(HeadParallelMhaErrors, CheckpointThatLacksASlice) {
  const Problem<double> p = make_problem<double>(kCases[1], 601);
  const Communicator comm(MPI_COMM_WORLD);
  // k.weight stored for one KV head fewer: the last rank's slice is missing.
  // The error is the one-process layer's, from the file and from memory.
  headmix::MhaWeights<double> w = p.w;
  w.k.weight.conservativeResize(w.k.weight.rows() - kDk, Eigen::NoChange);
  auto file = checkpoint<double>(w, "attn.");
  const std::string one_process = thrown([&] { headmix::Mha<double>::from_tensors(file, "attn.", p.opt); }).second;
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelMha<double>::from_tensors(file, "attn.", p.opt, comm); },
      {one_process});
  const SavedCheckpoint saved(file, "lacks_a_slice");
  const headmix::io::SafetensorsReader reader(saved.path());
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelMha<double>::from_tensors(reader, "attn.", p.opt, comm); },
      {one_process});
  // A bias one entry short, whose extent no longer splits over P: the
  // one-process message again.
  w = p.w;
  w.q.bias.conservativeResize(w.q.bias.size() - 1);
  file = checkpoint<double>(w, "attn.");
  const std::string short_bias = thrown([&] { headmix::Mha<double>::from_tensors(file, "attn.", p.opt); }).second;
  EXPECT_NE(short_bias.find("attn.q.bias"), std::string::npos) << short_bias;
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelMha<double>::from_tensors(file, "attn.", p.opt, comm); }, {short_bias});
  // A missing tensor.
  file = checkpoint<double>(p.w, "attn.");
  file.tensors.erase("attn.v.weight");
  expect_error_everywhere(
      "io_error", -1, [&] { HeadParallelMha<double>::from_tensors(file, "attn.", p.opt, comm); }, {"attn.v.weight"});
  // Only the last rank's file lacks it: every rank throws the same error type.
  const int last = world_size() - 1;
  const auto full = checkpoint<double>(p.w, "attn.");
  expect_error_everywhere(
      "io_error", last,
      [&] { HeadParallelMha<double>::from_tensors(world_rank() == last ? file : full, "attn.", p.opt, comm); },
      {"attn.v.weight"});
}

TEST(HeadParallelMhaErrors, BadInputOnOneRankThrowsOnEveryRank) {
  const Problem<double> p = make_problem<double>(kCases[0], 602);
  ErrorTestLayer t(p);
  t.expect_wide_query_on_last_rank_throws("[mha] input.query");
  const auto& sharded = t.sharded;
  auto& ws = t.ws;
  auto& out = t.out;
  const int last = world_size() - 1;

  // Rank 0's output buffer has the wrong width.
  Tensor<double> narrow({kBatch, kLength, kOut - 1});
  expect_error_everywhere(
      "shape_error", 0, [&] { sharded.forward(p.input(), world_rank() == 0 ? narrow.batch() : out.batch(), ws); },
      {"[head-parallel mha] output"});

  // Valid on each rank, but the last rank passes one query fewer: the
  // collectives would not match.
  auto in = p.input();
  Tensor<double> fewer({kBatch - 1, kLength, kOut});
  if (world_rank() == last) in.query = {p.x.data(), kBatch - 1, kLength, kWidth};
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.forward(in, world_rank() == last ? fewer.batch() : out.batch(), ws); },
      {"arguments across ranks", "batch from " + std::to_string(kBatch - 1) + " to " + std::to_string(kBatch)});

  // Only rank 0 asks for the attention weights.
  Tensor<double> probs;
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.forward(p.input(), out.batch(), ws, world_rank() == 0 ? &probs : nullptr); },
      {"probs from 0 to 1"});
  t.expect_still_works();
}

TEST(HeadParallelMhaErrors, DecodingErrorOnOneRankKeepsEveryCache) {
  const Problem<double> p = make_problem<double>(kCases[0], 603);
  const HeadParallelMha<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  const int last = world_size() - 1;
  headmix::Workspace<double> ws;
  // The last rank's cache holds 3 positions, the others' 5.
  headmix::SequenceCache<double> cache(kBatch, world_rank() == last ? 3 : 5);
  Tensor<double> out({kBatch, 2, kOut});
  sharded.step(positions(p.x, 0, 2).batch(), cache, out.batch(), ws);
  // 2 more fit everywhere but on the last rank: every rank throws, and every
  // cache keeps its 2 positions (the others had already appended theirs).
  expect_error_everywhere(
      "cache_full_error", last, [&] { sharded.step(positions(p.x, 2, 2).batch(), cache, out.batch(), ws); },
      {"[mha] cache", "do not fit"});
  EXPECT_EQ(cache.size(), 2);
  // A cache of another length on one rank.
  if (world_rank() == last) cache.truncate(1);
  Tensor<double> out1({kBatch, 1, kOut});
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.step(positions(p.x, 2, 1).batch(), cache, out1.batch(), ws); },
      {"cached positions from 1 to 2"});
  EXPECT_EQ(cache.size(), world_rank() == last ? 1 : 2);

  // Decoding goes on, and equals the one-process layer.
  cache.truncate(1);
  headmix::Mha<double> one(p.w, p.opt);
  headmix::SequenceCache<double> cache1(kBatch, 5);
  one.step(positions(p.x, 0, 1).batch(), cache1, ws);
  const Tensor<double> want = one.step(positions(p.x, 1, 1).batch(), cache1, ws);
  const Tensor<double> got = sharded.step(positions(p.x, 1, 1).batch(), cache, ws);
  EXPECT_TRUE(all_close("step after the errors", got, widen(want), sharded_tolerance<double>()));
}

// Bad input on one rank in a step on a bound cache (one collective, the
// agreement in it): every rank throws, no rank hangs, every cache keeps its
// size, and decoding goes on equal to one process.
TEST(HeadParallelMhaErrors, InBandStepErrorsOnEveryRank) {
  for (const Case& c : {kCases[0], kCases[2]}) {  // with o, and without (a zeroed full-width sum)
    SCOPED_TRACE(c.name);
    const Problem<double> p = make_problem<double>(c, 610);
    HeadParallelMha<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
    const headmix::Mha<double> one(p.w, p.opt);
    const int last = world_size() - 1;
    const Index W = one.out_dim();
    headmix::Workspace<double> ws, ws1;
    headmix::SequenceCache<double> cache(kBatch, kLength), cache1(kBatch, kLength);
    sharded.step(positions(p.x, 0, 2).batch(), cache, ws);
    one.step(positions(p.x, 0, 2).batch(), cache1, ws1);
    const Tensor<double> x = positions(p.x, 2, 1);
    Tensor<double> out({kBatch, 1, W}), wide({kBatch, 1, kWidth + 1});
    sharded.communicator().reset_counts();
    // The last rank's token is one column too wide.
    expect_error_everywhere(
        "shape_error", last,
        [&] { sharded.step(world_rank() == last ? wide.batch() : x.batch(), cache, out.batch(), ws); },
        {"[mha] input.query"});
    // Rank 0's output buffer has the wrong width.
    Tensor<double> narrow({kBatch, 1, W - 1});
    expect_error_everywhere(
        "shape_error", 0,
        [&] { sharded.step(x.batch(), cache, world_rank() == 0 ? narrow.batch() : out.batch(), ws); },
        {"[head-parallel mha] output"});
    // The last rank's token is for one sequence fewer than its cache holds.
    const headmix::ConstBatchView<double> fewer =
        world_rank() == last ? headmix::ConstBatchView<double>(x.data(), kBatch - 1, 1, kWidth) : x.batch();
    expect_error_everywhere(
        "shape_error", last, [&] { sharded.step(fewer, cache, out.batch(), ws); },
        {"[head-parallel mha] input batch"});
    // Only rank 0 asks for the attention weights.
    Tensor<double> probs;
    expect_error_everywhere(
        "shape_error", -1,
        [&] { sharded.step(x.batch(), cache, out.batch(), ws, world_rank() == 0 ? &probs : nullptr); },
        {"arguments across ranks", "probs from 0 to 1"});
    EXPECT_EQ(cache.size(), 2);
    // Each failed step was one collective, plus the failing rank's message
    // (two broadcasts) when one rank failed.
    EXPECT_EQ(sharded.communicator().collectives(), 3u * 3 + 1);
    const Tensor<double> want = one.step(x.batch(), cache1, ws1);
    sharded.step(x.batch(), cache, out.batch(), ws);
    EXPECT_TRUE(all_close("step after the errors", out, widen(want), sharded_tolerance<double>()));
  }
}

TEST(HeadParallelMhaErrors, ForwardScatterNeedsO) {
  const Problem<double> p = make_problem<double>(kCases[2], 611);  // no o
  const HeadParallelMha<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  headmix::Workspace<double> ws;
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.forward_scatter(p.input(), ws); },
      {"[head-parallel mha] o", "an output projection", "forward gathers the heads"});
  // A full-length output buffer is not this rank's rows: every rank throws
  // its own error (each expects its own row count).
  const Problem<double> q = make_problem<double>(kCases[0], 612);
  const HeadParallelMha<double> with_o(q.w, q.opt, Communicator(MPI_COMM_WORLD));
  Tensor<double> out({kBatch, kLength, kOut});
  const auto [type, message] = thrown([&] { with_o.forward_scatter(q.input(), out.batch(), ws); });
  EXPECT_EQ(type, "shape_error");
  const Index rows = with_o.output_split(kLength).rows(world_rank());
  EXPECT_TRUE(mentions(message, {"[head-parallel mha] output: expected [2, " + std::to_string(rows) + ", 5]"}));
  expect_all_ranks_here();
}

TEST(HeadParallelMhaErrors, SetOptionsIsAllOrNothing) {
  const Problem<double> p = make_problem<double>(kCases[0], 604);
  HeadParallelMha<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  headmix::MhaOptions opt = p.opt;
  opt.num_heads *= 2;
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.set_options(opt); }, {"[head-parallel mha] num_heads", "the sharded layer's"});
  // A window without causal, on rank 0 only: nobody's options change.
  opt = p.opt;
  opt.causal = world_rank() != 0;
  opt.window = 2;
  expect_error_everywhere("shape_error", 0, [&] { sharded.set_options(opt); }, {"window"});
  EXPECT_TRUE(sharded.options().causal);
  EXPECT_EQ(sharded.options().window, 0);
  EXPECT_EQ(sharded.local().options().window, 0);
  // A valid change applies everywhere.
  opt = p.opt;
  opt.causal = false;
  sharded.set_options(opt);
  EXPECT_FALSE(sharded.local().options().causal);
}

TEST(HeadParallelDcmhaErrors, GroupsThatDoNotShard) {
  const int P = world_size();
  const DcmhaProblem<double> p = make_problem<double>(kDcmhaCases[1], 605);  // 2 groups per rank
  // One group spans every rank's heads (checked before the weights).
  headmix::DcmhaOptions opt = p.opt;
  opt.groups = 1;
  expect_error_everywhere(
      "shape_error", -1, [&] { HeadParallelDcmha<double>(p.w, opt, Communicator(MPI_COMM_WORLD)); },
      {"[head-parallel dcmha] groups", "a multiple of the process count " + std::to_string(P), "whole head groups",
       "got 1"});
  // A checkpoint whose dc.qkw lacks the last rank's groups.
  headmix::DcmhaWeights<double> w = p.w;
  w.qkw = headmix::mpi::detail::slice_axis(p.w.qkw, 0, 0, p.w.qkw.dim(0) - 1);
  const auto file = checkpoint<double>(w, "attn.");
  expect_error_everywhere(
      "shape_error", -1,
      [&] { HeadParallelDcmha<double>::from_tensors(file, "attn.", p.opt, Communicator(MPI_COMM_WORLD)); },
      {"[dcmha] attn.dc.qkw"});
  // set_options may not regroup the heads.
  HeadParallelDcmha<double> sharded(p.w, p.opt, Communicator(MPI_COMM_WORLD));
  opt = p.opt;
  opt.groups = p.opt.groups / 2;
  expect_error_everywhere(
      "shape_error", -1, [&] { sharded.set_options(opt); }, {"[head-parallel dcmha] groups", "the sharded layer's"});
}

TEST(Communicator, SumAndGatherBlocks) {
  const Communicator comm(MPI_COMM_WORLD);
  const int P = comm.size(), r = comm.rank();
  std::vector<double> v{1.0 + r, 10.0 * r};
  comm.all_reduce_sum(v.data(), 2);
  EXPECT_EQ(v[0], P + P * (P - 1) / 2.0);
  EXPECT_EQ(v[1], 10.0 * P * (P - 1) / 2.0);
  // Each rank's [2 rows, 3 cols] block, units of 2 floats: element (i, j, e) = 100 r + 10 i + 2 j + e.
  std::vector<float> local(12), full(12 * static_cast<std::size_t>(P));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int e = 0; e < 2; ++e)
        local[static_cast<std::size_t>((i * 3 + j) * 2 + e)] = 100.0f * r + 10 * i + 2 * j + e;
  comm.all_gather_blocks(local.data(), 2, 3, 2, full.data());
  for (int i = 0; i < 2; ++i)
    for (int q = 0; q < P; ++q)
      for (int j = 0; j < 3; ++j)
        for (int e = 0; e < 2; ++e)
          EXPECT_EQ(full[static_cast<std::size_t>(((i * P + q) * 3 + j) * 2 + e)], 100.0f * q + 10 * i + 2 * j + e);
  EXPECT_EQ(comm.bytes(), 2 * sizeof(double) + 12 * sizeof(float));
  EXPECT_EQ(comm.collectives(), 2u);
  // Reduce-scatter: rank q gets q + 1 elements, element e of block q
  // summing to Σ_r (r + 10 q + e).
  std::vector<int> counts;
  std::vector<double> send;
  for (int q = 0; q < P; ++q) {
    counts.push_back(q + 1);
    for (int e = 0; e <= q; ++e) send.push_back(r + 10.0 * q + e);
  }
  std::vector<double> mine(static_cast<std::size_t>(r + 1));
  comm.reduce_scatter_sum(send.data(), mine.data(), counts.data());
  for (int e = 0; e <= r; ++e) EXPECT_EQ(mine[static_cast<std::size_t>(e)], P * (P - 1) / 2.0 + P * (10.0 * r + e));
  EXPECT_EQ(comm.bytes(), 2 * sizeof(double) + 12 * sizeof(float) + send.size() * sizeof(double));
  EXPECT_EQ(comm.collectives(), 3u);
}

// Any communicator, not only MPI_COMM_WORLD: the ranks split by parity,
// each half runs its own sharded layer, and neither involves the other.
TEST(Communicator, SubCommunicators) {
  MPI_Comm half = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &half);
  {
    const Problem<double> p = make_problem<double>(kCases[0], 606);  // H = 2·world size: a multiple of either half's
    const Communicator comm(half);
    const HeadParallelMha<double> sharded(p.w, p.opt, comm);
    EXPECT_EQ(sharded.local_heads() * comm.size(), p.opt.num_heads);
    const headmix::Mha<double> one(p.w, p.opt);
    headmix::Workspace<double> ws;
    EXPECT_TRUE(all_close("output on half the ranks", sharded.forward(p.input(), ws), widen(one.forward(p.input(), ws)),
                          sharded_tolerance<double>()));
  }
  MPI_Comm_free(&half);
  expect_all_ranks_here();
}

TEST(Communicator, AgreeOnAnyException) {
  const Communicator comm(MPI_COMM_WORLD);
  const int last = comm.size() - 1;
  // Not a headmix error: the others get a runtime_error naming the rank.
  expect_error_everywhere(
      "other", last,
      [&] {
        comm.agree("test", [&] {
          if (comm.rank() == last) throw std::out_of_range("index 9 of 3");
        });
      },
      {"index 9 of 3"});
  // Ranks 1 and up fail: each throws its own error, rank 0 rank 1's.
  const auto [type, message] = thrown([&] {
    comm.agree("test", [&] {
      if (comm.rank() >= 1) headmix::detail::throw_shape("test", "arg", "1", std::to_string(comm.rank()));
    });
  });
  EXPECT_EQ(type, "shape_error");
  const std::string want = comm.rank() == 0 ? "got 1 (on rank 1)" : "got " + std::to_string(comm.rank());
  EXPECT_TRUE(mentions(message, {"[test] arg: expected 1, " + want}));
  expect_all_ranks_here();
  // Success everywhere returns everywhere.
  int calls = 0;
  comm.agree("test", [&] { ++calls; }, {{"n", 4}});
  EXPECT_EQ(calls, 1);
}

}  // namespace

int main(int argc, char** argv) { return headmix_mpi_test::run_all_tests(argc, argv); }
