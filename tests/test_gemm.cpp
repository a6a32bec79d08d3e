// headmix::gemm, the product every attention path multiplies with (libxsmm's
// JIT kernels when built with them, else Eigen's), against a naive double
// loop: edge tiles, k past one slice, strided blocks, accumulation, empty
// shapes; and bit-identical results wherever the operands sit in memory and
// whether B is packed. Also the one-row products of decoding steps
// (row_product.hpp), float and bfloat16 rows, against the same loop; and a
// projection's tasks (project_rows).
#include <headmix/core/gemm.hpp>
#include <headmix/core/linear.hpp>
#include <headmix/core/parallel.hpp>
#include <headmix/core/row_product.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace headmix;

namespace {

HEADMIX_TYPED_OVER_SCALARS(GemmTyped);

template <class T>
Matrix<T> random_matrix(Index rows, Index cols, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  return Matrix<T>::NullaryExpr(rows, cols, [&] { return static_cast<T>(u(rng)); });
}

// C0 + A·B in double, one multiply-add at a time.
template <class A, class B, class C>
Matrix<double> naive_product(const A& a, const B& b, const C& c0, bool accumulate) {
  Matrix<double> c(a.rows(), b.cols());
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < b.cols(); ++j) {
      double s = accumulate ? double(c0(i, j)) : 0.0;
      for (Index p = 0; p < a.cols(); ++p) s += double(a(i, p)) * double(b(p, j));
      c(i, j) = s;
    }
  return c;
}

// |C - C_ref| within k·eps·Σ|a||b| per entry (plus |C0| when accumulating).
template <class T, class C>
void expect_close(const C& got, const Matrix<double>& want, Index k) {
  const double eps = std::numeric_limits<T>::epsilon();
  for (Index i = 0; i < want.rows(); ++i)
    for (Index j = 0; j < want.cols(); ++j)
      ASSERT_NEAR(double(got(i, j)), want(i, j), 2.0 * double(k + 1) * eps) << "entry (" << i << ", " << j << ")";
}

struct Dims {
  Index m, n, k;
};
// Edge tiles in every dimension, k over several slices (64 or 256), one-row and
// one-column products (a decoding step's shapes).
const Dims kShapes[] = {{1, 1, 1},   {3, 70, 5},    {64, 64, 64}, {65, 129, 257}, {130, 64, 600},
                        {1, 300, 64}, {64, 1, 1024}, {7, 5, 513},  {200, 33, 3}};

// B as it stands, or packed in panels (the projections' weights).
TYPED_TEST(GemmTyped, MatchesNaiveProductOnStridedBlocks) {
  using T = TypeParam;
  std::mt19937 rng(7);
  for (const Dims d : kShapes)
    for (bool accumulate : {false, true})
      for (bool packed : {false, true}) {
        SCOPED_TRACE(::testing::Message() << gemm_backend() << " m=" << d.m << " n=" << d.n << " k=" << d.k
                                          << " accumulate=" << accumulate << " packed=" << packed);
        // Operands inside wider matrices, as a head's columns sit in Q or K.
        Matrix<T> A = random_matrix<T>(d.m + 2, d.k + 3, rng), B = random_matrix<T>(d.k + 1, d.n + 5, rng);
        Matrix<T> C = random_matrix<T>(d.m + 1, d.n + 4, rng);
        const Matrix<T> before = C;
        auto a = A.block(1, 2, d.m, d.k);
        auto b = B.block(1, 3, d.k, d.n);
        auto c = C.block(1, 1, d.m, d.n);
        const Matrix<double> want = naive_product(a, b, c, accumulate);
        if (packed)
          gemm(a, PackedMatrix<T>(b), c, accumulate);
        else
          gemm(a, b, c, accumulate);
        expect_close<T>(c, want, d.k);
        // Nothing outside the block is written.
        Matrix<T> outside = C;
        outside.block(1, 1, d.m, d.n) = before.block(1, 1, d.m, d.n);
        EXPECT_EQ(outside, before);
      }
}

