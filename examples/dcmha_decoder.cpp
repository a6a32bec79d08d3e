// A small causal decoder built from DCMHA layers, with greedy generation
// through the incremental cache.
//
//   dcmha_decoder [--small] [--weights FILE] [--save FILE] [--threads N]
//
// Model (pre-norm):
//   x = embed[token]
//   for each block:  x += Dcmha(rmsnorm(x) ⊙ g_attn);  x += down(gelu(up(rmsnorm(x) ⊙ g_mlp)))
//   logits = (rmsnorm(x) ⊙ g_final) · headᵀ
//
// The prompt is prefilled in chunks, then each new token is one step() per
// layer over that layer's SequenceCache. Weights are random, or read from a
// .safetensors file with the names that --save writes:
//   embed.weight [V, D], head.weight [V, D], final_norm.weight [D],
//   layers.<i>.attn_norm.weight [D], layers.<i>.attn.{q,k,v,o}.weight,
//   layers.<i>.attn.dc.{dw1,qkw,dd} (DCFormer layout, see dcmha.md),
//   layers.<i>.mlp_norm.weight [D], layers.<i>.mlp.up.weight [F, D], layers.<i>.mlp.down.weight [D, F]
// (all shapes, the head count included, are read from the tensors).
//
// Sanity checks, which decide the exit code: the logits of cached decoding
// equal a full recompute of the whole sequence without a cache, and the
// greedy tokens agree with it.
#include <headmix/headmix.hpp>
#include <headmix/io/safetensors.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

using headmix::Index;
using Mat = headmix::Matrix<float>;
using Vec = headmix::Vector<float>;

namespace {

struct Block {
  Vec attn_norm, mlp_norm;
  headmix::Dcmha<float> attn;
  headmix::Linear<float> up, down;
};

struct Model {
  Mat embed;  // [V, D]
  Mat head;   // [V, D]: logits = x · headᵀ
  Vec final_norm;
  std::vector<Block> blocks;

