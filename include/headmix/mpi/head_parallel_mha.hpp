// Head-parallel MHA over MPI, grouped-query attention included: rank r of P
// holds query heads [r·H/P, (r+1)·H/P), the KV heads they read, those rows
// of q, k and v and the matching columns of o (see head_parallel.hpp for
// the call, the collectives and the errors). H and Hkv must be multiples
// of P.
#pragma once

#include "headmix/mpi/head_parallel.hpp"
#include "headmix/variants/mha.hpp"

namespace headmix::mpi {

template <class T>
struct HeadShard<Mha, T> {
  using Options = MhaOptions;
  static constexpr const char* kName = "head-parallel mha";

  static void check_split(const MhaOptions& o, int P) {
    detail::check_multiple(kName, "num_heads", o.num_heads, P);
    detail::check_multiple(kName, "num_kv_heads", detail::kv_heads_of(o.num_heads, o.num_kv_heads), P,
                           " (each rank holds whole KV heads)");
  }

  static constexpr SplitTensor kSplit[] = {{"q.weight", 0}, {"q.bias", 0}, {"k.weight", 0}, {"k.bias", 0},
                                           {"v.weight", 0}, {"v.bias", 0}, {"o.weight", 1}};

  static MhaOptions local_options(MhaOptions o, int /*rank*/, int P) {
    o.num_kv_heads = detail::kv_heads_of(o.num_heads, o.num_kv_heads) / P;
    o.num_heads /= P;
    return o;
  }

  static void same_split(const MhaOptions& now, const MhaOptions& next) {
    check_value(next.num_heads == now.num_heads, kName, "num_heads",
                "the sharded layer's " + std::to_string(now.num_heads), next.num_heads);
    const Index kv = detail::kv_heads_of(now.num_heads, now.num_kv_heads);
    check_value(detail::kv_heads_of(next.num_heads, next.num_kv_heads) == kv, kName, "num_kv_heads",
                "the sharded layer's " + std::to_string(kv), next.num_kv_heads);
  }

  static Mha<T> slice(const Mha<T>& full, const MhaOptions& options, int rank, int P) {
    MhaWeights<T> local;
    detail::slice_projections(full.weights(), local, rank, full.num_heads() / P, full.num_kv_heads() / P,
                              full.head_dim(), full.v_head_dim());
    return Mha<T>(std::move(local), local_options(options, rank, P));
  }
};

/// Head-parallel MHA: HeadParallel over Mha.
template <class T>
using HeadParallelMha = HeadParallel<Mha, T>;

}  // namespace headmix::mpi
