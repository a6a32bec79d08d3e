// Helpers shared by the unit tests (tests/test_*.cpp): random weights and
// inputs, widening to double for the naive references, element-wise
// agreement checks and the shape_error message checks.
//
// Every test file is its own executable and includes this header once. The
// naive references (tests/reference/*.hpp) stay independent of it: the
// conversions below fill any reference struct with the right field names.
//
// Random draws: every helper draws its values one after another in the
// storage order of what it builds (row-major for headmix::Matrix), one
// distribution per helper call, so a given seed gives the same values as
// the per-file helpers these replace.
#pragma once

// Opt-in (define before including this header, and before anything that
// includes Eigen): count every heap allocation, to check that sized
// decoding steps allocate nothing, in Debug and Release builds alike.
//  - The global operator new / delete are replaced with malloc / free and
//    counted in headmix_test::allocations(). Replacement allocation
//    functions cannot be inline, so only one translation unit per program
//    may define this; every test is one.
//  - Eigen allocates with std::malloc, which that counter does not see.
//    With EIGEN_RUNTIME_NO_MALLOC Eigen checks each allocation with
//    eigen_assert, which NDEBUG compiles out; eigen_assert is routed here
//    instead, so that inside allocations_during() a forbidden Eigen
//    allocation is counted whatever the build type. Outside it a failed
//    Eigen assertion aborts as usual (so Eigen's own asserts stay on).
#ifdef HEADMIX_TEST_COUNT_ALLOCATIONS
#ifdef EIGEN_WORLD_VERSION
#error "define HEADMIX_TEST_COUNT_ALLOCATIONS and include test_util.hpp before any Eigen or headmix header"
#endif
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
namespace headmix_test {
// Number of calls of the global operator new (and new[]) so far, all threads.
inline std::atomic<long>& allocations() {
  static std::atomic<long> n{0};
  return n;
}
// Eigen allocations refused while counting (the flag below), all threads.
inline std::atomic<long>& eigen_allocations() {
  static std::atomic<long> n{0};
  return n;
}
inline std::atomic<bool>& counting_eigen_allocations() {
  static std::atomic<bool> on{false};
  return on;
}
inline void eigen_assert_failed(const char* what, const char* file, int line) {
  if (counting_eigen_allocations()) {
    ++eigen_allocations();
    return;
  }
  std::fprintf(stderr, "Eigen assertion failed: %s at %s:%d\n", what, file, line);
  std::abort();
}
}  // namespace headmix_test
#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x)                                                         \
  do {                                                                          \
    if (!(x)) ::headmix_test::eigen_assert_failed(#x, __FILE__, __LINE__);      \
  } while (false)
// (GCC cannot see that these replace the global pair, hence the pragma.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  ++headmix_test::allocations();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // HEADMIX_TEST_COUNT_ALLOCATIONS

#include "headmix/headmix.hpp"
// Counting allocations needs Eigen's malloc check compiled into the layers
// themselves, so such a program compiles its own instances (CMake does not
// link it to the precompiled ones).
#if defined(HEADMIX_TEST_PRECOMPILED_LAYERS) && defined(HEADMIX_TEST_COUNT_ALLOCATIONS)
#error "a program that counts allocations must not use the precompiled layers (see tests/CMakeLists.txt)"
#endif
#include "precompiled_layers.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace headmix_test {

using headmix::Index;
using headmix::Matrix;
using headmix::Tensor;
using headmix::Vector;

// Values a cache's K stream holds per head and per K dimension: its
// capacity when K lies in panels, its padded row stride when in rows.
template <class T>
Index key_extent(const headmix::SequenceCache<T>& cache) {
  return cache.key_layout() == headmix::KeyLayout::panels ? cache.capacity() : cache.transposed_stride();
}

// ---------------------------------------------------------------------------
// Random draws

// The tests' random engine; each test seeds its own.
using Rng = std::mt19937;

// A suite typed over float and double: HEADMIX_TYPED_OVER_SCALARS(Name);
// then TYPED_TEST(Name, ...) with TypeParam the scalar.
template <class T>
class ScalarTest : public ::testing::Test {};
using FloatAndDouble = ::testing::Types<float, double>;
/// Names typed tests by scalar ("float", "double") instead of 0, 1. (Every
/// TYPED_TEST_SUITE passes a name generator: clang warns when its optional
/// argument is left out.)
struct ScalarName {
  template <class T>
  static std::string GetName(int) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "a suite typed over float and double");
    return std::is_same_v<T, float> ? "float" : "double";
  }
};
#define HEADMIX_TYPED_OVER_SCALARS(Name)       \
  template <class T>                           \
  using Name = ::headmix_test::ScalarTest<T>; \
  TYPED_TEST_SUITE(Name, ::headmix_test::FloatAndDouble, ::headmix_test::ScalarName)