  Index vocab() const { return embed.rows(); }
  Index dim() const { return embed.cols(); }
};

// ---- weights ---------------------------------------------------------------

Mat random_matrix(Index rows, Index cols, float scale, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, scale);
  Mat m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

headmix::Tensor<float> random_tensor(std::vector<Index> shape, float scale, std::mt19937& rng) {
  headmix::Tensor<float> t(std::move(shape));
  std::normal_distribution<float> n(0.0f, scale);
  for (Index i = 0; i < t.size(); ++i) t[i] = n(rng);
  return t;
}

headmix::DcmhaOptions attention_options(Index heads, Index groups, Index rank, int threads) {
  headmix::DcmhaOptions o;
  o.num_heads = heads;
  o.groups = groups;
  o.rank = rank;
  o.causal = true;
  o.threads = threads;
  return o;
}

Model random_model(Index V, Index D, Index layers, Index H, Index F, int threads, unsigned seed) {
  std::mt19937 rng(seed);
  const Index R = 2, K = 4 * H;  // the released DCFormer settings: one group, rank 2, K = 4H
  const float s = 1.0f / std::sqrt(float(D));
  Model m;
  m.embed = random_matrix(V, D, 1.0f, rng);
  m.head = random_matrix(V, D, s, rng);
  m.final_norm = Vec::Ones(D);
  for (Index l = 0; l < layers; ++l) {
    headmix::DcmhaWeights<float> w;
    w.q.weight = random_matrix(D, D, s, rng);
    w.k.weight = random_matrix(D, D, s, rng);
    w.v.weight = random_matrix(D, D, s, rng);
    w.o.weight = random_matrix(D, D, s / std::sqrt(float(2 * layers)), rng);
    w.dw1 = random_tensor({D, 1, 4, K}, s, rng);
    w.qkw = random_tensor({1, 4, K, 2 * R, H}, 1.0f / std::sqrt(float(K)), rng);
    w.dd = random_tensor({D, 1, 4 * H}, s, rng);
    headmix::Linear<float> up{random_matrix(F, D, s, rng), {}};
    headmix::Linear<float> down{random_matrix(D, F, 1.0f / std::sqrt(float(F * 2 * layers)), rng), {}};
    m.blocks.push_back(Block{Vec::Ones(D), Vec::Ones(D),
                             headmix::Dcmha<float>(std::move(w), attention_options(H, 1, R, threads)), std::move(up),
                             std::move(down)});
  }
  return m;
}

void save_model(const Model& m, const std::string& path) {
  headmix::io::TensorFile f;
  auto put_matrix = [&](const std::string& name, const Mat& a) {
    headmix::Tensor<float> t({a.rows(), a.cols()});
    std::copy_n(a.data(), a.size(), t.data());
    f.put(name, headmix::io::StoredTensor::from(t));
  };
  auto put_vector = [&](const std::string& name, const Vec& a) {
    headmix::Tensor<float> t({a.size()});
    std::copy_n(a.data(), a.size(), t.data());
    f.put(name, headmix::io::StoredTensor::from(t));
  };
  put_matrix("embed.weight", m.embed);
  put_matrix("head.weight", m.head);
  put_vector("final_norm.weight", m.final_norm);
  for (std::size_t l = 0; l < m.blocks.size(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const Block& b = m.blocks[l];
    const auto& w = b.attn.weights();
    put_vector(p + "attn_norm.weight", b.attn_norm);
    put_matrix(p + "attn.q.weight", w.q.weight);
    put_matrix(p + "attn.k.weight", w.k.weight);
    put_matrix(p + "attn.v.weight", w.v.weight);
    put_matrix(p + "attn.o.weight", w.o.weight);
    f.put(p + "attn.dc.dw1", headmix::io::StoredTensor::from(w.dw1));
    f.put(p + "attn.dc.qkw", headmix::io::StoredTensor::from(w.qkw));
    f.put(p + "attn.dc.dd", headmix::io::StoredTensor::from(w.dd));
    put_vector(p + "mlp_norm.weight", b.mlp_norm);
    put_matrix(p + "mlp.up.weight", b.up.weight);
    put_matrix(p + "mlp.down.weight", b.down.weight);
  }
  headmix::io::save_safetensors(path, f);
}

Model load_model(const std::string& path, int threads) {
  const headmix::io::TensorFile f = headmix::io::load_safetensors(path);
  Model m;
  m.embed = f.matrix<float>("embed.weight");
  m.head = f.matrix<float>("head.weight");
  m.final_norm = f.vector<float>("final_norm.weight");
  for (Index l = 0;; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    if (!f.contains(p + "attn.q.weight")) break;
    headmix::DcmhaWeights<float> w;
    w.q.weight = f.matrix<float>(p + "attn.q.weight");
    w.k.weight = f.matrix<float>(p + "attn.k.weight");
    w.v.weight = f.matrix<float>(p + "attn.v.weight");
    w.o.weight = f.matrix<float>(p + "attn.o.weight");
    w.dw1 = f.get<float>(p + "attn.dc.dw1");
    w.qkw = f.get<float>(p + "attn.dc.qkw");
    w.dd = f.get<float>(p + "attn.dc.dd");
    if (w.qkw.rank() != 5) throw std::runtime_error(p + "attn.dc.qkw: expected [G, 4, K, 2R, M]");
    const Index G = w.qkw.dim(0), R = w.qkw.dim(3) / 2, H = G * w.qkw.dim(4);
    headmix::Linear<float> up{f.matrix<float>(p + "mlp.up.weight"), {}};
    headmix::Linear<float> down{f.matrix<float>(p + "mlp.down.weight"), {}};
    // The layer checks every shape against the others and throws shape_error on a mismatch.
    m.blocks.push_back(Block{f.vector<float>(p + "attn_norm.weight"), f.vector<float>(p + "mlp_norm.weight"),
                             headmix::Dcmha<float>(std::move(w), attention_options(H, G, R, threads)), std::move(up),
                             std::move(down)});
  }
  if (m.blocks.empty()) throw std::runtime_error(path + ": no layers.0.attn.q.weight");
  return m;
}

// ---- the network -----------------------------------------------------------

Mat rmsnorm(const Mat& x, const Vec& gain) {
  Mat y(x.rows(), x.cols());
  for (Index t = 0; t < x.rows(); ++t) {
    const float inv = 1.0f / std::sqrt(x.row(t).squaredNorm() / float(x.cols()) + 1e-6f);
    y.row(t) = (x.row(t) * inv).cwiseProduct(gain.transpose());
  }
  return y;
}

Mat gelu(const Mat& z) {
  return z.unaryExpr([](float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678f)); });
}

// Logits [n, V] of positions whose embeddings are `x` [n, D]. `attend`
// runs block l's attention on its normalised input.
template <class Attend>
Mat run_blocks(const Model& m, Mat x, Attend&& attend) {
  for (std::size_t l = 0; l < m.blocks.size(); ++l) {
    const Block& b = m.blocks[l];
    x += attend(l, rmsnorm(x, b.attn_norm));
    const Mat hidden = rmsnorm(x, b.mlp_norm);
    Mat up(hidden.rows(), b.up.out_features()), down(hidden.rows(), m.dim());
    b.up.apply(hidden, up);
    b.down.apply(gelu(up), down);
    x += down;
  }
  return rmsnorm(x, m.final_norm) * m.head.transpose();
}

Mat embed(const Model& m, const std::vector<int>& tokens, std::size_t first, std::size_t count) {
  Mat x(static_cast<Index>(count), m.dim());
  for (std::size_t i = 0; i < count; ++i) x.row(static_cast<Index>(i)) = m.embed.row(tokens[first + i]);
  return x;
}

