// run_dense_pipeline's contract (core/pipeline.hpp), executed: two small
// hand-written policies, and what the pipeline must make of them, computed
// by naive loops in double.
//
//   * HeadsOnly declares score, values and the head counts, nothing else:
//     the pipeline supplies the rest (no mixes, each head on its own).
//   * Mixing adds has_pre_mix / has_post_mix and the two mix stages, which
//     run on [heads, rows, chunk] tiles of up to headmix::mix_chunk keys
//     (all keys for one-row blocks), with the softmax across chunks.
//
// Scores and values are fixed tables indexed by absolute (query, key), so
// a policy that is called with the wrong first query or key, or a tile the
// wrong size, gives the wrong answer. Checked: outputs and the exported
// weights, for causal + offset, windows, key padding, fully masked rows
// (zeros), several block sizes and thread counts.

#include "headmix/core/dot_product.hpp"
#include "headmix/core/pipeline.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace headmix_test;
using headmix::AttentionTensor;
using headmix::PositionMask;
using headmix::Workspace;

constexpr Index kB = 2, kT = 9, kS = 11, kScoreHeads = 3, kSoftmaxHeads = 2, kValueHeads = 4, kDv = 3;

// score[b][h](i, j) and value[b][h](j, :), the same tables for every policy.
struct Tables {
  Index S;                                   // keys
  std::vector<Matrix<double>> score, value;  // index b * heads + h
  Matrix<double> pre, post;                  // [softmax, score] heads; [value, score]: the first columns
                                             // that there are softmax heads
  explicit Tables(Rng& rng, Index keys = kS) : S(keys) {
    for (Index i = 0; i < kB * kScoreHeads; ++i) score.push_back(random_matrix<double>(rng, kT, S, 3.0));
    for (Index i = 0; i < kB * kValueHeads; ++i) value.push_back(random_matrix<double>(rng, S, kDv, 1.0));
    pre = random_matrix<double>(rng, kSoftmaxHeads, kScoreHeads, 1.0);
    post = random_matrix<double>(rng, kValueHeads, kScoreHeads, 1.0);
  }
};

// Independent heads: kValueHeads of each score, softmax and value.
struct HeadsOnly {
  const Tables* t;

  Index score_heads() const { return kValueHeads; }
  Index softmax_heads() const { return kValueHeads; }
  Index value_heads() const { return kValueHeads; }
  Index value_dim() const { return kDv; }
  void score(Index b, Index h, Eigen::Map<Matrix<double>> out, Index q0, Index k0, Workspace<double>&, int) const {
    out = t->score[b * kScoreHeads + h % kScoreHeads].block(q0, k0, out.rows(), out.cols());
  }
  auto values(Index b, Index h, Index k0, Index count, Workspace<double>&, int) const {
    return t->value[b * kValueHeads + h].middleRows(k0, count);
  }
};

// Score heads mixed into softmax heads before the softmax, softmax heads
// into value heads after it, as whole tiles.
struct Mixing {
  const Tables* t;
  bool pre_on, post_on;

  Index score_heads() const { return kScoreHeads; }
  Index softmax_heads() const { return pre_on ? kSoftmaxHeads : kScoreHeads; }
  Index value_heads() const { return kValueHeads; }
  Index value_dim() const { return kDv; }
  bool has_pre_mix() const { return pre_on; }
  bool has_post_mix() const { return post_on; }
  void score(Index b, Index h, Eigen::Map<Matrix<double>> out, Index q0, Index k0, Workspace<double>&, int) const {
    out = t->score[b * kScoreHeads + h].block(q0, k0, out.rows(), out.cols());
  }
  // In place: `heads_in` heads before, tile.heads() after (the buffer has
  // room for either).
  static void mix(const Matrix<double>& m, const AttentionTensor<double>& tile, Index heads_in) {
    const AttentionTensor<double> in = tile.like(tile.data(), heads_in);
    std::vector<Matrix<double>> before;
    for (Index i = 0; i < in.heads(); ++i) before.emplace_back(in.head(i));
    for (Index o = 0; o < tile.heads(); ++o) {
      tile.head(o).setZero();
      for (Index i = 0; i < in.heads(); ++i) tile.head(o) += m(o, i) * before[static_cast<std::size_t>(i)];
    }
  }
  void pre_mix(Index, const AttentionTensor<double>& tile, Workspace<double>&, int) const {
    mix(t->pre, tile, score_heads());
  }
  void post_mix(Index, const AttentionTensor<double>& tile, Workspace<double>&, int) const {
    mix(t->post, tile, softmax_heads());
  }
  auto values(Index b, Index c, Index k0, Index count, Workspace<double>&, int) const {
    return t->value[b * kValueHeads + c].middleRows(k0, count);
  }
};
static_assert(!headmix::mixes_heads<HeadsOnly>::value && headmix::mixes_heads<Mixing>::value);

