// Sequence-parallel MHA, CollabHead, Talking-Heads and DCMHA over MPI, run by
// ctest under `mpiexec -n 2` and `-n 3`. Lengths follow the process count P
// (T = 4P+1, 3P, 2P-1, 4P+3, 1, 4P), so the same program splits differently on
// 2 and 3 processes, with lengths P or 2P do not divide, chunks of unequal
// length, empty chunks and ranks without rows, and equal zig-zag shards
// (which the gathers must still put back in order).
//
// The contract: each rank's output rows, reassembled on every rank, equal
// the one-process layer's forward on the same weights and the whole
// sequence (causal with the zig-zag split, key padding, windows), the
// ranks' attention work adds up to one process's and is balanced by the
// zig-zag split, the bytes handed to MPI are comm_bytes(), and every error
// is an error on every rank with no rank left in a collective (ctest's
// 120 s timeout fails a hang). MHA is also checked against the naive double
// loops. Every rank checks its own results; a failure on any rank fails
// the run.

#include "test_util.hpp"

#include "headmix/io/safetensors.hpp"
#include "headmix/mpi/sequence_parallel.hpp"
#include "mpi/mpi_test_util.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace headmix_test;
using namespace headmix_mpi_test;

constexpr Index kBatch = 2, kWidth = 8, kDk = 4, kDv = 3, kOut = 5;

// Sharded against one process. A row's math is the one-process row's: the
// same weights, query, visible keys and padding. What may differ is the
// order of some sums: a chunk's keys start at another index (windows) and
// its tiles span other keys, so the softmax sums and the weighted sums of
// values over at most S = 4P+3 <= 15 keys group differently, and the K/V
// projections run as GEMMs of other heights. Each reordered n-term sum
// differs by at most 2·n·u·Σ|terms| (u = unit roundoff); through the mixes
// and o (|weights| <= 1/√fan-in, O(1) inputs) that stays below 1024·u
// absolute: 6.1e-5 in float, 1.1e-13 in double. Measured: printed by rank 0.
template <class T>
Tolerance sharded_tolerance() {
  return {0.0, 1024 * std::numeric_limits<T>::epsilon() / 2};
}

// The largest |sharded - one process| seen, per type, for the summary line.
template <class T>
double& worst_error() {
  static double worst = 0;
  return worst;
}

// ---------------------------------------------------------------------------
// Problems

struct Case {
  const char* name;
  Index per_process, extra;  // T = per_process · P + extra
  bool causal, padded;
  Index window;
  int threads;
  Index length() const { return per_process * world_size() + extra; }
};

const Case kCases[] = {
    {"contiguous, T = 4P+1", 4, 1, false, false, 0, 1},
    {"contiguous, key padding, T = 3P (shards already in order)", 3, 0, false, true, 0, 2},
    {"zig-zag, key padding, T = 4P+1", 4, 1, true, true, 0, 1},
    {"zig-zag, T = 2P-1 (an empty chunk)", 2, -1, true, false, 0, 2},
    {"zig-zag, window 3, key padding, T = 4P+3", 4, 3, true, true, 3, 1},
    {"zig-zag, T = 1 (one rank holds it)", 0, 1, true, true, 0, 1},
    {"contiguous, key padding, T = 1", 0, 1, false, true, 0, 1},
    {"zig-zag, T = 4P (equal shards, gathered out of order)", 4, 0, true, false, 0, 1},
};

// Keys padded in a fixed pattern: every third key, with a phase that moves
// every 6 keys (so that a chunk reading keys from the wrong start sees
// another pattern), never key 0 and never 3 keys in a row, so every query
// (windows of 3 included) sees a key.
std::vector<std::uint8_t> padding_pattern(Index keys) {
  std::vector<std::uint8_t> padding;
  for (Index b = 0; b < kBatch; ++b)
    for (Index j = 0; j < keys; ++j) padding.push_back(j % 3 == (b + 1 + j / 6) % 3 ? 1 : 0);
  return padding;
}

// One configuration of each layer: its full weights and options (the
// masking comes from the Case).
template <class T>
headmix::MhaWeights<T> mha_weights(Rng& rng, Index H, Index Hkv, bool o) {
  headmix::MhaWeights<T> w;
  w.q = random_linear<T>(rng, H * kDk, kWidth);
  w.k = random_linear<T>(rng, Hkv * kDk, kWidth);
  w.v = random_linear<T>(rng, Hkv * kDv, kWidth);
  if (o) w.o = random_linear<T>(rng, kOut, H * kDv);
  return w;
}

