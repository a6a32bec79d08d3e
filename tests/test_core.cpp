// Unit tests of the shared stages: masks, masked softmax, the attention
// tensor's views, head mixing, workspace and the parallel loop. Expected
// values come from direct formulas in double, never from the stage itself.
#include <headmix/headmix.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace headmix;

namespace {

HEADMIX_TYPED_OVER_SCALARS(CoreTyped);

// softmax of a plain vector in long double, for comparison.
std::vector<double> softmax_ref(const std::vector<double>& x, const std::vector<bool>& visible) {
  long double m = -INFINITY, s = 0;
  for (std::size_t j = 0; j < x.size(); ++j)
    if (visible[j]) m = std::max<long double>(m, x[j]);
  std::vector<double> p(x.size(), 0.0);
  if (m == -INFINITY) return p;
  for (std::size_t j = 0; j < x.size(); ++j)
    if (visible[j]) s += std::exp(static_cast<long double>(x[j]) - m);
  for (std::size_t j = 0; j < x.size(); ++j)
    if (visible[j]) p[j] = static_cast<double>(std::exp(static_cast<long double>(x[j]) - m) / s);
  return p;
}

}  // namespace

TEST(PositionMask, CausalRangesTopLeftAndOffset) {
  PositionMask m{true, 0, 0};
  EXPECT_EQ(m.key_range(0, 5), std::make_pair(Index(0), Index(1)));
  EXPECT_EQ(m.key_range(4, 5), std::make_pair(Index(0), Index(5)));
  EXPECT_EQ(m.key_range(9, 5), std::make_pair(Index(0), Index(5)));  // S < T: clamps
  PositionMask decode{true, 7, 0};                                    // 1 new token over 8 cached keys
  EXPECT_EQ(decode.key_range(0, 8), std::make_pair(Index(0), Index(8)));
  PositionMask negative{true, -2, 0};
  EXPECT_EQ(negative.key_range(1, 8).second - negative.key_range(1, 8).first, 0);  // fully masked
  PositionMask window{true, 0, 3};
  EXPECT_EQ(window.key_range(5, 10), std::make_pair(Index(3), Index(6)));
  EXPECT_EQ(window.visible_pairs(4, 4), 1 + 2 + 3 + 3);
  EXPECT_EQ((PositionMask{}.visible_pairs(3, 7)), 21);
  EXPECT_EQ((PositionMask{true, 0, 0}.visible_pairs(4, 2)), 1 + 2 + 2 + 2);
}

TYPED_TEST(CoreTyped, MaskedSoftmaxMatchesFormulaWithCausalPaddingAndOffsets) {
  using T = TypeParam;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(-3, 3);
  // Long enough rows that the vectorised exp path runs.
  const Index rows = 6, S = 40, first_query = 20, first_key = 1, cols = 37;
  const PositionMask mask{true, 1, 0};
  std::vector<std::uint8_t> pad(S, 0);
  pad[3] = pad[6] = pad[17] = 1;
  Matrix<T> scores(rows, cols);
  Matrix<double> orig(rows, cols);
  for (Index r = 0; r < rows; ++r)
    for (Index c = 0; c < cols; ++c) scores(r, c) = static_cast<T>(orig(r, c) = u(rng));
  std::vector<T> bias(cols);
  key_padding_bias(pad.data(), first_key, cols, bias.data());
  masked_softmax_head<T>(Eigen::Map<Matrix<T>>(scores.data(), rows, cols), first_query, first_key, S, mask,
                         bias.data());
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  for (Index r = 0; r < rows; ++r) {
    std::vector<double> x(cols);
    std::vector<bool> vis(cols);
    for (Index c = 0; c < cols; ++c) {
      const Index i = first_query + r, j = first_key + c;
      x[c] = orig(r, c);
      vis[c] = j <= i + 1 && !pad[j];
    }
    auto p = softmax_ref(x, vis);
    for (Index c = 0; c < cols; ++c) {
      EXPECT_NEAR(scores(r, c), p[c], tol) << "row " << r << " col " << c;
      if (!vis[c]) {
        EXPECT_EQ(scores(r, c), T(0)) << "masked entries must be exactly 0";
      }
    }
  }
}

TYPED_TEST(CoreTyped, FullyMaskedRowIsZeroNotNaN) {
  using T = TypeParam;
  Matrix<T> s = Matrix<T>::Constant(2, 4, T(1));
  std::vector<std::uint8_t> pad = {1, 1, 1, 1};
  std::vector<T> bias(4);
  key_padding_bias(pad.data(), 0, 4, bias.data());
  masked_softmax_head<T>(Eigen::Map<Matrix<T>>(s.data(), 2, 4), 0, 0, 4, PositionMask{}, bias.data());
  EXPECT_TRUE((s.array() == T(0)).all());
  // A causal offset that hides every key also gives zeros.
  Matrix<T> t = Matrix<T>::Constant(1, 4, T(2));
  masked_softmax_head<T>(Eigen::Map<Matrix<T>>(t.data(), 1, 4), 0, 0, 4, PositionMask{true, -1, 0}, nullptr);
  EXPECT_TRUE((t.array() == T(0)).all());
}

