// Pre-LayerNorm transformer encoder blocks, one per attention variant, all
// built from one block template: a copyable reference for putting any
// headmix layer into a model.
//
//   encoder_blocks [--small] [--threads N]
//
//   h = x + Attention(LayerNorm1(x))
//   y = h + W2 · GELU(W1 · LayerNorm2(h) + b1) + b2        MLP of width 4·D
//
// EncoderBlock<Attention> needs nothing from the layer but the forward()
// every headmix variant has: forward(AttentionInput, BatchView out,
// Workspace&). The dense variants (MHA, CollabHead, Talking-Heads, DCMHA)
// run on a batch of two sequences, the second right-padded as in BERT; an
// LSH block (Reformer) then runs on a long input, next to an MHA block on
// the same input. Weights are random.
//
// It prints, per variant, the time of one block call (after a first call
// that sizes the block's Workspace), the norms of the output and of the
// residual update y - x, and the attention's analytic GFLOP. It exits
// non-zero if a sanity check fails:
//   * every output is finite;
//   * dense variants: changing the padded tokens leaves every other output
//     bit-identical (masked keys get weight exactly 0);
//   * each variant reduces to the MHA block when its extra parameters are
//     neutral: Talking-Heads with identity mixes, CollabHead built from the
//     MHA weights by the exact copy of conformance/collab.md, DCMHA with
//     zero dynamic-weight tensors (so every composition matrix is I);
//   * LSH: a second call gives bit-identical outputs (rotations are fixed by
//     the seed, unlike the reference's fresh draw per call).
#include <headmix/headmix.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using headmix::Index;
using Mat = headmix::Matrix<float>;
using Vec = headmix::Vector<float>;
using Tensor = headmix::Tensor<float>;
using Padding = std::vector<std::uint8_t>;

namespace {

// ---- the block ---------------------------------------------------------------

struct LayerNorm {
  Vec gamma, beta;
  float eps = 1e-5f;  // torch.nn.LayerNorm's default

  // Each row of x, normalised with the biased variance, into y.
  void apply(const Eigen::Ref<const Mat>& x, Eigen::Ref<Mat> y) const {
    for (Index r = 0; r < x.rows(); ++r) {
      const auto row = x.row(r).array();
      const float mean = row.mean();
      const float inv = 1.0f / std::sqrt((row - mean).square().mean() + eps);
      y.row(r) = ((row - mean) * inv * gamma.transpose().array() + beta.transpose().array()).matrix();
    }
  }
};

// torch.nn.GELU(): the exact erf form.
float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678f)); }

// Everything of a block except its attention: shared here by all blocks,
// so that blocks whose attention layers agree give the same outputs.
struct BlockParams {
  LayerNorm ln1, ln2;
  headmix::Linear<float> fc1, fc2;  // [4D, D], [D, 4D]
};

template <class Attention>
class EncoderBlock {
 public:
  EncoderBlock(Attention attention, const BlockParams& params) : attention_(std::move(attention)), p_(params) {}

  const Attention& attention() const { return attention_; }
  /// Scratch the block keeps between calls (the attention's Workspace).
  std::size_t workspace_bytes() const { return ws_.bytes(); }

  /// x, y: [B, T, D]; padding: [B, T] (1 = padded) or empty.
  void forward(const Tensor& x, const Padding& padding, Tensor& y) {
    const Index B = x.dim(0), T = x.dim(1), D = x.dim(2);
    normed_.resize({B, T, D});
    attended_.resize({B, T, D});
    y.resize({B, T, D});
    const auto x_rows = x.batch().rows();
    auto n_rows = normed_.batch().rows();
    auto h_rows = y.batch().rows();  // h is built in y; the MLP then adds to it

    p_.ln1.apply(x_rows, n_rows);
    headmix::AttentionInput<float> in;
    in.query = normed_.batch();
    if (!padding.empty()) in.key_padding = {padding.data(), B, T};
    attention_.forward(in, attended_.batch(), ws_);
    h_rows = x_rows + attended_.batch().rows();

    p_.ln2.apply(h_rows, n_rows);
    hidden_.resize(B * T, p_.fc1.out_features());
    p_.fc1.apply(n_rows, hidden_);
    hidden_ = hidden_.unaryExpr(&gelu);
    mlp_out_.resize(B * T, D);
    p_.fc2.apply(hidden_, mlp_out_);
    h_rows += mlp_out_;
  }

 private:
  Attention attention_;
  const BlockParams& p_;
  headmix::Workspace<float> ws_;  // reused across calls: no allocation once sized
  Tensor normed_, attended_;
  Mat hidden_, mlp_out_;
};

