// One layer object, many threads: a layer is immutable after construction
// (its const methods only read it), and all scratch lives in the caller's
// Workspace (and decoding cache). So several std::threads may call one
// layer at once, each with its own Workspace, and must get exactly the
// results of serial use: bit for bit, for every variant, with the layer's
// own threads option at 1 and 2 (its workers then run inside each caller
// thread).
//
// Every caller thread runs every call of a variant several times, in an
// order of its own, reusing its one Workspace across the calls (so buffers
// grow and are reused under contention), and compares each result with the
// serial one. Calls differ in batch, length and padding, and include the
// decoding paths (Mha::step, Dcmha::step, each thread with its own cache),
// LSH's buckets() and seeded rotations, and the attention weights output.
//
// Run under ThreadSanitizer with `cmake --workflow --preset tsan` (that
// preset's ctest runs only the tests whose names contain "ThreadSafety").

#include "headmix/headmix.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace headmix_test;

constexpr int kCallers = 4;  // concurrent caller threads
constexpr int kRounds = 3;   // times each caller runs every call

// The inputs of one call: queries [B, T, D], optional keys [B, S, Dkv],
// optional padding [B, S].
template <class T>
struct Input {
  Index B, L, S;  // batch, query length, key length
  Matrix<T> xq, xk;
  std::vector<std::uint8_t> padding;

  headmix::AttentionInput<T> view() const {
    headmix::AttentionInput<T> in;
    in.query = {xq.data(), B, L, xq.cols()};
    if (xk.size()) in.key = {xk.data(), B, S, xk.cols()};
    if (!padding.empty()) in.key_padding = {padding.data(), B, S};
    return in;
  }
};

// Three calls' inputs of different sizes (so that a reused workspace grows
// and shrinks), the middle one padded.
template <class T>
std::vector<Input<T>> inputs(Rng& rng, Index D, Index Dkv, bool cross, std::vector<Index> lengths) {
  const Index batches[] = {2, 3, 1};
  std::vector<Input<T>> all;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    Input<T> in;
    in.B = batches[i % 3], in.L = lengths[i], in.S = cross ? lengths[i] + 3 : lengths[i];
    in.xq = random_matrix<T>(rng, in.B * in.L, D, 1.0);
    if (cross) in.xk = random_matrix<T>(rng, in.B * in.S, Dkv, 1.0);
    if (i == 1) {
      in.padding.assign(static_cast<std::size_t>(in.B * in.S), 0);
      for (std::size_t k = 0; k < in.padding.size(); k += 3) in.padding[k] = 1;
    }
    all.push_back(std::move(in));
  }
  return all;
}

// A call on a layer with a given workspace; returns everything it produced
// (output, and weights or buckets where the call has them) as one tensor.
template <class T>
using Call = std::function<Tensor<T>(headmix::Workspace<T>&)>;

// Output and weights of a forward, flattened into one tensor.
template <class T>
Tensor<T> joined(const Tensor<T>& a, const Tensor<T>& b) {
  Tensor<T> t({a.size() + b.size()});
  std::copy_n(a.data(), a.size(), t.data());
  std::copy_n(b.data(), b.size(), t.data() + a.size());
  return t;
}

// A call of layer.forward on `in`: its output and weights, joined.
template <class T, class Layer>
Call<T> forward_with_probs(const Layer& layer, const Input<T>& in) {
  return [&layer, &in](headmix::Workspace<T>& ws) {
    Tensor<T> probs;
    const Tensor<T> y = layer.forward(in.view(), ws, &probs);
    return joined(y, probs);
  };
}

bool same_bits(const void* a, const void* b, std::size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

// The test proper: serial results first (fresh workspace per call), then
// kCallers threads released together, each with its own workspace.
template <class T>
void expect_concurrent_equals_serial(const std::string& name, const std::vector<Call<T>>& calls) {
  const std::size_t n = calls.size();
  std::vector<Tensor<T>> serial;
  for (const auto& call : calls) {
    headmix::Workspace<T> ws;
    serial.push_back(call(ws));
  }
  // Serial use is itself repeatable (a sanity check of the comparison).
  {
    headmix::Workspace<T> ws;
    for (std::size_t k = 0; k < n; ++k) {
      const Tensor<T> again = calls[k](ws);
      ASSERT_EQ(again.shape(), serial[k].shape()) << name;
      ASSERT_TRUE(same_bits(again.data(), serial[k].data(), sizeof(T) * static_cast<std::size_t>(again.size())))
          << name << ": serial call " << k << " is not repeatable";
    }
  }

  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::string> errors(kCallers);
  std::vector<int> checked(kCallers, 0);
  std::vector<std::thread> callers;
  for (int t = 0; t < kCallers; ++t)
    callers.emplace_back([&, t] {
      headmix::Workspace<T> ws;  // this caller's own scratch, reused for every call
      ++ready;
      while (!go.load()) std::this_thread::yield();
      try {
        for (int r = 0; r < kRounds; ++r)
          for (std::size_t j = 0; j < n; ++j) {
            const std::size_t k = (j + static_cast<std::size_t>(t + r)) % n;  // each caller its own order
            const Tensor<T> got = calls[k](ws);
            ++checked[static_cast<std::size_t>(t)];
            if (got.shape() != serial[k].shape() ||
                !same_bits(got.data(), serial[k].data(), sizeof(T) * static_cast<std::size_t>(got.size()))) {
              std::ostringstream e;
              e << "caller " << t << " round " << r << " call " << k << " differs from serial use";
              errors[static_cast<std::size_t>(t)] = e.str();
              return;
            }
          }
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(t)] = std::string("threw ") + e.what();
      }
    });
  while (ready.load() < kCallers) std::this_thread::yield();
  go = true;
  for (auto& th : callers) th.join();
  for (std::size_t t = 0; t < kCallers; ++t) {
    EXPECT_TRUE(errors[t].empty()) << name << ": " << errors[t];
    if (errors[t].empty()) {
      EXPECT_EQ(checked[t], kRounds * static_cast<int>(n)) << name;  // every call was compared
    }
  }
}

