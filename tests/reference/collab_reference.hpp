// A naive CollabHead in double, written from shared/conformance/collab.md
// and nothing else: plain index loops, no Eigen, nothing from
// include/headmix. Plus naive helpers for checking the CP decomposition and
// the MHA -> CollabHead conversion (collab.md "Re-parameterization").
//
//   Qs = Xq qᵀ [T, R],  Ks = Xk kᵀ [S, R],  cb = Xk content_biasᵀ [S, H]   (no biases)
//   logit[b,h,i,j] = scale · (Σ_r Qs[i,r]·mixing[h,r]·Ks[j,r] + cb[j,h]),   scale default 1/sqrt(R/H)
//   -inf if padded[b,j] or, with causal, unless j <= i + offset (and, with window > 0,
//   j > i + offset - window);  P = softmax_j (all-masked row: zeros)
//   V = Xk vᵀ + bv,  C_h = P_h V_h,  y = C oᵀ + bo (or C),  out = LayerNorm(Xq + y) (optional)
//
// Work counted (multiply-adds of dot products only; scale, softmax and
// LayerNorm are not counted):
//   * projections: Qs, Ks, cb (when there is a content bias), V, o;
//   * per (b, h, i): the mixed query row Qs[i, r]·mixing[h, r], one per r in
//     head h's span, then per causally visible key one per r in the span, and
//     Dv for the readout.
// A head's span runs from its first to its last non-zero mixing entry:
// outside it every term is exactly zero, and skipping those columns is the
// saving a block-mixed layer (the exact MHA copy) is entitled to. With dense
// mixing the span is all R columns.
#pragma once

#include "reference/mha_reference.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace headmix_ref {

struct RefCollabWeights {
  int num_heads = 0, shared_dim = 0, embed_dim = 0, key_dim = 0;
  std::vector<double> q;             // [R, D]
  std::vector<double> k;             // [R, Dkv]
  std::vector<double> mixing;        // [H, R]
  std::vector<double> content_bias;  // [H, Dkv], or empty for none
  RefLinear v, o;                    // o may be absent
  std::vector<double> ln_weight, ln_bias;  // [D] each, or empty for no LayerNorm
  double ln_eps = 1e-5;
};

struct RefCollabOptions {
  bool causal = false;
  long causal_offset = 0;
  long window = 0;   // > 0 (with causal): also j > i + causal_offset - window
  double scale = 0;  // 0 means the default 1/sqrt(R/H)
};

