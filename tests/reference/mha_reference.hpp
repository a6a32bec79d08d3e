// A naive multi-head attention in double, written from
// shared/conformance/mha.md and nothing else: plain index loops, no Eigen,
// nothing from include/headmix. It is the independent check for Mha<T>, so
// it is deliberately slow and obvious rather than clever.
//
//   Q = Xq Wqᵀ + bq,  K = Xk Wkᵀ + bk,  V = Xk Wvᵀ + bv      (head h: columns h·Dk.., h·Dv..)
//   K and V have Hkv heads; query head h reads KV head g = h / (H / Hkv)
//   logit[b,h,i,j] = scale · Q_h[i]·K_g[j],  -inf if padded[b,j] or, with causal, unless
//                    j <= i + offset (and, with window > 0, j > i + offset - window)
//   P = softmax_j(logit) (row max subtracted; a row with no visible key is all zeros)
//   C_h = P_h V_h,  Y = concat_h(C_h) Woᵀ + bo   (no o: Y = concat_h(C_h))
//
// It also counts the multiply-adds its loops perform, so that a test can hold
// Mha::flops() to the work this straightforward algorithm does.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace headmix_ref {

/// y = x · weightᵀ + bias, weight row-major [out, in]; empty bias = none.
/// A Linear with out == 0 is absent (only allowed for the output projection).
struct RefLinear {
  int out = 0, in = 0;
  std::vector<double> weight;  // [out * in]
  std::vector<double> bias;    // [out] or empty

  bool absent() const { return out == 0; }
};

struct RefMhaWeights {
  RefLinear q, k, v, o;  // o may be absent
};

struct RefMhaOptions {
  int num_heads = 1;
  bool causal = false;
  long causal_offset = 0;   // query i sees keys j <= i + causal_offset
  long window = 0;          // > 0 (with causal): also j > i + causal_offset - window
  int num_kv_heads = 0;     // heads of K and V (w.k, w.v); 0 means num_heads
  double scale = 0;         // 0 means the default 1/sqrt(Dk)
};

/// A batch of sequences, row-major [batch, length, width].
struct RefBatch {
  int batch = 0, length = 0, width = 0;
  std::vector<double> data;

  double at(int b, int t, int c) const {
    return data[(static_cast<std::size_t>(b) * length + t) * width + c];
  }
};

struct RefMhaResult {
  int B = 0, T = 0, S = 0, H = 0, out_dim = 0;
  std::vector<double> output;  // [B, T, out_dim]
  std::vector<double> probs;   // [B, H, T, S]
  std::int64_t projection_macs = 0;
  std::int64_t attention_macs = 0;

  double out_at(int b, int t, int c) const { return output[(static_cast<std::size_t>(b) * T + t) * out_dim + c]; }
  double prob_at(int b, int h, int i, int j) const {
    return probs[((static_cast<std::size_t>(b) * H + h) * T + i) * S + j];
  }
};

namespace detail {

// Project every row of every sequence: returns [batch, length, lin.out].
inline std::vector<double> project(const RefLinear& lin, const RefBatch& x, std::int64_t& macs) {
  if (x.width != lin.in) throw std::invalid_argument("mha_reference: input width does not match weight");
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

}  // namespace detail

/// `key` == nullptr means self-attention (keys are the queries).
/// `padding` is [B, S] with 1 = padded, or empty for none.
inline RefMhaResult mha_reference(const RefMhaWeights& w, const RefMhaOptions& opt, const RefBatch& query,
                                  const RefBatch* key = nullptr, const std::vector<std::uint8_t>& padding = {}) {
  const RefBatch& xk = key ? *key : query;
  const int B = query.batch, T = query.length, S = xk.length, H = opt.num_heads;
  const int Hkv = opt.num_kv_heads > 0 ? opt.num_kv_heads : H;
  if (xk.batch != B) throw std::invalid_argument("mha_reference: key batch != query batch");
  if (H < 1 || H % Hkv != 0 || w.q.out % H != 0 || w.v.out % Hkv != 0 || w.k.out / Hkv != w.q.out / H ||
      w.k.out % Hkv != 0)
    throw std::invalid_argument("mha_reference: head split does not fit the weights");
  const int dk = w.q.out / H, dv = w.v.out / Hkv, group = H / Hkv;
  const int out_dim = w.o.absent() ? H * dv : w.o.out;
  const double scale = opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(dk));
  const double neg_inf = -std::numeric_limits<double>::infinity();

  RefMhaResult r;
  r.B = B, r.T = T, r.S = S, r.H = H, r.out_dim = out_dim;
  const std::vector<double> Q = detail::project(w.q, query, r.projection_macs);  // [B, T, H*dk]
  const std::vector<double> K = detail::project(w.k, xk, r.projection_macs);     // [B, S, Hkv*dk]
  const std::vector<double> V = detail::project(w.v, xk, r.projection_macs);     // [B, S, Hkv*dv]
  auto q_at = [&](int b, int i, int c) { return Q[(static_cast<std::size_t>(b) * T + i) * (H * dk) + c]; };
  auto k_at = [&](int b, int j, int c) { return K[(static_cast<std::size_t>(b) * S + j) * (Hkv * dk) + c]; };
  auto v_at = [&](int b, int j, int c) { return V[(static_cast<std::size_t>(b) * S + j) * (Hkv * dv) + c]; };
  auto causally_visible = [&](int i, int j) {
    return !opt.causal || (j <= i + opt.causal_offset && (opt.window <= 0 || j > i + opt.causal_offset - opt.window));
  };

  r.probs.assign(static_cast<std::size_t>(B) * H * T * S, 0.0);
  RefBatch context{B, T, H * dv, std::vector<double>(static_cast<std::size_t>(B) * T * H * dv, 0.0)};
  std::vector<double> logit(static_cast<std::size_t>(S));

  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        const int g = h / group;  // the KV head this query head reads
        // Logits. Causally hidden pairs are never computed; padded ones are
        // computed and then masked (so padding does not change the work).
        for (int j = 0; j < S; ++j) {
          logit[j] = neg_inf;
          if (!causally_visible(i, j)) continue;
          double dot = 0;
          for (int d = 0; d < dk; ++d) {
            dot += q_at(b, i, h * dk + d) * k_at(b, j, g * dk + d);
            ++r.attention_macs;
          }
          const bool padded = !padding.empty() && padding[static_cast<std::size_t>(b) * S + j] != 0;
          logit[j] = padded ? neg_inf : scale * dot;
        }
        // Softmax with the row max subtracted; no visible key leaves zeros.
        double row_max = neg_inf;
        for (int j = 0; j < S; ++j)
          if (logit[j] > row_max) row_max = logit[j];
        double* p = &r.probs[((static_cast<std::size_t>(b) * H + h) * T + i) * S];
        if (row_max != neg_inf) {
          double sum = 0;
          for (int j = 0; j < S; ++j) {
            p[j] = logit[j] == neg_inf ? 0.0 : std::exp(logit[j] - row_max);
            sum += p[j];
          }
          for (int j = 0; j < S; ++j) p[j] /= sum;
        }
        // Readout over the causally visible keys.
        for (int e = 0; e < dv; ++e) {
          double acc = 0;
          for (int j = 0; j < S; ++j) {
            if (!causally_visible(i, j)) continue;
            acc += p[j] * v_at(b, j, g * dv + e);
            ++r.attention_macs;
          }
          context.data[(static_cast<std::size_t>(b) * T + i) * (H * dv) + h * dv + e] = acc;
        }
      }

  r.output = w.o.absent() ? context.data : detail::project(w.o, context, r.projection_macs);
  return r;
}

}  // namespace headmix_ref