// Decoding: positions [0, T) of `in` fed to `step(x, out)` in chunks of 1,
// 2, 3, ... positions; the outputs concatenated in order.
template <class T, class Step>
Tensor<T> decode_all(const Input<T>& in, Index out_dim, Step&& step) {
  const Index B = in.B, T_ = in.L, D = in.xq.cols();
  Tensor<T> all({B * T_ * out_dim});
  Index t0 = 0, pos = 0;
  for (Index n = 1; t0 < T_; ++n) {
    n = std::min(n, T_ - t0);
    Matrix<T> x(B * n, D);
    for (Index b = 0; b < B; ++b) x.middleRows(b * n, n) = in.xq.middleRows(b * T_ + t0, n);
    Tensor<T> y({B, n, out_dim});
    step(x, n, y);
    std::copy_n(y.data(), y.size(), all.data() + pos);
    pos += y.size();
    t0 += n;
  }
  return all;
}

// Three cross-attention calls of different lengths through one layer, run
// concurrently and serially.
template <class T, class Layer>
void expect_cross_calls_thread_safe(const Layer& layer, Rng& rng, Index D, Index Dkv, const std::string& what) {
  const auto xs = inputs<T>(rng, D, Dkv, true, {37, 20, 53});
  std::vector<Call<T>> calls;
  for (const auto& in : xs) calls.push_back(forward_with_probs<T>(layer, in));
  expect_concurrent_equals_serial<T>(what, calls);
}

HEADMIX_TYPED_OVER_SCALARS(ThreadSafety);

TYPED_TEST(ThreadSafety, Mha) {
  using T = TypeParam;
  for (int threads : {1, 2}) {
    Rng rng(1);
    const Index D = 12, Dkv = 7, H = 3;
    const headmix::MhaWeights<T> w{random_linear<T>(rng, H * 4, D), random_linear<T>(rng, H * 4, Dkv),
                                   random_linear<T>(rng, H * 3, Dkv), random_linear<T>(rng, 10, H * 3)};
    headmix::MhaOptions o;
    o.num_heads = H, o.causal = true, o.causal_offset = 2, o.block_rows = 8, o.threads = threads;
    const headmix::Mha<T> cross(w, o);
    const headmix::MhaWeights<T> w_self{random_linear<T>(rng, H * 4, D), random_linear<T>(rng, H * 4, D),
                                        random_linear<T>(rng, H * 3, D), random_linear<T>(rng, 10, H * 3)};
    const headmix::Mha<T> self(w_self, o);
    const auto xs = inputs<T>(rng, D, Dkv, true, {37, 20, 53});
    const auto selfs = inputs<T>(rng, D, D, false, {30, 11});
    std::vector<Call<T>> calls;
    for (const auto& in : xs)
      calls.push_back(forward_with_probs<T>(cross, in));
    for (const auto& in : selfs)
      calls.push_back([&](headmix::Workspace<T>& w_) {
        headmix::SequenceCache<T> cache(in.B, in.L);
        return decode_all(in, 10, [&](const Matrix<T>& x, Index n, Tensor<T>& y) {
          self.step({x.data(), in.B, n, D}, cache, y.batch(), w_);
        });
      });
    expect_concurrent_equals_serial<T>("mha threads=" + std::to_string(threads), calls);
  }
}

TYPED_TEST(ThreadSafety, TalkingHeads) {
  using T = TypeParam;
  for (int threads : {1, 2}) {
    Rng rng(2);
    const Index D = 10, Dkv = 6, hk = 2, h = 4, hv = 3;
    headmix::TalkingHeadsWeights<T> w;
    w.q = random_linear<T>(rng, hk * 4, D), w.k = random_linear<T>(rng, hk * 4, Dkv), w.v = random_linear<T>(rng, hv * 3, Dkv);
    w.o = random_linear<T>(rng, 9, hv * 3);
    w.pre_softmax = random_matrix<T>(rng, h, hk, 1.0), w.post_softmax = random_matrix<T>(rng, hv, h, 1.0);
    headmix::TalkingHeadsOptions o;
    o.num_heads = h, o.key_heads = hk, o.value_heads = hv, o.causal = true, o.block_rows = 8, o.threads = threads;
    const headmix::TalkingHeads<T> layer(w, o);
    expect_cross_calls_thread_safe<T>(layer, rng, D, Dkv, "talking_heads threads=" + std::to_string(threads));
  }
}