// ---- random weights ----------------------------------------------------------

Mat random_matrix(Index rows, Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, stddev);
  Mat m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

headmix::Linear<float> random_linear(Index out, Index in, std::mt19937& rng) {
  headmix::Linear<float> lin;
  lin.weight = random_matrix(out, in, 1.0f / std::sqrt(float(in)), rng);
  lin.bias = random_matrix(out, 1, 0.1f, rng);
  return lin;
}

headmix::Tensor<float> random_tensor(std::vector<Index> shape, float stddev, std::mt19937& rng) {
  headmix::Tensor<float> t(std::move(shape));
  std::normal_distribution<float> n(0.0f, stddev);
  for (Index i = 0; i < t.size(); ++i) t[i] = n(rng);
  return t;
}

BlockParams random_block_params(Index D, std::mt19937& rng) {
  BlockParams p;
  for (LayerNorm* ln : {&p.ln1, &p.ln2}) {
    ln->gamma = Vec::Ones(D) + random_matrix(D, 1, 0.1f, rng);
    ln->beta = random_matrix(D, 1, 0.1f, rng);
  }
  p.fc1 = random_linear(4 * D, D, rng);
  p.fc2 = random_linear(D, 4 * D, rng);
  return p;
}

// The MHA layer every neutral variant is checked against.
headmix::MhaWeights<float> random_mha_weights(Index D, std::mt19937& rng) {
  return {random_linear(D, D, rng), random_linear(D, D, rng), random_linear(D, D, rng), random_linear(D, D, rng)};
}

headmix::TalkingHeads<float> talking_heads(const headmix::MhaWeights<float>& base, Index H, bool neutral,
                                           std::mt19937& rng) {
  headmix::TalkingHeadsWeights<float> w;
  w.q = base.q;
  w.k = base.k;
  w.v = base.v;
  w.o = base.o;
  // Mixes near the identity, as trained ones tend to be; exactly I when neutral.
  w.pre_softmax = Mat::Identity(H, H);
  w.post_softmax = Mat::Identity(H, H);
  if (!neutral) {
    w.pre_softmax += random_matrix(H, H, 0.3f, rng);
    w.post_softmax += random_matrix(H, H, 0.3f, rng);
  }
  headmix::TalkingHeadsOptions opt;
  opt.num_heads = H;
  return headmix::TalkingHeads<float>(std::move(w), opt);
}

// Neutral: the exact copy of an MHA layer (collab.md, "Re-parameterization",
// H·Dk == R): shared q/k are the MHA's, head h's mixing row selects its own
// Dk columns, the query bias becomes the content bias bQ_h · WK_h, and k's
// bias is dropped (the softmax cancels it). Otherwise: R = D/2 shared
// dimensions, dense random mixing.
headmix::CollabHead<float> collab_head(const headmix::MhaWeights<float>& base, Index H, bool neutral,
                                       std::mt19937& rng) {
  const Index D = base.q.in_features();
  headmix::CollabHeadWeights<float> w;
  if (neutral) {
    const Index dk = base.q.out_features() / H;
    w.q = base.q.weight;
    w.k = base.k.weight;
    w.mixing = Mat::Zero(H, H * dk);
    w.content_bias.resize(H, D);
    for (Index h = 0; h < H; ++h) {
      w.mixing.block(h, h * dk, 1, dk).setOnes();
      w.content_bias.row(h) = base.q.bias.segment(h * dk, dk).transpose() * base.k.weight.middleRows(h * dk, dk);
    }
  } else {
    const Index R = D / 2;
    w.q = random_matrix(R, D, 1.0f / std::sqrt(float(D)), rng);
    w.k = random_matrix(R, D, 1.0f / std::sqrt(float(D)), rng);
    w.mixing = random_matrix(H, R, 1.0f, rng);
    w.content_bias = random_matrix(H, D, 0.1f, rng);
  }
  w.v = base.v;
  w.o = base.o;
  headmix::CollabHeadOptions opt;
  opt.num_heads = H;  // scale 1/sqrt(R/H): 1/sqrt(Dk) for the copy, as in the MHA
  return headmix::CollabHead<float>(std::move(w), opt);
}

