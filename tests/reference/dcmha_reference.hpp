// A naive DCMHA (dynamically composable multi-head attention) in double,
// written from shared/conformance/dcmha.md and nothing else: plain index
// loops over std::vector, no Eigen, nothing from include/headmix. It is the
// independent check for Dcmha<T>, so it is slow and literal on purpose: the
// per-(t, s) composition matrix C is applied exactly as the spec writes it
// out, term by term.
//
// Per batch item, with query rows Xq [T, D] and key rows Xk [S, D] (self-
// attention: Xk = Xq):
//   q, k, v = Xq·Wqᵀ (+bq), Xk·Wkᵀ (+bk), Xk·Wvᵀ (+bv); A[h,t,s] = scale·q[t,h]·k[s,h]
//   dynamic weights per group g, slot c (0 pre-q, 1 pre-k, 2 post-q, 3 post-k)
//   and position p: X = Xq for the query slots 0, 2 (p = t), Xk for the key
//   slots 1, 3 (p = s):
//     hid = GELU(X[p]·dw1[:,g,c,:]);  F[j,m] = Σ_k hid[k]·qkw[g,c,k,j,m]
//     W1[r,m] = F[r,m] / sqrt(mean_m F[r,m]² + eps);  W2[r,m] = F[R+r,m]
//     dd[m] = tanh(X[p]·dd[:,g,c·M+m])
//   compose (per visible (t,s), per group, z[m] = Z[g·M+m,t,s]):
//     z'[n] = z[n] + Σ_m z[m]·P[m,n] + Σ_r (Σ_m z[m]·W1q[r,m])·W2q[r,n] + z[n]·ddq[n]
//                                    + Σ_r (Σ_m z[m]·W1k[r,m])·W2k[r,n] + z[n]·ddk[n]
//   L = pre(A) masked to -inf; P0 = softmax_s(L); P = post(P0); O = P·v; Y = O·Woᵀ (+bo)
//
// Only the slots the options use are computed. Every multiply-add the loops
// perform is counted, so a test can hold Dcmha::flops() to this algorithm.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace headmix_ref {

/// DCMHA parameters as plain row-major arrays (shapes in the comments).
/// An empty bias means none; out == 0 means no output projection.
struct RefDcmhaWeights {
  int D = 0, H = 0, dk = 0, dv = 0, out = 0;  // out: rows of wo, 0 = absent
  int G = 1, R = 2, K = 0;                    // groups, rank, dynamic-weight hidden width
  std::vector<double> wq, bq;  // [H*dk, D], [H*dk]
  std::vector<double> wk, bk;  // [H*dk, D], [H*dk]
  std::vector<double> wv, bv;  // [H*dv, D], [H*dv]
  std::vector<double> wo, bo;  // [out, H*dv], [out]
  std::vector<double> dw1;     // [D, G, 4, K]
  std::vector<double> qkw;     // [G, 4, K, 2R, M]
  std::vector<double> dd;      // [D, G, 4M]
  std::vector<double> pre_w;   // [G, M, M], used when static_w
  std::vector<double> post_w;  // [G, M, M], used when static_w
};

struct RefDcmhaOptions {
  bool use_pre = true, use_post = true;
  bool query_wise = true, key_wise = true;
  bool static_w = false;
  bool causal = false;
  long causal_offset = 0;  // with causal: query t sees keys s <= t + causal_offset
  int window = 0;          // > 0: t + causal_offset - s < window as well (needs causal)
  double eps = 1e-6;
  bool gelu_tanh = false;  // false: exact erf GELU
  double scale = 0;        // 0: 1/sqrt(dk)
  // Applied to every entry of k, v and the key-side factors once computed
  // (a half-precision cache's rounding); null: kept as computed.
  double (*store)(double) = nullptr;
};

struct RefDcmhaResult {
  int B = 0, T = 0, S = 0, H = 0, out_dim = 0;
  std::vector<double> output;   // [B, T, out_dim]
  std::vector<double> probs;    // [B, H, T, S], after post-compose
  std::vector<double> softmax;  // [B, H, T, S], before post-compose
  std::int64_t projection_macs = 0;  // q, k, v, o
  std::int64_t dynamic_macs = 0;     // dynamic weights (dw1, qkw, RMS sum of squares, dd)
  std::int64_t score_macs = 0;       // q·k and P·v over visible pairs
  std::int64_t compose_macs = 0;     // pre- and post-compose over visible pairs

