// Helpers shared by the MPI test programs: the world's rank and size,
// checks across ranks (an error on every rank, the same text on every
// rank), and the body of main(): run_all_tests() owns MPI_Init /
// MPI_Finalize and prints other ranks' failures with their rank.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/io/io_error.hpp"
#include "reference/mha_reference.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace headmix_mpi_test {

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

/// Every rank reaches this point and MPI's collectives are still matched.
inline void expect_all_ranks_here() { EXPECT_EQ(sum_over_ranks(1), world_size()); }

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
