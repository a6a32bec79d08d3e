// A naive Reformer LSH self-attention in double, written from
// shared/conformance/lsh.md section 3 and nothing else: plain index loops,
// no Eigen, nothing from include/headmix. It follows the spec's steps one
// by one (a per-query loop over explicit slots, the duplicate count by
// literally counting slots), so that it shares no shortcut with the kernel.
// It also counts the multiply-adds its loops perform, for Lsh::flops().
//
// Also here: dense full shared-QK attention with the same logits and masks
// (self −5e4 written after the pair and causal masks), which LSH must equal
// exactly when one padded length of 2·bucket_size covers the sequence and
// duplicates are divided out.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace headmix_ref {

/// y = x · weightᵀ + bias, weight row-major [out, in]; empty bias = none;
/// out == 0 means absent (only for the output projection).
struct LshRefLinear {
  int out = 0, in = 0;
  std::vector<double> weight;
  std::vector<double> bias;
  bool absent() const { return out == 0; }
};

struct LshRefWeights {
  LshRefLinear qk, v, o;
  std::vector<double> rotations;  // [R, dh, NH, NB/2], R = 1 or B·H
};

struct LshRefOptions {
  int num_heads = 1;
  int bucket_size = 4;
  int n_hashes = 1;
  int n_buckets = 0;  // 0: padded length / bucket_size
  bool causal = false;
  bool attend_across_buckets = true;
  bool allow_duplicate_attention = true;
  bool rotations_per_head = false;
  // The duplicate count as reformer-pytorch computes it, which lsh.md
  // step 6f calls a defect (per round: same chunk or the chunk just before
  // in that round). Only for showing that a test sees the difference.
  bool per_round_duplicate_count = false;
};

struct LshRefResult {
  int B = 0, T = 0, Tp = 0, H = 0, NH = 0, NB = 0, out_dim = 0, head_width = 0;
  std::vector<double> output;               // [B, T, out_dim]
  std::vector<double> heads;                // [B, T, H·dv], concatenated head outputs
  std::vector<double> probs;                // [B, H, T, T]
  std::vector<long long> buckets;           // [B, H, NH, Tp]
  std::int64_t projection_macs = 0, attention_macs = 0;
  double min_hash_margin = 1e300;           // smallest (top − second) / max|.| over non-zero argmax vectors
};

namespace lsh_ref_detail {

inline double project_row(const LshRefLinear& lin, const double* x, int r, std::int64_t& macs) {
  double acc = lin.bias.empty() ? 0.0 : lin.bias[r];
  for (int c = 0; c < lin.in; ++c) {
    acc += x[c] * lin.weight[static_cast<std::size_t>(r) * lin.in + c];
    ++macs;
  }
  return acc;
}

inline LshRefResult finish_output(LshRefResult r, const LshRefLinear& o) {
  r.out_dim = o.absent() ? r.head_width : o.out;
  if (o.absent()) {
    r.output = r.heads;
    return r;
  }
  r.output.assign(static_cast<std::size_t>(r.B) * r.T * r.out_dim, 0.0);
  for (int b = 0; b < r.B; ++b)
    for (int i = 0; i < r.T; ++i) {
      const double* row = &r.heads[(static_cast<std::size_t>(b) * r.T + i) * r.head_width];
      for (int c = 0; c < o.out; ++c)
        r.output[(static_cast<std::size_t>(b) * r.T + i) * r.out_dim + c] = project_row(o, row, c, r.projection_macs);
    }
  return r;
}

}  // namespace lsh_ref_detail