template <class T>
headmix::CollabHeadWeights<T> collab_weights(Rng& rng, Index H, Index R, bool layer_norm) {
  headmix::CollabHeadWeights<T> w;
  w.q = random_matrix<T>(rng, R, kWidth, 1.0 / std::sqrt(double(kWidth)));
  w.k = random_matrix<T>(rng, R, kWidth, 1.0 / std::sqrt(double(kWidth)));
  w.mixing = random_matrix<T>(rng, H, R, 1.0);
  w.content_bias = random_matrix<T>(rng, H, kWidth, 1.0 / std::sqrt(double(kWidth)));
  w.v = random_linear<T>(rng, H * kDv, kWidth);
  w.o = random_linear<T>(rng, layer_norm ? kWidth : kOut, H * kDv);
  if (layer_norm) {
    w.layer_norm.weight = random_matrix<T>(rng, kWidth, 1, 0.5, 1.5);
    w.layer_norm.bias = random_matrix<T>(rng, kWidth, 1, 0.5);
  }
  return w;
}

// h = 3 softmax heads between h_k = 4 key heads and h_v = 2 value heads,
// K and V stored for 2 heads (grouped-query).
template <class T>
headmix::TalkingHeadsWeights<T> talking_heads_weights(Rng& rng) {
  headmix::TalkingHeadsWeights<T> w;
  w.q = random_linear<T>(rng, 4 * kDk, kWidth);
  w.k = random_linear<T>(rng, 2 * kDk, kWidth);
  w.v = random_linear<T>(rng, 2 * kDv, kWidth);
  w.o = random_linear<T>(rng, kOut, 2 * kDv);
  w.pre_softmax = random_matrix<T>(rng, 3, 4, 1.0 / std::sqrt(4.0));
  w.post_softmax = random_matrix<T>(rng, 2, 3, 1.0 / std::sqrt(3.0));
  return w;
}

// DCMHA with H = 4 heads in `groups` groups, K and V stored for `kv` heads,
// dynamic-weight MLP of hidden width 3; the static terms with static_w.
template <class T>
headmix::DcmhaWeights<T> dcmha_weights(Rng& rng, Index groups, Index kv, Index rank, bool static_w) {
  const Index H = 4, M = H / groups, K = 3;
  headmix::DcmhaWeights<T> w;
  w.q = random_linear<T>(rng, H * kDk, kWidth);
  w.k = random_linear<T>(rng, kv * kDk, kWidth);
  w.v = random_linear<T>(rng, kv * kDv, kWidth);
  w.o = random_linear<T>(rng, kOut, H * kDv);
  w.dw1 = random_tensor<T>(rng, {kWidth, groups, 4, K}, 2.0 / std::sqrt(double(kWidth)));
  w.qkw = random_tensor<T>(rng, {groups, 4, K, 2 * rank, M}, 1.0 / std::sqrt(double(K)));
  w.dd = random_tensor<T>(rng, {kWidth, groups, 4 * M}, 2.0 / std::sqrt(double(kWidth)));
  if (static_w) {
    w.pre_w = random_tensor<T>(rng, {groups, M, M}, 0.5);
    w.post_w = random_tensor<T>(rng, {groups, M, M}, 0.5);
  }
  return w;
}

headmix::MhaOptions mha_options(Index H, Index Hkv, bool causal = false) {
  headmix::MhaOptions o;
  o.num_heads = H, o.num_kv_heads = Hkv == H ? 0 : Hkv, o.causal = causal;
  return o;
}
headmix::CollabHeadOptions collab_options(Index H) {
  headmix::CollabHeadOptions o;
  o.num_heads = H;
  return o;
}
headmix::TalkingHeadsOptions talking_heads_options() {
  headmix::TalkingHeadsOptions o;
  o.num_heads = 3, o.key_heads = 4, o.value_heads = 2, o.num_kv_heads = 2;
  return o;
}

headmix::DcmhaOptions dcmha_options(Index groups, Index kv, Index rank, bool static_w) {
  headmix::DcmhaOptions o;
  o.num_heads = 4, o.groups = groups, o.num_kv_heads = kv == 4 ? 0 : kv, o.rank = rank, o.static_w = static_w;
  return o;
}

template <class Options>
Options with_case(Options o, const Case& c) {
  o.causal = c.causal, o.window = c.window, o.threads = c.threads;
  o.block_rows = 2;  // several query blocks per chunk
  return o;
}

// A layer's whole-sequence input and each rank's shard of it.
template <class T>
struct Input {
  Index length;
  Tensor<T> x;
  std::vector<std::uint8_t> padding;

  Input(const Case& c, unsigned seed) : length(c.length()) {
    Rng rng(seed);
    x = random_tensor<T>(rng, {kBatch, length, kWidth}, 1.0);
    if (c.padded) padding = padding_pattern(length);
  }
  headmix::KeyPadding key_padding() const {
    return padding.empty() ? headmix::KeyPadding{} : headmix::KeyPadding{padding.data(), kBatch, length};
  }
  headmix::AttentionInput<T> whole() const { return {x.batch(), {}, key_padding()}; }
  // `shard` must outlive the input.
  headmix::AttentionInput<T> mine(const Tensor<T>& shard) const { return {shard.batch(), {}, key_padding()}; }
};

