// What a layer call reads: the query-side and key-side sequences and the
// key padding mask, plus the checks every variant runs on them.
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/mask.hpp"
#include "headmix/core/types.hpp"

#include <string>

namespace headmix {

template <class T>
struct AttentionInput {
  ConstBatchView<T> query;  ///< [B, T, D]
  ConstBatchView<T> key;    ///< [B, S, Dkv]; empty for self-attention (key = query)
  KeyPadding key_padding;   ///< [B, S], 1 = padded; empty for none

  bool self_attention() const { return key.empty(); }
  const ConstBatchView<T>& keys() const { return key.empty() ? query : key; }
};

/// Check an input against a layer's widths. Every extent must be at least 1.
template <class T>
void check_input(const char* variant, const AttentionInput<T>& in, Index query_width, Index key_width) {
  const auto& q = in.query;
  if (q.data() == nullptr || q.batch() < 1 || q.length() < 1)
    detail::throw_shape(variant, "input.query", "[B >= 1, T >= 1, " + std::to_string(query_width) + "]",
                        detail::format_shape(q.shape()));
  check_shape(variant, "input.query", {-1, -1, query_width}, q.shape());
  if (in.self_attention()) {
    if (key_width != query_width)
      detail::throw_shape(variant, "input.key", "a key sequence of width " + std::to_string(key_width) +
                                                    " (self-attention needs key width == query width)",
                          "none");
  } else {
    const auto& k = in.key;
    if (k.length() < 1)
      detail::throw_shape(variant, "input.key", "[" + std::to_string(q.batch()) + ", S >= 1, " +
                                                    std::to_string(key_width) + "]",
                          detail::format_shape(k.shape()));
    check_shape(variant, "input.key", {q.batch(), -1, key_width}, k.shape());
  }
  if (!in.key_padding.empty())
    check_shape(variant, "input.key_padding_mask", {q.batch(), in.keys().length()},
                {in.key_padding.batch, in.key_padding.keys});
}

/// An output buffer must be [B, T, width].
template <class T>
void check_output(const char* variant, const BatchView<T>& out, Index B, Index T_, Index width) {
  if (out.data() == nullptr) detail::throw_shape(variant, "output", detail::format_shape({B, T_, width}), "no buffer");
  check_shape(variant, "output", {B, T_, width}, out.shape());
}

}  // namespace headmix