/// x is [B, T, D] row-major; padding is [B, T] (1 = padded) or empty.
/// With `hash_only`, stops after step 2: only buckets and min_hash_margin are filled.
inline LshRefResult lsh_reference(const LshRefWeights& w, const LshRefOptions& opt, int B, int T, int D,
                                  const std::vector<double>& x, const std::vector<std::uint8_t>& padding = {},
                                  bool hash_only = false) {
  const int H = opt.num_heads, bs = opt.bucket_size, NH = opt.n_hashes;
  if (H < 1 || w.qk.out % H || w.v.out % H || w.qk.in != D || w.v.in != D)
    throw std::invalid_argument("lsh_reference: weights do not fit");
  const int dh = w.qk.out / H, dv = w.v.out / H;
  const int Tp = (T + 2 * bs - 1) / (2 * bs) * (2 * bs);  // step 0
  const int NB = opt.n_buckets > 0 ? opt.n_buckets : Tp / bs, half = NB / 2;
  const int NC = NH * Tp / bs;
  const double NEG = -DBL_MAX;
  const bool use_mask = !padding.empty() || Tp > T;

  LshRefResult res;
  res.B = B, res.T = T, res.Tp = Tp, res.H = H, res.NH = NH, res.NB = NB, res.head_width = H * dv;
  res.heads.assign(static_cast<std::size_t>(B) * T * H * dv, 0.0);
  res.probs.assign(static_cast<std::size_t>(B) * H * T * T, 0.0);
  res.buckets.assign(static_cast<std::size_t>(B) * H * NH * Tp, 0);

  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      // Step 1: projections; an autopad row of x is zero, so its qk and v are the biases (or 0).
      std::vector<std::vector<double>> qk(Tp, std::vector<double>(dh)), v(Tp, std::vector<double>(dv));
      std::vector<bool> valid(Tp);
      for (int p = 0; p < Tp; ++p) {
        const double* xr = p < T ? &x[(static_cast<std::size_t>(b) * T + p) * D] : nullptr;
        for (int f = 0; f < dh; ++f) {
          const int row = h * dh + f;
          qk[p][f] = p < T ? lsh_ref_detail::project_row(w.qk, xr, row, res.projection_macs)
                           : (w.qk.bias.empty() ? 0.0 : w.qk.bias[row]);
        }
        for (int e = 0; e < dv; ++e) {
          const int row = h * dv + e;
          v[p][e] = p < T ? lsh_ref_detail::project_row(w.v, xr, row, res.projection_macs)
                          : (w.v.bias.empty() ? 0.0 : w.v.bias[row]);
        }
        valid[p] = p < T && !(!padding.empty() && padding[static_cast<std::size_t>(b) * T + p]);
      }

      // Step 2: buckets, argmax over [u, −u], ties to the lowest index.
      const int rho = opt.rotations_per_head ? b * H + h : 0;
      auto A = [&](int f, int r, int k) {
        return w.rotations[((static_cast<std::size_t>(rho) * dh + f) * NH + r) * half + k];
      };
      std::vector<std::vector<int>> bucket(NH, std::vector<int>(Tp));
      std::vector<double> vec(NB);
      for (int r = 0; r < NH; ++r)
        for (int p = 0; p < Tp; ++p) {
          for (int k = 0; k < half; ++k) {
            double u = 0;
            for (int f = 0; f < dh; ++f) {
              u += qk[p][f] * A(f, r, k);
              ++res.attention_macs;
            }
            vec[k] = u;
            vec[half + k] = -u;
          }
          int best = 0;
          for (int k = 1; k < NB; ++k)
            if (vec[k] > vec[best]) best = k;
          bucket[r][p] = best;
          res.buckets[((static_cast<std::size_t>(b) * H + h) * NH + r) * Tp + p] = best;
          double top = -1e300, second = -1e300, biggest = 0;
          for (int k = 0; k < NB; ++k) {
            biggest = std::max(biggest, std::abs(vec[k]));
            if (vec[k] > top) second = top, top = vec[k];
            else if (vec[k] > second) second = vec[k];
          }
          if (biggest > 0) res.min_hash_margin = std::min(res.min_hash_margin, (top - second) / biggest);
        }
      if (hash_only) continue;

      // Step 3: per round, positions by (bucket, position) into slots r·Tp...
      std::vector<int> pos(static_cast<std::size_t>(NH) * Tp), slot_of(static_cast<std::size_t>(NH) * Tp);
      for (int r = 0; r < NH; ++r) {
        int s = r * Tp;
        for (int k = 0; k < NB; ++k)
          for (int p = 0; p < Tp; ++p)
            if (bucket[r][p] == k) {
              pos[s] = p;
              slot_of[static_cast<std::size_t>(r) * Tp + p] = s;
              ++s;
            }
      }
      auto rnd = [&](int s) { return s / Tp; };
      auto chunk_r = [&](int r, int p) { return slot_of[static_cast<std::size_t>(r) * Tp + p] / bs; };
      auto g = [&](int r, int p) { return r * NB + bucket[r][p]; };

      // Step 4: unit keys.
      std::vector<std::vector<double>> khat(Tp, std::vector<double>(dh));
      for (int p = 0; p < Tp; ++p) {
        double ss = 0;
        for (int f = 0; f < dh; ++f) {
          ss += qk[p][f] * qk[p][f];
          ++res.attention_macs;
        }
        const double n = std::max(std::sqrt(ss), 1e-12);
        for (int f = 0; f < dh; ++f) khat[p][f] = qk[p][f] / n;
      }

      // Step 5: the 2·bs candidate slots of the query in slot s.
      auto window = [&](int s) {
        const int c = s / bs, prev = (c - 1 + NC) % NC;
        std::vector<int> slots;
        for (int q = 0; q < bs; ++q) slots.push_back(c * bs + q);
        for (int q = 0; q < bs; ++q) slots.push_back(prev * bs + q);
        return slots;
      };
      auto same_bucket_ok = [&](int r_query, int i, int t) {  // E for the slot t seen from round r_query
        return opt.attend_across_buckets || g(rnd(t), pos[t]) == g(r_query, i);
      };
      // Step 6f's N(i, j): slots holding j in i's window of every round.
      auto dup_count = [&](int i, int j) {
        int n = 0;
        for (int r = 0; r < NH; ++r) {
          if (opt.per_round_duplicate_count) {
            const bool e = opt.attend_across_buckets || g(r, j) == g(r, i);
            n += e && chunk_r(r, j) == chunk_r(r, i);
            n += e && (chunk_r(r, j) + 1) % NC == chunk_r(r, i);
          } else {
            for (int t : window(slot_of[static_cast<std::size_t>(r) * Tp + i]))
              if (pos[t] == j && same_bucket_ok(r, i, t)) ++n;
          }
        }
        return n;
      };

      // Steps 6-7 for every (round, query) row.
      std::vector<std::vector<double>> lse(NH, std::vector<double>(Tp));
      std::vector<std::vector<std::vector<double>>> out_r(NH, std::vector<std::vector<double>>(Tp, std::vector<double>(dv)));
      std::vector<std::vector<std::vector<double>>> row_p(NH, std::vector<std::vector<double>>(Tp));
      std::vector<std::vector<std::vector<int>>> row_j(NH, std::vector<std::vector<int>>(Tp));
      for (int s = 0; s < NH * Tp; ++s) {
        const int i = pos[s], r = rnd(s);
        const std::vector<int> cand = window(s);
        std::vector<double> l(cand.size());
        for (std::size_t n = 0; n < cand.size(); ++n) {
          const int t = cand[n], j = pos[t];
          double dot = 0;
          for (int f = 0; f < dh; ++f) {
            dot += qk[i][f] * khat[j][f];
            ++res.attention_macs;
          }
          double li = dot / std::sqrt(static_cast<double>(dh));                 // a
          if (use_mask && !(valid[i] && valid[j])) li = NEG;                      // b
          if (opt.causal && j > i) li = NEG;                                      // c
          if (j == i) li = -5e4;                                                  // d
          if (!opt.attend_across_buckets && g(rnd(t), j) != g(r, i)) li = NEG;   // e
          if (!opt.allow_duplicate_attention) li = li - std::log(dup_count(i, j) + 1e-9);  // f
          l[n] = li;
        }
        double m = -HUGE_VAL;
        for (double li : l) m = std::max(m, li);
        double sum = 0;
        std::vector<double> e(l.size());
        for (std::size_t n = 0; n < l.size(); ++n) sum += e[n] = std::exp(l[n] - m);
        lse[r][i] = m + std::log(sum);
        for (std::size_t n = 0; n < l.size(); ++n) {
          const double p = e[n] / sum;
          row_p[r][i].push_back(p);
          row_j[r][i].push_back(pos[cand[n]]);
          for (int k = 0; k < dv; ++k) {
            out_r[r][i][k] += p * v[pos[cand[n]]][k];
            ++res.attention_macs;
          }
        }
      }

      // Step 8 (and section 4): rounds weighted by a softmax over lse.
      for (int i = 0; i < T; ++i) {
        double L = -HUGE_VAL;
        for (int r = 0; r < NH; ++r) L = std::max(L, lse[r][i]);
        double z = 0;
        for (int r = 0; r < NH; ++r) z += std::exp(lse[r][i] - L);
        for (int r = 0; r < NH; ++r) {
          const double wr = std::exp(lse[r][i] - L) / z;
          for (int k = 0; k < dv; ++k) {
            res.heads[(static_cast<std::size_t>(b) * T + i) * H * dv + h * dv + k] += wr * out_r[r][i][k];
            ++res.attention_macs;
          }
          for (std::size_t n = 0; n < row_p[r][i].size(); ++n) {
            const int j = row_j[r][i][n];
            if (j < T) res.probs[((static_cast<std::size_t>(b) * H + h) * T + i) * T + j] += wr * row_p[r][i][n];
          }
        }
      }
    }
  if (hash_only) return res;
  return lsh_ref_detail::finish_output(std::move(res), w.o);  // step 9
}