TYPED_TEST(GemmTyped, EmptyInnerDimensionZeroesOrKeeps) {
  using T = TypeParam;
  Matrix<T> a(4, 0), b(0, 5), c = Matrix<T>::Constant(4, 5, T(3));
  gemm(a, b, c, true);
  EXPECT_TRUE((c.array() == T(3)).all());
  gemm(a, b, c);
  EXPECT_TRUE((c.array() == T(0)).all());
}

// The promise behind "bit-identical across buffer addresses": the same
// product from operands at other offsets (other alignments) gives the
// same bits.
TYPED_TEST(GemmTyped, BitIdenticalAtAnyAddress) {
  using T = TypeParam;
  std::mt19937 rng(11);
  const Index m = 70, n = 150, k = 300;
  const Matrix<T> a0 = random_matrix<T>(m, k, rng), b0 = random_matrix<T>(k, n, rng);
  Matrix<T> c0(m, n);
  gemm(a0, b0, c0);
  for (Index shift = 1; shift < 4; ++shift) {
    std::vector<T> abuf(m * k + shift), bbuf(k * n + shift), cbuf(m * n + shift);
    MatrixMap<T> a(abuf.data() + shift, m, k), b(bbuf.data() + shift, k, n), c(cbuf.data() + shift, m, n);
    a = a0, b = b0;
    gemm(a, b, c);
    EXPECT_EQ(Matrix<T>(c), c0) << "operands shifted by " << shift << " elements";
  }
}

// Packing changes where B's tiles are read from, not the arithmetic: under
// libxsmm the packed product has the unpacked one's bits, so preparing a
// layer's weights changes no result. (On Eigen's GEMM a packed product runs
// panel by panel, with Eigen's own blocking, and is only close.)
TYPED_TEST(GemmTyped, PackedOperandGivesTheUnpackedBits) {
  using T = TypeParam;
  if (std::string(gemm_backend()) != "libxsmm") GTEST_SKIP() << "bit equality is libxsmm's tiling; this is Eigen's";
  std::mt19937 rng(13);
  for (const Dims d : kShapes) {
    const Matrix<T> a = random_matrix<T>(d.m, d.k, rng), b = random_matrix<T>(d.k, d.n, rng);
    Matrix<T> unpacked(d.m, d.n), packed(d.m, d.n);
    gemm(a, b, unpacked);
    gemm(a, PackedMatrix<T>(b), packed);
    EXPECT_EQ(packed, unpacked) << "m=" << d.m << " n=" << d.n << " k=" << d.k;
  }
}

// Fetching the next product's B while multiplying (gemm's next_b: the
// kernels that also prefetch, which DCMHA's and Talking-Heads' heads take
// in turn) changes
// where data sits in cache, never the arithmetic: the same bits as without,
// for B as it stands and packed, at every shape (tiles after tiles along k,
// n and m, and the last one fetching next_b), accumulating or not.
TYPED_TEST(GemmTyped, FetchingTheNextOperandGivesTheSameBits) {
  using T = TypeParam;
  std::mt19937 rng(19);
  for (const Dims d : kShapes)
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << gemm_backend() << " m=" << d.m << " n=" << d.n << " k=" << d.k
                                        << " accumulate=" << accumulate);
      const Matrix<T> a = random_matrix<T>(d.m, d.k, rng), b = random_matrix<T>(d.k, d.n, rng);
      const Matrix<T> next = random_matrix<T>(d.k, d.n, rng), c0 = random_matrix<T>(d.m, d.n, rng);
      const PackedMatrix<T> packed(b), packed_next(next);
      Matrix<T> plain = c0, fetching = c0, packed_plain = c0, packed_fetching = c0;
      gemm(a, b, plain, accumulate);
      gemm(a, b, fetching, accumulate, next.data());
      gemm(a, packed, packed_plain, accumulate);
      gemm(a, packed.panels(), packed_fetching, accumulate, packed_next.panels().start());
      EXPECT_EQ(fetching, plain);
      EXPECT_EQ(packed_fetching, packed_plain);
      expect_close<T>(fetching, naive_product(a, b, c0, accumulate), d.k);
    }
}

