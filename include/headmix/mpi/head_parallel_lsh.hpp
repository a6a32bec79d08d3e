// Head-parallel LSH attention over MPI: rank r of P holds heads
// [r·H/P, (r+1)·H/P): those rows of the shared query/key projection qk and
// of v, and those columns of o. H must be a multiple of P. The rotations
// (one shared rotation, given or drawn from options.seed) are the same for
// every head, so every rank holds or draws them whole and hashes exactly as
// one process does.
//
// Not sharded: rotations_per_head, whose rotation of head h is indexed by
// b·H + h over all heads (a rank would need its heads' offset): refused.
// LSH has no decoding step. See head_parallel.hpp for the call, the
// collectives and the errors.
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
    check_value(!o.rotations_per_head, kName, "rotations_per_head",
                "false (a head's own rotation is indexed over all heads: not sharded)", o.rotations_per_head);
  }

  static LshOptions local_options(LshOptions o, int P) {
    o.num_heads /= P;
    return o;
  }

  static void same_split(const LshOptions& now, const LshOptions& next) {
    check_value(next.num_heads == now.num_heads, kName, "num_heads",
                "the sharded layer's " + std::to_string(now.num_heads), next.num_heads);
    check_value(!next.rotations_per_head, kName, "rotations_per_head", "false (not sharded)", next.rotations_per_head);
  }

  static Lsh<T> slice(const Lsh<T>& full, const LshOptions& options, int rank, int P) {
    const LshWeights<T>& w = full.weights();
    const Index h = full.num_heads() / P, first = rank * h, dk = full.head_dim(), dv = full.v_head_dim();
    LshWeights<T> local;
    local.qk = detail::linear_rows(w.qk, first * dk, h * dk);
    local.v = detail::linear_rows(w.v, first * dv, h * dv);
    if (!w.o.empty()) local.o.weight = w.o.weight.middleCols(first * dv, h * dv);  // bias: after the sum
    local.rotations = w.rotations;                                                 // one rotation for every head
    return Lsh<T>(std::move(local), local_options(options, P));
  }
};

/// Head-parallel LSH attention: HeadParallel over Lsh.
template <class T>
using HeadParallelLsh = HeadParallel<Lsh, T>;

}  // namespace headmix::mpi