/// Dense shared-QK attention with LSH's logits: q_i · k̂_j / sqrt(dh),
/// pair mask, causal mask, then self = −5e4. Rotations and buckets unused.
inline LshRefResult full_shared_qk_reference(const LshRefWeights& w, const LshRefOptions& opt, int B, int T, int D,
                                             const std::vector<double>& x,
                                             const std::vector<std::uint8_t>& padding = {}) {
  const int H = opt.num_heads;
  const int dh = w.qk.out / H, dv = w.v.out / H;
  LshRefResult res;
  res.B = B, res.T = T, res.Tp = T, res.H = H, res.head_width = H * dv;
  res.heads.assign(static_cast<std::size_t>(B) * T * H * dv, 0.0);
  res.probs.assign(static_cast<std::size_t>(B) * H * T * T, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      std::vector<std::vector<double>> qk(T, std::vector<double>(dh)), v(T, std::vector<double>(dv));
      for (int p = 0; p < T; ++p) {
        const double* xr = &x[(static_cast<std::size_t>(b) * T + p) * D];
        for (int f = 0; f < dh; ++f) qk[p][f] = lsh_ref_detail::project_row(w.qk, xr, h * dh + f, res.projection_macs);
        for (int e = 0; e < dv; ++e) v[p][e] = lsh_ref_detail::project_row(w.v, xr, h * dv + e, res.projection_macs);
      }
      auto padded = [&](int p) { return !padding.empty() && padding[static_cast<std::size_t>(b) * T + p]; };
      for (int i = 0; i < T; ++i) {
        std::vector<double> l(T);
        for (int j = 0; j < T; ++j) {
          double ss = 0, dot = 0;
          for (int f = 0; f < dh; ++f) ss += qk[j][f] * qk[j][f];
          const double n = std::max(std::sqrt(ss), 1e-12);
          for (int f = 0; f < dh; ++f) dot += qk[i][f] * qk[j][f] / n;
          l[j] = dot / std::sqrt(static_cast<double>(dh));
          if (padded(i) || padded(j)) l[j] = -DBL_MAX;
          if (opt.causal && j > i) l[j] = -DBL_MAX;
          if (j == i) l[j] = -5e4;
        }
        double m = -HUGE_VAL, sum = 0;
        for (double li : l) m = std::max(m, li);
        for (int j = 0; j < T; ++j) sum += std::exp(l[j] - m);
        for (int j = 0; j < T; ++j) {
          const double p = std::exp(l[j] - m) / sum;
          res.probs[((static_cast<std::size_t>(b) * H + h) * T + i) * T + j] = p;
          for (int e = 0; e < dv; ++e) res.heads[(static_cast<std::size_t>(b) * T + i) * H * dv + h * dv + e] += p * v[j][e];
        }
      }
    }
  return lsh_ref_detail::finish_output(std::move(res), w.o);
}

}  // namespace headmix_ref
