// A small causal language-model decoder with greedy generation over each
// layer's KV cache; the attention variant is chosen on the command line.
//
//   causal_decoder [--small] [--variant all|mha|talking_heads|collab|dcmha] [--threads N]
//
// Every dense variant's step() appends to a SequenceCache what later
// positions need: per-head keys and values (MHA, Talking-Heads), shared
// keys, values and content bias (CollabHead), and for DCMHA also the
// key-side dynamic weights. The default, `all`, runs the decoder once with
// each.
//
// Model (pre-LayerNorm, weights random):
//   x   = embed[token] + position[p]
//   for each block:  x += Attention(LayerNorm1(x));  x += W2 · GELU(W1 · LayerNorm2(x) + b1) + b2
//   logits = LayerNorm_f(x) · headᵀ
//
// Generation: the prompt goes through every layer as one step (prefill), then
// each new token is one step per layer: it attends to the cached keys and
// values of all earlier positions and appends its own. No position is
// recomputed.
//
// Sanity checks, which decide the exit code:
//   * the logits of every position fed through the cache equal one full
//     causal forward pass over the whole sequence without a cache, and the
//     greedy choice of that pass is the generated token (a near tie,
//     within the float tolerance, is reported, not failed);
//   * a full cache refuses one more token with headmix::cache_full_error,
//     and keeps its contents.
#include <headmix/headmix.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
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

namespace {

Mat random_matrix(Index rows, Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, stddev);
  Mat m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

headmix::Linear<float> random_linear(Index out, Index in, std::mt19937& rng) {
  headmix::Linear<float> lin;
  lin.weight = random_matrix(out, in, 1.0f / std::sqrt(float(in)), rng);
  lin.bias = random_matrix(out, 1, 0.05f, rng);
  return lin;
}

// ---- the attention variants: how to build one -----------------------------------
//
// Everything else is common: every variant's layer has
//   forward(AttentionInput, BatchView out, Workspace&)                      causal with options.causal
//   step(ConstBatchView x, SequenceCache& cache, BatchView out, Workspace&)  always bottom-right causal

struct MhaKind {
  using Layer = headmix::Mha<float>;
  static Layer make(Index D, Index H, int threads, std::mt19937& rng) {
    headmix::MhaOptions opt;
    opt.num_heads = H;
    opt.causal = true;  // for the full forward; step() is always causal
    opt.threads = threads;
    return Layer({random_linear(D, D, rng), random_linear(D, D, rng), random_linear(D, D, rng),
                  random_linear(D, D, rng)},
                 opt);
  }
};

struct TalkingHeadsKind {
  using Layer = headmix::TalkingHeads<float>;
  static Layer make(Index D, Index H, int threads, std::mt19937& rng) {
    headmix::TalkingHeadsWeights<float> w;
    w.q = random_linear(D, D, rng);
    w.k = random_linear(D, D, rng);
    w.v = random_linear(D, D, rng);
    w.o = random_linear(D, D, rng);
    w.pre_softmax = Mat::Identity(H, H) + random_matrix(H, H, 0.3f, rng);   // [h, h_k]
    w.post_softmax = Mat::Identity(H, H) + random_matrix(H, H, 0.3f, rng);  // [h_v, h]
    headmix::TalkingHeadsOptions opt;
    opt.num_heads = H;
    opt.causal = true;
    opt.threads = threads;
    return Layer(std::move(w), opt);
  }
};

struct CollabKind {
  using Layer = headmix::CollabHead<float>;
  static Layer make(Index D, Index H, int threads, std::mt19937& rng) {
    const Index R = D / 2;  // half the concatenated heads' width, dense mixing
    headmix::CollabHeadWeights<float> w;
    w.q = random_matrix(R, D, 1.0f / std::sqrt(float(D)), rng);
    w.k = random_matrix(R, D, 1.0f / std::sqrt(float(D)), rng);
    w.mixing = random_matrix(H, R, 1.0f, rng);
    w.content_bias = random_matrix(H, D, 1.0f / std::sqrt(float(D)), rng);
    w.v = random_linear(D, D, rng);
    w.o = random_linear(D, D, rng);
    headmix::CollabHeadOptions opt;
    opt.num_heads = H;
    opt.causal = true;
    opt.threads = threads;
    return Layer(std::move(w), opt);
  }
};

struct DcmhaKind {
  using Layer = headmix::Dcmha<float>;
  static Layer make(Index D, Index H, int threads, std::mt19937& rng) {
    const Index R = 2, K = 2 * R * H;  // one group: M = H
    headmix::DcmhaWeights<float> w;
    w.q = random_linear(D, D, rng);
    w.k = random_linear(D, D, rng);
    w.v = random_linear(D, D, rng);
    w.o = random_linear(D, D, rng);
    auto fill = [&rng](headmix::Tensor<float>& t, std::vector<Index> shape, float stddev) {
      t.resize(std::move(shape));
      std::normal_distribution<float> n(0.0f, stddev);
      for (Index i = 0; i < t.size(); ++i) t[i] = n(rng);
    };
    fill(w.dw1, {D, 1, 4, K}, 1.0f / std::sqrt(float(D)));
    fill(w.qkw, {1, 4, K, 2 * R, H}, 0.3f / std::sqrt(float(K)));
    fill(w.dd, {D, 1, 4 * H}, 0.5f / std::sqrt(float(D)));
    headmix::DcmhaOptions opt;
    opt.num_heads = H;
    opt.rank = R;
    opt.causal = true;
    opt.threads = threads;
    return Layer(std::move(w), opt);
  }
};

// ---- the decoder --------------------------------------------------------------

struct LayerNorm {
  Vec gamma, beta;
  void apply(const Eigen::Ref<const Mat>& x, Eigen::Ref<Mat> y) const {
    for (Index r = 0; r < x.rows(); ++r) {
      const auto row = x.row(r).array();
      const float mean = row.mean();
      const float inv = 1.0f / std::sqrt((row - mean).square().mean() + 1e-5f);
      y.row(r) = ((row - mean) * inv * gamma.transpose().array() + beta.transpose().array()).matrix();
    }
  }
  static LayerNorm random(Index D, std::mt19937& rng) {
    return {Vec::Ones(D) + random_matrix(D, 1, 0.1f, rng), random_matrix(D, 1, 0.1f, rng)};
  }
};

float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678f)); }

