// The dense attention pipeline, shared by every dense variant:
//
//   score ──► pre-softmax mix ──► mask + softmax ──► post-softmax mix ──► readout
//
// It walks tasks of one batch item's block of query rows (for independent
// heads, of one group of heads as well), so scratch is
// O(heads · block_rows · S) per worker, never O(heads · T · S). A variant is
// a policy that fills in its own stages (see Mha::Policy in variants/mha.hpp,
// the smallest; DotProductStages in core/dot_product.hpp provides score and
// values for the variants whose scores are Q_a K_aᵀ):
//
//   Index score_heads(), softmax_heads(), value_heads(), value_dim();
//   void score(b, head, Eigen::Map<Matrix<T>> out, first_query, first_key, Workspace<T>&, worker);
//   values(b, head, first_key, count, Workspace<T>&, worker) -> [count, value_dim] row-major block
//
// A policy that mixes heads also declares which mixes a call runs, and
// either both mixes as stages of their own, each rewriting a tile in place
// (score heads into softmax heads, softmax heads into value heads; the
// tile's buffer holds max(score, softmax, value heads) planes):
//
//   bool has_pre_mix(), has_post_mix();
//   void pre_mix(b, const AttentionTensor<T>& tile, Workspace<T>&, worker);
//   void post_mix(b, const AttentionTensor<T>& tile, Workspace<T>&, worker);
//
// or one fused stage that rewrites the scores tile in place (its buffer
// holds max(score_heads, value_heads) planes) and returns the final weights:
//
//   AttentionTensor<T> mix_softmax(b, const AttentionTensor<T>& scores, num_keys, const PositionMask&,
//                                  const T* key_bias, Workspace<T>&, worker);
//
// A policy without has_pre_mix / has_post_mix has independent heads: the
// pipeline runs each head alone, over blocks of run.key_block keys with an
// online softmax (core/online_softmax.hpp), so its tile stays in cache at
// any length, and the mixing paths are not compiled for it. Such a policy
// may say which consecutive heads read the same K and V
// (kv_sharing_heads()) or the same K only (key_sharing_heads()); with
// score_group, a one-row block then scores them as one product. Mixing heads
// need every key of a row before the post-softmax mix: mix stages of their
// own run over chunks of keys in two sweeps (detail::mix_in_key_chunks),
// the fused stage over the block's whole tile.
//
// Projections happen before the pipeline (as GEMMs over all B·T rows) and
// the output projection after it.
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/gemm.hpp"
#include "headmix/core/mask.hpp"
#include "headmix/core/online_softmax.hpp"
#include "headmix/core/parallel.hpp"
#include "headmix/core/row_product.hpp"
#include "headmix/core/softmax.hpp"
#include "headmix/core/workspace.hpp"

#include <algorithm>
#include <type_traits>