TYPED_TEST(ThreadSafety, CollabHead) {
  using T = TypeParam;
  for (int threads : {1, 2}) {
    Rng rng(3);
    const Index D = 10, Dkv = 6, H = 3, R = 9;
    headmix::CollabHeadWeights<T> w;
    w.q = random_matrix<T>(rng, R, D, 0.3), w.k = random_matrix<T>(rng, R, Dkv, 0.4), w.mixing = random_matrix<T>(rng, H, R, 1.0);
    w.mixing(1, 0) = w.mixing(1, 8) = T(0);  // a head with a narrower span
    w.content_bias = random_matrix<T>(rng, H, Dkv, 0.4);
    w.v = random_linear<T>(rng, H * 2, Dkv), w.o = random_linear<T>(rng, D, H * 2);
    w.layer_norm.weight = random_matrix<T>(rng, D, 1, 1.0), w.layer_norm.bias = random_matrix<T>(rng, D, 1, 1.0);
    headmix::CollabHeadOptions o;
    o.num_heads = H, o.causal = true, o.causal_offset = -1, o.block_rows = 8, o.threads = threads;
    const headmix::CollabHead<T> layer(w, o);
    expect_cross_calls_thread_safe<T>(layer, rng, D, Dkv, "collab threads=" + std::to_string(threads));
  }
}

TYPED_TEST(ThreadSafety, Lsh) {
  using T = TypeParam;
  for (int threads : {1, 2}) {
    Rng rng(4);
    const Index D = 10, H = 2, dh = 4, dv = 3;
    headmix::LshWeights<T> w;
    w.qk = random_linear<T>(rng, H * dh, D, false), w.v = random_linear<T>(rng, H * dv, D, false);
    w.o = random_linear<T>(rng, 8, H * dv);
    headmix::LshOptions o;  // seeded rotations: drawn into each caller's workspace
    o.num_heads = H, o.bucket_size = 4, o.n_hashes = 3, o.causal = true, o.seed = 17, o.threads = threads;
    const headmix::Lsh<T> shared_rotation(w, o);
    o.rotations_per_head = true, o.allow_duplicate_attention = false;
    const headmix::Lsh<T> per_head(w, o);
    const auto xs = inputs<T>(rng, D, D, false, {37, 20, 53});
    std::vector<Call<T>> calls;
    for (const auto& in : xs) {
      calls.push_back(forward_with_probs<T>(shared_rotation, in));
      calls.push_back([&](headmix::Workspace<T>& ws) { return per_head.forward(in.view(), ws); });
      calls.push_back([&](headmix::Workspace<T>& ws) {
        const Tensor<std::int64_t> b = per_head.buckets(in.view(), ws);
        Tensor<T> t({b.size()});
        for (Index i = 0; i < b.size(); ++i) t[i] = static_cast<T>(b[i]);
        return t;
      });
    }
    expect_concurrent_equals_serial<T>("lsh threads=" + std::to_string(threads), calls);
  }
}

TYPED_TEST(ThreadSafety, Dcmha) {
  using T = TypeParam;
  for (int threads : {1, 2}) {
    Rng rng(5);
    const Index D = 10, H = 4, G = 2, M = 2, R = 2, K = 5;
    headmix::DcmhaWeights<T> w;
    w.q = random_linear<T>(rng, H * 3, D), w.k = random_linear<T>(rng, H * 3, D), w.v = random_linear<T>(rng, H * 2, D);
    w.o = random_linear<T>(rng, 7, H * 2);
    w.dw1 = random_tensor<T>(rng, {D, G, 4, K}, 0.6), w.qkw = random_tensor<T>(rng, {G, 4, K, 2 * R, M}, 0.45);
    w.dd = random_tensor<T>(rng, {D, G, 4 * M}, 0.6);
    w.pre_w = random_tensor<T>(rng, {G, M, M}, 0.5), w.post_w = random_tensor<T>(rng, {G, M, M}, 0.5);
    headmix::DcmhaOptions o;
    o.num_heads = H, o.groups = G, o.rank = R, o.static_w = true, o.causal = true, o.window = 9, o.block_rows = 8;
    o.threads = threads;
    const headmix::Dcmha<T> layer(w, o);
    const auto xs = inputs<T>(rng, D, D, false, {37, 20, 53});
    std::vector<Call<T>> calls;
    for (const auto& in : xs) {
      calls.push_back(forward_with_probs<T>(layer, in));
      if (in.padding.empty())  // step() takes no padding
        calls.push_back([&](headmix::Workspace<T>& ws) {
          headmix::SequenceCache<T> cache(in.B, in.L);
          return decode_all(in, 7, [&](const Matrix<T>& x, Index n, Tensor<T>& y) {
            layer.step({x.data(), in.B, n, D}, cache, y.batch(), ws);
          });
        });
    }
    expect_concurrent_equals_serial<T>("dcmha threads=" + std::to_string(threads), calls);
  }
}

}  // namespace
