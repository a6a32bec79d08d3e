// DCMHA's dynamic weights: per position, group and used slot (pre/post ×
// query/key side), the factors W1 [R, M] (each row RMS-normalised over the
// M heads), W2 [R, M] and dd [M] that a Compose applies, computed from the
// layer input by a small MLP as in shared/conformance/dcmha.md:
//
//   u = GELU(x · dw1[:, g, c]),  [W1 | W2] = u · qkw[g, c],  dd = tanh(x · dd[:, g, c])
//
// The used slots' dw1 and dd columns are packed into one input matrix, so a
// block of rows takes one GEMM for all of them, then one [rows, K]·[K, 2R·M]
// GEMM per (group, slot).
#pragma once

#include "headmix/core/gemm.hpp"
#include "headmix/core/parallel.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/variants/dcmha/options.hpp"

#include <unsupported/Eigen/SpecialFunctions>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace headmix::detail {

/// Where factors go, per stage (0 pre, 1 post; null: not used): the query
/// side as rows, [rows, G·(2R+1)·M] qf_stride apart; the key side as
/// columns, factor row j of position s of batch item b at
/// b·kf_batch_stride + j·kf_row_stride + s, so that a Compose reads each
/// coefficient row contiguously along the keys: in kf, or in kf_half
/// (a bfloat16 cache's streams), rounded to nearest even.
template <class T>
struct DcmhaFactorTargets {
  T* qf[2] = {nullptr, nullptr};
  T* kf[2] = {nullptr, nullptr};
  Eigen::bfloat16* kf_half[2] = {nullptr, nullptr};
  Index qf_stride = 0, kf_batch_stride = 0, kf_row_stride = 0;
};

template <class T>
class DcmhaFactors {
 public:
  /// Which rows' factors compute() writes: both sides of the same rows
  /// (self-attention, a step), or one side of query or key rows.
  enum class Side { both, query, key };

  /// Pack the slots the options use (a stage's query side with query_wise,
  /// its key side with key_wise) from checked weights.
  void prepare(const DcmhaWeights<T>& w, const DcmhaOptions& o) {
    opt_ = o;
    G_ = o.groups, M_ = o.num_heads / o.groups, R_ = o.rank, K_ = w.dw1.dim(3);
    const Index D = w.dw1.dim(0), G = G_, M = M_, R = R_, K = K_;
    const bool used[2] = {o.use_pre, o.use_post};
    slots_.clear();
    for (int c = 0; c < 4; ++c)
      if (used[c / 2] && (c % 2 == 0 ? o.query_wise : o.key_wise)) slots_.push_back(c);
    const Index ns = static_cast<Index>(slots_.size()), units = G * ns;
    dyn_in_.setZero(D, units * (K + M));
    qkw_.assign(static_cast<std::size_t>(units), Matrix<T>());
    for (Index g = 0; g < G; ++g)
      for (Index si = 0; si < ns; ++si) {
        const Index unit = g * ns + si, c = slots_[static_cast<std::size_t>(si)];
        for (Index d = 0; d < D; ++d) {
          for (Index kk = 0; kk < K; ++kk) dyn_in_(d, unit * K + kk) = w.dw1[((d * G + g) * 4 + c) * K + kk];
          for (Index m = 0; m < M; ++m) dyn_in_(d, units * K + unit * M + m) = w.dd[(d * G + g) * 4 * M + c * M + m];
        }
        Matrix<T>& q = qkw_[static_cast<std::size_t>(unit)];
        q.resize(K, 2 * R * M);
        for (Index kk = 0; kk < K; ++kk)
          for (Index j = 0; j < 2 * R * M; ++j) q(kk, j) = w.qkw[((g * 4 + c) * K + kk) * 2 * R * M + j];
      }
#ifdef HEADMIX_USE_LIBXSMM
    dyn_in_packed_ = PackedMatrix<T>(dyn_in_);  // the panels libxsmm reads (as Linear::prepare)
#endif
  }

  /// Options that leave the packing as it is (threads, GELU form, epsilon).
  void set_options(const DcmhaOptions& o) { opt_ = o; }

  /// Used slots c (0 pre/query, 1 pre/key, 2 post/query, 3 post/key).
  const std::vector<int>& slots() const { return slots_; }