// Keys are read from K_hᵀ in panels at any key offset and count (a query
// block's visible keys), and CollabHead's heads read a span of its rows: a
// view that starts inside a panel, ends inside one, or spans many
// multiplies exactly its own rows and columns.
TYPED_TEST(GemmTyped, PanelViewsAtAnyOffset) {
  using T = TypeParam;
  std::mt19937 rng(17);
  const Index m = 5, stored_rows = 70, stored_cols = 300;
  const Matrix<T> b = random_matrix<T>(stored_rows, stored_cols, rng);
  const PackedMatrix<T> packed(b);
  for (const auto& [r0, k] : {std::pair<Index, Index>{0, 70}, {0, 20}, {13, 57}, {31, 9}})
    for (const Index c0 : {0, 1, 37, 63, 64, 65, 128, 250, 299})
      for (const Index n : {1, 2, 27, 63, 64, 65, 130, 236})
        for (bool accumulate : {false, true}) {
          if (c0 + n > stored_cols) continue;
          SCOPED_TRACE(::testing::Message() << gemm_backend() << " rows " << r0 << " + " << k << ", columns " << c0
                                            << " + " << n << " accumulate=" << accumulate);
          const Matrix<T> a = random_matrix<T>(m, k, rng);
          Matrix<T> c = random_matrix<T>(m, n, rng), plain = c;
          const auto block = b.block(r0, c0, k, n);
          const Matrix<double> want = naive_product(a, block, c, accumulate);
          gemm(a, packed.panels().middle_rows(r0, k).middle_cols(c0, n), c, accumulate);
          expect_close<T>(c, want, k);
          // A view from a panel boundary is tiled as B as it stands; one from
          // inside a panel runs its first columns on a narrower kernel, whose
          // sums libxsmm may order differently.
          if (std::string(gemm_backend()) != "libxsmm" || c0 % Panels<T>::kWidth != 0) continue;
          gemm(a, block, plain, accumulate);
          EXPECT_EQ(c, plain) << "the bits of the product on B as it stands";
        }
}

// Columns written a few at a time (a cache's keys, position by position or
// in chunks) land where Panels keeps them: column c of row r in the panel
// at p0 = 64·⌊c / 64⌋, width min(64, stored - p0), at p0·rows + r·width +
// (c - p0); columns never written keep what was there.
TYPED_TEST(GemmTyped, PanelColumnsWrittenInChunksLieWherePanelsKeepThem) {
  using T = TypeParam;
  std::mt19937 rng(29);
  const Index rows = 3, stored = 150;
  const Matrix<T> b = random_matrix<T>(rows, stored, rng);
  const T untouched = T(-7);
  std::vector<T> out(rows * stored, untouched);
  for (auto [c0, n] : {std::pair<Index, Index>{5, 59}, {64, 1}, {65, 70}, {135, 10}})  // columns [5, 145)
    Panels<T>::write_columns(b.middleCols(c0, n), out.data(), stored, c0);
  for (Index c = 0; c < stored; ++c)
    for (Index r = 0; r < rows; ++r) {
      const Index p0 = c / 64 * 64, width = std::min<Index>(64, stored - p0);
      ASSERT_EQ(out[p0 * rows + r * width + (c - p0)], c >= 5 && c < 145 ? b(r, c) : untouched)
          << "row " << r << " column " << c;
    }
}

