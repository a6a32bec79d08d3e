// A pre-LayerNorm transformer block with Talking-Heads attention, built on
// headmix's public API: a copyable reference for putting the layer in a model.
//
//   talking_heads_block [--small]
//
//   h = x + Attention(LayerNorm1(x))        causal Talking-Heads self-attention
//   y = h + W2 · GELU(W1 · LayerNorm2(h))   MLP of width 4·D
//
// The block runs on a batch of two sequences, the second left-padded (as in
// batched generation, so real tokens see padded keys). It then checks what a user of the block relies on and exits non-zero
// if any check fails:
//   * every output is finite;
//   * causality: the first half of a sequence, run on its own, gives the same
//     outputs as inside the whole sequence;
//   * padding: changing the padded tokens does not change the other outputs;
//   * the post-softmax weights are not renormalised: each row of head c sums
//     to Σ_g post_softmax[c, g], and a padded query, which sees no key at
//     all, gets weights exactly 0.
#include <headmix/headmix.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

using headmix::Index;
using headmix::Matrix;

namespace {

headmix::Linear<float> random_linear(Index out, Index in, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(float(in)));
  headmix::Linear<float> lin;
  lin.weight.resize(out, in);
  for (Index i = 0; i < lin.weight.size(); ++i) lin.weight.data()[i] = n(rng);
  lin.bias = headmix::Vector<float>::Zero(out);
  return lin;
}

// A head-mixing matrix near the identity, as trained ones tend to be.
Matrix<float> random_mix(Index out, Index in, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 0.3f);
  Matrix<float> m(out, in);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  for (Index i = 0; i < std::min(out, in); ++i) m(i, i) += 1.0f;
  return m;
}

struct LayerNorm {
  headmix::Vector<float> gamma, beta;
  float eps = 1e-5f;

  // Normalise each row of `x` into `y` (same shape).
  void apply(const Eigen::Ref<const Matrix<float>>& x, Eigen::Ref<Matrix<float>> y) const {
    for (Index r = 0; r < x.rows(); ++r) {
      const auto row = x.row(r).array();
      const float mean = row.mean();
      const float var = (row - mean).square().mean();
      y.row(r) = ((row - mean) / std::sqrt(var + eps)).matrix().cwiseProduct(gamma.transpose()) + beta.transpose();
    }
  }
};

// GELU with the exact erf, as torch.nn.GELU() computes it.
float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v / std::sqrt(2.0f))); }

class TransformerBlock {
 public:
  TransformerBlock(Index D, Index heads, std::mt19937& rng)
      : attention_(make_attention(D, heads, rng)), fc1_(random_linear(4 * D, D, rng)), fc2_(random_linear(D, 4 * D, rng)) {
    for (LayerNorm* ln : {&ln1_, &ln2_}) {
      ln->gamma = headmix::Vector<float>::Ones(D);
      ln->beta = headmix::Vector<float>::Zero(D);
    }
  }

  const headmix::TalkingHeads<float>& attention() const { return attention_; }

  /// x, y: [B, T, D]; padding: [B, T] (1 = padded) or empty. `probs`
  /// receives the attention weights [B, H, T, T] when given.
  void forward(const headmix::Tensor<float>& x, const std::vector<std::uint8_t>& padding, headmix::Tensor<float>& y,
               headmix::Tensor<float>* probs = nullptr) {
    const Index B = x.dim(0), T = x.dim(1), D = x.dim(2), rows = B * T;
    normed_.resize({B, T, D});
    attended_.resize({B, T, D});
    y.resize({B, T, D});
    const auto x_rows = x.batch().rows();
    auto n_rows = normed_.batch().rows();
    auto h_rows = y.batch().rows();  // h is built in y, then the MLP adds to it

    ln1_.apply(x_rows, n_rows);
    headmix::AttentionInput<float> in;
    in.query = headmix::ConstBatchView<float>(normed_.data(), B, T, D);
    if (!padding.empty()) in.key_padding = {padding.data(), B, T};
    attention_.forward(in, attended_.batch(), ws_, probs);
    h_rows = x_rows + attended_.batch().rows();

    ln2_.apply(h_rows, n_rows);
    hidden_.resize(rows, fc1_.out_features());
    fc1_.apply(n_rows, hidden_);
    hidden_ = hidden_.unaryExpr(&gelu);
    mlp_out_.resize(rows, D);
    fc2_.apply(hidden_, mlp_out_);
    h_rows += mlp_out_;
  }