// Everything at once, no cache: the check for the cached path.
Mat full_forward(const Model& m, const std::vector<int>& tokens, headmix::Workspace<float>& ws) {
  return run_blocks(m, embed(m, tokens, 0, tokens.size()), [&](std::size_t l, const Mat& a) {
    Mat y(a.rows(), m.dim());
    m.blocks[l].attn.forward(headmix::AttentionInput<float>{headmix::as_batch(a), {}, {}}, headmix::as_batch(y), ws);
    return y;
  });
}

// The next positions through every layer's cache.
Mat cached_step(const Model& m, const std::vector<int>& tokens, std::size_t first, std::size_t count,
                std::vector<headmix::SequenceCache<float>>& caches, headmix::Workspace<float>& ws) {
  return run_blocks(m, embed(m, tokens, first, count), [&](std::size_t l, const Mat& a) {
    Mat y(a.rows(), m.dim());
    m.blocks[l].attn.step(headmix::as_batch(a), caches[l], headmix::as_batch(y), ws);
    return y;
  });
}

int argmax(const Mat& logits, Index row) {
  Index best;
  logits.row(row).maxCoeff(&best);
  return static_cast<int>(best);
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  std::string weights_path, save_path;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--small") {
      small = true;
    } else if (a == "--weights" && i + 1 < argc) {
      weights_path = argv[++i];
    } else if (a == "--save" && i + 1 < argc) {
      save_path = argv[++i];
    } else if (a == "--threads" && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else {
      std::cerr << "usage: dcmha_decoder [--small] [--weights FILE] [--save FILE] [--threads N]\n";
      return 2;
    }
  }

  try {
    const Index V = small ? 64 : 512, D = small ? 32 : 256, layers = small ? 2 : 4, H = small ? 4 : 8;
    const std::size_t prompt_len = small ? 7 : 48, generate = small ? 12 : 80, chunk = small ? 3 : 16;
    const Model model = weights_path.empty() ? random_model(V, D, layers, H, 4 * D, threads, 7)
                                             : load_model(weights_path, threads);
    if (!save_path.empty()) save_model(model, save_path);
    std::cout << "DCMHA decoder: vocab " << model.vocab() << ", dim " << model.dim() << ", " << model.blocks.size()
              << " layers of " << model.blocks[0].attn.num_heads() << " heads\n";

    std::vector<int> tokens;
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> pick(0, static_cast<int>(model.vocab()) - 1);
    for (std::size_t i = 0; i < prompt_len; ++i) tokens.push_back(pick(rng));

    // Prefill in chunks, then one token at a time. Each layer's cache has
    // room for the whole sequence (its memory is taken on the first step),
    // so after that the layers allocate nothing.
    const Index capacity = static_cast<Index>(prompt_len + generate);
    std::vector<headmix::SequenceCache<float>> caches(model.blocks.size(), headmix::SequenceCache<float>(1, capacity));
    headmix::Workspace<float> ws;
    Mat cached_logits(capacity, model.vocab());  // row t: the logits after position t
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t t0 = 0; t0 < prompt_len; t0 += chunk) {
      const std::size_t n = std::min(chunk, prompt_len - t0);
      cached_logits.middleRows(static_cast<Index>(t0), static_cast<Index>(n)) =
          cached_step(model, tokens, t0, n, caches, ws);
    }
    while (tokens.size() < prompt_len + generate) {
      tokens.push_back(argmax(cached_logits, static_cast<Index>(tokens.size()) - 1));
      if (tokens.size() == prompt_len + generate) break;  // its own logits are not needed
      const std::size_t t = tokens.size() - 1;
      cached_logits.row(static_cast<Index>(t)) = cached_step(model, tokens, t, 1, caches, ws);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "generated " << generate << " tokens after a prompt of " << prompt_len << " in " << seconds * 1e3
              << " ms:";
    for (std::size_t i = prompt_len; i < tokens.size(); ++i) std::cout << ' ' << tokens[i];
    std::cout << "\n";

    // Check: recompute every position at once without caches.
    const Mat full = full_forward(model, tokens, ws);
    const Index checked = capacity - 1;  // the last token's logits were never computed by the cache
    const double scale = full.topRows(checked).cwiseAbs().maxCoeff();
    const double diff = (full.topRows(checked) - cached_logits.topRows(checked)).cwiseAbs().maxCoeff();
    int disagreements = 0;
    for (Index t = static_cast<Index>(prompt_len) - 1; t + 1 < capacity; ++t) {
      // A greedy choice may only differ where the top two logits tie within the error.
      const int want = argmax(full, t);
      if (want != tokens[static_cast<std::size_t>(t) + 1] &&
          full(t, want) - full(t, tokens[static_cast<std::size_t>(t) + 1]) > 10 * diff)
        ++disagreements;
    }
    const bool ok = diff <= 1e-4 * scale && disagreements == 0 && std::isfinite(diff);
    std::cout << "cached vs full recompute: max |logit difference| " << diff << " (logits up to " << scale << "), "
              << disagreements << " greedy disagreements -> " << (ok ? "OK" : "FAILED") << "\n";
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "dcmha_decoder: " << e.what() << "\n";
    return 1;
  }
}
