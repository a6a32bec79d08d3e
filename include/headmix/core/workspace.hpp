// Reusable scratch memory.
//
// Fresh large buffers cost a page fault per 4 KiB on first touch (hundreds
// of milliseconds for a long sequence), so a layer takes its scratch from a
// Workspace that the caller keeps across calls. Buffers only grow: once a
// workspace has seen the largest shape, later calls allocate nothing.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/types.hpp"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace headmix {

template <class T>
class Workspace {
 public:
  /// Slots shared by all threads of one call (projections, context).
  T* shared(std::size_t slot, Index count) { return grow(shared_, slot, count); }
  /// Make room for `workers` threads' private slots. Call before a
  /// parallel region: local() itself never resizes the list of workers.
  void reserve_workers(int workers) {
    if (static_cast<std::size_t>(workers) > local_.size()) local_.resize(static_cast<std::size_t>(workers));
  }
  /// Slots private to one worker thread (tiles, row scratch).
  T* local(int worker, std::size_t slot, Index count) {
    HEADMIX_ASSERT(static_cast<std::size_t>(worker) < local_.size());
    return grow(local_[static_cast<std::size_t>(worker)], slot, count);
  }
  /// Size slot `slot` of each of `workers` workers for `count` values, before
  /// a parallel region: which worker takes a task varies from call to call,
  /// so sizing only the ones that ran would let a later call allocate.
  void reserve_local(int workers, std::size_t slot, Index count) {
    reserve_workers(workers);
    for (int w = 0; w < workers; ++w) local(w, slot, count);
  }
  /// Grow every worker's slots to the largest any worker holds, after a
  /// parallel region whose tasks size their own scratch: the next call's
  /// tasks may land on other workers, and then find their slots sized.
  void even_out_workers() {
    std::size_t slots = 0;
    for (const auto& w : local_) slots = std::max(slots, w.size());
    for (std::size_t s = 0; s < slots; ++s) {
      Index widest = 0;
      for (const auto& w : local_)
        if (s < w.size()) widest = std::max(widest, static_cast<Index>(w[s].size()));
      for (auto& w : local_) grow(w, s, widest);
    }
  }
  MatrixMap<T> shared_matrix(std::size_t slot, Index rows, Index cols) {
    return MatrixMap<T>(shared(slot, rows * cols), rows, cols);
  }

  /// Bytes held right now.
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& b : shared_) n += static_cast<std::size_t>(b.size());
    for (const auto& slots : local_)
      for (const auto& b : slots) n += static_cast<std::size_t>(b.size());
    return n * sizeof(T);
  }
  /// Give all memory back.
  void release() {
    shared_.clear();
    local_.clear();
  }

 private:
  using Buffer = Eigen::Matrix<T, Eigen::Dynamic, 1>;

  static T* grow(std::vector<Buffer>& slots, std::size_t slot, Index count) {
    if (slot >= slots.size()) slots.resize(slot + 1);
    Buffer& b = slots[slot];
    if (b.size() < count) b.resize(count);
    return b.data();
  }

  std::vector<Buffer> shared_;
  std::vector<std::vector<Buffer>> local_;
};

/// Workspace slots. Shared slots below slot::variant belong to the
/// pipeline's callers (projections), per-worker slots below
/// slot::local_variant to the pipeline. A variant names its own in an enum
/// that starts at slot::variant (shared) or slot::local_variant (per worker).
namespace slot {
/// Shared: Q, K, V and the heads' context; K_hᵀ and V_h copied head-major
/// once per call (DotProductStages::packed); variants' own from `variant`.
enum : std::size_t { query = 0, key, value, context, packed_key, packed_value, variant = 8 };
/// Per worker: the pipeline's tile, padding bias and softmax statistics; a
/// bfloat16 cache's K and V blocks widened to T (DotProductStages).
enum : std::size_t { tile = 0, key_bias, row_stats, widened_key, widened_value, local_variant = 8 };
}  // namespace slot

}  // namespace headmix