// The contract in loops: logits L = pre · scores (or the scores), masked
// (position mask and padding) softmax per row, weights W = post · P (or P),
// output_c = W_c · V_c. A row with no visible key has P = 0.
struct Expected {
  std::vector<double> out, probs;  // [B, T, hv·dv], [B, hv, T, S]
};
Expected expected(const Tables& t, const PositionMask& mask, const std::vector<std::uint8_t>& pad, bool pre,
                  bool post, bool independent) {
  const Index hs = independent ? kValueHeads : kScoreHeads;
  const Index hl = independent ? kValueHeads : (pre ? kSoftmaxHeads : kScoreHeads);
  Expected e{std::vector<double>(kB * kT * kValueHeads * kDv, 0.0), std::vector<double>(kB * kValueHeads * kT * t.S)};
  for (Index b = 0; b < kB; ++b)
    for (Index i = 0; i < kT; ++i) {
      std::vector<std::vector<double>> p(hl, std::vector<double>(t.S, 0.0));
      for (Index g = 0; g < hl; ++g) {
        std::vector<double> logit(t.S);
        double top = -std::numeric_limits<double>::infinity();
        for (Index j = 0; j < t.S; ++j) {
          auto s = [&](Index a) { return t.score[b * kScoreHeads + a % kScoreHeads](i, j); };
          double l = 0;
          if (!independent && pre)
            for (Index a = 0; a < hs; ++a) l += t.pre(g, a) * s(a);
          else
            l = s(g);
          const auto [lo, hi] = mask.key_range(i, t.S);
          const bool visible = j >= lo && j < hi && !pad[b * t.S + j];
          logit[j] = visible ? l : -std::numeric_limits<double>::infinity();
          top = std::max(top, logit[j]);
        }
        if (std::isinf(top)) continue;  // no visible key: zeros
        double sum = 0;
        for (Index j = 0; j < t.S; ++j) sum += p[g][j] = std::exp(logit[j] - top);
        for (Index j = 0; j < t.S; ++j) p[g][j] /= sum;
      }
      for (Index c = 0; c < kValueHeads; ++c)
        for (Index j = 0; j < t.S; ++j) {
          double w = 0;
          if (!independent && post)
            for (Index g = 0; g < hl; ++g) w += t.post(c, g) * p[g][j];
          else
            w = p[c][j];
          e.probs[((b * kValueHeads + c) * kT + i) * t.S + j] = w;
          for (Index d = 0; d < kDv; ++d)
            e.out[(b * kT + i) * kValueHeads * kDv + c * kDv + d] += w * t.value[b * kValueHeads + c](j, d);
        }
    }
  return e;
}

struct Setting {
  const char* name;
  PositionMask mask;
  bool padded;
};

const std::vector<Setting>& settings() {
  static const std::vector<Setting> s = {
      {"none", {}, false},
      {"causal", {true, 0, 0}, false},
      {"causal offset 2, padded", {true, 2, 0}, true},
      {"window 3", {true, 1, 3}, true},
      {"negative offset (rows without keys)", {true, -3, 0}, true},
  };
  return s;
}