  /// Factors of the rows of `x` (sequences of `len` rows each): the query
  /// side into `to.qf` rows, the key side into `to.kf` columns
  /// first_pos + (row mod len); with `side` query or key, only that side
  /// (for one side while the other side's slots are in use too, the GEMM
  /// takes just the dw1 and dd columns of its slots). Per-worker scratch in
  /// Workspace local slots `u_slot` and `f_slot`.
  void compute(const ConstMatrixMap<T>& x, Index len, Index first_pos, const DcmhaFactorTargets<T>& to,
               Workspace<T>& ws, std::size_t u_slot, std::size_t f_slot, Side side = Side::both) const {
    const auto wanted = [side](int c) { return side == Side::both || (c % 2 == 0) == (side == Side::query); };
    if (std::none_of(slots_.begin(), slots_.end(), wanted)) return;
    const bool all_slots = std::all_of(slots_.begin(), slots_.end(), wanted);
    const Index N = x.rows(), G = G_, M = M_, R = R_, K = K_;
    const Index units = G * static_cast<Index>(slots_.size()), hidden_cols = units * K, ucols = dyn_in_.cols();
    const Index FW = (2 * R + 1) * M;
    const T eps = static_cast<T>(opt_.dw_norm_eps);
    const auto slot_of = [&](Index unit) {
      return slots_[static_cast<std::size_t>(unit % static_cast<Index>(slots_.size()))];
    };
    const int workers = std::max(1, opt_.threads);
    const Index task_rows = std::min(kRows, N);
    ws.reserve_local(workers, u_slot, task_rows * ucols);
    ws.reserve_local(workers, f_slot, task_rows * 2 * R * M);
    parallel_for((N + kRows - 1) / kRows, opt_.threads, [&](Index task, int w) {
      const Index r0 = task * kRows, rows = std::min(kRows, N - r0);
      MatrixMap<T> u(ws.local(w, u_slot, rows * ucols), rows, ucols);
      MatrixMap<T> f(ws.local(w, f_slot, rows * 2 * R * M), rows, 2 * R * M);
      // GELU on the MLP's hidden columns, tanh on the dd gate columns, with
      // Eigen's erf and tanh: vectorised in float (a rational approximation,
      // within a few ulp), the C library's in double. The C library's float
      // erf, one call per value, took 3-4% of the layer's time (T = 256-1024).
      const auto activate = [&](auto&& hidden, auto&& gate) {
        auto z = hidden.array();
        if (opt_.gelu == DcmhaGelu::erf)
          z = T(0.5) * z * (T(1) + (z * T(0.70710678118654752440)).erf());
        else
          z = T(0.5) * z * (T(1) + (T(0.79788456080286535588) * (z + T(0.044715) * z.cube())).tanh());
        gate.array() = gate.array().tanh();
      };
      if (all_slots) {
        if (dyn_in_packed_.rows() == dyn_in_.rows())
          gemm(x.middleRows(r0, rows), dyn_in_packed_.panels(), u);
        else
          u.noalias() = x.middleRows(r0, rows) * dyn_in_;
        activate(u.leftCols(hidden_cols), u.rightCols(ucols - hidden_cols));
      } else {
        for (Index unit = 0; unit < units; ++unit) {
          if (!wanted(slot_of(unit))) continue;
          auto hidden = u.middleCols(unit * K, K);
          auto gate = u.middleCols(hidden_cols + unit * M, M);
          gemm(x.middleRows(r0, rows), dyn_in_.middleCols(unit * K, K), hidden);
          gemm(x.middleRows(r0, rows), dyn_in_.middleCols(hidden_cols + unit * M, M), gate);
          activate(hidden, gate);
        }
      }

      for (Index unit = 0; unit < units; ++unit) {
        const Index g = unit / static_cast<Index>(slots_.size());
        const int c = slot_of(unit);
        if (!wanted(c)) continue;
        const int st = c / 2;
        const bool query_side = c % 2 == 0;
        gemm(u.middleCols(unit * K, K), qkw_[static_cast<std::size_t>(unit)], f);
        for (Index i = 0; i < rows; ++i) {
          for (Index r = 0; r < R; ++r) {  // scale-free RMSNorm of each W1 row over the M heads
            auto w1 = f.row(i).segment(r * M, M);
            w1 *= T(1) / std::sqrt(w1.squaredNorm() / static_cast<T>(M) + eps);
          }
          const T* fr = &f(i, 0);
          const T* dd = &u(i, hidden_cols + unit * M);
          const Index p = r0 + i;
          if (query_side) {
            T* dst = to.qf[st] + p * to.qf_stride + g * FW;
            std::copy_n(fr, 2 * R * M, dst);
            std::copy_n(dd, M, dst + 2 * R * M);
          } else {
            const Index rs = to.kf_row_stride, at = (p / len) * to.kf_batch_stride + g * FW * rs + first_pos + p % len;
            const auto store = [&](auto* dst) {
              using Stored = std::remove_pointer_t<decltype(dst)>;
              // As T, or as bfloat16 (double through float, as the cache's K and V).
              const auto put = [](Stored& slot, T v) {
                if constexpr (std::is_same_v<Stored, T>) slot = v; else slot = Stored(static_cast<float>(v));
              };
              for (Index j = 0; j < 2 * R * M; ++j) put(dst[j * rs], fr[j]);
              for (Index m = 0; m < M; ++m) put(dst[(2 * R * M + m) * rs], dd[m]);
            };
            if (to.kf_half[st])
              store(to.kf_half[st] + at);
            else
              store(to.kf[st] + at);
          }
        }
      }
    });
  }

 private:
  // Rows per task (fixed, so that results do not depend on the thread count).
  static constexpr Index kRows = 64;

  DcmhaOptions opt_;
  Index G_ = 1, M_ = 1, R_ = 1, K_ = 0;
  std::vector<int> slots_;
  Matrix<T> dyn_in_;            // [D, G·slots·K | G·slots·M]: dw1 then dd columns
  PackedMatrix<T> dyn_in_packed_;  // dyn_in_ in gemm's panels under libxsmm; empty otherwise
  std::vector<Matrix<T>> qkw_;  // per (group, slot): [K, 2R·M]
};

}  // namespace headmix::detail