inline RefMhaResult collab_reference(const RefCollabWeights& w, const RefCollabOptions& opt, const RefBatch& query,
                                     const RefBatch* key = nullptr, const std::vector<std::uint8_t>& padding = {}) {
  const RefBatch& xk = key ? *key : query;
  const int B = query.batch, T = query.length, S = xk.length, H = w.num_heads, R = w.shared_dim;
  const int D = w.embed_dim, Dkv = w.key_dim;
  if (xk.batch != B) throw std::invalid_argument("collab_reference: key batch != query batch");
  if (query.width != D || xk.width != Dkv) throw std::invalid_argument("collab_reference: input widths");
  if (H < 1 || w.v.out % H != 0) throw std::invalid_argument("collab_reference: head split");
  const int dv = w.v.out / H;
  const int out_dim = w.o.absent() ? H * dv : w.o.out;
  const bool layer_norm = !w.ln_weight.empty();
  if (layer_norm && out_dim != D) throw std::invalid_argument("collab_reference: LayerNorm needs out_dim == D");
  const double scale = opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(R) / H);
  const double neg_inf = -std::numeric_limits<double>::infinity();

  RefMhaResult res;
  res.B = B, res.T = T, res.S = S, res.H = H, res.out_dim = out_dim;
  auto at2 = [](const std::vector<double>& m, int cols, int r, int c) {
    return m[static_cast<std::size_t>(r) * cols + c];
  };

  // Shared projections and the content bias (one value per key and head),
  // none with a bias: Qs [B, T, R], Ks [B, S, R], cb [B, S, H].
  auto no_bias = [](int out, int in, const std::vector<double>& weight) { return RefLinear{out, in, weight, {}}; };
  const std::vector<double> Qs = detail::project(no_bias(R, D, w.q), query, res.projection_macs);
  const std::vector<double> Ks = detail::project(no_bias(R, Dkv, w.k), xk, res.projection_macs);
  const std::vector<double> cb = w.content_bias.empty()
                                     ? std::vector<double>(static_cast<std::size_t>(B) * S * H, 0.0)
                                     : detail::project(no_bias(H, Dkv, w.content_bias), xk, res.projection_macs);
  const std::vector<double> V = detail::project(w.v, xk, res.projection_macs);  // [B, S, H*dv]

  auto visible = [&](int i, int j) {
    return !opt.causal || (j <= i + opt.causal_offset && (opt.window <= 0 || j > i + opt.causal_offset - opt.window));
  };
  res.probs.assign(static_cast<std::size_t>(B) * H * T * S, 0.0);
  RefBatch context{B, T, H * dv, std::vector<double>(static_cast<std::size_t>(B) * T * H * dv, 0.0)};
  std::vector<double> mixed(static_cast<std::size_t>(R)), logit(static_cast<std::size_t>(S));

  for (int h = 0; h < H; ++h) {
    int lo = 0, hi = R;  // the head's span: first to last non-zero mixing entry
    while (lo < hi && at2(w.mixing, R, h, lo) == 0.0) ++lo;
    while (hi > lo && at2(w.mixing, R, h, hi - 1) == 0.0) --hi;
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < T; ++i) {
        for (int r = lo; r < hi; ++r, ++res.attention_macs)
          mixed[r] = Qs[(static_cast<std::size_t>(b) * T + i) * R + r] * at2(w.mixing, R, h, r);
        for (int j = 0; j < S; ++j) {
          logit[j] = neg_inf;
          if (!visible(i, j)) continue;
          double dot = 0;
          for (int r = lo; r < hi; ++r, ++res.attention_macs)
            dot += mixed[r] * Ks[(static_cast<std::size_t>(b) * S + j) * R + r];
          const bool padded = !padding.empty() && padding[static_cast<std::size_t>(b) * S + j] != 0;
          logit[j] = padded ? neg_inf : scale * (dot + cb[(static_cast<std::size_t>(b) * S + j) * H + h]);
        }
        double row_max = neg_inf;
        for (int j = 0; j < S; ++j) row_max = logit[j] > row_max ? logit[j] : row_max;
        double* p = &res.probs[((static_cast<std::size_t>(b) * H + h) * T + i) * S];
        if (row_max != neg_inf) {
          double sum = 0;
          for (int j = 0; j < S; ++j) sum += (p[j] = logit[j] == neg_inf ? 0.0 : std::exp(logit[j] - row_max));
          for (int j = 0; j < S; ++j) p[j] /= sum;
        }
        for (int e = 0; e < dv; ++e) {
          double acc = 0;
          for (int j = 0; j < S; ++j) {
            if (!visible(i, j)) continue;
            acc += p[j] * V[(static_cast<std::size_t>(b) * S + j) * (H * dv) + h * dv + e];
            ++res.attention_macs;
          }
          context.data[(static_cast<std::size_t>(b) * T + i) * (H * dv) + h * dv + e] = acc;
        }
      }
  }

  res.output = w.o.absent() ? context.data : detail::project(w.o, context, res.projection_macs);
  if (layer_norm) {
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < T; ++i) {
        double* y = &res.output[(static_cast<std::size_t>(b) * T + i) * D];
        double mean = 0, var = 0;
        for (int c = 0; c < D; ++c) mean += (y[c] += query.at(b, i, c));
        mean /= D;
        for (int c = 0; c < D; ++c) var += (y[c] - mean) * (y[c] - mean);
        var /= D;  // biased, as torch
        const double inv = 1.0 / std::sqrt(var + w.ln_eps);
        for (int c = 0; c < D; ++c) y[c] = (y[c] - mean) * inv * w.ln_weight[c] + w.ln_bias[c];
      }
  }
  return res;
}

// ---------------------------------------------------------------------------
// CP decomposition helpers. A dense tensor is row-major [I, J, K] (k fastest);
// factors are row-major [dim, R].

struct RefTensor3 {
  int I = 0, J = 0, K = 0;
  std::vector<double> data;
  double at(int i, int j, int k) const { return data[(static_cast<std::size_t>(i) * J + j) * K + k]; }
};