// DCFormer's layout with one group, rank 2 and K = 2·R·M (dcmha.md). With
// all three dynamic tensors zero, W1 = W2 = 0 and dd = tanh(0) = 0, so both
// compositions are the identity.
headmix::Dcmha<float> dcmha(const headmix::MhaWeights<float>& base, Index H, bool neutral, std::mt19937& rng) {
  const Index D = base.q.in_features(), R = 2, K = 2 * R * H;
  headmix::DcmhaWeights<float> w;
  w.q = base.q;
  w.k = base.k;
  w.v = base.v;
  w.o = base.o;
  w.dw1 = random_tensor({D, 1, 4, K}, 1.0f / std::sqrt(float(D)), rng);
  w.qkw = random_tensor({1, 4, K, 2 * R, H}, 0.3f / std::sqrt(float(K)), rng);
  w.dd = random_tensor({D, 1, 4 * H}, 0.5f / std::sqrt(float(D)), rng);
  if (neutral)
    for (headmix::Tensor<float>* t : {&w.dw1, &w.qkw, &w.dd}) t->set_zero();
  headmix::DcmhaOptions opt;
  opt.num_heads = H;
  opt.rank = R;
  return headmix::Dcmha<float>(std::move(w), opt);
}

headmix::Lsh<float> lsh(Index D, Index H, Index bucket_size, Index n_hashes, std::mt19937& rng, int threads) {
  headmix::LshWeights<float> w;
  w.qk = random_linear(D, D, rng);  // shared query/key (reformer-pytorch: toqk)
  w.qk.bias.resize(0);
  w.v = random_linear(D, D, rng);
  w.v.bias.resize(0);
  w.o = random_linear(D, D, rng);
  headmix::LshOptions opt;
  opt.num_heads = H;
  opt.bucket_size = bucket_size;
  opt.n_hashes = n_hashes;
  opt.seed = 1234;  // rotations drawn once from the seed
  opt.threads = threads;
  return headmix::Lsh<float>(std::move(w), opt);
}