// One draw from U[lo, hi).
template <class G>
double uniform(G& rng, double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(rng);
}

// One draw from {lo, ..., hi}.
template <class G>
int uniform_int(G& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

// A [rows, cols] matrix of U[lo, hi) entries, drawn in storage order.
template <class T, class G>
Matrix<T> random_matrix(G& rng, Index rows, Index cols, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(u(rng));
  return m;
}
// A [rows, cols] matrix of U[-bound, bound) entries.
template <class T, class G>
Matrix<T> random_matrix(G& rng, Index rows, Index cols, double bound) {
  return random_matrix<T>(rng, rows, cols, -bound, bound);
}

// A length-n vector of U[-bound, bound) entries.
template <class T, class G>
Vector<T> random_vector(G& rng, Index n, double bound) {
  std::uniform_real_distribution<double> u(-bound, bound);
  Vector<T> v(n);
  for (Index i = 0; i < n; ++i) v(i) = static_cast<T>(u(rng));
  return v;
}

// A tensor of the given shape with U[-bound, bound) entries.
template <class T, class G>
Tensor<T> random_tensor(G& rng, std::vector<Index> shape, double bound) {
  std::uniform_real_distribution<double> u(-bound, bound);
  Tensor<T> t(std::move(shape));
  for (Index i = 0; i < t.size(); ++i) t[i] = static_cast<T>(u(rng));
  return t;
}

// A [rows, cols] matrix of N(0, stddev²) entries (one distribution for the
// whole matrix: normal_distribution caches every other draw).
template <class T, class G>
Matrix<T> normal_matrix(G& rng, Index rows, Index cols, double stddev = 1.0) {
  std::normal_distribution<double> n(0.0, stddev);
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(n(rng));
  return m;
}

// A [out, in] Linear with weights bounded by 1/sqrt(in), like torch's init,
// so activations stay O(1); then, if `bias`, a bias of U[-bias_bound, bias_bound).
template <class T, class G>
headmix::Linear<T> random_linear(G& rng, Index out, Index in, bool bias = true, double bias_bound = 0.5) {
  headmix::Linear<T> lin;
  lin.weight = random_matrix<T>(rng, out, in, 1.0 / std::sqrt(static_cast<double>(in)));
  if (bias) lin.bias = random_vector<T>(rng, out, bias_bound);
  return lin;
}

// ---------------------------------------------------------------------------
// Widening to double, for the naive references

// n values from `p`, as doubles.
template <class T>
std::vector<double> widen(const T* p, Index n) {
  std::vector<double> r(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) r[static_cast<std::size_t>(i)] = static_cast<double>(p[i]);
  return r;
}
// An Eigen matrix or vector, row by row (whatever its storage order).
template <class Derived>
std::vector<double> widen(const Eigen::MatrixBase<Derived>& m) {
  std::vector<double> r;
  r.reserve(static_cast<std::size_t>(m.size()));
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) r.push_back(static_cast<double>(m(i, j)));
  return r;
}
// A tensor in storage order.
template <class T>
std::vector<double> widen(const Tensor<T>& t) {
  return widen(t.data(), t.size());
}

// A Linear as a reference struct with fields out, in, weight ([out * in]) and
// bias ([out] or empty): RefLinear, RefThLinear, LshRefLinear. An empty
// Linear gives out = in = 0 (the references' "absent").
template <class Ref, class T>
Ref ref_linear_as(const headmix::Linear<T>& lin) {
  Ref r;
  r.out = static_cast<int>(lin.weight.rows());
  r.in = static_cast<int>(lin.weight.cols());
  r.weight = widen(lin.weight);
  r.bias = widen(lin.bias);
  return r;
}

// A [batch * length, width] matrix as a reference batch struct with fields
// batch, length, width and data: RefBatch, RefThBatch.
template <class Ref, class T>
Ref ref_batch_as(const Matrix<T>& m, Index batch) {
  Ref r;
  r.batch = static_cast<int>(batch);
  r.length = static_cast<int>(m.rows() / batch);
  r.width = static_cast<int>(m.cols());
  r.data = widen(m);
  return r;
}

// ---------------------------------------------------------------------------
// Agreement checks