struct Config {
  Index vocab, dim, heads, layers, max_len;
  int threads;
};

template <class Kind>
class Decoder {
 public:
  using Layer = typename Kind::Layer;

  Decoder(const Config& c, std::mt19937& rng)
      : embed_(random_matrix(c.vocab, c.dim, 1.0f, rng)),
        position_(random_matrix(c.max_len, c.dim, 0.5f, rng)),
        head_(random_matrix(c.vocab, c.dim, 1.0f / std::sqrt(float(c.dim)), rng)),
        final_norm_(LayerNorm::random(c.dim, rng)) {
    for (Index l = 0; l < c.layers; ++l)
      blocks_.push_back({LayerNorm::random(c.dim, rng), Kind::make(c.dim, c.heads, c.threads, rng),
                         LayerNorm::random(c.dim, rng), random_linear(4 * c.dim, c.dim, rng),
                         random_linear(c.dim, 4 * c.dim, rng)});
    reset(c.max_len);
  }

  /// Empty every layer's cache, with room for `capacity` positions.
  void reset(Index capacity) {
    caches_.assign(blocks_.size(), headmix::SequenceCache<float>(1, capacity));
    position_in_cache_ = 0;
  }
  Index cached() const { return position_in_cache_; }
  const headmix::SequenceCache<float>& cache(std::size_t layer) const { return caches_[layer]; }

  /// Feed new tokens through the caches: returns their logits [n, V].
  Mat step(const std::vector<int>& tokens) {
    Mat x = embed(tokens, position_in_cache_);
    run_blocks(x, [this](std::size_t l, const Mat& in, Mat& out) {
      blocks_[l].attention.step(headmix::as_batch(in), caches_[l], headmix::as_batch(out), ws_);
    });
    position_in_cache_ += static_cast<Index>(tokens.size());
    return logits(x);
  }

