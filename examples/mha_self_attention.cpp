// Multi-head self-attention over a batch of sequences with headmix.
//
//   mha_self_attention [--small]
//
// Builds a random BERT-base-sized layer (D = 768, H = 12), runs it on a
// batch where the second sequence is shorter (its tail is padding), reads
// the attention weights back, and shows that a reused Workspace makes the
// second call allocation-free.
#include <headmix/headmix.hpp>

#include <chrono>
#include <cstring>
#include <iostream>
#include <random>

using headmix::Index;

namespace {

headmix::Linear<float> random_linear(Index out, Index in, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(float(in)));
  headmix::Linear<float> lin;
  lin.weight.resize(out, in);
  for (Index i = 0; i < lin.weight.size(); ++i) lin.weight.data()[i] = n(rng);
  lin.bias = headmix::Vector<float>::Zero(out);
  return lin;
}

}  // namespace

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  const Index B = 2, T = small ? 16 : 256, D = small ? 64 : 768, H = small ? 4 : 12;

  std::mt19937 rng(42);
  headmix::MhaWeights<float> weights{random_linear(D, D, rng), random_linear(D, D, rng), random_linear(D, D, rng),
                                     random_linear(D, D, rng)};
  headmix::MhaOptions options;
  options.num_heads = H;
  headmix::Mha<float> attention(std::move(weights), options);

  // Inputs [B, T, D]; sequence 1 has only T/2 real tokens.
  headmix::Tensor<float> x({B, T, D});
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (Index i = 0; i < x.size(); ++i) x[i] = n(rng);
  std::vector<std::uint8_t> padding(B * T, 0);
  for (Index j = T / 2; j < T; ++j) padding[T + j] = 1;

  headmix::AttentionInput<float> input;
  input.query = x.batch();
  input.key_padding = {padding.data(), B, T};

  headmix::Workspace<float> workspace;
  headmix::Tensor<float> probs;
  headmix::Tensor<float> y = attention.forward(input, workspace, &probs);  // [B, T, D], probs [B, H, T, T]

  // Row sums of the weights are 1, and padded keys get exactly 0.
  double max_row_error = 0, padded_weight = 0;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < T; ++i) {
        const float* row = probs.data() + ((b * H + h) * T + i) * T;
        double sum = 0;
        for (Index j = 0; j < T; ++j) {
          sum += row[j];
          if (padding[b * T + j]) padded_weight += row[j];
        }
        max_row_error = std::max(max_row_error, std::abs(sum - 1.0));
      }

  const auto start = std::chrono::steady_clock::now();
  attention.forward(input, y.batch(), workspace);  // workspace already sized: no allocation
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::cout << "MHA B=" << B << " T=" << T << " D=" << D << " H=" << H << "\n"
            << "  output [" << y.dim(0) << ", " << y.dim(1) << ", " << y.dim(2) << "], y[0,0,0] = " << y[0] << "\n"
            << "  max |row sum - 1| = " << max_row_error << ", weight on padded keys = " << padded_weight << "\n"
            << "  second call: " << ms << " ms, workspace " << workspace.bytes() / 1024 << " KiB, "
            << attention.flops(B, T, T).flops() * 1e-9 << " GFLOP\n";
  return max_row_error < 1e-4 && padded_weight == 0 ? 0 : 1;
}
