// Head-parallel CollabHead over MPI: rank r of P holds heads
// [r·H/P, (r+1)·H/P): those rows of mixing [H, R] and content_bias [H, Dkv],
// those heads' rows of v and columns of o. H must be a multiple of P.
//
// Replicated: the shared query and key projections q [R, D] and k [R, Dkv].
// Every head of a dense mixing reads all R shared dimensions, so sharding
// them would not cut a rank's work; each rank computes Q̃ and K̃ in full
// (2·B·(T·D + S·Dkv)·R multiply-adds that P ranks repeat: flops() counts
// them on every rank) and its decoding cache holds K̃ [R] per position,
// next to its heads' values and content bias. The logit scale defaults to
// the full layer's 1/sqrt(R/H), not the local 1/sqrt(R/(H/P)).
//
// Replicated too: the optional LayerNorm(Xq + y), which needs the summed
// output. The local layers have none; every rank applies the full layer's
// (CollabLayerNorm::apply, the one-process code) to its summed or gathered
// output, after o's bias, on all rows (or, in forward_scatter, on its own).
// See head_parallel.hpp for the call, the collectives and the errors.
#pragma once

#include "headmix/mpi/head_parallel.hpp"
#include "headmix/variants/collab_head.hpp"

#include <cmath>
#include <string>

namespace headmix::mpi {

template <class T>
struct HeadShard<CollabHead, T> {
  using Options = CollabHeadOptions;
  static constexpr const char* kName = "head-parallel collab";

  static void check_split(const CollabHeadOptions& o, int P) {
    detail::check_multiple(kName, "num_heads", o.num_heads, P);
  }

  /// q and k (shared by every head) are read whole; o's bias and the
  /// LayerNorm too, after the sum.
  static constexpr SplitTensor kSplit[] = {
      {"mixing", 0}, {"content_bias.weight", 0}, {"v.weight", 0}, {"v.bias", 0}, {"o.weight", 1}};

  static CollabHeadOptions local_options(CollabHeadOptions o, int /*rank*/, int P) {
    o.num_heads /= P;
    return o;
  }
  /// The scale is fixed from the full head count: the local layer's default
  /// would use its own H/P.
  static CollabHeadOptions local_options(CollabHeadOptions o, int rank, int P, const CollabHead<T>& local) {
    if (!o.scale) o.scale = 1.0 / std::sqrt(static_cast<double>(local.shared_dim()) / static_cast<double>(o.num_heads));
    return local_options(o, rank, P);
  }

  static void same_split(const CollabHeadOptions& now, const CollabHeadOptions& next) {
    check_value(next.num_heads == now.num_heads, kName, "num_heads",
                "the sharded layer's " + std::to_string(now.num_heads), next.num_heads);
  }

  static CollabHead<T> slice(const CollabHead<T>& full, const CollabHeadOptions& options, int rank, int P) {
    const CollabHeadWeights<T>& w = full.weights();
    const Index h = full.num_heads() / P, first = rank * h, dv = full.v_head_dim();
    CollabHeadWeights<T> local;
    local.q = w.q;  // replicated: see above
    local.k = w.k;
    local.mixing = w.mixing.middleRows(first, h);
    if (full.has_content_bias()) local.content_bias = w.content_bias.middleRows(first, h);
    local.v = detail::linear_rows(w.v, first * dv, h * dv);
    if (!w.o.empty()) local.o.weight = w.o.weight.middleCols(first * dv, h * dv);  // bias: after the sum
    // No layer_norm: it runs after the sum (epilogue).
    CollabHeadOptions o = options;
    o.scale = full.scale_value();
    o.num_heads = h;
    return CollabHead<T>(std::move(local), o);
  }

  /// The full layer's LayerNorm (empty: none), run on the summed output.
  static CollabLayerNorm<T> epilogue(const CollabHead<T>& full) { return full.weights().layer_norm; }

  /// The LayerNorm in a checkpoint: hidden from the local layer (whose heads
  /// alone do not make out_dim), read whole and checked against the full
  /// layer's out_dim.
  static constexpr const char* kAfterSum[] = {"layer_norm.weight", "layer_norm.bias"};
  template <class Source>
  static CollabLayerNorm<T> read_epilogue(const Source& tensors, const std::string& prefix,
                                          const CollabHead<T>& local, int P, double layer_norm_eps = 1e-5) {
    auto ln = CollabLayerNorm<T>::read(tensors, prefix + "layer_norm", layer_norm_eps);
    const Index out = local.weights().o.empty() ? P * local.num_heads() * local.v_head_dim() : local.out_dim();
    ln.check(CollabHead<T>::kName, local.embed_dim(), out);
    return ln;
  }
};

/// Head-parallel CollabHead: HeadParallel over CollabHead, q and k replicated.
template <class T>
using HeadParallelCollabHead = HeadParallel<CollabHead, T>;

}  // namespace headmix::mpi