  /// The whole sequence at once with causal forward passes, no cache:
  /// logits [T, V].
  Mat full_forward(const std::vector<int>& tokens) {
    Mat x = embed(tokens, 0);
    run_blocks(x, [this](std::size_t l, const Mat& in, Mat& out) {
      blocks_[l].attention.forward(headmix::AttentionInput<float>{headmix::as_batch(in), {}, {}},
                                   headmix::as_batch(out), ws_);
    });
    return logits(x);
  }

 private:
  struct Block {
    LayerNorm ln1;
    Layer attention;
    LayerNorm ln2;
    headmix::Linear<float> fc1, fc2;
  };

  Mat embed(const std::vector<int>& tokens, Index first_position) const {
    Mat x(static_cast<Index>(tokens.size()), embed_.cols());
    for (Index i = 0; i < x.rows(); ++i)
      x.row(i) = embed_.row(tokens[static_cast<std::size_t>(i)]) + position_.row(first_position + i);
    return x;
  }

  template <class Attend>
  void run_blocks(Mat& x, Attend attend) {
    Mat normed(x.rows(), x.cols()), attended(x.rows(), x.cols());
    Mat hidden(x.rows(), 4 * x.cols()), mlp(x.rows(), x.cols());
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      const Block& b = blocks_[l];
      b.ln1.apply(x, normed);
      attend(l, normed, attended);
      x += attended;
      b.ln2.apply(x, normed);
      b.fc1.apply(normed, hidden);
      hidden = hidden.unaryExpr(&gelu);
      b.fc2.apply(hidden, mlp);
      x += mlp;
    }
  }

  Mat logits(const Mat& x) const {
    Mat normed(x.rows(), x.cols());
    final_norm_.apply(x, normed);
    return normed * head_.transpose();
  }

  Mat embed_, position_, head_;  // [V, D], [max_len, D], [V, D]
  LayerNorm final_norm_;
  std::vector<Block> blocks_;
  std::vector<headmix::SequenceCache<float>> caches_;  // one per block
  Index position_in_cache_ = 0;
  headmix::Workspace<float> ws_;  // shared by the layers: they run one after another
};

