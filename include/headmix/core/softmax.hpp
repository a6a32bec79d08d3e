// The mask + softmax stage, over each row of an attention tensor.
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/mask.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace headmix {

namespace detail {
/// exp(x) in float for the arguments a softmax takes, x <= 0 (scores less
/// their row's maximum): 1 at 0, NaN for NaN, and 0 below -87 (-inf, a
/// padded key, included), where exp is below FLT_MIN · 1.4.
/// x = m ln2 + r with m = rint(x / ln2), |r| <= ln2 / 2 (ln2 in two parts,
/// so r carries one rounding), exp(r) = 1 + r + r^2 q(r) with q of degree
/// 4 fitted for relative error (minimax), then 2^m applied exactly
/// (vscalefps, or the exponent bits: m >= -126 here).
/// Within 1.26 ulp of exp over every float in [-87, 0], where Eigen's exp
/// reaches 4.5 with AVX-512 (1.3 in SSE2 without FMA); 0.11 ns a value
/// against Eigen's 0.14 on the Zen 5 of docs/bench (SLEEF's 1-ulp expf16:
/// 0.20), which made forwards 1-3% faster (README, "Softmax"). Fast CPU
/// attention kernels take the same route (PyTorch's flash attention has its
/// own `exp_u20`).
/// Each step is the same operation in a packet's lanes as in the scalar
/// form (fused multiply-adds exactly where Eigen's packets fuse them), so a
/// value comes out the same bits wherever it falls in a row.
struct SoftmaxExp {
  static constexpr float kLowest = -87.0f;  ///< the smallest argument with a nonzero result

  template <class Packet>
  Packet packetOp(const Packet& x) const {
    Packet m;
    const Packet mantissa = exp_reduced(clamped(x), m);
    return times_pow2_or_zero(x, mantissa, m);
  }
  float operator()(float x) const {
    if (!(x >= kLowest)) return x < kLowest ? 0.0f : x;  // NaN stays NaN
    float m;
    const float mantissa = exp_reduced(x, m);
    // m capped so that the conversion stays defined for x > 0, outside the
    // domain: +inf (an infinite score) gives a NaN mantissa, as the packets do.
    return std::ldexp(mantissa, static_cast<int>(std::min(m, 128.0f)));
  }

 private:
  // exp(x) = mantissa · 2^m: returns the mantissa, sets m.
  template <class Packet>
  static Packet exp_reduced(const Packet& x, Packet& m) {
    using namespace Eigen::internal;
    m = print(pmul(x, pset1<Packet>(1.44269504088896341f)));
    Packet r = madd(m, pset1<Packet>(-0.693359375f), x);  // ln2's leading bits: m times them is exact
    r = madd(m, pset1<Packet>(2.12194440e-4f), r);        // the rest of ln2
    Packet q = madd(pset1<Packet>(1.381459838e-03f), r, pset1<Packet>(8.368716922e-03f));
    q = madd(q, r, pset1<Packet>(4.166838805e-02f));
    q = madd(q, r, pset1<Packet>(1.666652063e-01f));
    q = madd(q, r, pset1<Packet>(4.999999345e-01f));
    return madd(pmul(r, r), q, padd(r, pset1<Packet>(1.0f)));
  }
  // a · b + c, fused exactly when Eigen's packets fuse it.
  template <class Packet>
  static Packet madd(const Packet& a, const Packet& b, const Packet& c) {
    return Eigen::internal::pmadd(a, b, c);
  }
  static float madd(float a, float b, float c) {
#if defined EIGEN_VECTORIZE_FMA
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
  }
  // max(x, kLowest), NaN kept: Eigen leaves pmax's NaN operand open, so
  // x · 0 (NaN for NaN, and for -inf, which times_pow2_or_zero zeroes)
  // is added.
  template <class Packet>
  static Packet clamped(const Packet& x) {
    using namespace Eigen::internal;
    return madd(x, pzero(x), pmax(x, pset1<Packet>(kLowest)));
  }
  // mantissa · 2^m, or 0 where x < kLowest. The exponent bits hold 2^m
  // exactly for m >= -126, all a clamped argument gives.
  template <class Packet>
  static Packet times_pow2_or_zero(const Packet& x, const Packet& mantissa, const Packet& m) {
    using namespace Eigen::internal;
    using Bits = typename unpacket_traits<Packet>::integer_packet;
    const Bits biased = padd(pcast<Packet, Bits>(m), pset1<Bits>(127));
    const Packet scaled = pmul(mantissa, preinterpret<Packet>(plogical_shift_left<23>(biased)));
    return pselect(pcmp_lt(x, pset1<Packet>(kLowest)), pzero(x), scaled);
  }
#if defined EIGEN_VECTORIZE_AVX512
  // The same in AVX-512: vmaxps returns its second operand (x) for NaN;
  // vscalefps zeroes the lanes its compare mask drops. m is capped as in
  // the scalar form: Zen 5 returns +inf, not NaN, for vscalefps(NaN, +inf).
  static Eigen::internal::Packet16f clamped(const Eigen::internal::Packet16f& x) {
    return _mm512_max_ps(_mm512_set1_ps(kLowest), x);
  }
  static Eigen::internal::Packet16f times_pow2_or_zero(const Eigen::internal::Packet16f& x,
                                                       const Eigen::internal::Packet16f& mantissa,
                                                       const Eigen::internal::Packet16f& m) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kLowest), _CMP_NLT_UQ);  // NaN kept
    return _mm512_maskz_scalef_ps(keep, mantissa, _mm512_min_ps(m, _mm512_set1_ps(128.0f)));
  }
