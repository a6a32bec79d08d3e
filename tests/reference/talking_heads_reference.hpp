// A naive Talking-Heads attention in double, written from
// shared/conformance/talking_heads.md and nothing else: plain index loops, no
// Eigen, nothing from include/headmix. It is the independent check for
// TalkingHeads<T>: slow and obvious on purpose.
//
//   Q = Xq Wqᵀ + bq [.., hk·dk],  K = Xk Wkᵀ + bk [.., hk·dk],  V = Xk Wvᵀ + bv [.., hv·dv]
//   J[a,i,j] = scale · Σ_d Q[i, a·dk + d] · K[j, a·dk + d]
//   L[g,i,j] = Σ_a pre[g][a] · J[a,i,j]                    (no pre: L = J)
//   L[g,i,j] = -inf if padded[b,j] or, with causal, unless j <= i + offset      <- after the mix
//              (and, with window > 0, j > i + offset - window)
//   W[g,i,:] = softmax_j(L[g,i,:])  (row max subtracted; a row with no visible key is all zeros)
//   U[c,i,j] = Σ_g post[c][g] · W[g,i,j]                   (no post: U = W), not renormalised
//   O[i, c·dv + e] = Σ_j U[c,i,j] · V[j, c·dv + e],  Y = O Woᵀ + bo   (no o: Y = O)
//
// It counts the multiply-adds its loops perform so that a test can hold
// TalkingHeads::flops() to them: causally hidden pairs are never computed;
// padded pairs are computed and then masked, so padding does not change the
// count.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace headmix_ref {

/// y = x · weightᵀ + bias, weight row-major [out, in]; empty bias = none.
/// out == 0 means absent (allowed for the output projection only).
struct RefThLinear {
  int out = 0, in = 0;
  std::vector<double> weight;  // [out * in]
  std::vector<double> bias;    // [out] or empty

  bool absent() const { return out == 0; }
};

/// A head-mixing matrix [rows = out heads, cols = in heads], row-major; empty = no mix.
struct RefMix {
  int rows = 0, cols = 0;
  std::vector<double> w;

  bool absent() const { return w.empty(); }
  double at(int r, int c) const { return w[static_cast<std::size_t>(r) * cols + c]; }
};

struct RefThWeights {
  RefThLinear q, k, v, o;  // o may be absent
  RefMix pre, post;        // [h, hk] and [hv, h], each may be absent
};

struct RefThOptions {
  int key_heads = 1, heads = 1, value_heads = 1;  // hk, h, hv
  bool causal = false;
  long causal_offset = 0;  // query i sees keys j <= i + causal_offset
  long window = 0;         // > 0 (with causal): also j > i + causal_offset - window
  double scale = 0;        // 0 means the default 1/sqrt(dk)
};

/// A batch of sequences, row-major [batch, length, width].
struct RefThBatch {
  int batch = 0, length = 0, width = 0;
  std::vector<double> data;

  double at(int b, int t, int c) const { return data[(static_cast<std::size_t>(b) * length + t) * width + c]; }
};

struct RefThResult {
  int B = 0, T = 0, S = 0, H = 0, HV = 0, out_dim = 0;
  std::vector<double> output;   // [B, T, out_dim]
  std::vector<double> probs;    // U, [B, hv, T, S]
  std::vector<double> softmax;  // W, [B, h, T, S]
  std::int64_t projection_macs = 0;
  std::int64_t attention_macs = 0;

  double out_at(int b, int t, int c) const { return output[(static_cast<std::size_t>(b) * T + t) * out_dim + c]; }
  double prob_at(int b, int c, int i, int j) const {
    return probs[((static_cast<std::size_t>(b) * HV + c) * T + i) * S + j];
  }
};

namespace th_detail {

inline std::vector<double> project(const RefThLinear& lin, const RefThBatch& x, std::int64_t& macs) {
  if (x.width != lin.in) throw std::invalid_argument("talking_heads_reference: input width does not match weight");
  std::vector<double> y(static_cast<std::size_t>(x.batch) * x.length * lin.out);
  for (int b = 0; b < x.batch; ++b)
    for (int t = 0; t < x.length; ++t)
      for (int r = 0; r < lin.out; ++r) {
        double acc = lin.bias.empty() ? 0.0 : lin.bias[r];
        for (int c = 0; c < lin.in; ++c) {
          acc += x.at(b, t, c) * lin.weight[static_cast<std::size_t>(r) * lin.in + c];
          ++macs;
        }
        y[(static_cast<std::size_t>(b) * x.length + t) * lin.out + r] = acc;
      }
  return y;
}

}  // namespace th_detail