// The greedy choice: the largest logit of row r.
int argmax(const Mat& logits, Index r) {
  Index best;
  logits.row(r).maxCoeff(&best);
  return static_cast<int>(best);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <class Kind>
int run(const char* variant, const Config& config, Index prompt_length, Index new_tokens) {
  std::mt19937 rng(99);
  Decoder<Kind> model(config, rng);
  // Every position but the last generated one is fed: room for exactly those.
  model.reset(prompt_length + new_tokens - 1);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(config.vocab) - 1);
  std::vector<int> tokens;
  for (Index i = 0; i < prompt_length; ++i) tokens.push_back(pick(rng));

  // Prefill, then one step per generated token. Logits of every fed position are kept.
  auto start = std::chrono::steady_clock::now();
  Mat cached_logits(prompt_length + new_tokens - 1, config.vocab);
  Mat step_logits = model.step(tokens);
  cached_logits.topRows(prompt_length) = step_logits;
  const double prefill_s = seconds_since(start);
  start = std::chrono::steady_clock::now();
  for (Index g = 0; g < new_tokens; ++g) {
    tokens.push_back(argmax(step_logits, step_logits.rows() - 1));
    if (g + 1 == new_tokens) break;  // the last token is chosen, not fed
    step_logits = model.step({tokens.back()});
    cached_logits.row(prompt_length + g) = step_logits;
  }
  const double per_token_s = seconds_since(start) / double(std::max<Index>(1, new_tokens - 1));

  // The same positions without a cache: one causal forward over the sequence.
  const std::vector<int> fed(tokens.begin(), tokens.end() - 1);
  start = std::chrono::steady_clock::now();
  const Mat full_logits = model.full_forward(fed);
  const double full_s = seconds_since(start);

  bool ok = true;
  auto check = [&](bool pass, const std::string& what) {
    std::cout << "  " << (pass ? "ok   " : "FAIL ") << what << "\n";
    ok = ok && pass;
  };
  const double diff = (cached_logits - full_logits).cwiseAbs().maxCoeff();
  const double scale = full_logits.cwiseAbs().maxCoeff();
  // Float sums in another order: ~1e-6 relative per value, a little more after N blocks.
  const double tol = 1e-4 * (1 + scale);
  std::ostringstream what;
  what << "cached logits equal a full recomputation (max |diff| " << std::setprecision(2) << diff << ", logits up to "
       << scale << ")";
  check(diff <= tol, what.str());
  Index disagreements = 0, near_ties = 0;
  for (Index p = prompt_length - 1; p < full_logits.rows(); ++p) {
    const int generated = tokens[static_cast<std::size_t>(p + 1)];
    const int recomputed = argmax(full_logits, p);
    if (generated == recomputed) continue;
    if (full_logits(p, recomputed) - full_logits(p, generated) <= 2 * tol)
      ++near_ties;
    else
      ++disagreements;
  }
  check(disagreements == 0, "the recomputation picks the same greedy tokens (" + std::to_string(near_ties) +
                                " near ties within the tolerance)");

  // One more token does not fit: the cache throws and keeps its contents.
  const Index before = model.cache(0).size();
  bool refused = false;
  try {
    model.step({tokens.back()});
  } catch (const headmix::cache_full_error& e) {
    refused = true;
    std::cout << "  full cache: " << e.what() << "\n";
  }
  check(refused && model.cache(0).size() == before, "a full cache refuses another token and keeps its contents");

  std::cout << variant << " decoder: " << config.layers << " blocks, D=" << config.dim << " H=" << config.heads
            << " V=" << config.vocab << "; prompt " << prompt_length << " tokens, generated " << new_tokens << "\n"
            << "  generated:";
  const std::size_t first = static_cast<std::size_t>(prompt_length), shown = std::min<std::size_t>(tokens.size(), first + 24);
  for (std::size_t i = first; i < shown; ++i) std::cout << ' ' << tokens[i];
  if (shown < tokens.size()) std::cout << " ...";
  std::cout << "\n  prefill " << prefill_s * 1e3 << " ms; " << per_token_s * 1e3
            << " ms per cached token; one full forward over " << fed.size() << " positions " << full_s * 1e3
            << " ms (what each token would cost without the cache)\n";
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  std::string variant = "all";
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--small") == 0) {
      small = true;
    } else if (std::strcmp(argv[i], "--variant") == 0 && i + 1 < argc) {
      variant = argv[++i];
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else {
      std::cerr << "usage: causal_decoder [--small] [--variant all|mha|talking_heads|collab|dcmha] [--threads N]\n";
      return 2;
    }
  }
  const Index prompt = small ? 8 : 64, generate = small ? 12 : 192;
  const Config config{small ? 64 : 1000, small ? 64 : 512, small ? 4 : 8, small ? 2 : 4, prompt + generate, threads};

  try {
    if (variant == "mha") return run<MhaKind>("mha", config, prompt, generate);
    if (variant == "talking_heads") return run<TalkingHeadsKind>("talking_heads", config, prompt, generate);
    if (variant == "collab") return run<CollabKind>("collab", config, prompt, generate);
    if (variant == "dcmha") return run<DcmhaKind>("dcmha", config, prompt, generate);
    if (variant == "all") {
      int failed = 0;
      failed += run<MhaKind>("mha", config, prompt, generate) != 0;
      failed += run<TalkingHeadsKind>("talking_heads", config, prompt, generate) != 0;
      failed += run<CollabKind>("collab", config, prompt, generate) != 0;
      failed += run<DcmhaKind>("dcmha", config, prompt, generate) != 0;
      std::cout << (failed ? "SOME CHECKS FAILED\n" : "all checks passed\n");
      return failed ? 1 : 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "unknown or unsupported variant '" << variant
            << "': choose all, mha, talking_heads, collab or dcmha\n";
  return 2;
}