// Every setting, block size, key block (independent heads run keys in
// blocks of run.key_block with an online softmax; mixing heads ignore it)
// and thread count; with and without exported weights, which must not
// change the output.
template <class Policy>
void check(const Policy& policy, const Tables& t, bool pre, bool post, bool independent) {
  std::vector<std::uint8_t> pad(kB * t.S, 0);
  for (Index j = 0; j < t.S; j += 4) pad[t.S + j] = 1;  // item 1: every fourth key padded
  for (const Setting& s : settings())
    for (Index block : {Index(1), Index(4), Index(kT)})
      for (Index key_block : {Index(1), Index(3), Index(512)})
        for (int threads : {1, 3}) {
          SCOPED_TRACE(std::string(s.name) + ", block_rows " + std::to_string(block) + ", key_block " +
                       std::to_string(key_block) + ", threads " + std::to_string(threads));
          const Expected e = expected(t, s.mask, s.padded ? pad : std::vector<std::uint8_t>(kB * t.S, 0), pre, post,
                                      independent);
          std::vector<double> first;
          for (bool export_probs : {true, false}) {
            std::vector<double> context(kB * kT * kValueHeads * kDv, -7.0);  // every entry must be written
            Tensor<double> probs;
            headmix::DenseRun<double> run;
            run.batch = kB, run.queries = kT, run.keys = t.S, run.mask = s.mask, run.block_rows = block;
            run.key_block = key_block, run.threads = threads, run.context = context.data();
            if (export_probs) run.probs = &probs;
            if (s.padded) run.padding = {pad.data(), kB, t.S};
            Workspace<double> ws;
            headmix::run_dense_pipeline(policy, run, ws);
            EXPECT_TRUE(all_close("context", context.data(), context.size(), e.out, {1e-12, 1e-12}));
            if (export_probs) {
              EXPECT_TRUE(all_close("probs", probs, e.probs, {1e-12, 1e-12}));
              for (Index i = 0; i < probs.size(); ++i) {  // masked and padded keys: exactly 0
                if (e.probs[i] == 0) {
                  ASSERT_EQ(probs.data()[i], 0.0) << "weight " << i;
                }
              }
              first = context;
            } else {
              EXPECT_EQ(context, first) << "exporting the weights changed the output";
            }
          }
        }
}

TEST(DensePipeline, IndependentHeadsGetEveryOtherStageFromThePipeline) {
  Rng rng(3);
  const Tables t(rng);
  check(HeadsOnly{&t}, t, false, false, true);
}

void check_mixes(const Tables& t) {
  for (bool pre : {false, true})
    for (bool post : {false, true}) {
      if (!post && kValueHeads != (pre ? kSoftmaxHeads : kScoreHeads)) continue;  // heads must line up
      SCOPED_TRACE(std::string("pre ") + (pre ? "on" : "off") + ", post " + (post ? "on" : "off"));
      check(Mixing{&t, pre, post}, t, pre, post, false);
    }
}

TEST(DensePipeline, MixesRunAroundTheMaskedSoftmax) {
  Rng rng(4);
  check_mixes(Tables(rng));
}

// Taller blocks take their keys in chunks of mix_chunk, the softmax running
// across them: a whole chunk and part of a second.
TEST(DensePipeline, MixesRunOverKeyChunks) {
  Rng rng(7);
  check_mixes(Tables(rng, headmix::mix_chunk + 22));
}

// The online softmax against one pass over all keys, in float, on rows
// whose maximum keeps growing (scores rise along the keys, so every block
// rescales): the bound stated in core/online_softmax.hpp, (2 + blocks) ·
// ε · max|v|, with ε of float.
struct Rising {
  const Matrix<float>* v;
  Index* widest_tile;  ///< the most keys one score() call was given
  Index score_heads() const { return 1; }
  Index softmax_heads() const { return 1; }
  Index value_heads() const { return 1; }
  Index value_dim() const { return v->cols(); }
  void score(Index, Index, Eigen::Map<Matrix<float>> out, Index q0, Index k0, Workspace<float>&, int) const {
    *widest_tile = std::max(*widest_tile, out.cols());
    for (Index r = 0; r < out.rows(); ++r)
      for (Index c = 0; c < out.cols(); ++c)
        out(r, c) = 0.01f * float(k0 + c) * float(1 + (q0 + r) % 5) + 0.5f * std::sin(float(k0 + c + q0 + r));
  }
  auto values(Index, Index, Index k0, Index count, Workspace<float>&, int) const { return v->middleRows(k0, count); }
};

TEST(DensePipeline, OnlineSoftmaxStaysWithinItsBoundOfOnePass) {
  Rng rng(5);
  constexpr Index T = 7, S = 4096, dv = 8;
  const Matrix<float> v = random_matrix<float>(rng, S, dv, 1.0);
  Index widest = 0;
  auto run_with = [&](Index key_block) {
    widest = 0;
    std::vector<float> context(T * dv);
    headmix::DenseRun<float> run;
    run.batch = 1, run.queries = T, run.keys = S, run.block_rows = T, run.key_block = key_block;
    run.context = context.data();
    Workspace<float> ws;
    headmix::run_dense_pipeline(Rising{&v, &widest}, run, ws);
    return context;
  };
  const std::vector<float> one_pass = run_with(S);
  EXPECT_EQ(widest, S) << "one pass should score all keys at once";
  const float max_v = v.cwiseAbs().maxCoeff();
  for (Index key_block : {Index(16), Index(512)}) {
    const std::vector<float> online = run_with(key_block);
    EXPECT_EQ(widest, key_block) << "the scores came in blocks of " << widest << " keys";
    const double blocks = double(S / key_block);
    const double bound = (2 + blocks) * std::numeric_limits<float>::epsilon() * max_v;
    double worst = 0;
    for (std::size_t i = 0; i < online.size(); ++i) worst = std::max(worst, double(std::abs(online[i] - one_pass[i])));
    EXPECT_LE(worst, bound) << "key_block " << key_block;
  }
}