/// `key` == nullptr means self-attention. `padding` is [B, S], 1 = padded, or empty.
inline RefThResult talking_heads_reference(const RefThWeights& w, const RefThOptions& opt, const RefThBatch& query,
                                           const RefThBatch* key = nullptr,
                                           const std::vector<std::uint8_t>& padding = {}) {
  const RefThBatch& xk = key ? *key : query;
  const int B = query.batch, T = query.length, S = xk.length;
  const int hk = opt.key_heads, h = opt.heads, hv = opt.value_heads;
  if (xk.batch != B) throw std::invalid_argument("talking_heads_reference: key batch != query batch");
  if (hk < 1 || h < 1 || hv < 1 || w.q.out % hk != 0 || w.v.out % hv != 0 || w.k.out != w.q.out)
    throw std::invalid_argument("talking_heads_reference: head split does not fit the weights");
  if (w.pre.absent() ? hk != h : (w.pre.rows != h || w.pre.cols != hk))
    throw std::invalid_argument("talking_heads_reference: pre mix does not fit the head counts");
  if (w.post.absent() ? h != hv : (w.post.rows != hv || w.post.cols != h))
    throw std::invalid_argument("talking_heads_reference: post mix does not fit the head counts");
  const int dk = w.q.out / hk, dv = w.v.out / hv;
  const int out_dim = w.o.absent() ? hv * dv : w.o.out;
  const double scale = opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(dk));
  const double neg_inf = -std::numeric_limits<double>::infinity();

  RefThResult r;
  r.B = B, r.T = T, r.S = S, r.H = h, r.HV = hv, r.out_dim = out_dim;
  const std::vector<double> Q = th_detail::project(w.q, query, r.projection_macs);
  const std::vector<double> K = th_detail::project(w.k, xk, r.projection_macs);
  const std::vector<double> V = th_detail::project(w.v, xk, r.projection_macs);
  auto q_at = [&](int b, int i, int c) { return Q[(static_cast<std::size_t>(b) * T + i) * (hk * dk) + c]; };
  auto k_at = [&](int b, int j, int c) { return K[(static_cast<std::size_t>(b) * S + j) * (hk * dk) + c]; };
  auto v_at = [&](int b, int j, int c) { return V[(static_cast<std::size_t>(b) * S + j) * (hv * dv) + c]; };
  auto visible = [&](int i, int j) {
    return !opt.causal || (j <= i + opt.causal_offset && (opt.window <= 0 || j > i + opt.causal_offset - opt.window));
  };
  auto padded = [&](int b, int j) { return !padding.empty() && padding[static_cast<std::size_t>(b) * S + j] != 0; };

  r.probs.assign(static_cast<std::size_t>(B) * hv * T * S, 0.0);
  r.softmax.assign(static_cast<std::size_t>(B) * h * T * S, 0.0);
  RefThBatch context{B, T, hv * dv, std::vector<double>(static_cast<std::size_t>(B) * T * hv * dv, 0.0)};
  std::vector<double> J(static_cast<std::size_t>(hk) * S), L(static_cast<std::size_t>(h) * S);

  for (int b = 0; b < B; ++b)
    for (int i = 0; i < T; ++i) {
      // J for every key head at the causally visible keys.
      for (int a = 0; a < hk; ++a)
        for (int j = 0; j < S; ++j) {
          double dot = 0;
          if (visible(i, j))
            for (int d = 0; d < dk; ++d) {
              dot += q_at(b, i, a * dk + d) * k_at(b, j, a * dk + d);
              ++r.attention_macs;
            }
          J[static_cast<std::size_t>(a) * S + j] = scale * dot;
        }
      // Pre mix, then the mask.
      for (int g = 0; g < h; ++g)
        for (int j = 0; j < S; ++j) {
          double l = neg_inf;
          if (visible(i, j)) {
            if (w.pre.absent()) {
              l = J[static_cast<std::size_t>(g) * S + j];
            } else {
              l = 0;
              for (int a = 0; a < hk; ++a) {
                l += w.pre.at(g, a) * J[static_cast<std::size_t>(a) * S + j];
                ++r.attention_macs;
              }
            }
            if (padded(b, j)) l = neg_inf;
          }
          L[static_cast<std::size_t>(g) * S + j] = l;
        }
      // Softmax per logit head, row max first; no visible key leaves zeros.
      for (int g = 0; g < h; ++g) {
        const double* l = &L[static_cast<std::size_t>(g) * S];
        double* p = &r.softmax[((static_cast<std::size_t>(b) * h + g) * T + i) * S];
        double row_max = neg_inf;
        for (int j = 0; j < S; ++j)
          if (l[j] > row_max) row_max = l[j];
        if (row_max == neg_inf) continue;
        double sum = 0;
        for (int j = 0; j < S; ++j) {
          p[j] = l[j] == neg_inf ? 0.0 : std::exp(l[j] - row_max);
          sum += p[j];
        }
        for (int j = 0; j < S; ++j) p[j] /= sum;
      }
      // Post mix at the causally visible keys (masked ones stay exactly 0).
      for (int c = 0; c < hv; ++c) {
        double* u = &r.probs[((static_cast<std::size_t>(b) * hv + c) * T + i) * S];
        for (int j = 0; j < S; ++j) {
          if (!visible(i, j)) continue;
          if (w.post.absent()) {
            u[j] = r.softmax[((static_cast<std::size_t>(b) * h + c) * T + i) * S + j];
          } else {
            double acc = 0;
            for (int g = 0; g < h; ++g) {
              acc += w.post.at(c, g) * r.softmax[((static_cast<std::size_t>(b) * h + g) * T + i) * S + j];
              ++r.attention_macs;
            }
            u[j] = acc;
          }
        }
        // Readout over the causally visible keys.
        for (int e = 0; e < dv; ++e) {
          double acc = 0;
          for (int j = 0; j < S; ++j) {
            if (!visible(i, j)) continue;
            acc += u[j] * v_at(b, j, c * dv + e);
            ++r.attention_macs;
          }
          context.data[(static_cast<std::size_t>(b) * T + i) * (hv * dv) + c * dv + e] = acc;
        }
      }
    }

  r.output = w.o.absent() ? context.data : th_detail::project(w.o, context, r.projection_macs);
  return r;
}

}  // namespace headmix_ref