// Element-wise bound |got - want| <= atol + rtol * |want|.
struct Tolerance {
  double rtol, atol;
  Tolerance times(double f) const { return {rtol * f, atol * f}; }
};

// The dense variants' bound (MHA, Talking-Heads, CollabHead, LSH): a few
// hundred roundings of O(1) values.
template <class T>
Tolerance default_tolerance() {
  return std::is_same_v<T, float> ? Tolerance{2e-4, 2e-5} : Tolerance{1e-10, 1e-12};
}

// DCMHA's looser float bound (the dynamic-weight MLP and compositions).
template <class T>
Tolerance dcmha_tolerance() {
  return std::is_same_v<T, float> ? Tolerance{5e-4, 1e-4} : Tolerance{1e-10, 1e-11};
}

// got[i] for i < n within `tol` of want[at(i)], where the layer should
// have produced `expected_n` values (a wrongly sized result fails rather
// than passing on the entries it has). NaN never agrees.
template <class T>
::testing::AssertionResult all_close_at(const char* what, const T* got, std::size_t n, std::size_t expected_n,
                                        const std::vector<double>& want, Tolerance tol,
                                        const std::function<std::size_t(std::size_t)>& at) {
  if (n != expected_n)
    return ::testing::AssertionFailure() << what << ": " << n << " values, expected " << expected_n;
  std::size_t bad = 0, first = 0;
  double worst = 0;  // largest |got - want| / (atol + rtol|want|)
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t j = at(i);
    if (j >= want.size()) return ::testing::AssertionFailure() << what << ": index " << j << " beyond the reference";
    const double err = std::abs(static_cast<double>(got[i]) - want[j]);
    const double allowed = tol.atol + tol.rtol * std::abs(want[j]);
    if (!(err <= allowed)) {  // also catches NaN
      if (bad++ == 0) first = i;
      worst = std::isnan(err) ? err : std::max(worst, err / allowed);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << n << " values off; first at flat index "
                                       << first << ": got " << static_cast<double>(got[first]) << ", want "
                                       << want[at(first)] << "; worst error is " << worst << "x the tolerance";
}
// got[i] for i < n within `tol` of want[i]; n must equal want.size().
template <class T>
::testing::AssertionResult all_close(const char* what, const T* got, std::size_t n, const std::vector<double>& want,
                                     Tolerance tol) {
  return all_close_at(what, got, n, want.size(), want, tol, [](std::size_t i) { return i; });
}
// A whole tensor against the reference's values.
template <class T>
::testing::AssertionResult all_close(const char* what, const Tensor<T>& got, const std::vector<double>& want,
                                     Tolerance tol) {
  return all_close(what, got.data(), static_cast<std::size_t>(got.size()), want, tol);
}

// Same shape and the same bits in every entry (for paths that must agree
// exactly: threads, workspace reuse).
template <class T>
::testing::AssertionResult bit_identical(const char* what, const Tensor<T>& a, const Tensor<T>& b) {
  if (a.shape() != b.shape()) return ::testing::AssertionFailure() << what << ": shapes differ";
  for (Index i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << ": differs at flat index " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

#ifdef HEADMIX_TEST_COUNT_ALLOCATIONS
// Heap allocations made while `fn` runs, on any thread: operator new calls
// plus the Eigen allocations that set_is_malloc_allowed(false) refuses.
template <class Fn>
long allocations_during(Fn&& fn) {
  struct Window {  // closes even if fn throws
    Window() {
      counting_eigen_allocations() = true;
      Eigen::internal::set_is_malloc_allowed(false);
    }
    ~Window() {
      Eigen::internal::set_is_malloc_allowed(true);
      counting_eigen_allocations() = false;
    }
  };
  const long news = allocations().load(), eigens = eigen_allocations().load();
  {
    const Window window;
    fn();
  }
  return (allocations().load() - news) + (eigen_allocations().load() - eigens);
}
#endif

// ---------------------------------------------------------------------------
// Conformance files

// A test that needs conformance files it cannot find fails when the build
// requires the cases (HEADMIX_REQUIRE_CONFORMANCE=1, tests/CMakeLists.txt's
// default) and is skipped otherwise: HEADMIX_CONFORMANCE_MISSING() << why;
#if defined(HEADMIX_REQUIRE_CONFORMANCE) && HEADMIX_REQUIRE_CONFORMANCE
#define HEADMIX_CONFORMANCE_MISSING() GTEST_FAIL() << "conformance cases required: "
#else
#define HEADMIX_CONFORMANCE_MISSING() GTEST_SKIP()
#endif

// ---------------------------------------------------------------------------
// Decoding caches

// A copy of the first `streams` streams of a cache, every row of its
// capacity (so that a write past the used positions shows too). The layer
// knows how many streams it binds; the cache does not say.
template <class T>
std::vector<std::vector<T>> cache_streams(headmix::SequenceCache<T>& cache, std::size_t streams) {
  std::vector<std::vector<T>> copy;
  for (std::size_t s = 0; s < streams; ++s) {
    const auto m = cache.stream(s);
    copy.emplace_back(m.data(), m.data() + m.size());
  }
  return copy;
}

// Two cache_streams() copies hold the same streams, bit for bit.
template <class T>
::testing::AssertionResult same_cache_bits(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " streams";
  for (std::size_t s = 0; s < a.size(); ++s) {
    if (a[s].size() != b[s].size())
      return ::testing::AssertionFailure() << "stream " << s << ": " << a[s].size() << " vs " << b[s].size() << " values";
    for (std::size_t i = 0; i < a[s].size(); ++i)
      if (std::memcmp(&a[s][i], &b[s][i], sizeof(T)) != 0)
        return ::testing::AssertionFailure() << "stream " << s << " differs at flat index " << i << ": " << a[s][i]
                                             << " vs " << b[s][i];
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// shape_error messages

// The message of the shape_error `fn` throws, or why there is none.
template <class Fn>
std::string shape_error_message(Fn&& fn) {
  try {
    fn();
  } catch (const headmix::shape_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a shape_error: ") + e.what() + ">";
  }
  return "<no exception>";
}

// `message` contains every one of `parts`.
inline ::testing::AssertionResult mentions(const std::string& message, const std::vector<std::string>& parts) {
  for (const auto& part : parts)
    if (message.find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "message \"" << message << "\" does not contain \"" << part << "\"";
  return ::testing::AssertionSuccess() << message;
}

// ---------------------------------------------------------------------------
// Sliding windows: the same cases for every dense variant. `Shape` and
// `Problem` are the test file's own (fields T, S, Dkv, cross, causal,
// offset, window, pad_rate, block_rows, threads; a Problem holds its Shape
// as `s`).

/// Windows 1, 3 and longer than T over causal offsets 0, 2 and -2, self
/// and padded cross-attention, block_rows 2 or automatic (0), 1 or 3
/// threads: `check(shape, seed)` for each, seeds counting up from `seed`.
template <class Shape, class Check>
void for_each_window_case(unsigned seed, Check check) {
  for (long window : {1L, 3L, 20L})
    for (long offset : {0L, 2L, -2L})
      for (int cross = 0; cross < 2; ++cross, ++seed) {
        Shape s;
        s.T = 11, s.causal = true, s.window = window, s.offset = offset;
        s.cross = cross == 1, s.S = 14, s.Dkv = 5, s.pad_rate = cross == 1 ? 0.3 : 0.0;
        s.block_rows = seed % 2 == 0 ? 0 : 2, s.threads = seed % 3 == 0 ? 3 : 1;
        check(s, seed);
      }
}

/// A window of at least T (offset 0, self-attention) hides nothing that
/// causal does not: `run(p)` (a result with `out` and `probs`) gives the
/// same bits with a window of T, and of far more, as with none.
template <class Problem, class Run>
void expect_long_window_is_plain_causal(Problem p, Run run) {
  p.s.window = 0;
  const auto causal = run(p);
  for (long window : {static_cast<long>(p.s.T), 1000L}) {
    p.s.window = window;
    const auto windowed = run(p);
    EXPECT_TRUE(bit_identical("output", windowed.out, causal.out)) << "window " << window;
    EXPECT_TRUE(bit_identical("probs", windowed.probs, causal.probs)) << "window " << window;
  }
}

}  // namespace headmix_test

// `call` throws headmix::shape_error whose message names the variant `tag`
// (e.g. "[mha]") and contains every further argument. Each test file wraps
// it as EXPECT_SHAPE_ERROR(call, ...) with its own tag.
#define HEADMIX_EXPECT_SHAPE_ERROR_IN(tag, call, ...)                                                    \
  do {                                                                                                   \
    EXPECT_THROW(call, headmix::shape_error);                                                            \
    EXPECT_TRUE(::headmix_test::mentions(::headmix_test::shape_error_message([&] { call; }),            \
                                         {tag, __VA_ARGS__}));                                           \
  } while (0)