// Grouped-query dot-product attention through DotProductStages: four query
// heads over two K/V heads. Blocks of one query row take the stacked path
// (a group's heads as the rows of one tile); taller blocks run head by head.
// Both against loops over Q, K and V.
struct GroupedDot : headmix::DotProductStages<double> {
  Index score_heads() const { return q_heads; }
  Index softmax_heads() const { return q_heads; }
  Index value_heads() const { return q_heads; }
  Index value_dim() const { return dv; }
};
static_assert(headmix::stacks_heads<GroupedDot>::value);

TEST(DensePipeline, GroupedQueryHeadsStackedOrOneByOne) {
  constexpr Index H = 4, Hkv = 2, dk = 3, dv = 2;
  Rng rng(6);
  const Matrix<double> q = random_matrix<double>(rng, kB * kT, H * dk, 1.5);
  const Matrix<double> k = random_matrix<double>(rng, kB * kS, Hkv * dk, 1.5);
  const Matrix<double> v = random_matrix<double>(rng, kB * kS, Hkv * dv, 1.0);
  GroupedDot policy;
  policy.q = q.data(), policy.k = k.data(), policy.v = v.data(), policy.queries = kT, policy.key_stride = kS;
  policy.q_heads = H, policy.k_heads = Hkv, policy.v_heads = Hkv, policy.dk = dk, policy.dv = dv;
  policy.k_group = H / Hkv, policy.v_group = H / Hkv;
  std::vector<std::uint8_t> pad(kB * kS, 0);
  for (Index j = 0; j < kS; j += 3) pad[j] = 1;  // item 0: every third key padded
  for (const Setting& s : settings()) {
    // Expected output and weights, in loops.
    std::vector<double> out(kB * kT * H * dv, 0.0), weights(kB * H * kT * kS, 0.0);
    for (Index b = 0; b < kB; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index i = 0; i < kT; ++i) {
          const auto [lo, hi] = s.mask.key_range(i, kS);
          std::vector<double> logit(kS, -std::numeric_limits<double>::infinity());
          double top = -std::numeric_limits<double>::infinity();
          for (Index j = lo; j < hi; ++j) {
            if (s.padded && pad[b * kS + j]) continue;
            double dot = 0;
            for (Index d = 0; d < dk; ++d) dot += q(b * kT + i, h * dk + d) * k(b * kS + j, h / 2 * dk + d);
            top = std::max(top, logit[j] = dot);
          }
          if (std::isinf(top)) continue;
          double sum = 0;
          for (Index j = 0; j < kS; ++j) sum += std::exp(logit[j] - top);
          for (Index j = 0; j < kS; ++j) {
            const double p = std::exp(logit[j] - top) / sum;
            weights[((b * H + h) * kT + i) * kS + j] = p;
            for (Index d = 0; d < dv; ++d) out[(b * kT + i) * H * dv + h * dv + d] += p * v(b * kS + j, h / 2 * dv + d);
          }
        }
    for (Index block : {Index(1), Index(4)})
      for (Index key_block : {Index(1), Index(4), Index(512)}) {
        SCOPED_TRACE(std::string(s.name) + ", block_rows " + std::to_string(block) + ", key_block " +
                     std::to_string(key_block));
        std::vector<double> context(kB * kT * H * dv, -7.0);
        Tensor<double> probs;
        headmix::DenseRun<double> run;
        run.batch = kB, run.queries = kT, run.keys = kS, run.mask = s.mask, run.block_rows = block;
        run.key_block = key_block, run.threads = 2, run.context = context.data(), run.probs = &probs;
        if (s.padded) run.padding = {pad.data(), kB, kS};
        Workspace<double> ws;
        headmix::run_dense_pipeline(policy, run, ws);
        EXPECT_TRUE(all_close("context", context.data(), context.size(), out, {1e-12, 1e-12}));
        EXPECT_TRUE(all_close("probs", probs, weights, {1e-12, 1e-12}));
      }
  }
}

}  // namespace