TYPED_TEST(CoreTyped, LargeLogitsDoNotOverflow) {
  using T = TypeParam;
  Matrix<T> s(1, 3);
  s << T(1e4), T(1e4 - 1), T(-1e4);
  masked_softmax_head<T>(Eigen::Map<Matrix<T>>(s.data(), 1, 3), 0, 0, 3, PositionMask{}, nullptr);
  const double e = std::exp(-1.0);
  EXPECT_NEAR(s(0, 0), 1 / (1 + e), 1e-6);
  EXPECT_NEAR(s(0, 1), e / (1 + e), 1e-6);
  EXPECT_EQ(s(0, 2), T(0));
  EXPECT_TRUE(s.allFinite());
}

TYPED_TEST(CoreTyped, NaNInARowPropagatesToThatRowOnly) {
  using T = TypeParam;
  Matrix<T> s(2, 3);
  s << T(0), std::numeric_limits<T>::quiet_NaN(), T(1), T(0), T(1), T(2);
  masked_softmax_head<T>(Eigen::Map<Matrix<T>>(s.data(), 2, 3), 0, 0, 3, PositionMask{}, nullptr);
  EXPECT_TRUE(s.row(0).array().isNaN().any());
  EXPECT_TRUE(s.row(1).allFinite());
}

TYPED_TEST(CoreTyped, AttentionTensorViewsAddressTheSameMemory) {
  using T = TypeParam;
  const Index H = 3, rows = 2, cols = 4;
  std::vector<T> buf(H * rows * cols);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<T>(i);
  AttentionTensor<T> a(buf.data(), H, rows, cols, 5, 2);
  EXPECT_EQ(a.first_query(), 5);
  EXPECT_EQ(a.first_key(), 2);
  for (Index h = 0; h < H; ++h)
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c) {
        const T want = static_cast<T>((h * rows + r) * cols + c);
        EXPECT_EQ(a.head(h)(r, c), want);
        EXPECT_EQ(a.across_heads(r, c)(h), want);
        EXPECT_EQ(a.heads_by_entries()(h, r * cols + c), want);
      }
}

TYPED_TEST(CoreTyped, HeadMixIsAProductOverHeadsAtEachEntry) {
  using T = TypeParam;
  const Index hin = 3, hout = 5, rows = 2, cols = 3;
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(-1, 1);
  Matrix<T> w(hout, hin);
  for (Index i = 0; i < w.size(); ++i) w.data()[i] = static_cast<T>(u(rng));
  std::vector<T> in(hin * rows * cols), out(hout * rows * cols);
  for (auto& x : in) x = static_cast<T>(u(rng));
  AttentionTensor<T> a(in.data(), hin, rows, cols), b(out.data(), hout, rows, cols);
  mix_heads(w, a, b);
  for (Index g = 0; g < hout; ++g)
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c) {
        double want = 0;
        for (Index h = 0; h < hin; ++h) want += double(w(g, h)) * double(in[(h * rows + r) * cols + c]);
        EXPECT_NEAR(b.head(g)(r, c), want, 1e-5);
      }
}

// Rows read side by side (a step's K_hᵀ rows, DCMHA's key-wise factor
// rows): room for n elements and a spare line, whole 64-byte lines, an odd
// number of them at every length, so that 64 consecutive rows start in 64
// different L1 sets (rows a multiple of 4 KiB apart would share one).
template <class E>
void expect_odd_line_strides() {
  const Index line = 64 / static_cast<Index>(sizeof(E));
  for (Index n = 0; n <= 4200; ++n) {
    const Index stride = detail::odd_line_stride<E>(n);
    ASSERT_GE(stride, n + line) << n;
    ASSERT_EQ(stride % line, 0) << n;
    ASSERT_EQ((stride / line) % 2, 1) << n;
  }
}
TEST(OddLineStride, RowsAnOddNumberOfLinesApartAtEveryLength) {
  expect_odd_line_strides<float>();
  expect_odd_line_strides<double>();
  expect_odd_line_strides<Eigen::bfloat16>();
}

TEST(Workspace, GrowsAndKeepsBuffers) {
  Workspace<float> ws;
  float* a = ws.shared(0, 100);
  EXPECT_EQ(ws.shared(0, 50), a);  // smaller request: same buffer
  EXPECT_GE(ws.bytes(), 100 * sizeof(float));
  ws.reserve_workers(2);
  float* l0 = ws.local(0, 1, 10);
  float* l1 = ws.local(1, 1, 10);
  EXPECT_NE(l0, l1);
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u);
}

TEST(Parallel, EveryTaskRunsOnceOnAValidWorker) {
  for (int threads : {1, 2, 3, 8}) {
    std::vector<std::atomic<int>> hits(17);
    std::atomic<bool> bad_worker{false};
    parallel_for(17, threads, [&](Index t, int w) {
      hits[static_cast<std::size_t>(t)]++;
      if (w < 0 || w >= threads) bad_worker = true;
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    EXPECT_FALSE(bad_worker.load());
  }
}

TEST(Parallel, ExceptionsReachTheCaller) {
  EXPECT_THROW(parallel_for(8, 2, [](Index t, int) { if (t == 6) throw std::runtime_error("x"); }),
               std::runtime_error);
}

TEST(ShapeError, MessageNamesVariantArgumentAndShapes) {
  try {
    check_shape("talking_heads", "pre_softmax.weight", {8, 8}, {8, 4});
    FAIL() << "no throw";
  } catch (const shape_error& e) {
    EXPECT_STREQ(e.what(), "[talking_heads] pre_softmax.weight: expected [8, 8], got [8, 4]");
  }
  EXPECT_THROW(check_shape("mha", "x", {-1, 3}, {2, 4}), std::invalid_argument);
  EXPECT_NO_THROW(check_shape("mha", "x", {-1, 3}, {2, 3}));
}