// K_hᵀ is laid out from K's strided rows (a head's columns of [keys, H·dk])
// by register transposes of square blocks, with scalar edges: every element
// lands where a panel of Kᵀ keeps it, at any row count and head width, and
// an accumulating transpose adds each element once, leaving the rest.
TYPED_TEST(GemmTyped, PanelsOfATransposeHoldEveryElementInPlace) {
  using T = TypeParam;
  std::mt19937 rng(23);
  for (const Index rows : {1, 7, 16, 17, 63, 64, 65, 130, 200})
    for (const Index cols : {1, 5, 8, 16, 33, 64, 72}) {
      SCOPED_TRACE(::testing::Message() << "a is [" << rows << ", " << cols << "] of a wider matrix");
      const Matrix<T> wide = random_matrix<T>(rows, cols + 11, rng);
      const ConstStridedMap<T> a(wide.data() + 3, rows, cols, Eigen::OuterStride<>(cols + 11));
      std::vector<T> out(rows * cols, std::numeric_limits<T>::quiet_NaN());
      Panels<T>::write_transposed(a, out.data());
      for (Index r = 0; r < rows; ++r)
        for (Index c = 0; c < cols; ++c) {
          const Index i0 = r / 64 * 64, w = std::min<Index>(64, rows - i0);  // r's panel and its width
          ASSERT_EQ(out[i0 * cols + c * w + (r - i0)], wide(r, c + 3)) << "row " << r << " column " << c;
        }
      // Added instead (CollabHead's content bias onto a step's scores), into rows 2 longer than a's.
      const Index ld = rows + 2;
      const Matrix<T> before = random_matrix<T>(cols, ld, rng);
      Matrix<T> sum = before;
      detail::transpose_into(a, sum.data(), ld, true);
      for (Index c = 0; c < cols; ++c)
        for (Index r = 0; r < ld; ++r)
          ASSERT_EQ(sum(c, r), r < rows ? T(before(c, r) + wide(r, c + 3)) : before(c, r)) << "row " << r << " column " << c;
    }
}

// A Linear applies Wᵀ from its prepared copy (libxsmm) or from W itself
// (Eigen); both give x·Wᵀ + b, and a Linear never prepared still works.
TYPED_TEST(GemmTyped, LinearAppliesPreparedAndUnpreparedWeights) {
  using T = TypeParam;
  std::mt19937 rng(3);
  Linear<T> lin{random_matrix<T>(40, 300, rng), random_matrix<T>(40, 1, rng).col(0)};
  const Matrix<T> x = random_matrix<T>(9, 300, rng);
  Matrix<double> want = naive_product(x, Matrix<T>(lin.weight.transpose()), Matrix<T>(9, 40), false);
  want.rowwise() += lin.bias.template cast<double>().transpose();
  Matrix<T> y(9, 40);
  lin.apply(x, y);
  expect_close<T>(y, want, 300);
  lin.prepare();
  lin.apply(x, y);
  expect_close<T>(y, want, 300);
}

// A projection runs in tasks of 64 rows (a lone last row joining the task
// before it), or of 128 columns for at most 64 rows (project_rows): at and
// past those boundaries it gives x·Wᵀ + b, the same bits on 1, 2 and 3
// threads, and under libxsmm the bits of one apply() over the whole input
// (column tasks start at panel boundaries; one row streams the panels, a
// sum per column, and no row of a longer input takes that path alone).
// One row from a column inside a panel gives the same values.
TYPED_TEST(GemmTyped, ProjectionTasksMatchNaiveProductOnAnyThreadCount) {
  using T = TypeParam;
  std::mt19937 rng(17);
  const Index in = 70;
  for (const Index out : {1, 127, 128, 129, 300})
    for (const Index n : {1, 5, 64, 65, 129, 130}) {
      Linear<T> lin{random_matrix<T>(out, in, rng), random_matrix<T>(out, 1, rng).col(0)};
      lin.prepare();
      const Matrix<T> x = random_matrix<T>(n, in, rng);
      Matrix<double> want = naive_product(x, Matrix<T>(lin.weight.transpose()), Matrix<T>(n, out), false);
      want.rowwise() += lin.bias.template cast<double>().transpose();
      Matrix<T> whole(n, out), one;
      lin.apply(x, whole);
      for (const int threads : {1, 2, 3}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " out=" + std::to_string(out) + " threads=" + std::to_string(threads));
        Matrix<T> y = Matrix<T>::Constant(n, out, std::numeric_limits<T>::quiet_NaN());  // unwritten entries fail
        project_rows<T>(lin, ConstMatrixMap<T>(x.data(), n, in), MatrixMap<T>(y.data(), n, out), threads);
        expect_close<T>(y, want, in);
        if (threads == 1) one = y;
        EXPECT_EQ(y, one);
        if (std::string(gemm_backend()) == "libxsmm") {
          EXPECT_EQ(y, whole);
        }
      }
      if (n == 1 && out > 3) {  // from a column inside a panel, across the next boundary
        const Index c0 = out > 64 ? 61 : 2, width = out - c0;
        Matrix<T> part(1, width);
        lin.apply_columns(x, c0, part);
        expect_close<T>(part, want.rightCols(width), in);
      }
    }
}