#endif
};
}  // namespace detail

/// exp of a softmax's shifted scores (each <= 0), elementwise: float
/// through detail::SoftmaxExp, double through Eigen's exp.
template <class Derived>
auto softmax_exp(const Eigen::ArrayBase<Derived>& x) {
  if constexpr (std::is_same_v<typename Derived::Scalar, float>)
    return x.unaryExpr(detail::SoftmaxExp{});
  else
    return x.exp();
}

/// Additive key bias for a tile's columns: -inf where the key is padded,
/// else 0. `padding` is one batch item's row of the key padding mask.
template <class T>
void key_padding_bias(const std::uint8_t* padding, Index first_key, Index cols, T* bias) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (Index c = 0; c < cols; ++c) bias[c] = padding[first_key + c] ? neg_inf : T(0);
}

namespace detail {
/// Zero the columns of tile row r that query `query` may not see (the tile
/// starts at key `first_key` of `num_keys`); return the ones it may see,
/// [lo, hi), before padding.
template <class T>
std::pair<Index, Index> zero_hidden_keys(Eigen::Map<Matrix<T>>& tile, Index r, Index query, Index first_key,
                                         Index num_keys, const PositionMask& mask) {
  const Index cols = tile.cols();
  auto [lo, hi] = mask.key_range(query, num_keys);
  lo = std::clamp<Index>(lo - first_key, 0, cols);
  hi = std::clamp<Index>(hi - first_key, lo, cols);
  tile.row(r).head(lo).setZero();
  tile.row(r).tail(cols - hi).setZero();
  return {lo, hi};
}
}  // namespace detail

/// Mask and softmax one head of a tile in place, row by row.
///
/// A row's visible keys are those of `mask.key_range` (relative to the
/// tile's columns) that `key_bias` (nullable, from key_padding_bias) leaves
/// finite. The row max is subtracted before exp, so logits of any finite
/// size are safe. Masked entries come out exactly 0, and a row with no
/// visible key comes out all zeros: its attention output is then zero, never
/// NaN.
template <class T>
void masked_softmax_head(Eigen::Map<Matrix<T>> scores, Index first_query, Index first_key, Index num_keys,
                         const PositionMask& mask, const T* key_bias) {
  for (Index r = 0; r < scores.rows(); ++r) {
    const auto [lo, hi] = detail::zero_hidden_keys(scores, r, first_query + r, first_key, num_keys, mask);
    auto seg = scores.row(r).array().segment(lo, hi - lo);
    const Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>> bias(key_bias ? key_bias + lo : nullptr, hi - lo);
    if (key_bias) seg += bias;
    const T m = hi > lo ? seg.maxCoeff() : -std::numeric_limits<T>::infinity();
    if (!(m > -std::numeric_limits<T>::infinity())) {  // nothing visible, or a NaN to pass on
      if (m != m) seg = std::numeric_limits<T>::quiet_NaN(); else seg.setZero();
      continue;
    }
    seg = softmax_exp(seg - m);
    // Eigen's exp (double) clamps its argument, so exp(-inf) is ~1e-308,
    // not 0: padded keys are zeroed explicitly.
    if (key_bias) seg = (bias == T(0)).select(seg, T(0));
    seg *= T(1) / seg.sum();
  }
}

/// Mask and softmax every head of a tile in place.
template <class T>
void masked_softmax(const AttentionTensor<T>& a, Index num_keys, const PositionMask& mask, const T* key_bias) {
  for (Index h = 0; h < a.heads(); ++h)
    masked_softmax_head<T>(a.head(h), a.first_query(), a.first_key(), num_keys, mask, key_bias);
}

}  // namespace headmix

namespace Eigen::internal {
template <>
struct functor_traits<headmix::detail::SoftmaxExp> {
  enum { Cost = 16 * NumTraits<float>::MulCost, PacketAccess = true };
};
}  // namespace Eigen::internal