// The [I, J, K] tensor whose entry (i, j, k) is entry(i, j, k).
template <class Entry>
RefTensor3 tensor3_of(int I, int J, int K, Entry entry) {
  RefTensor3 t{I, J, K, std::vector<double>(static_cast<std::size_t>(I) * J * K, 0.0)};
  for (int i = 0; i < I; ++i)
    for (int j = 0; j < J; ++j)
      for (int k = 0; k < K; ++k) t.data[(static_cast<std::size_t>(i) * J + j) * K + k] = entry(i, j, k);
  return t;
}

/// T[q, h, k] = Σ_d WQ[h·Dk + d, q] · WK[h·Dk + d, k], from row-major WQ [H·Dk, D] and WK [H·Dk, Dkv]
/// (collab.md: einsum("hdq,hdk->qhk")).
inline RefTensor3 mha_bilinear_tensor(const std::vector<double>& wq, const std::vector<double>& wk, int H, int Dk,
                                      int D, int Dkv) {
  return tensor3_of(D, H, Dkv, [&](int q, int h, int k) {
    double acc = 0;
    for (int d = 0; d < Dk; ++d)
      acc += wq[static_cast<std::size_t>(h * Dk + d) * D + q] * wk[static_cast<std::size_t>(h * Dk + d) * Dkv + k];
    return acc;
  });
}

/// Σ_r A[i, r] B[j, r] C[k, r].
inline RefTensor3 cp_reconstruct_reference(const std::vector<double>& a, const std::vector<double>& b,
                                           const std::vector<double>& c, int I, int J, int K, int R) {
  return tensor3_of(I, J, K, [&](int i, int j, int k) {
    double acc = 0;
    for (int r = 0; r < R; ++r)
      acc += a[static_cast<std::size_t>(i) * R + r] * b[static_cast<std::size_t>(j) * R + r] *
             c[static_cast<std::size_t>(k) * R + r];
    return acc;
  });
}

/// T_(n) T_(n)ᵀ: G[a, b] = Σ over the other two indices of T[.. a ..] · T[.. b ..], row-major [dim, dim].
inline std::vector<double> unfolding_gram_reference(const RefTensor3& t, int mode) {
  const int n = mode == 0 ? t.I : mode == 1 ? t.J : t.K;
  // The two other extents, and T at (mode index = m, others = u, v).
  const int nu = mode == 0 ? t.J : t.I, nv = mode == 2 ? t.J : t.K;
  auto entry = [&](int m, int u, int v) {
    return mode == 0 ? t.at(m, u, v) : mode == 1 ? t.at(u, m, v) : t.at(u, v, m);
  };
  std::vector<double> g(static_cast<std::size_t>(n) * n, 0.0);
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      double acc = 0;
      for (int u = 0; u < nu; ++u)
        for (int v = 0; v < nv; ++v) acc += entry(a, u, v) * entry(b, u, v);
      g[static_cast<std::size_t>(a) * n + b] = acc;
    }
  return g;
}

/// ‖x − y‖_F / ‖x‖_F.
inline double relative_difference(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size()) throw std::invalid_argument("relative_difference: sizes differ");
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += x[i] * x[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

/// MTTKRP of `mode` (0, 1, 2): out[n, r] = Σ over the other two indices of
/// T · (the other two factors' entries), row-major [dim(mode), R].
inline std::vector<double> mttkrp_reference(const RefTensor3& t, const std::vector<double>& a,
                                            const std::vector<double>& b, const std::vector<double>& c, int R,
                                            int mode) {
  const int n = mode == 0 ? t.I : mode == 1 ? t.J : t.K;
  std::vector<double> out(static_cast<std::size_t>(n) * R, 0.0);
  for (int i = 0; i < t.I; ++i)
    for (int j = 0; j < t.J; ++j)
      for (int k = 0; k < t.K; ++k)
        for (int r = 0; r < R; ++r) {
          const double x = t.at(i, j, k);
          const double fa = a.empty() ? 0 : a[static_cast<std::size_t>(i) * R + r];
          const double fb = b.empty() ? 0 : b[static_cast<std::size_t>(j) * R + r];
          const double fc = c.empty() ? 0 : c[static_cast<std::size_t>(k) * R + r];
          if (mode == 0) out[static_cast<std::size_t>(i) * R + r] += x * fb * fc;
          if (mode == 1) out[static_cast<std::size_t>(j) * R + r] += x * fa * fc;
          if (mode == 2) out[static_cast<std::size_t>(k) * R + r] += x * fa * fb;
        }
  return out;
}

}  // namespace headmix_ref