// A Linear with no input features gives its bias, one row (the one-row
// product over empty panels) or several, with float or bfloat16 weights.
TYPED_TEST(GemmTyped, LinearWithoutInputFeaturesGivesItsBias) {
  using T = TypeParam;
  std::mt19937 rng(41);
  for (const bool half : {false, true})
    for (const Index n : {1, 3}) {
      SCOPED_TRACE(std::string(half ? "bfloat16" : "float") + " weights, n=" + std::to_string(n));
      Linear<T> lin{Matrix<T>(70, 0), random_matrix<T>(70, 1, rng).col(0)};
      lin.prepare(half);
      const Matrix<T> x(n, 0);
      Matrix<T> y = Matrix<T>::Constant(n, 70, std::numeric_limits<T>::quiet_NaN());
      project_rows<T>(lin, ConstMatrixMap<T>(x.data(), n, 0), MatrixMap<T>(y.data(), n, 70), 2);
      for (Index r = 0; r < n; ++r) EXPECT_EQ(Matrix<T>(y.row(r)), Matrix<T>(lin.bias.transpose()));
    }
}

// With bfloat16 weights (DenseOptions::bfloat16_weights) a Linear rounds
// its weight once, to the nearest bfloat16 through float, and every product
// uses the rounded values: one row from the bfloat16 panels, more rows by
// GEMM, each against a naive product over the rounded weights, on 1-3
// threads with the same bits, from any first column. Against the float
// weights, each value moves by at most 2^-8 · Σ_i |x_i w_i| (the stated
// bound; 2^-24 more for double weights, rounded to float first). Preparing
// again without the option drops the bfloat16 copy and keeps the rounding.
TYPED_TEST(GemmTyped, BfloatWeightsAreRoundedOnceAndStayWithinTheirBound) {
  using T = TypeParam;
  std::mt19937 rng(29);
  const Index in = 70;
  for (const Index out : {1, 63, 64, 65, 129, 300})
    for (const Index n : {1, 2, 5}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " out=" + std::to_string(out));
      const Linear<T> exact{random_matrix<T>(out, in, rng), random_matrix<T>(out, 1, rng).col(0)};
      Linear<T> lin = exact;
      lin.prepare(true);
      for (Index o = 0; o < out; ++o)
        for (Index i = 0; i < in; ++i)
          ASSERT_EQ(lin.weight(o, i), T(float(Eigen::bfloat16(float(exact.weight(o, i)))))) << o << ", " << i;
      ASSERT_GT((lin.weight - exact.weight).cwiseAbs().maxCoeff(), T(0)) << "the rounding must be visible";

      const Matrix<T> x = random_matrix<T>(n, in, rng);
      Matrix<double> want = naive_product(x, Matrix<T>(lin.weight.transpose()), Matrix<T>(n, out), false);
      want.rowwise() += lin.bias.template cast<double>().transpose();
      Matrix<double> unrounded = naive_product(x, Matrix<T>(exact.weight.transpose()), Matrix<T>(n, out), false);
      unrounded.rowwise() += exact.bias.template cast<double>().transpose();
      const Matrix<double> magnitude = x.template cast<double>().cwiseAbs() *
                                       exact.weight.template cast<double>().cwiseAbs().transpose();
      const double u = std::ldexp(1.0, -8) + (std::is_same_v<T, double> ? std::ldexp(1.0, -24) : 0.0);
      Matrix<T> one;
      for (const int threads : {1, 2, 3}) {
        Matrix<T> y = Matrix<T>::Constant(n, out, std::numeric_limits<T>::quiet_NaN());
        project_rows<T>(lin, ConstMatrixMap<T>(x.data(), n, in), MatrixMap<T>(y.data(), n, out), threads);
        expect_close<T>(y, want, in);
        if (threads == 1) one = y;
        EXPECT_EQ(y, one) << threads << " threads";
        for (Index r = 0; r < n; ++r)
          for (Index o = 0; o < out; ++o)
            ASSERT_LE(std::abs(double(y(r, o)) - unrounded(r, o)),
                      u * magnitude(r, o) + 2.0 * double(in + 1) * std::numeric_limits<T>::epsilon())
                << "against the float weights, row " << r << ", column " << o;
      }
      if (n == 1 && out > 3) {  // from a column inside a panel, across the next boundary
        const Index c0 = out > 64 ? 61 : 2, width = out - c0;
        Matrix<T> part(1, width);
        lin.apply_columns(x, c0, part);
        expect_close<T>(part, want.rightCols(width), in);
      }
      lin.prepare(false);
      EXPECT_EQ(lin.weight_half.rows(), 0);
      Matrix<T> y(n, out);
      lin.apply(x, y);
      expect_close<T>(y, want, in);
    }
}