// ---- checks and reporting ----------------------------------------------------------

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (Index i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

double norm(const Tensor& t) {
  double s = 0;
  for (Index i = 0; i < t.size(); ++i) s += double(t[i]) * double(t[i]);
  return std::sqrt(s);
}

bool all_finite(const Tensor& t) {
  for (Index i = 0; i < t.size(); ++i)
    if (!std::isfinite(t[i])) return false;
  return true;
}

struct Report {
  bool ok = true;
  void check(bool pass, const std::string& what) {
    std::cout << "    " << (pass ? "ok   " : "FAIL ") << what << "\n";
    ok = ok && pass;
  }
};

// Run a block twice (the first call sizes its workspace), time the second,
// print the line of the table and return the output.
template <class Attention>
Tensor run_block(const char* name, EncoderBlock<Attention>& block, const Tensor& x, const Padding& padding) {
  Tensor y;
  block.forward(x, padding, y);
  const auto start = std::chrono::steady_clock::now();
  block.forward(x, padding, y);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  Tensor update = y;
  for (Index i = 0; i < update.size(); ++i) update[i] -= x[i];
  const Index B = x.dim(0), T = x.dim(1);
  std::cout << "  " << std::left << std::setw(14) << name << std::right << std::fixed << std::setprecision(2)
            << std::setw(9) << ms << " ms   |y| " << std::setw(8) << norm(y) << "   |y - x| " << std::setw(8)
            << norm(update) << "   attention " << std::setprecision(3)
            << block.attention().flops(B, T, T).flops() * 1e-9 << " GFLOP   workspace "
            << block.workspace_bytes() / 1024 << " KiB\n";
  std::cout.unsetf(std::ios::floatfield);
  std::cout << std::setprecision(6);
  return y;
}

// The dense variant's checks: finite, padding-invariant, and equal to the
// MHA block when its extra parameters are neutral.
template <class Attention>
void check_dense(Report& report, const char* name, EncoderBlock<Attention>& block,
                 EncoderBlock<Attention>& neutral_block, const Tensor& x, const Tensor& x_scribbled,
                 const Padding& padding, const Tensor& y, const Tensor& y_mha, const char* neutral_what) {
  report.check(all_finite(y), std::string(name) + ": every output is finite");
  Tensor y2;
  block.forward(x_scribbled, padding, y2);
  double worst = 0;
  for (Index i = 0; i < y.size(); ++i)
    if (x_scribbled[i] == x[i]) worst = std::max(worst, std::abs(double(y2[i]) - double(y[i])));
  report.check(worst == 0, std::string(name) + ": padded tokens do not change the other outputs");
  if (!neutral_what) return;
  Tensor y_neutral;
  neutral_block.forward(x, padding, y_neutral);
  // Float sums taken in another order: ~1e-6 relative to outputs of size ~1.
  const double diff = max_abs_diff(y_neutral, y_mha);
  std::ostringstream what;
  what << name << " " << neutral_what << " gives the MHA block (max diff " << std::scientific << std::setprecision(1)
       << diff << ")";
  report.check(diff < 2e-4, what.str());
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--small") == 0) {
      small = true;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else {
      std::cerr << "usage: encoder_blocks [--small] [--threads N]\n";
      return 2;
    }
  }
  const Index B = 2, T = small ? 24 : 256, D = small ? 64 : 512, H = small ? 4 : 8;
  const Index T_long = small ? 512 : 4096, bucket = small ? 32 : 64, hashes = small ? 2 : 4;

  std::mt19937 rng(2024);
  const BlockParams params = random_block_params(D, rng);
  const headmix::MhaWeights<float> base = random_mha_weights(D, rng);

  // Inputs: sequence 1 has T - T/4 real tokens, then padding.
  Tensor x({B, T, D});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Index i = 0; i < x.size(); ++i) x[i] = normal(rng);
  Padding padding(static_cast<std::size_t>(B * T), 0);
  const Index real = T - T / 4;
  for (Index j = real; j < T; ++j) padding[static_cast<std::size_t>(T + j)] = 1;
  Tensor x_scribbled = x;  // the padded tokens overwritten
  for (Index j = real; j < T; ++j)
    for (Index c = 0; c < D; ++c) x_scribbled[(T + j) * D + c] = 100.0f;

  auto with_threads = [threads](auto layer) {
    auto opt = layer.options();
    opt.threads = threads;
    layer.set_options(opt);
    return layer;
  };

  Report report;
  std::cout << "dense encoder blocks: B=" << B << " T=" << T << " D=" << D << " H=" << H << " (sequence 1 has "
            << real << " real tokens), " << threads << " thread(s)\n";

  headmix::MhaOptions mha_opt;
  mha_opt.num_heads = H;
  mha_opt.threads = threads;
  EncoderBlock<headmix::Mha<float>> mha_block(headmix::Mha<float>(base, mha_opt), params);
  const Tensor y_mha = run_block("MHA", mha_block, x, padding);

  EncoderBlock<headmix::CollabHead<float>> collab_block(with_threads(collab_head(base, H, false, rng)), params);
  EncoderBlock<headmix::CollabHead<float>> collab_copy(with_threads(collab_head(base, H, true, rng)), params);
  const Tensor y_collab = run_block("CollabHead", collab_block, x, padding);

  EncoderBlock<headmix::TalkingHeads<float>> th_block(with_threads(talking_heads(base, H, false, rng)), params);
  EncoderBlock<headmix::TalkingHeads<float>> th_identity(with_threads(talking_heads(base, H, true, rng)), params);
  const Tensor y_th = run_block("Talking-Heads", th_block, x, padding);

  EncoderBlock<headmix::Dcmha<float>> dc_block(with_threads(dcmha(base, H, false, rng)), params);
  EncoderBlock<headmix::Dcmha<float>> dc_zero(with_threads(dcmha(base, H, true, rng)), params);
  const Tensor y_dc = run_block("DCMHA", dc_block, x, padding);

  std::cout << "  checks:\n";
  check_dense(report, "MHA", mha_block, mha_block, x, x_scribbled, padding, y_mha, y_mha, nullptr);
  check_dense(report, "CollabHead", collab_block, collab_copy, x, x_scribbled, padding, y_collab, y_mha,
              "built from the MHA weights (exact copy)");
  check_dense(report, "Talking-Heads", th_block, th_identity, x, x_scribbled, padding, y_th, y_mha,
              "with identity mixes");
  check_dense(report, "DCMHA", dc_block, dc_zero, x, x_scribbled, padding, y_dc, y_mha,
              "with zero dynamic weights");

  // A long input: LSH attention, and MHA on the same input for comparison.
  std::cout << "long input: B=1 T=" << T_long << " D=" << D << " H=" << H << ", LSH bucket_size " << bucket
            << ", n_hashes " << hashes << "\n";
  Tensor x_long({1, T_long, D});
  for (Index i = 0; i < x_long.size(); ++i) x_long[i] = normal(rng);
  EncoderBlock<headmix::Lsh<float>> lsh_block(lsh(D, H, bucket, hashes, rng, threads), params);
  const Tensor y_lsh = run_block("LSH", lsh_block, x_long, {});
  EncoderBlock<headmix::Mha<float>> mha_long(headmix::Mha<float>(base, mha_opt), params);
  (void)run_block("MHA (dense)", mha_long, x_long, {});
  std::cout << "  checks:\n";
  report.check(all_finite(y_lsh), "LSH: every output is finite");
  Tensor y_again;
  lsh_block.forward(x_long, {}, y_again);
  report.check(max_abs_diff(y_again, y_lsh) == 0, "LSH: a second call gives the same outputs (fixed rotations)");

  std::cout << (report.ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return report.ok ? 0 : 1;
}
