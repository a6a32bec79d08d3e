// Reformer LSH self-attention over a long sequence with headmix, compared
// with the full shared-QK attention it approximates.
//
//   lsh_long_sequence [--small]
//
// The input is clustered: every token is one of C cluster centres plus a
// little noise, in shuffled order, and the shared query/key projection is
// scaled up so that each token attends sharply to the other members of its
// cluster. That is the regime LSH is built for: similar tokens share hash
// buckets, so each query finds the keys that matter within its 2·bucket_size
// window. (On diffuse attention the full output averages over thousands of
// keys, and the few dozen keys of an LSH window cannot approximate it.)
//
// For n_hashes = 1, 2, 4, 8 it prints the time of a call, its workspace and
// the process's peak memory, and the relative error
// ‖heads_lsh − heads_full‖_F / ‖heads_full‖_F over the concatenated head
// outputs (median over three rotation seeds: hashing is random). The full attention is written out below with plain Eigen:
// logits q_i · k̂_j / sqrt(dh) with unit keys k̂ = qk / ‖qk‖, a query's own
// position at −5e4, softmax, times V, one block of query rows at a time.
//
// With --small (as ctest runs it) the sequence is short and the program
// exits 0 only if its sanity checks pass: finite outputs, and an error that
// falls as rounds are added.
#include <headmix/headmix.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <random>
#include <vector>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/resource.h>
#endif

using headmix::Index;
using MatrixF = headmix::Matrix<float>;
using MatrixD = headmix::Matrix<double>;

namespace {

double peak_rss_mib() {
#if defined(__unix__) || defined(__APPLE__)
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
#if defined(__APPLE__)
  return double(usage.ru_maxrss) / (1024.0 * 1024.0);  // bytes
#else
  return double(usage.ru_maxrss) / 1024.0;  // KiB
#endif
#else
  return 0;
#endif
}

MatrixF normal(Index rows, Index cols, double stddev, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, float(stddev));
  MatrixF m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

// Full shared-QK attention of one sequence, in double: [T, H·dv].
MatrixD full_attention(const MatrixF& x, const MatrixF& w_qk, const MatrixF& w_v, Index H) {
  const Index T = x.rows(), dh = w_qk.rows() / H, dv = w_v.rows() / H;
  const MatrixD qk = x.cast<double>() * w_qk.cast<double>().transpose();
  const MatrixD v = x.cast<double>() * w_v.cast<double>().transpose();
  MatrixD heads(T, H * dv);
  const Index block = 256;
  MatrixD logits;
  for (Index h = 0; h < H; ++h) {
    const MatrixD q = qk.middleCols(h * dh, dh);
    MatrixD k = q;
    for (Index j = 0; j < T; ++j) k.row(j) /= std::max(k.row(j).norm(), 1e-12);
    for (Index i0 = 0; i0 < T; i0 += block) {
      const Index rows = std::min(block, T - i0);
      logits.noalias() = q.middleRows(i0, rows) * k.transpose() / std::sqrt(double(dh));
      for (Index r = 0; r < rows; ++r) {
        logits(r, i0 + r) = -5e4;  // a query's own position
        const double m = logits.row(r).maxCoeff();
        logits.row(r) = (logits.row(r).array() - m).exp().matrix();
        logits.row(r) /= logits.row(r).sum();
      }
      heads.block(i0, h * dv, rows, dv).noalias() = logits * v.middleCols(h * dv, dv);
    }
  }
  return heads;
}

}  // namespace

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  const Index T = small ? 512 : 8192, D = 64, H = 2, dh = 32, bucket = 32;
  const Index cluster_size = 16, clusters = T / cluster_size;

  // Clustered tokens in shuffled order: centre (norm ~ 8) + noise (norm ~ 0.25).
  std::mt19937 rng(2020);
  const MatrixF centres = normal(clusters, D, 1.0, rng);
  std::vector<Index> order(static_cast<std::size_t>(T));
  std::iota(order.begin(), order.end(), Index(0));
  std::shuffle(order.begin(), order.end(), rng);
  MatrixF x = normal(T, D, 0.03, rng);
  for (Index t = 0; t < T; ++t) x.row(t) += centres.row(order[std::size_t(t)] / cluster_size);

  // Shared QK projection scaled x16 (sharp attention: with x8, a third of
  // each row of the full attention at T = 8192 spreads over the thousands
  // of other tokens, which no bucket can hold), value projection, no output
  // projection: the output is the concatenated heads.
  headmix::LshWeights<float> weights;
  weights.qk.weight = normal(H * dh, D, 16.0 / std::sqrt(double(D)), rng);
  weights.v.weight = normal(H * dh, D, 1.0 / std::sqrt(double(D)), rng);

  auto start = std::chrono::steady_clock::now();
  const MatrixD full = full_attention(x, weights.qk.weight, weights.v.weight, H);
  const double full_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const double full_norm = full.norm();

  std::cout << "LSH self-attention, T = " << T << ", D = " << D << ", H = " << H << ", head_dim = " << dh
            << ", bucket_size = " << bucket << ", " << clusters << " clusters of " << cluster_size << " tokens\n"
            << "full shared-QK attention (double, plain Eigen): " << std::fixed << std::setprecision(1) << full_ms
            << " ms, its [T, T] logits would be " << double(T) * T * 4 / (1 << 20) << " MiB per head in float\n\n"
            << " n_hashes   time [ms]   workspace [MiB]   peak RSS [MiB]   rel. error vs full (median of 3 seeds)\n";

  bool ok = true;
  std::vector<double> errors;
  for (Index n_hashes : {1, 2, 4, 8}) {
    headmix::LshOptions options;
    options.num_heads = H;
    options.bucket_size = bucket;
    options.n_hashes = n_hashes;
    headmix::Lsh<float> lsh(weights, options);

    // Hashing is random: the error is the median over three rotation seeds.
    headmix::Workspace<float> workspace;
    MatrixF y(T, lsh.out_dim());
    const headmix::AttentionInput<float> input{headmix::as_batch(x), {}, {}};
    double ms = 0;
    std::vector<double> seed_errors;
    for (std::uint64_t seed : {11, 12, 13}) {
      headmix::LshOptions options = lsh.options();
      options.seed = seed;
      lsh.set_options(options);
      lsh.forward(input, headmix::as_batch(y), workspace);  // the first call sizes the workspace
      if (seed == 11) {
        start = std::chrono::steady_clock::now();
        lsh.forward(input, headmix::as_batch(y), workspace);  // allocation-free
        ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      }
      ok = ok && y.allFinite();
      seed_errors.push_back((y.cast<double>() - full).norm() / full_norm);
    }
    std::sort(seed_errors.begin(), seed_errors.end());
    const double error = seed_errors[1];
    errors.push_back(error);
    std::cout << std::setw(9) << n_hashes << std::setw(12) << std::setprecision(1) << ms << std::setw(18)
              << std::setprecision(2) << double(workspace.bytes()) / (1 << 20) << std::setw(17)
              << std::setprecision(1) << peak_rss_mib() << std::setw(21) << std::setprecision(4) << error << "\n";
  }

  // More rounds find more of each query's cluster: the error must fall
  // (a little slack between neighbours, where it can level off) and end small.
  for (std::size_t i = 1; i < errors.size(); ++i) ok = ok && errors[i] <= errors[i - 1] * 1.05;
  ok = ok && errors.back() < 0.5 * errors.front() && errors.back() < 0.2;
  std::cout << "\nsanity checks " << (ok ? "passed" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
