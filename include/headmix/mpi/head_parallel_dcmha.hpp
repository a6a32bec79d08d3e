// Head-parallel DCMHA over MPI, by whole head groups: Compose mixes heads
// only within a group (the reason DCFormer groups them), so rank r of P
// holds groups [r·G/P, (r+1)·G/P), their heads and the KV heads they read,
// and its slice of every per-group tensor (dc.dw1, dc.qkw, dc.dd and the
// static dc.pre_w / dc.post_w); the dynamic-weight MLP runs on the full
// input on every rank, each for its own groups. G and Hkv must be multiples
// of P. See head_parallel.hpp for the call, the collectives and the errors.
#pragma once

#include "headmix/mpi/head_parallel.hpp"
#include "headmix/variants/dcmha.hpp"

#include <algorithm>
#include <vector>

namespace headmix::mpi {

namespace detail {

/// Entries [first, first + n) along `axis` of `t`, the other axes whole.
template <class T>
Tensor<T> slice_axis(const Tensor<T>& t, std::size_t axis, Index first, Index n) {
  std::vector<Index> shape = t.shape();
  Index outer = 1, inner = 1;
  for (std::size_t a = 0; a < axis; ++a) outer *= shape[a];
  for (std::size_t a = axis + 1; a < shape.size(); ++a) inner *= shape[a];
  const Index extent = shape[axis];
  shape[axis] = n;
  Tensor<T> part(shape);
  for (Index o = 0; o < outer; ++o)
    std::copy_n(t.data() + (o * extent + first) * inner, n * inner, part.data() + o * n * inner);
  return part;
}

}  // namespace detail

template <class T>
struct HeadShard<Dcmha, T> {
  using Options = DcmhaOptions;
  static constexpr const char* kName = "head-parallel dcmha";

  static void check_split(const DcmhaOptions& o, int P) {
    detail::check_multiple(kName, "groups", o.groups, P, " (each rank holds whole head groups)");
    detail::check_multiple(kName, "num_kv_heads", detail::kv_heads_of(o.num_heads, o.num_kv_heads), P,
                           " (each rank holds whole KV heads)");
  }

  static constexpr SplitTensor kSplit[] = {
      {"q.weight", 0}, {"q.bias", 0}, {"k.weight", 0}, {"k.bias", 0}, {"v.weight", 0},   {"v.bias", 0},
      {"o.weight", 1}, {"dc.dw1", 1}, {"dc.qkw", 0},   {"dc.dd", 1},  {"dc.pre_w", 0}, {"dc.post_w", 0}};

  static DcmhaOptions local_options(DcmhaOptions o, int /*rank*/, int P) {
    o.num_kv_heads = detail::kv_heads_of(o.num_heads, o.num_kv_heads) / P;
    o.num_heads /= P;
    o.groups /= P;
    return o;
  }

  static void same_split(const DcmhaOptions& now, const DcmhaOptions& next) {
    check_value(next.num_heads == now.num_heads, kName, "num_heads",
                "the sharded layer's " + std::to_string(now.num_heads), next.num_heads);
    check_value(next.groups == now.groups, kName, "groups", "the sharded layer's " + std::to_string(now.groups),
                next.groups);
    const Index kv = detail::kv_heads_of(now.num_heads, now.num_kv_heads);
    check_value(detail::kv_heads_of(next.num_heads, next.num_kv_heads) == kv, kName, "num_kv_heads",
                "the sharded layer's " + std::to_string(kv), next.num_kv_heads);
  }

  static Dcmha<T> slice(const Dcmha<T>& full, const DcmhaOptions& options, int rank, int P) {
    const DcmhaWeights<T>& w = full.weights();
    DcmhaWeights<T> local;
    detail::slice_projections(w, local, rank, full.num_heads() / P, full.num_kv_heads() / P, full.head_dim(),
                              full.v_head_dim());
    const Index g = full.groups() / P, first = rank * g;
    local.dw1 = detail::slice_axis(w.dw1, 1, first, g);  // [D, G, 4, K]
    local.qkw = detail::slice_axis(w.qkw, 0, first, g);  // [G, 4, K, 2R, M]
    local.dd = detail::slice_axis(w.dd, 1, first, g);    // [D, G, 4·M]
    if (w.pre_w.rank() != 0) local.pre_w = detail::slice_axis(w.pre_w, 0, first, g);  // [G, M, M]
    if (w.post_w.rank() != 0) local.post_w = detail::slice_axis(w.post_w, 0, first, g);
    return Dcmha<T>(std::move(local), local_options(options, rank, P));
  }
};

/// Head-parallel DCMHA: HeadParallel over Dcmha, by whole head groups.
template <class T>
using HeadParallelDcmha = HeadParallel<Dcmha, T>;

}  // namespace headmix::mpi
