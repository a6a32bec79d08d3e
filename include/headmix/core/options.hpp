// The options every dense variant shares, with one validation, one mask and
// one choice of block size. A variant's own options derive from
// DenseOptions and add only their own fields:
//
//   struct MhaOptions : DenseOptions { Index num_heads = 1; Index num_kv_heads = 0; };
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/mask.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>

namespace headmix {

namespace detail {
/// The expected shape of a K/V weight in a shape_error: "[num_heads *
/// v_head_dim, D] with num_heads = 4", or in terms of num_kv_heads when the
/// options set it.
inline std::string heads_times(const std::string& rest, Index num_kv_heads, Index num_heads) {
  return num_kv_heads > 0 ? "[num_kv_heads * " + rest + "] with num_kv_heads = " + std::to_string(num_kv_heads)
                          : "[num_heads * " + rest + "] with num_heads = " + std::to_string(num_heads);
}
}  // namespace detail

struct DenseOptions {
  bool causal = false;
  Index causal_offset = 0;      ///< see PositionMask: query i sees keys j <= i + causal_offset
  Index window = 0;             ///< > 0 (needs causal): query i sees only its last `window` keys, itself included
  std::optional<double> scale;  ///< default: the variant's (1/sqrt(head_dim) unless it says otherwise)
  Index block_rows = 0;         ///< query rows per pipeline task; 0 = chosen from heads, keys and window
  Index key_block = 0;          ///< keys per online-softmax step where heads run alone; 0 = automatic
  int threads = 1;              ///< worker threads; results do not depend on it
  /// Round the projection weights (Q, K, V, output) to bfloat16 when the
  /// layer is built or this option is set, and let one-row products (a
  /// decoding step of one token) read them as bfloat16: half the weight
  /// bytes per token. Every product uses the rounded weights, so forward
  /// calls and steps still agree; against the float weights each projected
  /// value moves by at most 2^-8 · Σ_i |x_i · w_i| (README, "Half-precision
  /// weights"). Exact for weights stored in bfloat16. Turning it off keeps
  /// the rounded values.
  bool bfloat16_weights = false;

  /// The mask of a forward call.
  PositionMask mask() const { return {causal, causal_offset, window}; }
  /// The mask of a decoding step whose new queries follow `past` cached
  /// positions: bottom-right causal whatever `causal` says, same window.
  PositionMask step_mask(Index past) const { return {true, past, window}; }

  /// Query rows per pipeline task when up to `keys` keys are in view and
  /// `resident_heads` [rows, keys] tiles of `element_bytes` coexist (1 for
  /// variants whose heads run one at a time). GEMMs want many rows: each
  /// block packs every head's K and V again, about 1/rows of its GEMMs, and
  /// resident tiles of H · rows · S are past L2 at any useful row count once
  /// S passes a few hundred keys, so small blocks buy no cache residency
  /// (12 heads, S = 4096: 42 rows cost ~10% more than 64, 16 rows ~40%).
  /// So: 64 rows, fewer only once the tiles pass 32 MiB. A block computes
  /// every key of its window range, rows + window - 1 of them, so with a
  /// window the block is no taller than max(window, 16): cost
  /// O(T · max(window, 16)).
  Index rows_per_block(Index resident_heads, Index keys, std::size_t element_bytes) const {
    if (block_rows > 0) return block_rows;
    const Index cap = window > 0 ? std::clamp<Index>(window, 16, 64) : 64;
    if (resident_heads <= 1) return cap;
    const Index budget = (Index(32) << 20) / static_cast<Index>(element_bytes);
    return std::clamp<Index>(budget / std::max<Index>(1, resident_heads * keys), 16, cap);
  }

  /// Keys per online-softmax step (core/online_softmax.hpp): 1024 unless
  /// set. A [64, 1024] float tile is 256 KiB, and so are a head's K and V
  /// blocks: together they stay in a 1 MiB L2. Forward calls run as fast
  /// with 512 or 2048 (within 2%); a decoding step (D = 1024, 16 heads,
  /// S = 8192) took 4.3 ms with 512 and 3.0 ms with 1024.
  Index keys_per_block() const { return key_block > 0 ? key_block : 1024; }

  /// Throws shape_error naming `variant` and the offending option.
  void validate(const std::string& variant) const {
    check_value(block_rows >= 0, variant, "block_rows", ">= 0 (0 = automatic)", block_rows);
    check_value(key_block >= 0, variant, "key_block", ">= 0 (0 = automatic)", key_block);
    check_value(threads >= 1, variant, "threads", ">= 1", threads);
    check_value(window >= 0, variant, "window", ">= 0", window);
    check_value(window == 0 || causal, variant, "window", "0 unless causal (a window needs causal = true)", window);
    if (scale && !std::isfinite(*scale)) detail::throw_shape(variant, "scale", "a finite number", std::to_string(*scale));
  }
};

}  // namespace headmix