// A step's readout, one row of weights times n value rows: every part
// boundary (n below, at and past multiples of 4), full 64-column chunks and
// the columns past them, rows wider than the product (a head's slice of a
// cache row), accumulating or not; and from bfloat16 rows, against the same
// loop on the widened values.
TYPED_TEST(GemmTyped, OneRowTimesStoredRowsMatchesNaiveProduct) {
  using T = TypeParam;
  std::mt19937 rng(19);
  for (const Index n : {0, 1, 3, 4, 5, 7, 64, 257, 1023})
    for (const Index width : {1, 16, 63, 64, 65, 128, 150})
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " width=" << width << " accumulate=" << accumulate);
        const Index stride = width + 3;
        const Matrix<T> w = random_matrix<T>(1, n, rng), stored = random_matrix<T>(n, stride, rng);
        const Matrix<T> c0 = random_matrix<T>(1, width + 2, rng);
        const auto rows = stored.leftCols(width);
        Matrix<T> c = c0;
        multiply_rows(w, rows, c.leftCols(width), accumulate);
        expect_close<T>(c.leftCols(width), naive_product(w, rows, c0.leftCols(width), accumulate), n);
        EXPECT_EQ(c.rightCols(2), c0.rightCols(2)) << "columns past the product are written";

        std::vector<Eigen::bfloat16> half(n * stride);
        Matrix<T> widened(n, width);
        for (Index i = 0; i < n; ++i)
          for (Index j = 0; j < stride; ++j) {
            half[i * stride + j] = Eigen::bfloat16(float(stored(i, j)));
            if (j < width) widened(i, j) = static_cast<T>(float(half[i * stride + j]));
          }
        c = c0;
        accumulate_rows(w.data(), half.data(), n, stride, width, c.data(), accumulate);
        expect_close<T>(c.leftCols(width), naive_product(w, widened, c0.leftCols(width), accumulate), n);
        EXPECT_EQ(c.rightCols(2), c0.rightCols(2)) << "columns past the product are written (bfloat16)";
      }
}

