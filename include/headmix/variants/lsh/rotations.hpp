// Random rotations for LSH hashing, from a seed, bit-identical on every
// platform and standard library.
//
// std::normal_distribution is out: its algorithm is implementation-defined
// (libstdc++, libc++ and MSVC draw different numbers from the same engine).
// So is std::log's last bit (libms differ in rare cases). Everything here
// is integer arithmetic, except a few IEEE-754 double operations that are
// correctly rounded by definition (int -> double conversion, *, /, sqrt) and
// that are never of the form a * b + c, so no compiler can contract them
// into an FMA with a different rounding. Needs IEEE double without x87
// excess precision (any x86-64, ARM64, ... build).
//
// The generator, fully specified so that it can be re-implemented:
//
//   mix64(z)        = SplitMix64's output function: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
//                     z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
//   SplitMix64(s)   : s += 0x9E3779B97F4A7C15; return mix64(s)
//   stream rho      : xoshiro256** whose four state words are the first four
//                     SplitMix64 outputs from s = seed ^ mix64(rho)
//   normal pairs    : Marsaglia's polar method on a = int32(next() >> 32),
//                     b = int32(next() >> 32): reject unless
//                     0 < a² + b² < 2^62 (exact in uint64); with
//                     s = (a² + b²) / 2^62 (one rounding) and ln s from the
//                     fixed-point logarithm below, f = sqrt(-2 ln s / s), and
//                     the two normals are (a / 2^31) f, (b / 2^31) f, in that order.
//   rotation rho    : dh · NH · NB/2 normals in that order, filling the
//                     row-major [dh, NH, NB/2] block of A[rho]; T = float
//                     rounds the double normals once.
//
// Rotation rho depends only on (seed, rho), so the rotation shared by all
// heads (rho = 0) and the per-(batch, head) rotations (rho = b·H + h) can be
// drawn independently, in any order, on any thread.
#pragma once

#include "headmix/core/types.hpp"

#include <cmath>
#include <cstdint>