  double prob_at(int b, int h, int t, int s) const {
    return probs[((static_cast<std::size_t>(b) * H + h) * T + t) * S + s];
  }
};

namespace dcmha_detail {

inline double gelu(double z, bool tanh_form) {
  if (!tanh_form) return 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0)));
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * z * (1.0 + std::tanh(c * (z + 0.044715 * z * z * z)));
}

// y[t, r] = Σ_c x[t, c]·w[r, c] (+ bias[r]) for one sequence x [T, in].
inline std::vector<double> linear(const std::vector<double>& x, int T, int in, const std::vector<double>& w,
                                  const std::vector<double>& bias, int out, std::int64_t& macs) {
  std::vector<double> y(static_cast<std::size_t>(T) * out);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < out; ++r) {
      double acc = bias.empty() ? 0.0 : bias[r];
      for (int c = 0; c < in; ++c) {
        acc += x[static_cast<std::size_t>(t) * in + c] * w[static_cast<std::size_t>(r) * in + c];
        ++macs;
      }
      y[static_cast<std::size_t>(t) * out + r] = acc;
    }
  return y;
}

// The dynamic factors of one position, group and slot.
struct Factors {
  std::vector<double> w1, w2;  // [R, M]
  std::vector<double> dd;      // [M]
};

}  // namespace dcmha_detail