namespace headmix {

/// Whether a policy provides the fused `mix_softmax` stage.
template <class P, class = void>
struct fuses_mix_softmax : std::false_type {};
template <class P>
struct fuses_mix_softmax<P, std::void_t<decltype(&P::mix_softmax)>> : std::true_type {};

/// Whether a policy mixes heads (declares has_pre_mix and has_post_mix).
template <class P, class = void>
struct mixes_heads : std::false_type {};
template <class P>
struct mixes_heads<P, std::void_t<decltype(&P::has_pre_mix), decltype(&P::has_post_mix)>> : std::true_type {};

/// How many consecutive heads read the same K and V (grouped-query
/// attention): a policy says so with kv_sharing_heads(); else 1.
template <class P, class = void>
struct has_kv_sharing : std::false_type {};
template <class P>
struct has_kv_sharing<P, std::void_t<decltype(&P::kv_sharing_heads)>> : std::true_type {};
template <class P>
Index kv_sharing_heads(const P& policy) {
  if constexpr (has_kv_sharing<P>::value) return policy.kv_sharing_heads();
  return 1;
}

/// How many consecutive heads read the same K (all of them in CollabHead,
/// whose keys are shared, while each head has its own V): a policy says so
/// with key_sharing_heads(); else kv_sharing_heads().
template <class P, class = void>
struct has_key_sharing : std::false_type {};
template <class P>
struct has_key_sharing<P, std::void_t<decltype(&P::key_sharing_heads)>> : std::true_type {};
template <class P>
Index key_sharing_heads(const P& policy) {
  if constexpr (has_key_sharing<P>::value) return policy.key_sharing_heads();
  return kv_sharing_heads(policy);
}

/// Whether a policy scores several K-sharing heads of one query at once
/// (DotProductStages::score_group).
template <class P, class = void>
struct stacks_heads : std::false_type {};
template <class P>
struct stacks_heads<P, std::void_t<decltype(&P::score_group)>> : std::true_type {};

/// How many heads a one-row block scores in one product over shared keys:
/// key_sharing_heads() for a policy that stacks heads, else 1.
template <class P>
Index stacked_key_group(const P& policy, Index heads) {
  if constexpr (stacks_heads<P>::value) return std::clamp<Index>(key_sharing_heads(policy), 1, std::max<Index>(1, heads));
  return 1;
}

/// What one call of the pipeline works on.
template <class T>
struct DenseRun {
  Index batch = 0, queries = 0, keys = 0;  ///< B, T, S
  PositionMask mask;
  KeyPadding padding;   ///< [B, S] or empty
  Index block_rows = 64;
  int threads = 1;
  T* context = nullptr;        ///< out: [B·T, value_heads·value_dim], row-major
  Tensor<T>* probs = nullptr;  ///< out, optional: resized to [B, value_heads, T, S], the final weights
  Index key_block = 1024;      ///< keys per online-softmax step when heads run alone
};

/// Keys per chunk when a policy mixes heads in stages of their own
/// (detail::mix_in_key_chunks): a chunk, heads · rows · 128 values (384
/// KiB at 12 heads, 64 rows, float), stays in L2 through each sweep.
/// Measured on DCMHA (D = 768, T = 1024 and 2048, paired): 128 ran 1-5%
/// faster than 64 (whose rows are too short for the softmax's per-row
/// work) and than 256; 32 ran ~15% slower. One query row (a decoding step)
/// takes all its keys as one chunk.
inline constexpr Index mix_chunk = 128;
inline Index mix_chunk_keys(Index rows, Index cols) {
  return rows == 1 ? std::max<Index>(1, cols) : std::clamp<Index>(cols, 1, mix_chunk);
}

/// Size every worker's tiles for blocks of up to `block_rows` queries over
/// up to `keys` keys ahead of time, so that a sequence of calls with growing
/// key counts (decoding steps over a cache) allocates nothing. `planes`: the
/// [rows, keys] planes a worker holds at once, 1 when heads run one at a
/// time, else max(score, softmax, value heads). `mix_stages`: the policy
/// mixes in stages of their own, run over chunks of keys. `key_block`
/// > 0: heads run alone over blocks of that many keys (the online softmax),
/// `group` of them at a time (key_sharing_heads).
template <class T>
void reserve_dense_tiles(Workspace<T>& ws, int threads, Index planes, bool mix_stages, Index block_rows,
                         Index keys, Index key_block = 0, Index group = 1) {
  const int workers = std::max(1, threads);
  ws.reserve_local(workers, slot::key_bias, keys);
  if (mix_stages) {  // the block's chunks, and per row: max, sum and the chunks' maxima
    const Index chunk = mix_chunk_keys(block_rows, keys), chunks = (std::max<Index>(1, keys) + chunk - 1) / chunk;
    ws.reserve_local(workers, slot::tile, planes * std::max(block_rows * chunks * chunk, keys));
    ws.reserve_local(workers, slot::row_stats, planes * std::max<Index>(block_rows * (2 + chunks), 3));
    return;
  }
  // Heads run alone over key blocks, except one query row (a step): all keys at once.
  const Index tile_keys = key_block > 0 ? std::min(keys, key_block) : keys, one_row = key_block > 0 ? group * keys : 0;
  ws.reserve_local(workers, slot::row_stats, 2 * block_rows * group);
  ws.reserve_local(workers, slot::tile, std::max(std::max(planes * block_rows, group) * tile_keys, one_row));
}

namespace detail {
/// Policies with their own readout product, multiply_values (DotProductStages:
/// a decoding step over a bfloat16 cache reads the stored values directly).
template <class P, class T, class = void>
struct multiplies_values : std::false_type {};
template <class P, class T>
struct multiplies_values<P, T,
                         std::void_t<decltype(std::declval<const P&>().multiply_values(
                             std::declval<const Eigen::Map<Matrix<T>>&>(), Index(), Index(), Index(),
                             std::declval<Eigen::Map<Matrix<T>>&>(), true, std::declval<Workspace<T>&>(), 0))>>
    : std::true_type {};

/// out (+)= weights · V_c[k0 .. k0 + weights.cols()) of batch item b.
template <class T, class Policy, class Weights, class Out>
void read_values(const Policy& policy, const Weights& weights, Index b, Index c, Index k0, Out&& out, bool accumulate,
                 Workspace<T>& ws, int w) {
  if constexpr (multiplies_values<Policy, T>::value)
    policy.multiply_values(weights, b, c, k0, std::forward<Out>(out), accumulate, ws, w);
  else
    multiply_rows(weights, policy.values(b, c, k0, weights.cols(), ws, w), out, accumulate);
}

/// One query row of heads [h_begin, h_end), `group` heads at a time stacked
/// as the rows of one tile: they share each K block, so a score block is one
/// product that reads K once, where one head at a time would make `group`
/// matrix-vector products each reading it. When they share V too
/// (`shared_values`), a readout block is one product as well; else each
/// row reads its own head's V. `context_row`: the query's [heads · dv] output,
/// which holds the group's outputs as a [group, dv] matrix; `probs`
/// (nullable): head 0's row of exported weights, `head_stride` apart per
/// head.
template <class T, class Policy>
void attend_stacked(const Policy& policy, Index b, Index q0, Index k0, Index k1, Index S, const PositionMask& mask,
                    const T* bias, Index key_block, Index group, bool shared_values, T* context_row, T* probs,
                    Index head_stride, Workspace<T>& ws, int w, Index h_begin, Index h_end) {
  const Index dv = policy.value_dim();
  T* buf = ws.local(w, slot::tile, group * key_block);
  OnlineSoftmax<T> softmax(ws.local(w, slot::row_stats, 2 * group), group);
  for (Index h0 = h_begin; h0 < h_end; h0 += group) {
    const Index n_heads = std::min(group, h_end - h0);
    auto tile = [&](Index kb) { return Eigen::Map<Matrix<T>>(buf, n_heads, std::min(key_block, k1 - kb)); };
    Eigen::Map<Matrix<T>> out(context_row + h0 * dv, n_heads, dv);
    out.setZero();
    softmax.start();
    for (Index kb = k0; kb < k1; kb += key_block) {
      auto t = tile(kb);
      policy.score_group(b, h0, n_heads, t, q0, kb, ws, w);
      softmax.absorb(t, q0, kb, S, mask, bias ? bias + (kb - k0) : nullptr, out, 0);
      if (shared_values)
        read_values(policy, t, b, h0, kb, out, true, ws, w);
      else
        for (Index i = 0; i < n_heads; ++i) read_values(policy, t.row(i), b, h0 + i, kb, out.row(i), true, ws, w);
    }
    softmax.finish(out);
    if (!probs) continue;
    for (Index i = 0; i < n_heads; ++i) std::fill_n(probs + (h0 + i) * head_stride, S, T(0));
    for (Index kb = k0; kb < k1; kb += key_block) {  // the weights again, from the final row statistics
      auto t = tile(kb);
      policy.score_group(b, h0, n_heads, t, q0, kb, ws, w);
      softmax.weights(t, q0, kb, S, mask, bias ? bias + (kb - k0) : nullptr, 0);
      for (Index i = 0; i < n_heads; ++i) std::copy_n(t.row(i).data(), t.cols(), probs + (h0 + i) * head_stride + kb);
    }
  }
}

/// Heads that mix in stages of their own, on one block of `rows` queries
/// from q0 and its keys [k0, k0 + cols), a chunk of keys at a time
/// (mix_chunk_keys), in two sweeps:
///  1. score every head, pre-mix, and turn each softmax head's logits into
///     exp(logit - m), m the row's running maximum (OnlineSoftmax::absorb),
///     keeping m after every chunk;
///  2. scale each chunk's exponentials to the final softmax
///     (OnlineSoftmax::rescale), post-mix them, and hand each value
///     head's weights to emit(head, weights, chunk's first column).
/// Each chunk is a tile of its own in one buffer, and every stage rewrites
/// it in place while it is in L2, so the block's traffic beyond L2 is each
/// chunk written once and read once (mixing into a second tile cost DCMHA
/// 1.03x the time on 1 thread and 1.11x on 2, T = 1024). Against the
/// two-pass softmax the weights differ by the online softmax's rounding
/// (core/online_softmax.hpp, with chunks for blocks) plus the one
/// rescaling multiply.
template <class T, class Policy, class Emit>
void mix_in_key_chunks(const Policy& policy, Index b, Index q0, Index rows, Index k0, Index cols, Index S,
                       const PositionMask& mask, const T* bias, Index tile_heads, Emit&& emit, Workspace<T>& ws,
                       int w) {
  const Index hs = policy.softmax_heads(), hv = policy.value_heads();
  const Index chunk = mix_chunk_keys(rows, cols), chunks = (std::max<Index>(1, cols) + chunk - 1) / chunk;
  const Index chunk_size = tile_heads * rows * chunk;
  T* kept = ws.local(w, slot::tile, chunks * chunk_size);  // chunk i at kept + i · chunk_size
  if (cols == 0) {  // no visible key: zero weights
    for (Index c = 0; c < hv; ++c) emit(c, Eigen::Map<Matrix<T>>(kept, rows, 0), 0);
    return;
  }
  T* stats = ws.local(w, slot::row_stats, hs * rows * (2 + chunks));
  T* chunk_max = stats + 2 * hs * rows;  // [chunk, head, row]: m after the chunk
  auto softmax_of = [&](Index h) { return OnlineSoftmax<T>(stats + 2 * rows * h, rows); };
  Eigen::Map<Matrix<T>> nothing_to_rescale(nullptr, rows, 0);
  auto tile = [&](Index i, Index heads) {
    const Index c0 = i * chunk;
    return AttentionTensor<T>(kept + i * chunk_size, heads, rows, std::min(chunk, cols - c0), q0, k0 + c0);
  };

  for (Index h = 0; h < hs; ++h) softmax_of(h).start();
  for (Index i = 0; i < chunks; ++i) {
    const Index c0 = i * chunk;
    const AttentionTensor<T> scores = tile(i, policy.score_heads()), logits = tile(i, hs);
    for (Index h = 0; h < scores.heads(); ++h) policy.score(b, h, scores.head(h), q0, k0 + c0, ws, w);
    if (policy.has_pre_mix()) policy.pre_mix(b, logits, ws, w);
    for (Index h = 0; h < hs; ++h) {
      auto softmax = softmax_of(h);
      softmax.absorb(logits.head(h), q0, k0 + c0, S, mask, bias ? bias + c0 : nullptr, nothing_to_rescale);
      for (Index r = 0; r < rows; ++r) chunk_max[(i * hs + h) * rows + r] = softmax.max(r);
    }
  }

  for (Index i = 0; i < chunks; ++i) {
    const AttentionTensor<T> probs = tile(i, hs), weights = tile(i, hv);
    for (Index h = 0; h < hs; ++h) softmax_of(h).rescale(probs.head(h), chunk_max + (i * hs + h) * rows);
    if (policy.has_post_mix()) policy.post_mix(b, weights, ws, w);
    for (Index c = 0; c < hv; ++c) emit(c, weights.head(c), i * chunk);
  }
}
}  // namespace detail

template <class T, class Policy>
void run_dense_pipeline(const Policy& policy, const DenseRun<T>& run, Workspace<T>& ws) {
  const Index T_ = run.queries, S = run.keys, block = std::max<Index>(1, run.block_rows);
  const Index blocks = (T_ + block - 1) / block;
  const Index hv = policy.value_heads(), dv = policy.value_dim();
  bool mixes = false;
  if constexpr (mixes_heads<Policy>::value) mixes = policy.has_pre_mix() || policy.has_post_mix();
  const Index tile_heads = std::max({policy.score_heads(), policy.softmax_heads(), hv});
  MatrixMap<T> context(run.context, run.batch * T_, hv * dv);
  T* probs = nullptr;
  if (run.probs) {
    run.probs->resize({run.batch, hv, T_, S});
    probs = run.probs->data();
  }
  // Every worker's scratch before the parallel region: a worker that ran no
  // task in one call must not allocate in the next.
  reserve_dense_tiles(ws, run.threads, mixes ? tile_heads : 1, mixes && !fuses_mix_softmax<Policy>::value,
                      std::min(block, T_), S, mixes ? 0 : std::max<Index>(1, run.key_block),
                      std::clamp<Index>(key_sharing_heads(policy), 1, std::max<Index>(1, hv)));

  // Independent heads run as tasks of their own, a group of heads that read
  // the same K and V (group_heads) over one block, every block of a group
  // before the next group: consecutive tasks then read the same K_h and V_h,
  // which stay in L2 at moderate lengths instead of being fetched again from
  // L3 for every block. Heads that mix share each block's tile: one task.
  // Blocks are handed out last first: under a causal mask a later block sees
  // more keys, and with the largest tasks taken first the threads finish
  // together, where a last large task would run alone at the end.
  const Index group_heads = std::clamp<Index>(kv_sharing_heads(policy), 1, std::max<Index>(1, hv));
  const Index head_tasks = mixes ? 1 : (hv + group_heads - 1) / group_heads;
  parallel_for(head_tasks * run.batch * blocks, run.threads, [&](Index task, int w) {
    const Index head_task = task / (run.batch * blocks), item_block = task % (run.batch * blocks);
    const Index b = item_block / blocks, q0 = (blocks - 1 - item_block % blocks) * block;
    const Index rows = std::min(block, T_ - q0);
    const auto keys = run.mask.block_range(q0, rows, S);  // keys no row of the block sees are skipped
    const Index k0 = keys.first, k1 = keys.second;
    const Index cols = k1 - k0;
    // A decoding step over shared keys scores the heads that share them in
    // one product: a grouped-query KV group in its own task (the groups
    // split over the threads); CollabHead's heads, which share K but not V,
    // all in the block's first task.
    const Index key_group = stacked_key_group(policy, hv);
    const bool stacked_step = !mixes && rows == 1 && key_group > 1, task_per_group = group_heads == key_group;
    if (stacked_step && !task_per_group && head_task > 0) return;
    const T* bias = nullptr;
    if (!run.padding.empty()) {
      T* buf = ws.local(w, slot::key_bias, cols);
      key_padding_bias(run.padding.item(b), k0, cols, buf);
      bias = buf;
    }

    // Readout of final head c from its weights on the tile's columns from
    // c0 on (added to the columns before), and the exported weights if asked for.
    auto emit = [&](Index c, const Eigen::Map<Matrix<T>>& weights, Index c0) {
      auto out = context.block(b * T_ + q0, c * dv, rows, dv);
      if (weights.cols() > 0)
        detail::read_values(policy, weights, b, c, k0 + c0, out, c0 > 0, ws, w);
      else if (c0 == 0)
        out.setZero();
      if (probs) {
        T* dst = probs + ((b * hv + c) * T_ + q0) * S;
        for (Index r = 0; r < rows; ++r, dst += S) {
          if (c0 == 0) std::fill(dst, dst + S, T(0));
          std::copy_n(weights.row(r).data(), weights.cols(), dst + k0 + c0);
        }
      }
    };

    if (!mixes) {  // heads are independent: each runs alone, over blocks of keys
      // One query row (a decoding step) takes its keys in one block, a row
      // of S scores: its products then stream each K_hᵀ row whole.
      const Index key_block = rows == 1 ? std::max<Index>(1, cols)
                                        : std::min(std::max<Index>(1, run.key_block), std::max<Index>(1, cols));
      T* buf = ws.local(w, slot::tile, rows * key_block);
      T* stats = ws.local(w, slot::row_stats, 2 * rows * group_heads);
      auto tile = [&](Index kb) { return Eigen::Map<Matrix<T>>(buf, rows, std::min(key_block, k1 - kb)); };
      auto out_of = [&](Index h) { return context.block(b * T_ + q0, h * dv, rows, dv); };
      if constexpr (stacks_heads<Policy>::value) {
        if (stacked_step) {
          detail::attend_stacked(policy, b, q0, k0, k1, S, run.mask, bias, key_block, key_group, task_per_group,
                                 &context(b * T_ + q0, 0),
                                 probs ? probs + (b * hv * T_ + q0) * S : nullptr, T_ * S, ws, w,
                                 task_per_group ? head_task * group_heads : 0,
                                 task_per_group ? std::min(hv, (head_task + 1) * group_heads) : hv);
          return;
        }
      }
      const Index h0 = head_task * group_heads, h1 = std::min(hv, h0 + group_heads);
      auto softmax_of = [&](Index h) { return OnlineSoftmax<T>(stats + 2 * rows * (h - h0), rows); };
      for (Index h = h0; h < h1; ++h) {
        out_of(h).setZero();
        softmax_of(h).start();
      }
      // Heads that read the same K and V take each block in turn while it
      // is in cache; each head's arithmetic is the same in any order.
      for (Index kb = k0; kb < k1; kb += key_block)
        for (Index h = h0; h < h1; ++h) {
          auto t = tile(kb);
          auto out = out_of(h);
          policy.score(b, h, t, q0, kb, ws, w);
          softmax_of(h).absorb(t, q0, kb, S, run.mask, bias ? bias + (kb - k0) : nullptr, out);
          detail::read_values(policy, t, b, h, kb, out, true, ws, w);
        }
      for (Index h = h0; h < h1; ++h) {
        auto out = out_of(h);
        softmax_of(h).finish(out);
        if (!probs) continue;
        T* dst = probs + ((b * hv + h) * T_ + q0) * S;
        std::fill(dst, dst + rows * S, T(0));
        for (Index kb = k0; kb < k1; kb += key_block) {  // the weights again, from the final row statistics
          auto t = tile(kb);
          policy.score(b, h, t, q0, kb, ws, w);
          softmax_of(h).weights(t, q0, kb, S, run.mask, bias ? bias + (kb - k0) : nullptr);
          for (Index r = 0; r < rows; ++r) std::copy_n(t.row(r).data(), t.cols(), dst + r * S + kb);
        }
      }
      return;
    }
    if constexpr (mixes_heads<Policy>::value) {
      if constexpr (fuses_mix_softmax<Policy>::value) {  // one pass over the block's tile, in place
        T* buf = ws.local(w, slot::tile, tile_heads * rows * cols);
        AttentionTensor<T> scores(buf, policy.score_heads(), rows, cols, q0, k0);
        for (Index h = 0; h < scores.heads(); ++h)
          if (cols > 0) policy.score(b, h, scores.head(h), q0, k0, ws, w);
        const AttentionTensor<T> weights = policy.mix_softmax(b, scores, S, run.mask, bias, ws, w);
        for (Index c = 0; c < hv; ++c) emit(c, weights.head(c), 0);
      } else {
        detail::mix_in_key_chunks(policy, b, q0, rows, k0, cols, S, run.mask, bias, tile_heads, emit, ws, w);
      }
    }
  });
}

}  // namespace headmix
