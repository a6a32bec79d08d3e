// Head-parallel LSH attention over MPI: rank r of P holds heads
// [r·H/P, (r+1)·H/P): those rows of the shared query/key projection qk and
// of v, and those columns of o. H must be a multiple of P. The rotations
// are replicated: one shared rotation, given or drawn from options.seed, is
// the same for every head; with rotations_per_head, head h of batch item b
// uses rotation b·H + h over all heads, so the local layer indexes them over
// the full layer's heads from its first (LshOptions::rotation_heads,
// rotation_head_offset): seeded, it draws just its heads' rotations; given
// ([B·H, ...]), every rank holds the whole tensor. Either way each rank
// hashes its heads exactly as one process does. LSH has no decoding step.
// See head_parallel.hpp for the call, the collectives and the errors.
#pragma once

#include "headmix/mpi/head_parallel.hpp"
#include "headmix/variants/lsh.hpp"

#include <string>

namespace headmix::mpi {

template <class T>
struct HeadShard<Lsh, T> {
  using Options = LshOptions;
  static constexpr const char* kName = "head-parallel lsh";

  static void check_split(const LshOptions& o, int P) {
    detail::check_multiple(kName, "num_heads", o.num_heads, P);
  }

  /// The rotations are replicated, read whole.
  static constexpr SplitTensor kSplit[] = {
      {"qk.weight", 0}, {"qk.bias", 0}, {"v.weight", 0}, {"v.bias", 0}, {"o.weight", 1}};

  /// The local heads keep the full layer's rotation indexing: they are heads
  /// [rank·H/P, (rank+1)·H/P) of it.
  static LshOptions local_options(LshOptions o, int rank, int P) {
    const Index h = o.num_heads / P;
    o.rotation_heads = o.rotation_heads > 0 ? o.rotation_heads : o.num_heads;
    o.rotation_head_offset += rank * h;
    o.num_heads = h;
    return o;
  }

  static void same_split(const LshOptions& now, const LshOptions& next) {
    check_value(next.num_heads == now.num_heads, kName, "num_heads",
                "the sharded layer's " + std::to_string(now.num_heads), next.num_heads);
    check_value(next.rotation_heads == now.rotation_heads, kName, "rotation_heads",
                "the sharded layer's " + std::to_string(now.rotation_heads), next.rotation_heads);
    check_value(next.rotation_head_offset == now.rotation_head_offset, kName, "rotation_head_offset",
                "the sharded layer's " + std::to_string(now.rotation_head_offset), next.rotation_head_offset);
  }

  static Lsh<T> slice(const Lsh<T>& full, const LshOptions& options, int rank, int P) {
    const LshWeights<T>& w = full.weights();
    const Index h = full.num_heads() / P, first = rank * h, dk = full.head_dim(), dv = full.v_head_dim();
    LshWeights<T> local;
    local.qk = detail::linear_rows(w.qk, first * dk, h * dk);
    local.v = detail::linear_rows(w.v, first * dv, h * dv);
    if (!w.o.empty()) local.o.weight = w.o.weight.middleCols(first * dv, h * dv);  // bias: after the sum
    local.rotations = w.rotations;  // replicated: see above
    return Lsh<T>(std::move(local), local_options(options, rank, P));
  }
};

/// Head-parallel LSH attention: HeadParallel over Lsh.
template <class T>
using HeadParallelLsh = HeadParallel<Lsh, T>;

}  // namespace headmix::mpi