/// Queries xq [B, T, D] against keys xk [B, S, D], row-major. padding:
/// [B, S] (1 = padded key) or empty.
inline RefDcmhaResult dcmha_reference(const RefDcmhaWeights& w, const RefDcmhaOptions& opt, int B, int T,
                                      const std::vector<double>& xq, int S, const std::vector<double>& xk,
                                      const std::vector<std::uint8_t>& padding = {}) {
  using dcmha_detail::Factors;
  const int D = w.D, H = w.H, dk = w.dk, dv = w.dv, G = w.G, R = w.R, K = w.K;
  if (G < 1 || H % G != 0) throw std::invalid_argument("dcmha_reference: H not divisible by G");
  const int M = H / G;
  if (xq.size() != static_cast<std::size_t>(B) * T * D) throw std::invalid_argument("dcmha_reference: xq size");
  if (xk.size() != static_cast<std::size_t>(B) * S * D) throw std::invalid_argument("dcmha_reference: xk size");
  const int out_dim = w.out == 0 ? H * dv : w.out;
  const double scale = opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(dk));
  const double neg_inf = -std::numeric_limits<double>::infinity();

  RefDcmhaResult res;
  res.B = B, res.T = T, res.S = S, res.H = H, res.out_dim = out_dim;
  res.output.assign(static_cast<std::size_t>(B) * T * out_dim, 0.0);
  res.probs.assign(static_cast<std::size_t>(B) * H * T * S, 0.0);
  res.softmax.assign(static_cast<std::size_t>(B) * H * T * S, 0.0);

  auto allowed = [&](int t, int s) {
    if (!opt.causal) return true;
    return s <= t + opt.causal_offset && (opt.window <= 0 || t + opt.causal_offset - s < opt.window);
  };
  // Which of the four slots are computed at all.
  bool used[4];
  used[0] = opt.use_pre && opt.query_wise;
  used[1] = opt.use_pre && opt.key_wise;
  used[2] = opt.use_post && opt.query_wise;
  used[3] = opt.use_post && opt.key_wise;

  auto dw1_at = [&](int d, int g, int c, int k) {
    return w.dw1[((static_cast<std::size_t>(d) * G + g) * 4 + c) * K + k];
  };
  auto qkw_at = [&](int g, int c, int k, int j, int m) {
    return w.qkw[(((static_cast<std::size_t>(g) * 4 + c) * K + k) * (2 * R) + j) * M + m];
  };
  auto dd_at = [&](int d, int g, int col) { return w.dd[(static_cast<std::size_t>(d) * G + g) * (4 * M) + col]; };

  for (int b = 0; b < B; ++b) {
    const std::vector<double> xqb(xq.begin() + static_cast<std::ptrdiff_t>(b) * T * D,
                                  xq.begin() + static_cast<std::ptrdiff_t>(b + 1) * T * D);
    const std::vector<double> xkb(xk.begin() + static_cast<std::ptrdiff_t>(b) * S * D,
                                  xk.begin() + static_cast<std::ptrdiff_t>(b + 1) * S * D);
    const auto q = dcmha_detail::linear(xqb, T, D, w.wq, w.bq, H * dk, res.projection_macs);
    auto k = dcmha_detail::linear(xkb, S, D, w.wk, w.bk, H * dk, res.projection_macs);
    auto v = dcmha_detail::linear(xkb, S, D, w.wv, w.bv, H * dv, res.projection_macs);
    if (opt.store) {
      for (double& e : k) e = opt.store(e);
      for (double& e : v) e = opt.store(e);
    }

    // Dynamic weights: fac[(p * G + g) * 4 + c], p a query position for the
    // query slots (c even), a key position for the key slots.
    std::vector<Factors> fac(static_cast<std::size_t>(std::max(T, S)) * G * 4);
    for (int c = 0; c < 4; ++c)
      for (int p = 0; p < (c % 2 == 0 ? T : S); ++p)
        for (int g = 0; g < G; ++g) {
          if (!used[c]) continue;
          const std::vector<double>& xb = c % 2 == 0 ? xqb : xkb;
          std::vector<double> hid(K);
          for (int kk = 0; kk < K; ++kk) {
            double u = 0;
            for (int d = 0; d < D; ++d) {
              u += xb[static_cast<std::size_t>(p) * D + d] * dw1_at(d, g, c, kk);
              ++res.dynamic_macs;
            }
            hid[kk] = dcmha_detail::gelu(u, opt.gelu_tanh);
          }
          std::vector<double> F(static_cast<std::size_t>(2) * R * M);
          for (int j = 0; j < 2 * R; ++j)
            for (int m = 0; m < M; ++m) {
              double acc = 0;
              for (int kk = 0; kk < K; ++kk) {
                acc += hid[kk] * qkw_at(g, c, kk, j, m);
                ++res.dynamic_macs;
              }
              F[static_cast<std::size_t>(j) * M + m] = acc;
            }
          Factors& f = fac[(static_cast<std::size_t>(p) * G + g) * 4 + c];
          f.w1.assign(static_cast<std::size_t>(R) * M, 0.0);
          f.w2.assign(static_cast<std::size_t>(R) * M, 0.0);
          f.dd.assign(M, 0.0);
          for (int r = 0; r < R; ++r) {
            double sq = 0;
            for (int m = 0; m < M; ++m) {
              sq += F[static_cast<std::size_t>(r) * M + m] * F[static_cast<std::size_t>(r) * M + m];
              ++res.dynamic_macs;
            }
            const double denom = std::sqrt(sq / M + opt.eps);
            for (int m = 0; m < M; ++m) {
              f.w1[static_cast<std::size_t>(r) * M + m] = F[static_cast<std::size_t>(r) * M + m] / denom;
              f.w2[static_cast<std::size_t>(r) * M + m] = F[static_cast<std::size_t>(R + r) * M + m];
            }
          }
          for (int m = 0; m < M; ++m) {
            double e = 0;
            for (int d = 0; d < D; ++d) {
              e += xb[static_cast<std::size_t>(p) * D + d] * dd_at(d, g, c * M + m);
              ++res.dynamic_macs;
            }
            f.dd[m] = std::tanh(e);
          }
          if (opt.store && c % 2 == 1)
            for (std::vector<double>* part : {&f.w1, &f.w2, &f.dd})
              for (double& e : *part) e = opt.store(e);
        }

    // One stage's composition of the head vector at (t, s), group g, in place.
    auto compose = [&](int stage, int t, int s, int g, std::vector<double>& z) {
      const int qc = stage == 0 ? 0 : 2, kc = qc + 1;
      const std::vector<double>& P = stage == 0 ? w.pre_w : w.post_w;
      std::vector<double> out(z);  // the identity term
      if (opt.static_w)
        for (int n = 0; n < M; ++n)
          for (int m = 0; m < M; ++m) {
            out[n] += z[m] * P[(static_cast<std::size_t>(g) * M + m) * M + n];
            ++res.compose_macs;
          }
      auto dynamic_term = [&](const Factors& f) {
        for (int r = 0; r < R; ++r) {
          double proj = 0;
          for (int m = 0; m < M; ++m) {
            proj += z[m] * f.w1[static_cast<std::size_t>(r) * M + m];
            ++res.compose_macs;
          }
          for (int n = 0; n < M; ++n) {
            out[n] += proj * f.w2[static_cast<std::size_t>(r) * M + n];
            ++res.compose_macs;
          }
        }
        for (int n = 0; n < M; ++n) {
          out[n] += z[n] * f.dd[n];
          ++res.compose_macs;
        }
      };
      if (opt.query_wise) dynamic_term(fac[(static_cast<std::size_t>(t) * G + g) * 4 + qc]);
      if (opt.key_wise) dynamic_term(fac[(static_cast<std::size_t>(s) * G + g) * 4 + kc]);
      z = out;
    };

    // Scores A[h][t][s] over visible pairs; others stay -inf.
    std::vector<double> L(static_cast<std::size_t>(H) * T * S, neg_inf);
    auto at = [&](std::vector<double>& a, int h, int t, int s) -> double& {
      return a[(static_cast<std::size_t>(h) * T + t) * S + s];
    };
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t)
        for (int s = 0; s < S; ++s) {
          if (!allowed(t, s)) continue;
          double dot = 0;
          for (int e = 0; e < dk; ++e) {
            dot += q[static_cast<std::size_t>(t) * H * dk + h * dk + e] * k[static_cast<std::size_t>(s) * H * dk + h * dk + e];
            ++res.score_macs;
          }
          at(L, h, t, s) = scale * dot;
        }
    // Composes `a` (stage 0: pre, 1: post) in place at every visible (t, s), one group at a time.
    std::vector<double> z(M);
    auto compose_all = [&](int stage, std::vector<double>& a) {
      for (int t = 0; t < T; ++t)
        for (int s = 0; s < S; ++s) {
          if (!allowed(t, s)) continue;
          for (int g = 0; g < G; ++g) {
            for (int m = 0; m < M; ++m) z[m] = at(a, g * M + m, t, s);
            compose(stage, t, s, g, z);
            for (int m = 0; m < M; ++m) at(a, g * M + m, t, s) = z[m];
          }
        }
    };
    if (opt.use_pre) compose_all(0, L);
    // Padding masks after the pre-compose (C never mixes positions).
    if (!padding.empty())
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t)
          for (int s = 0; s < S; ++s)
            if (padding[static_cast<std::size_t>(b) * S + s]) at(L, h, t, s) = neg_inf;

    // Softmax over s; a row with nothing visible stays all zero.
    std::vector<double> P(static_cast<std::size_t>(H) * T * S, 0.0);
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        double mx = neg_inf;
        for (int s = 0; s < S; ++s) mx = std::max(mx, at(L, h, t, s));
        if (mx == neg_inf) continue;
        double sum = 0;
        for (int s = 0; s < S; ++s) {
          const double e = at(L, h, t, s) == neg_inf ? 0.0 : std::exp(at(L, h, t, s) - mx);
          at(P, h, t, s) = e;
          sum += e;
        }
        for (int s = 0; s < S; ++s) at(P, h, t, s) /= sum;
      }
    std::copy(P.begin(), P.end(), res.softmax.begin() + static_cast<std::ptrdiff_t>(b) * H * T * S);  // [H, T, S]

    if (opt.use_post) compose_all(1, P);
    std::copy(P.begin(), P.end(), res.probs.begin() + static_cast<std::ptrdiff_t>(b) * H * T * S);  // [H, T, S]

    // Readout over visible pairs, then the output projection.
    std::vector<double> ctx(static_cast<std::size_t>(T) * H * dv, 0.0);
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t)
        for (int e = 0; e < dv; ++e) {
          double acc = 0;
          for (int s = 0; s < S; ++s) {
            if (!allowed(t, s)) continue;
            acc += at(P, h, t, s) * v[static_cast<std::size_t>(s) * H * dv + h * dv + e];
            ++res.score_macs;
          }
          ctx[static_cast<std::size_t>(t) * H * dv + h * dv + e] = acc;
        }
    if (w.out != 0) ctx = dcmha_detail::linear(ctx, T, H * dv, w.wo, w.bo, out_dim, res.projection_macs);
    std::copy(ctx.begin(), ctx.end(), res.output.begin() + static_cast<std::ptrdiff_t>(b) * T * out_dim);
  }
  return res;
}

/// Self-attention: x [B, T, D] row-major is both the queries and the keys.
/// padding: [B, T] (1 = padded key) or empty.
inline RefDcmhaResult dcmha_reference(const RefDcmhaWeights& w, const RefDcmhaOptions& opt, int B, int T,
                                      const std::vector<double>& x, const std::vector<std::uint8_t>& padding = {}) {
  return dcmha_reference(w, opt, B, T, x, T, x, padding);
}

}  // namespace headmix_ref