// check(case, input, one-process layer, sharded layer, split, this rank's
// shard) for every case: `layer` with the case's masking, inputs from
// `seed` up.
template <template <class> class Layer, class T, class Check>
void for_each_case(const Layer<T>& layer, unsigned seed, Check check) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const auto opt = with_case(layer.options(), c);
    const Input<T> in(c, seed++);
    const Layer<T> one(layer.weights(), opt);
    SequenceParallel<Layer, T> sharded(layer.weights(), opt, Communicator(MPI_COMM_WORLD));
    const SequenceSplit split = sharded.split(in.length);
    check(c, in, one, sharded, split, split.take(in.x.batch(), world_rank()));
  }
}

// The sharded forward against the one-process layer for every case:
// output rows (reassembled), a second call with the same workspace, the
// counted bytes and the flops. Returns nothing; records the worst error.
template <template <class> class Layer, class T>
void expect_equal_to_one_process(const Layer<T>& layer, unsigned seed) {
  for_each_case(layer, seed, [](const Case&, const Input<T>& in, const Layer<T>& one, auto& sharded,
                                const SequenceSplit& split, const Tensor<T>& shard) {
    headmix::Workspace<T> ws1, ws;
    const Tensor<T> want = one.forward(in.whole(), ws1);
    Communicator& comm = sharded.communicator();
    comm.reset_bytes();
    const Tensor<T> got = sharded.forward(in.mine(shard), in.length, ws);
    EXPECT_EQ(comm.bytes(), sharded.comm_bytes(kBatch, in.length));
    EXPECT_EQ(got.shape(), (std::vector<Index>{kBatch, split.rows(world_rank()), one.out_dim()}));

    const Tensor<T> whole = reassemble(got, split);
    EXPECT_TRUE(all_close("reassembled output vs one process", whole, widen(want), sharded_tolerance<T>()));
    for (Index i = 0; i < whole.size(); ++i)
      worst_error<T>() = std::max(worst_error<T>(), std::abs(double(whole[i]) - double(want[i])));
    EXPECT_TRUE(bit_identical("a second call, same workspace", sharded.forward(in.mine(shard), in.length, ws), got));

    // The ranks' attention work is one process's; each rank projects at
    // least its rows' share of everything.
    const headmix::FlopCount f = sharded.flops(kBatch, in.length), f1 = one.flops(kBatch, in.length, in.length);
    EXPECT_EQ(sum_over_ranks(f.attention_macs), f1.attention_macs);
    EXPECT_GE(sum_over_ranks(f.projection_macs), f1.projection_macs);
  });
}

// ---------------------------------------------------------------------------
// Tests

HEADMIX_TYPED_OVER_SCALARS(SequenceParallelTest);

// ---------------------------------------------------------------------------
// The layer setups the output and probs tests shard, each in float and
// double: suites typed over Row<T, i>, row i of a table.

enum class Kind { mha, collab, talking_heads, dcmha };

struct Setup {
  const char* name;
  Kind kind;
  Index a, b, c;   // mha: H, Hkv; collab: H, R; dcmha: groups, kv, rank
  bool flag;       // mha: o; collab: LayerNorm; dcmha: static_w
  bool tanh_only;  // dcmha: the tanh GELU, no post-compose
  unsigned seed;   // the weights'; the inputs' count up from 10 · seed
};

// DCMHA: two head groups, K/V for 2 of the 4 heads, the static terms; then
// one group (Compose over all heads), rank 2, the tanh GELU, one branch off.
const Setup kEqualSetups[] = {
    {"Mha", Kind::mha, 4, 4, 0, true, false, 100},
    {"GroupedQueryMhaWithoutO", Kind::mha, 4, 2, 0, false, false, 101},
    {"CollabHead", Kind::collab, 3, 6, 0, false, false, 102},
    {"CollabHeadWithLayerNorm", Kind::collab, 2, 4, 0, true, false, 103},
    {"TalkingHeads", Kind::talking_heads, 0, 0, 0, false, false, 104},
    {"GroupedDcmha", Kind::dcmha, 2, 2, 1, true, false, 106},
    {"DcmhaOneGroup", Kind::dcmha, 1, 4, 2, false, true, 107},
};
const Setup kProbsSetups[] = {
    {"Mha", Kind::mha, 4, 2, 0, true, false, 110},
    {"CollabHead", Kind::collab, 3, 6, 0, false, false, 111},
    {"TalkingHeads", Kind::talking_heads, 0, 0, 0, false, false, 112},
    {"Dcmha", Kind::dcmha, 2, 2, 1, true, false, 113},
};