// A step's few rows (a KV group's heads, a few tokens) times n bfloat16
// rows, for every row count it takes: full 32-column chunks and the columns
// past them, n of 0 and past a key block, strided operands, accumulating or
// not, against naive double loops over the widened values. Each row's sums
// run in the order of that row alone: its bits equal those of the row
// multiplied on its own, and of the product from rows at another address.
TYPED_TEST(GemmTyped, FewRowsTimesBfloat16RowsMatchNaiveProduct) {
  using T = TypeParam;
  std::mt19937 rng(29);
  for (Index R = 1; R <= kFewRows; ++R)
    for (const Index n : {0, 1, 5, 64, 203})
      for (const Index width : {1, 31, 32, 33, 70, 130})
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "R=" << R << " n=" << n << " width=" << width
                                            << " accumulate=" << accumulate);
          const Index stride = width + 3;
          const Matrix<T> w = random_matrix<T>(R, n + 2, rng), c0 = random_matrix<T>(R, width + 2, rng);
          std::vector<Eigen::bfloat16> half(n * stride + 1);
          Matrix<T> widened(n, width);
          for (Index i = 0; i < n; ++i)
            for (Index j = 0; j < stride; ++j) {
              half[i * stride + j] = Eigen::bfloat16(float(rng() % 2001) / 1000.0f - 1.0f);
              if (j < width) widened(i, j) = static_cast<T>(float(half[i * stride + j]));
            }
          Matrix<T> c = c0;
          multiply_few_rows(R, w.data(), w.cols(), half.data(), n, stride, width, c.data(), c.cols(), accumulate);
          expect_close<T>(c.leftCols(width), naive_product(w.leftCols(n), widened, c0.leftCols(width), accumulate), n);
          EXPECT_EQ(c.rightCols(2), c0.rightCols(2)) << "columns past the product are written";

          std::vector<Eigen::bfloat16> moved(half.size() + 1);  // the same rows, one element further in
          std::copy(half.begin(), half.end(), moved.begin() + 1);
          for (Index r = 0; r < R; ++r) {
            Matrix<T> alone = c0.row(r);
            multiply_few_rows(1, w.row(r).data(), w.cols(), moved.data() + 1, n, stride, width, alone.data(),
                              alone.cols(), accumulate);
            EXPECT_EQ(alone.leftCols(width), c.row(r).leftCols(width)) << "row " << r << " alone, rows moved";
          }
        }
}

// The readout's sums are ordered by the number of rows alone: the same
// product from rows at other addresses gives the same bits, from T rows
// and from bfloat16 rows.
TYPED_TEST(GemmTyped, OneRowProductBitIdenticalAtAnyAddress) {
  using T = TypeParam;
  std::mt19937 rng(23);
  const Index n = 301, width = 128;
  const Matrix<T> w = random_matrix<T>(1, n, rng), rows0 = random_matrix<T>(n, width, rng);
  std::vector<Eigen::bfloat16> half0(n * width);
  for (Index i = 0; i < n * width; ++i) half0[i] = Eigen::bfloat16(float(rows0.data()[i]));
  Matrix<T> c0(1, width), h0(1, width);
  multiply_rows(w, rows0, c0, false);
  accumulate_rows(w.data(), half0.data(), n, width, width, h0.data(), false);
  for (Index shift = 1; shift < 4; ++shift) {
    std::vector<T> buf(n * width + shift);
    MatrixMap<T> rows(buf.data() + shift, n, width);
    rows = rows0;
    Matrix<T> c(1, width);
    multiply_rows(w, rows, c, false);
    EXPECT_EQ(c, c0) << "rows shifted by " << shift << " elements";
    std::vector<Eigen::bfloat16> half(n * width + shift);
    std::copy(half0.begin(), half0.end(), half.begin() + shift);
    accumulate_rows(w.data(), half.data() + shift, n, width, width, c.data(), false);
    EXPECT_EQ(c, h0) << "bfloat16 rows shifted by " << shift << " elements";
  }
}

}  // namespace
