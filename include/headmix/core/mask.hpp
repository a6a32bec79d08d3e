// Which keys a query may see: causal (with an offset), a sliding window,
// and a per-batch-item key padding mask.
#pragma once

#include "headmix/core/types.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace headmix {

/// Positional masking, the same for every head and batch item.
///
/// With `causal`, query i (0-based over the layer's queries) sees key j iff
/// `j <= i + causal_offset`. Offset 0 is the top-left alignment of
/// PyTorch's `triu(ones(T, S), 1)`, also when S != T. A decoder step of n
/// new queries over a cache of S keys uses offset S - n (bottom-right).
/// With `window > 0` (needs `causal`) query i also needs
/// `j > i + causal_offset - window`: W keys, itself included.
struct PositionMask {
  bool causal = false;
  Index causal_offset = 0;
  Index window = 0;

  /// Keys [lo, hi) that query i may see among S keys, before padding.
  /// Any offset is valid, down to the limits of Index: the sums saturate.
  std::pair<Index, Index> key_range(Index i, Index S) const {
    Index lo = 0, hi = S;
    if (causal) {
      const Index last = saturating_add(i, causal_offset);
      hi = std::clamp<Index>(saturating_add(last, 1), 0, S);
      if (window > 0) lo = std::clamp<Index>(saturating_add(last, 1 - window), 0, S);
    }
    return {lo, std::max(lo, hi)};
  }
  /// Keys [lo, hi) that any of the queries [first, first + n) may see.
  std::pair<Index, Index> block_range(Index first, Index n, Index S) const {
    if (n <= 0) return {0, 0};
    Index lo = key_range(first, S).first, hi = key_range(first + n - 1, S).second;
    return {lo, std::max(lo, hi)};
  }
  static Index saturating_add(Index a, Index b) {
    constexpr Index top = std::numeric_limits<Index>::max(), bottom = std::numeric_limits<Index>::min();
    if (b > 0 && a > top - b) return top;
    if (b < 0 && a < bottom - b) return bottom;
    return a + b;
  }

  /// Number of (query, key) pairs a dense [T, S] layer leaves visible.
  std::int64_t visible_pairs(Index T, Index S) const {
    std::int64_t n = 0;
    for (Index i = 0; i < T; ++i) {
      auto [lo, hi] = key_range(i, S);
      n += hi - lo;
    }
    return n;
  }
};

/// Key padding `[batch, keys]`, 1 (non-zero) = padded: no query sees that key.
/// Non-owning; empty means no padding.
struct KeyPadding {
  const std::uint8_t* data = nullptr;
  Index batch = 0;
  Index keys = 0;

  bool empty() const { return data == nullptr; }
  const std::uint8_t* item(Index b) const { return data ? data + b * keys : nullptr; }
};

}  // namespace headmix