namespace headmix {
namespace lsh_detail {

inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

class Xoshiro256ss {
 public:
  explicit Xoshiro256ss(std::uint64_t seed) {
    for (auto& w : s_) {
      seed += 0x9E3779B97F4A7C15ULL;  // SplitMix64
      w = mix64(seed);
    }
  }
  std::uint64_t next() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

/// ln(s / 2^62) for 0 < s < 2^62, to about 1e-17 absolute, in integer
/// arithmetic only (so the same bits everywhere). Writes s / 2^62 as
/// Y · 2^e with Y in [1, 2), then multiplies Y by factors (1 + 2^-k), each
/// at most once, while the product stays below 2 (shift-and-add, exact);
/// ln Y = ln 2 − Σ ln(1 + 2^-k) to within 2^-62.
inline double fixed_point_log(std::uint64_t s) {
  // round(ln(1 + 2^-k) · 2^62) for k = 1..30; for k > 30 it is 2^(62-k).
  static constexpr std::uint64_t kLn1p[30] = {
      0x19f323ecbf984bf3ULL, 0x0e47fbe3cd4d10d6ULL, 0x0789c1db8abcb97aULL, 0x03e14618022c54ccULL,
      0x01f829b0e7833005ULL, 0x00fe054587e01f1eULL, 0x007f80a9ac419e24ULL, 0x003fe01545621781ULL,
      0x001ff802a9ab10e6ULL, 0x000ffe0055455888ULL, 0x0007ff800aa9aac4ULL, 0x0003ffe001554556ULL,
      0x0001fff8002aa9abULL, 0x0000fffe00055545ULL, 0x00007fff8000aaaaULL, 0x00003fffe0001555ULL,
      0x00001ffff80002abULL, 0x00000ffffe000055ULL, 0x000007ffff80000bULL, 0x000003ffffe00001ULL,
      0x000001fffff80000ULL, 0x000000fffffe0000ULL, 0x0000007fffff8000ULL, 0x0000003fffffe000ULL,
      0x0000001ffffff800ULL, 0x0000000ffffffe00ULL, 0x00000007ffffff80ULL, 0x00000003ffffffe0ULL,
      0x00000001fffffff8ULL, 0x00000000fffffffeULL};
  constexpr std::uint64_t kLn2Q62 = 0x2c5c85fdf473de6bULL;  // round(ln 2 · 2^62)
  constexpr std::int64_t kLn2Q56 = 0xb17217f7d1cf7aLL;      // round(ln 2 · 2^56)
  constexpr std::uint64_t kTwo = 1ULL << 63;                 // 2.0 in Q62

  int msb = 61;
  while (!(s >> msb)) --msb;
  std::uint64_t y = s << (62 - msb);  // Y in [1, 2) as Q62
  std::uint64_t acc = 0;              // Σ ln(1 + 2^-k), Q62
  for (int k = 1; k <= 62; ++k) {
    const std::uint64_t t = y + (y >> k);
    if (t < kTwo) {
      y = t;
      acc += k <= 30 ? kLn1p[k - 1] : (1ULL << (62 - k));
    }
  }
  // ln(s / 2^62) = (ln 2 − acc) + (msb − 62) ln 2, summed in Q56 (fits int64).
  // ln 2 − acc is signed: rounding of the table can leave it a few units
  // below zero when Y is a power of two.
  const std::int64_t frac = static_cast<std::int64_t>(kLn2Q62) - static_cast<std::int64_t>(acc);
  const std::int64_t total = frac / 64 + (msb - 62) * kLn2Q56;
  return static_cast<double>(total) * 0x1p-56;
}

/// Standard normal deviates of one stream (see the file comment).
class NormalStream {
 public:
  NormalStream(std::uint64_t seed, std::uint64_t rho) : rng_(seed ^ mix64(rho)) {}

  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    for (;;) {
      const std::int64_t a = static_cast<std::int32_t>(static_cast<std::uint32_t>(rng_.next() >> 32));
      const std::int64_t b = static_cast<std::int32_t>(static_cast<std::uint32_t>(rng_.next() >> 32));
      const std::uint64_t s = static_cast<std::uint64_t>(a * a) + static_cast<std::uint64_t>(b * b);
      if (s == 0 || s >= (1ULL << 62)) continue;
      const double sd = static_cast<double>(s) * 0x1p-62;
      const double f = std::sqrt((-2.0 * fixed_point_log(s)) / sd);
      spare_ = (static_cast<double>(b) * 0x1p-31) * f;
      has_spare_ = true;
      return (static_cast<double>(a) * 0x1p-31) * f;
    }
  }

 private:
  Xoshiro256ss rng_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace lsh_detail

/// Fill `out[0 .. count)` with rotation `rho` of `seed` (row-major
/// [dh, NH, NB/2], count = dh · NH · NB/2): standard normal deviates, the
/// same bits on every platform.
template <class T>
void lsh_rotation(std::uint64_t seed, Index rho, Index count, T* out) {
  lsh_detail::NormalStream normals(seed, static_cast<std::uint64_t>(rho));
  for (Index i = 0; i < count; ++i) out[i] = static_cast<T>(normals.next());
}

/// The rotations tensor [R, dh, NH, NB/2] a seeded layer uses: R = 1 for
/// one rotation shared by every head, R = B·H for one per (batch, head).
template <class T>
Tensor<T> lsh_rotations(std::uint64_t seed, Index R, Index head_dim, Index n_hashes, Index n_buckets) {
  Tensor<T> rot({R, head_dim, n_hashes, n_buckets / 2});
  const Index per = head_dim * n_hashes * (n_buckets / 2);
  for (Index rho = 0; rho < R; ++rho) lsh_rotation<T>(seed, rho, per, rot.data() + rho * per);
  return rot;
}

}  // namespace headmix