// f(setup s's one-process layer in T), its weights drawn from s.seed.
template <class T, class F>
void with_layer(const Setup& s, F f) {
  Rng rng(s.seed);
  switch (s.kind) {
    case Kind::mha:
      return f(headmix::Mha<T>(mha_weights<T>(rng, s.a, s.b, s.flag), mha_options(s.a, s.b)));
    case Kind::collab:
      return f(headmix::CollabHead<T>(collab_weights<T>(rng, s.a, s.b, s.flag), collab_options(s.a)));
    case Kind::talking_heads:
      return f(headmix::TalkingHeads<T>(talking_heads_weights<T>(rng), talking_heads_options()));
    case Kind::dcmha: {
      headmix::DcmhaOptions opt = dcmha_options(s.a, s.b, s.c, s.flag);
      if (s.tanh_only) opt.gelu = headmix::DcmhaGelu::tanh, opt.use_post = false;
      return f(headmix::Dcmha<T>(dcmha_weights<T>(rng, s.a, s.b, s.c, s.flag), opt));
    }
  }
}

// Row i of a setups table, in T.
template <class T, std::size_t I>
struct Row {
  using Scalar = T;
  static constexpr std::size_t row = I;
};
template <class Is>
struct RowsOf;
template <std::size_t... I>
struct RowsOf<std::index_sequence<I...>> {
  using type = ::testing::Types<Row<float, I>..., Row<double, I>...>;
};
// Test names: the setup's name and the scalar.
template <const auto& Table>
struct SetupName {
  template <class R>
  static std::string GetName(int) {
    return std::string(Table[R::row].name) + (std::is_same_v<typename R::Scalar, float> ? "_float" : "_double");
  }
};
// A suite typed over every row of `table` in both scalars.
#define SETUP_TYPED_SUITE(Name, table)                                                         \
  template <class R>                                                                           \
  class Name : public ::testing::Test {};                                                      \
  using Name##Rows = RowsOf<std::make_index_sequence<std::size(table)>>::type;                 \
  TYPED_TEST_SUITE(Name, Name##Rows, SetupName<table>)

SETUP_TYPED_SUITE(SequenceParallelEqualTest, kEqualSetups);

TYPED_TEST(SequenceParallelEqualTest, OneProcess) {
  const Setup& s = kEqualSetups[TypeParam::row];
  with_layer<typename TypeParam::Scalar>(s, [&](const auto& one) { expect_equal_to_one_process(one, 10 * s.seed); });
}

// Against the naive double loops too: causal, key padding, grouped-query.
TYPED_TEST(SequenceParallelTest, MhaMatchesNaiveLoops) {
  using T = TypeParam;
  Rng rng(105);
  const headmix::MhaWeights<T> w = mha_weights<T>(rng, 4, 2, true);
  const Case& c = kCases[2];
  const headmix::MhaOptions opt = with_case(mha_options(4, 2), c);
  const Input<T> in(c, 1500);
  using headmix_ref::RefLinear;
  const headmix_ref::RefMhaWeights rw{ref_linear_as<RefLinear>(w.q), ref_linear_as<RefLinear>(w.k),
                                      ref_linear_as<RefLinear>(w.v), ref_linear_as<RefLinear>(w.o)};
  headmix_ref::RefMhaOptions ro;
  ro.num_heads = 4, ro.num_kv_heads = 2, ro.causal = true;
  const auto want = headmix_ref::mha_reference(rw, ro, ref_batch(in.x), nullptr, in.padding);

  const SequenceParallelMha<T> sharded(w, opt, Communicator(MPI_COMM_WORLD));
  const SequenceSplit split = sharded.split(in.length);
  const Tensor<T> shard = split.take(in.x.batch(), world_rank());
  headmix::Workspace<T> ws;
  const Tensor<T> whole = reassemble(sharded.forward(in.mine(shard), in.length, ws), split);
  EXPECT_TRUE(all_close("output vs naive loops", whole, want.output, default_tolerance<T>()));
}

TEST(SequenceSplit, ShardsPartitionTheSequence) {
  for (const Index T_ : {1, 2, 5, 7, 12, 13}) {
    for (const int P : {1, 2, 3, 4}) {
      for (const bool causal : {false, true}) {
        const SequenceSplit s(T_, P, causal);
        std::vector<int> owner(static_cast<std::size_t>(T_), -1);
        Index most = 0, least = T_;
        for (int r = 0; r < P; ++r) {
          const auto chunks = s.chunks(r);
          ASSERT_EQ(chunks.size(), causal ? 2u : 1u);
          for (const auto& c : chunks)
            for (Index i = c.start; i < c.start + c.length; ++i) {
              EXPECT_EQ(owner[static_cast<std::size_t>(i)], -1) << "position " << i << " held twice";
              owner[static_cast<std::size_t>(i)] = r;
            }
          most = std::max(most, s.rows(r)), least = std::min(least, s.rows(r));
        }
        for (Index i = 0; i < T_; ++i) EXPECT_GE(owner[static_cast<std::size_t>(i)], 0) << "position " << i;
        EXPECT_EQ(s.max_rows(), most);
        EXPECT_LE(most - least, causal ? 2 : 1) << "T " << T_ << ", P " << P;
      }
    }
  }
  // The zig-zag: T = 8 on 2 ranks in chunks of 2: rank 0 holds 0-1 and 6-7.
  const SequenceSplit s(8, 2, true);
  EXPECT_EQ(s.chunks(0)[0].start, 0);
  EXPECT_EQ(s.chunks(0)[1].start, 6);
  EXPECT_EQ(s.chunks(1)[0].start, 2);
  EXPECT_EQ(s.chunks(1)[1].start, 4);
  // take() then put() restores every row.
  Rng rng(7);
  const Tensor<double> x = random_tensor<double>(rng, {2, 8, 3}, 1.0);
  Tensor<double> back({2, 8, 3});
  for (int r = 0; r < 2; ++r) s.put(s.take(x.batch(), r).batch(), r, back.batch());
  EXPECT_TRUE(bit_identical("take then put", back, x));
}

// With T a multiple of 2P the zig-zag chunks are equal and every rank has
// exactly the same attention work (contiguous causal shards would leave
// the first rank far less than the last).
TEST(SequenceParallelFlops, ZigZagBalancesCausalWork) {
  Rng rng(200);
  const auto w = mha_weights<double>(rng, 2, 2, true);
  const headmix::MhaOptions opt = mha_options(2, 2, true);
  const SequenceParallelMha<double> sharded(w, opt, Communicator(MPI_COMM_WORLD));
  const Index T_ = 8 * world_size();
  const long long mine = sharded.flops(kBatch, T_).attention_macs;
  expect_same_across_ranks(mine);
  const headmix::Mha<double> one(w, opt);
  EXPECT_EQ(mine * world_size(), one.flops(kBatch, T_, T_).attention_macs);
}

// DCMHA: the zig-zag balances the attention work too, and without causal
// each rank projects its own rows' queries (and query-wise factors) and
// every key's K, V and key-wise factors: P - 1 extra copies of the key-side
// work, which flops(B, 0, T) counts alone.
TEST(SequenceParallelFlops, DcmhaCountsKeySideWorkPerRank) {
  Rng rng(202);
  const auto w = dcmha_weights<double>(rng, 2, 2, 1, false);
  headmix::DcmhaOptions opt = dcmha_options(2, 2, 1, false);
  const Index T_ = 8 * world_size();
  const SequenceParallelDcmha<double> contiguous(w, opt, Communicator(MPI_COMM_WORLD));
  const headmix::Dcmha<double> one(w, opt);
  const headmix::FlopCount f = contiguous.flops(kBatch, T_), f1 = one.flops(kBatch, T_, T_);
  EXPECT_EQ(sum_over_ranks(f.attention_macs), f1.attention_macs);
  EXPECT_EQ(sum_over_ranks(f.projection_macs),
            f1.projection_macs + (world_size() - 1) * one.flops(kBatch, 0, T_).projection_macs);
  EXPECT_GT(one.flops(kBatch, 0, T_).projection_macs, 0);

  opt.causal = true;
  const SequenceParallelDcmha<double> zigzag(w, opt, Communicator(MPI_COMM_WORLD));
  const long long mine = zigzag.flops(kBatch, T_).attention_macs;
  expect_same_across_ranks(mine);
  EXPECT_EQ(mine * world_size(), headmix::Dcmha<double>(w, opt).flops(kBatch, T_, T_).attention_macs);
}

// comm_bytes against a count by hand: the agreement's 9 long longs, then
// B · max_rows · D values of T.
TEST(SequenceParallelBytes, CommBytesByHand) {
  const int P = world_size();
  Rng rng(201);
  const auto w = mha_weights<float>(rng, 2, 2, true);
  const SequenceParallelMha<float> contiguous(w, mha_options(2, 2), Communicator(MPI_COMM_WORLD));
  const SequenceParallelMha<float> zigzag(w, mha_options(2, 2, true), Communicator(MPI_COMM_WORLD));
  // T = 4P+1: one contiguous shard has 5 rows, the others 4; one of the 2P
  // zig-zag chunks has 3 rows, the others 2, so one rank holds 5.
  const Index T_ = 4 * P + 1;
  EXPECT_EQ(contiguous.comm_bytes(kBatch, T_), 9 * 8 + kBatch * 5 * kWidth * 4u);
  EXPECT_EQ(zigzag.comm_bytes(kBatch, T_), 9 * 8 + kBatch * 5 * kWidth * 4u);
  // T = 4P: every rank 4 rows either way.
  EXPECT_EQ(zigzag.comm_bytes(kBatch, 4 * P), 9 * 8 + kBatch * 4 * kWidth * 4u);
}

// ---------------------------------------------------------------------------
// Errors: each on every rank, no rank left in a collective.

// The error tests' call: a sequence-parallel layer, case `c`'s input (from
// `seed`), this rank's shard of it and a buffer for this rank's output rows.
// A test binds its members by name, and its lambdas name them through the
// call: C++17 lets no lambda capture a structured binding (clang rejects it).
template <template <class> class Layer>
struct ShardedCall {
  const SequenceParallel<Layer, double> sharded;
  const Input<double> in;
  const SequenceSplit split;
  const Tensor<double> shard;
  Tensor<double> out;
  headmix::Workspace<double> ws;

  template <class Weights, class Options>
  ShardedCall(const Weights& w, const Options& opt, const Case& c, unsigned seed)
      : sharded(w, opt, Communicator(MPI_COMM_WORLD)),
        in(c, seed),
        split(sharded.split(in.length)),
        shard(split.take(in.x.batch(), world_rank())),
        out({kBatch, split.rows(world_rank()), kOut}) {}
};

// MHA with 2 heads, weights from `seed`, on the zig-zag case with key
// padding, input from seed + 1.
ShardedCall<headmix::Mha> error_test_mha(unsigned seed) {
  Rng rng(seed);
  const Case& c = kCases[2];
  return ShardedCall<headmix::Mha>(mha_weights<double>(rng, 2, 2, true), with_case(mha_options(2, 2), c), c, seed + 1);
}

TEST(SequenceParallelErrors, BadShardOnOneRankThrowsOnEveryRank) {
  ShardedCall<headmix::Mha> call = error_test_mha(300);
  auto& [sharded, in, split, shard, out, ws] = call;
  const int me = world_rank(), last = world_size() - 1;
  const Tensor<double> want = sharded.forward(in.mine(shard), in.length, ws);

  // The last rank passes one row more than its shard.
  const Tensor<double> longer({kBatch, split.rows(last) + 1, kWidth});
  auto bad = in.mine(shard);
  if (me == last) bad.query = longer.batch();
  expect_error_everywhere(
      "shape_error", last, [&] { call.sharded.forward(bad, call.in.length, call.out.batch(), call.ws); },
      {"[sequence-parallel mha] input.query", "this rank's " + std::to_string(split.rows(last)) + " of " +
                                                  std::to_string(in.length) + " positions"});

  // Rank 0 passes its own rows' padding, not the whole sequence's.
  const std::vector<std::uint8_t> short_padding(static_cast<std::size_t>(kBatch * split.rows(0)), 0);
  bad = in.mine(shard);
  if (me == 0) bad.key_padding = {short_padding.data(), kBatch, split.rows(0)};
  expect_error_everywhere(
      "shape_error", 0, [&] { call.sharded.forward(bad, call.in.length, call.out.batch(), call.ws); },
      {"input.key_padding_mask (the whole sequence's)", std::to_string(in.length)});

  // The last rank passes a key sequence.
  bad = in.mine(shard);
  if (me == last) bad.key = in.x.batch();
  expect_error_everywhere(
      "shape_error", last, [&] { call.sharded.forward(bad, call.in.length, call.out.batch(), call.ws); },
      {"input.key", "gathered"});

  // Rank 0's output is one column narrow.
  Tensor<double> narrow({kBatch, split.rows(me), kOut - 1});
  expect_error_everywhere(
      "shape_error", 0,
      [&] {
        call.sharded.forward(call.in.mine(call.shard), call.in.length, (me == 0 ? narrow : call.out).batch(), call.ws);
      },
      {"[sequence-parallel mha] output"});

  // A length of 0 on every rank.
  expect_error_everywhere(
      "shape_error", -1, [&] { call.sharded.forward(call.in.mine(call.shard), 0, call.out.batch(), call.ws); },
      {"length", ">= 1"});

  // Valid on each rank, but only rank 0 passes padding: the others would
  // mask differently.
  bad = in.mine(shard);
  if (me != 0) bad.key_padding = {};
  expect_error_everywhere(
      "shape_error", -1, [&] { call.sharded.forward(bad, call.in.length, call.out.batch(), call.ws); },
      {"arguments across ranks", "key padding from 0 to 1"});

  // Valid on each rank, but the last rank passes one sequence fewer: the
  // gather would not match.
  bad = in.mine(shard);
  Tensor<double> fewer({kBatch - 1, split.rows(me), kOut});
  if (me == last) bad = {{shard.data(), kBatch - 1, split.rows(me), kWidth}, {}, {in.padding.data(), kBatch - 1, in.length}};
  expect_error_everywhere(
      "shape_error", -1,
      [&] { call.sharded.forward(bad, call.in.length, (me == last ? fewer : call.out).batch(), call.ws); },
      {"batch from " + std::to_string(kBatch - 1) + " to " + std::to_string(kBatch)});

  // The last rank's sequence is P positions longer.
  Rng other_rng(303);
  const Tensor<double> other = random_tensor<double>(other_rng, {kBatch, in.length + world_size(), kWidth}, 1.0);
  expect_longer_sequence_on_last_rank_throws(sharded, shard, in.length, out, other, ws);

  // The layer still works on every rank.
  sharded.forward(in.mine(shard), in.length, out.batch(), ws);
  EXPECT_TRUE(bit_identical("output after the errors", out, want));
}

TEST(SequenceParallelErrors, BadWeightsOrOptionsThrowOnEveryRank) {
  Rng rng(302);
  const auto w = mha_weights<double>(rng, 2, 2, true);
  headmix::MhaOptions opt = mha_options(2, 2, true);
  opt.causal_offset = 3;  // the split sets the offsets
  expect_error_everywhere(
      "shape_error", -1, [&] { SequenceParallelMha<double>(w, opt, Communicator(MPI_COMM_WORLD)); },
      {"[sequence-parallel mha] causal_offset", "got 3"});
  // The weights are checked as the one-process layer checks them.
  auto narrow = w;
  narrow.o.weight.conservativeResize(kOut, narrow.o.weight.cols() - 1);
  expect_error_everywhere(
      "shape_error", -1,
      [&] { SequenceParallelMha<double>(narrow, mha_options(2, 2), Communicator(MPI_COMM_WORLD)); },
      {"[mha] o.weight"});
  // A checkpoint that lacks v.weight on the last rank only.
  headmix::io::TensorFile full, lacking;
  for (auto* f : {&full, &lacking}) {
    f->put("attn.q.weight", headmix::io::StoredTensor::from(Tensor<double>({2 * kDk, kWidth})));
    f->put("attn.k.weight", headmix::io::StoredTensor::from(Tensor<double>({2 * kDk, kWidth})));
  }
  full.put("attn.v.weight", headmix::io::StoredTensor::from(Tensor<double>({2 * kDv, kWidth})));
  const int last = world_size() - 1;
  expect_error_everywhere(
      "io_error", last,
      [&] {
        SequenceParallelMha<double>::from_tensors(world_rank() == last ? lacking : full, "attn.", mha_options(2, 2),
                                                  Communicator(MPI_COMM_WORLD));
      },
      {"attn.v.weight"});
  // The same checkpoint everywhere loads.
  const auto loaded =
      SequenceParallelMha<double>::from_tensors(full, "attn.", mha_options(2, 2), Communicator(MPI_COMM_WORLD));
  EXPECT_EQ(loaded.local().num_heads(), 2);
}

// DCMHA's errors: its options and weights, a bad shard, on every rank.
TEST(SequenceParallelErrors, DcmhaBadInputThrowsOnEveryRank) {
  Rng rng(304);
  const auto w = dcmha_weights<double>(rng, 2, 2, 1, true);
  headmix::DcmhaOptions opt = dcmha_options(2, 2, 1, true);
  opt.causal = true;
  opt.causal_offset = 2;
  expect_error_everywhere(
      "shape_error", -1, [&] { SequenceParallelDcmha<double>(w, opt, Communicator(MPI_COMM_WORLD)); },
      {"[sequence-parallel dcmha] causal_offset", "got 2"});
  opt.causal_offset = 0;
  auto narrow = w;  // dc.dd one gate column short
  narrow.dd = Tensor<double>({kWidth, 2, 3});
  expect_error_everywhere(
      "shape_error", -1, [&] { SequenceParallelDcmha<double>(narrow, opt, Communicator(MPI_COMM_WORLD)); },
      {"[dcmha] dc.dd"});

  ShardedCall<headmix::Dcmha> call(w, opt, kCases[2], 305);
  auto& [sharded, in, split, shard, out, ws] = call;
  const int me = world_rank(), last = world_size() - 1;
  // The last rank's shard is one column narrow.
  const Tensor<double> narrow_shard({kBatch, split.rows(last), kWidth - 1});
  auto bad = in.mine(shard);
  if (me == last) bad.query = narrow_shard.batch();
  expect_error_everywhere(
      "shape_error", last, [&] { call.sharded.forward(bad, call.in.length, call.out.batch(), call.ws); },
      {"[sequence-parallel dcmha] input.query"});
  // The layer still works.
  sharded.forward(in.mine(shard), in.length, out.batch(), ws);
  EXPECT_TRUE(std::all_of(out.data(), out.data() + out.size(), [](double v) { return std::isfinite(v); }));
}

// Rank 0 prints the largest deviation from one process seen above.
TEST(SequenceParallelSummary, WorstErrors) {
  if (world_rank() == 0)
    std::printf("largest |sharded - one process|: float %.3g (bound %.3g), double %.3g (bound %.3g)\n",
                worst_error<float>(), sharded_tolerance<float>().atol, worst_error<double>(),
                sharded_tolerance<double>().atol);
}

// ---------------------------------------------------------------------------
// probs: every rank gets the whole sequence's weights [B, H, T, T], the
// one-process layer's, rows and keys in global positions; masked keys
// (future, outside the window, padded) exactly 0; the output rows as
// without probs; comm_bytes() + probs_comm_bytes() handed to MPI. Every
// case: contiguous and zig-zag, key padding, a window of 3, an empty
// chunk, T = 1 (ranks without rows).

template <template <class> class Layer, class T>
void expect_probs_equal_to_one_process(const Layer<T>& layer, unsigned seed) {
  for_each_case(layer, seed, [](const Case& c, const Input<T>& in, const Layer<T>& one, auto& sharded,
                                const SequenceSplit& split, const Tensor<T>& shard) {
    headmix::Workspace<T> ws1, ws;
    Tensor<T> want;
    const Tensor<T> want_out = one.forward(in.whole(), ws1, &want);
    Tensor<T> probs;
    const Tensor<T> got = forward_with_probs(sharded, in.mine(shard), in.length, ws, probs);
    EXPECT_EQ(want.dim(1), sharded.probs_heads());
    EXPECT_TRUE(all_close("this rank's output rows, with probs", got,
                          widen(split.take(want_out.batch(), world_rank())), sharded_tolerance<T>()));
    expect_probs_equal(probs, want, sharded_tolerance<T>(), [&](Index b, Index i, Index j) {
      const bool hidden = c.causal && (j > i || (c.window > 0 && j <= i - c.window));
      return hidden || (!in.padding.empty() && in.padding[static_cast<std::size_t>(b * in.length + j)] != 0);
    });
  });
}

// Every layer setup's probs (kProbsSetups); TalkingHeads' are the
// post-mixed ones, over h_v = 2 heads.
SETUP_TYPED_SUITE(SequenceParallelProbsTest, kProbsSetups);

TYPED_TEST(SequenceParallelProbsTest, EqualOneProcess) {
  const Setup& s = kProbsSetups[TypeParam::row];
  with_layer<typename TypeParam::Scalar>(s, [&](const auto& one) { expect_probs_equal_to_one_process(one, 10 * s.seed); });
}

// probs_comm_bytes against a count by hand: B · H · max_rows · T values.
// T = 4P+1: the longest shard has 5 rows, contiguous or zig-zag.
TEST(SequenceParallelBytes, ProbsCommBytesByHand) {
  const int P = world_size();
  Rng rng(203);
  headmix::TalkingHeadsOptions opt = talking_heads_options();
  const headmix::mpi::SequenceParallelTalkingHeads<double> contiguous(talking_heads_weights<double>(rng), opt,
                                                                       Communicator(MPI_COMM_WORLD));
  const Index T_ = 4 * P + 1;
  EXPECT_EQ(contiguous.probs_heads(), 2);  // h_v
  EXPECT_EQ(contiguous.probs_comm_bytes(kBatch, T_), static_cast<std::uint64_t>(kBatch * 2 * 5 * T_ * 8));
  const auto mha = mha_weights<float>(rng, 4, 2, true);
  const SequenceParallelMha<float> zigzag(mha, mha_options(4, 2, true), Communicator(MPI_COMM_WORLD));
  EXPECT_EQ(zigzag.probs_heads(), 4);  // query heads, not the 2 K/V heads
  EXPECT_EQ(zigzag.probs_comm_bytes(kBatch, T_), static_cast<std::uint64_t>(kBatch * 4 * 5 * T_ * 4));
  EXPECT_EQ(zigzag.probs_comm_bytes(1, 1), 4 * 4u);  // one row on one rank, padded alike on the others
}

// probs asked for on one rank only: the same error on every rank, no rank
// left in the weights' gather; then every rank asking works.
TEST(SequenceParallelErrors, ProbsOnOneRankThrowsOnEveryRank) {
  ShardedCall<headmix::Mha> call = error_test_mha(306);
  auto& [sharded, in, split, shard, out, ws] = call;
  expect_probs_on_one_rank_throw(sharded, in.mine(shard), in.length, out.batch(), ws);
  Tensor<double> probs;
  sharded.forward(in.mine(shard), in.length, out.batch(), ws, &probs);
  EXPECT_EQ(probs.shape(), (std::vector<Index>{kBatch, 2, in.length, in.length}));
}

}  // namespace

int main(int argc, char** argv) { return headmix_mpi_test::run_all_tests(argc, argv); }