 private:
  static headmix::TalkingHeads<float> make_attention(Index D, Index heads, std::mt19937& rng) {
    headmix::TalkingHeadsWeights<float> w;
    w.q = random_linear(D, D, rng);
    w.k = random_linear(D, D, rng);
    w.v = random_linear(D, D, rng);
    w.o = random_linear(D, D, rng);
    w.pre_softmax = random_mix(heads, heads, rng);   // [h, h_k]
    w.post_softmax = random_mix(heads, heads, rng);  // [h_v, h]
    headmix::TalkingHeadsOptions opt;
    opt.num_heads = heads;  // key_heads and value_heads default to num_heads
    opt.causal = true;
    return headmix::TalkingHeads<float>(std::move(w), opt);
  }

  headmix::TalkingHeads<float> attention_;
  headmix::Linear<float> fc1_, fc2_;
  LayerNorm ln1_, ln2_;
  headmix::Workspace<float> ws_;  // reused across calls: no allocation once sized
  headmix::Tensor<float> normed_, attended_;
  Matrix<float> hidden_, mlp_out_;
};

double max_abs_diff(const float* a, const float* b, Index n) {
  double m = 0;
  for (Index i = 0; i < n; ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  const Index B = 2, T = small ? 16 : 256, D = small ? 64 : 768, H = small ? 4 : 12;
  const Index pad = T / 4;  // sequence 1: padding [0, pad), real tokens after

  std::mt19937 rng(7);
  TransformerBlock block(D, H, rng);
  headmix::Tensor<float> x({B, T, D});
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (Index i = 0; i < x.size(); ++i) x[i] = n(rng);
  std::vector<std::uint8_t> padding(static_cast<std::size_t>(B * T), 0);
  for (Index j = 0; j < pad; ++j) padding[static_cast<std::size_t>(T + j)] = 1;

  headmix::Tensor<float> y, probs;
  block.forward(x, padding, y, &probs);
  const auto start = std::chrono::steady_clock::now();
  block.forward(x, padding, y);  // workspace already sized
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  bool ok = true;
  auto check = [&](bool pass, const char* what) {
    std::cout << "  " << (pass ? "ok   " : "FAIL ") << what << "\n";
    ok = ok && pass;
  };

  bool finite = true;
  for (Index i = 0; i < y.size(); ++i) finite = finite && std::isfinite(y[i]);
  check(finite, "every output is finite");

  // Causality: sequence 0's first half on its own.
  const Index half = T / 2;
  headmix::Tensor<float> prefix({1, half, D}), y_prefix;
  std::copy_n(x.data(), half * D, prefix.data());
  block.forward(prefix, {}, y_prefix);
  // Float rounding of the same sums in another order: ~1e-6 per value.
  check(max_abs_diff(y_prefix.data(), y.data(), half * D) < 1e-4, "a prefix gives the same outputs (causal)");

  // Padding: scribble over sequence 1's padded tokens.
  headmix::Tensor<float> x2 = x, y2;
  for (Index j = 0; j < pad; ++j)
    for (Index c = 0; c < D; ++c) x2[(T + j) * D + c] = 100.0f;
  block.forward(x2, padding, y2);
  // Masked keys get weight exactly 0, so the real rows come out bit-identical.
  check(max_abs_diff(y2.data(), y.data(), T * D) == 0 &&
            max_abs_diff(y2.data() + (T + pad) * D, y.data() + (T + pad) * D, (T - pad) * D) == 0,
        "padded tokens do not change the other outputs");

  // Rows of head c sum to Σ_g post_softmax[c, g]; padded queries see no key.
  const Matrix<float>& post = block.attention().weights().post_softmax;
  double worst = 0;
  bool padded_rows_zero = true;
  for (Index b = 0; b < B; ++b)
    for (Index c = 0; c < H; ++c)
      for (Index i = 0; i < T; ++i) {
        const bool sees_nothing = b == 1 && i < pad;
        double sum = 0;
        for (Index j = 0; j < T; ++j) {
          const float p = probs[((b * H + c) * T + i) * T + j];
          sum += p;
          if (sees_nothing) padded_rows_zero = padded_rows_zero && p == 0.0f;
        }
        if (!sees_nothing) worst = std::max(worst, std::abs(sum - double(post.row(c).sum())));
      }
  check(worst < 1e-4, "weights are not renormalised after the post mix");
  check(padded_rows_zero, "a query that sees no key gets zero weights");

  std::cout << "Talking-Heads block B=" << B << " T=" << T << " D=" << D << " H=" << H << ": y[0,0,0] = " << y[0]
            << ", second call " << ms << " ms, attention "
            << block.attention().flops(B, T, T).flops() * 1e-9 << " GFLOP\n";
  return ok ? 0 : 1;
}
