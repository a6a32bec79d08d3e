// Reading and writing safetensors files (the Hugging Face weight format).
//
// Layout: an 8-byte little-endian u64 N, then N bytes of JSON header, then the
// data buffer. The header maps each tensor name to
//   {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// (offsets relative to the data buffer) plus an optional "__metadata__" object
// of string values.
//
// The reader is meant for files from the internet. Every malformation is an
// io_error: sizes are checked before any allocation or copy, so a lying header
// can neither read out of bounds nor make a tensor allocate more bytes than
// the input actually holds. Besides the tensors, memory goes to the parsed
// header, whose text is capped at 100 MB; it is checked while it is parsed
// (no JSON tree), so it costs a few times its text at most. Stricter than the
// Rust reference implementation: duplicate JSON keys are rejected (two
// readers could otherwise disagree on which tensor a name means), so are
// unknown fields in a tensor entry (they could change what the bytes mean)
// and shapes of more than 1024 extents; a shape's non-zero extents must
// multiply to a byte count that fits in 63 bits even when another extent is
// 0; and a file is only accepted if the writer can write it back (its
// header, tensors in name order, also fits in 100 MB). Gaps between tensors
// in the data buffer are tolerated; overlapping tensors are not.
//
// Data is copied with memcpy, so the host must be little-endian, like every
// platform headmix targets (checked at compile time where the compiler says).
// Tensor<bool> is not usable (std::vector<bool>), so BOOL tensors are read as
// uint8_t or any other arithmetic type (false -> 0, true -> 1).
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/types.hpp"
#include "headmix/io/io_error.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "headmix/io/safetensors.hpp copies little-endian tensor data with memcpy: big-endian hosts are not "
              "supported");
#endif

namespace headmix::io {

/// The element types headmix reads and writes (a subset of safetensors').
enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: return 1;
  }
  throw io_error("safetensors: invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

/// The dtype's name as spelled in safetensors headers.
inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  throw io_error("safetensors: invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

namespace detail {

/// Quote a name from a file for an error message, cut short: a hostile
/// header can hold a name of megabytes.
inline std::string quote_name(const std::string& text) {
  constexpr std::size_t kShown = 80;
  if (text.size() <= kShown) return "'" + text + "'";
  return "'" + text.substr(0, kShown) + "...' (" + std::to_string(text.size()) + " bytes)";
}

[[noreturn]] inline void fail(const std::string& what) { throw io_error("safetensors: " + what); }

inline bool dtype_from_name(const std::string& name, DType& out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"I64", DType::I64},
      {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},   {"U8", DType::U8},     {"BOOL", DType::BOOL}};
  for (const auto& [spelling, dtype] : kNames) {
    if (name == spelling) {
      out = dtype;
      return true;
    }
  }
  return false;
}

inline std::string unsupported_dtype(const std::string& name) {
  return "unsupported dtype " + quote_name(name) + " (headmix reads F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)";
}

}  // namespace detail

/// Throws io_error, naming the dtype, when it is not one of DType's names.
inline DType parse_dtype(const std::string& name) {
  DType dtype;
  if (!detail::dtype_from_name(name, dtype)) detail::fail(detail::unsupported_dtype(name));
  return dtype;
}

/// One tensor as stored: its dtype, shape and little-endian bytes.
struct StoredTensor {
  DType dtype = DType::F64;
  std::vector<Index> shape;
  std::vector<unsigned char> bytes;  ///< little-endian raw data, size == numel() * dtype_size(dtype)

  /// Element count; io_error if an extent is negative or the byte size would
  /// overflow (see the file comment).
  Index numel() const;
  /// Every element converted to T: floats exactly (F16/BF16 included), then
  /// rounded if T is narrower; integers must fit T, and floats are truncated
  /// toward zero when T is an integer, else io_error.
  template <class T>
  headmix::Tensor<T> as() const;
  /// `t` stored as `stored` (by default the dtype matching T, F64 for other
  /// floating types). F16/BF16 round to nearest, ties to even; integer
  /// dtypes take the value truncated toward zero and throw io_error when it
  /// does not fit; BOOL stores value != 0.
  template <class T>
  static StoredTensor from(const headmix::Tensor<T>& t, DType stored = natural_dtype<T>());

  /// The dtype `from` picks for T by default.
  template <class T>
  static constexpr DType natural_dtype() {
    static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, "safetensors elements are numbers");
    if constexpr (std::is_floating_point_v<T>) {
      return sizeof(T) == 4 ? DType::F32 : DType::F64;
    } else if constexpr (std::is_signed_v<T>) {
      return sizeof(T) == 1 ? DType::I8 : sizeof(T) == 2 ? DType::I16 : sizeof(T) == 4 ? DType::I32 : DType::I64;
    } else {
      // No unsigned types wider than U8 here: the next signed one holds every value.
      return sizeof(T) == 1 ? DType::U8 : sizeof(T) == 2 ? DType::I32 : DType::I64;
    }
  }
};

/// Where a tensor lies in a file: its dtype, shape and byte range in the
/// data buffer (checked against each other when the header is read).
struct TensorInfo {
  DType dtype = DType::F64;
  std::vector<Index> shape;
  std::uint64_t begin = 0, end = 0;
};

/// The tensors and metadata of one file, by name.
struct TensorFile {
  std::map<std::string, StoredTensor> tensors;
  std::map<std::string, std::string> metadata;  ///< "__metadata__"

  bool contains(const std::string& name) const { return tensors.count(name) != 0; }
  /// io_error "missing tensor 'name'" when absent.
  const StoredTensor& at(const std::string& name) const {
    const auto found = tensors.find(name);
    if (found == tensors.end()) throw io_error("missing tensor " + detail::quote_name(name));
    return found->second;
  }
  const std::vector<Index>& shape(const std::string& name) const { return at(name).shape; }
  template <class T>
  headmix::Tensor<T> get(const std::string& name) const;
  /// A rank-2 tensor as a row-major [rows, cols] matrix; shape_error otherwise.
  template <class T>
  headmix::Matrix<T> matrix(const std::string& name) const;
  /// A rank-1 tensor as a vector; shape_error otherwise.
  template <class T>
  headmix::Vector<T> vector(const std::string& name) const;
  /// The same, decoding only `part` (shape_error if it is outside the tensor).
  template <class T>
  headmix::Tensor<T> get(const std::string& name, const headmix::AxisSlice& part) const;
  template <class T>
  headmix::Matrix<T> matrix(const std::string& name, const headmix::AxisSlice& part) const;
  template <class T>
  headmix::Vector<T> vector(const std::string& name, const headmix::AxisSlice& part) const;
  /// Insert or replace; io_error if the name is "__metadata__" or the bytes
  /// do not match dtype and shape.
  void put(const std::string& name, StoredTensor t);

 private:
  /// `part` (nullptr: all) of tensor `name` of rank `rank` (0: any) as Result.
  template <class Result>
  Result read(const std::string& name, std::size_t rank, const headmix::AxisSlice* part) const;
};

namespace detail {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // as in the Rust reference reader
/// Extents a shape may have: far above any real tensor's rank, and it keeps
/// a hostile "shape": [0, 0, ...] of millions of zeros from costing gigabytes.
constexpr std::size_t kMaxTensorRank = 1024;

/// Element count of a shape, checked so that (product of non-zero extents) *
/// element_size fits in an Index: then no partial product of the extents,
/// taken in any order (Tensor::count multiplies left to right), overflows.
inline Index checked_numel(const std::vector<Index>& shape, DType dtype, const std::string& context) {
  const auto max_bytes = static_cast<std::uint64_t>(
      std::min<std::uintmax_t>(std::numeric_limits<Index>::max(), std::numeric_limits<std::size_t>::max()));
  const std::uint64_t max_count = max_bytes / dtype_size(dtype);
  if (shape.size() > kMaxTensorRank)
    fail(context + ": shape has " + std::to_string(shape.size()) + " extents, more than " +
         std::to_string(kMaxTensorRank));
  std::uint64_t product = 1;
  bool has_zero = false;
  for (const Index extent : shape) {
    if (extent < 0) fail(context + ": shape " + headmix::detail::format_shape(shape) + " has a negative extent");
    if (extent == 0) {
      has_zero = true;
      continue;
    }
    const auto e = static_cast<std::uint64_t>(extent);
    if (product > max_count / e)
      fail(context + ": shape " + headmix::detail::format_shape(shape) + " of " + dtype_name(dtype) +
           " elements is too large (its byte size overflows)");
    product *= e;
  }
  return has_zero ? 0 : static_cast<Index>(product);
}

/// The stored bytes must be exactly numel * dtype_size.
inline void check_consistent(const StoredTensor& t, const std::string& context) {
  const auto expected = static_cast<std::uint64_t>(checked_numel(t.shape, t.dtype, context)) * dtype_size(t.dtype);
  if (t.bytes.size() != expected)
    fail(context + ": holds " + std::to_string(t.bytes.size()) + " bytes, but shape " +
         headmix::detail::format_shape(t.shape) + " of " + dtype_name(t.dtype) + " needs " + std::to_string(expected));
}

inline std::string tensor_context(const std::string& name) { return "tensor " + quote_name(name); }

// ---- F16 / BF16 ------------------------------------------------------------

/// IEEE binary16 bits to float, exactly (every half is a float): subnormals
/// are renormalised, infinities kept, NaN payloads kept.
inline float f16_bits_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1Fu;
  std::uint32_t fraction = half & 0x3FFu;
  std::uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (fraction << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + (127 - 15)) << 23) | (fraction << 13);
  } else if (fraction == 0) {
    bits = sign;
  } else {
    // fraction * 2^-24: shift the leading 1 up to the implicit-bit position.
    std::uint32_t float_exponent = 127 - 14;
    while ((fraction & 0x400u) == 0) {
      fraction <<= 1;
      --float_exponent;
    }
    bits = sign | (float_exponent << 23) | ((fraction & 0x3FFu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

/// bfloat16 bits to float, exactly: bfloat16 is the top half of a float.
inline float bf16_bits_to_float(std::uint16_t bf16) {
  const std::uint32_t bits = static_cast<std::uint32_t>(bf16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

/// Round a positive number (magnitude + f) * 2^exponent, 0 <= f < 1 and f > 0
/// exactly when `sticky`, to a binary format with `exponent_bits` and
/// `fraction_bits` (IEEE-style: bias, subnormals, inf) to nearest, ties to
/// even, and return its bits without the sign. Every source type reduces to
/// this exactly (see small_float_bits), so nothing is rounded twice.
inline std::uint16_t round_to_small_float(std::uint64_t magnitude, int exponent, bool sticky, int exponent_bits,
                                          int fraction_bits) {
  const auto infinity = static_cast<std::uint16_t>(((1u << exponent_bits) - 1) << fraction_bits);
  // Normalise so that bit 63 is the leading 1: then the rounding point is
  // always inside `magnitude` and `sticky` only breaks ties.
  while ((magnitude >> 63) == 0) {
    magnitude <<= 1;
    --exponent;
  }
  const int value_exponent = exponent + 63;  // value in [2^value_exponent, 2^(value_exponent + 1))
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int min_exponent = 1 - bias;
  // Below min_exponent the target's quantum stays 2^(min_exponent - fraction_bits): subnormals.
  int target_exponent = std::max(value_exponent, min_exponent);
  const int shift = target_exponent - fraction_bits - exponent;  // >= 63 - fraction_bits > 0
  std::uint64_t quanta, remainder, half;
  if (shift > 64) return 0;  // below half the smallest subnormal
  if (shift == 64) {
    quanta = 0;
    remainder = magnitude;
    half = std::uint64_t{1} << 63;
  } else {
    quanta = magnitude >> shift;
    remainder = magnitude & ((std::uint64_t{1} << shift) - 1);
    half = std::uint64_t{1} << (shift - 1);
  }
  if (remainder > half || (remainder == half && (sticky || (quanta & 1)))) ++quanta;
  if (quanta >> (fraction_bits + 1)) {  // rounded up into the next binade
    quanta >>= 1;
    ++target_exponent;
  }
  const std::uint64_t implicit_bit = std::uint64_t{1} << fraction_bits;
  if (quanta < implicit_bit) return static_cast<std::uint16_t>(quanta);  // subnormal (or zero)
  const int biased_exponent = target_exponent + bias;
  if (biased_exponent >= (1 << exponent_bits) - 1) return infinity;
  return static_cast<std::uint16_t>((static_cast<std::uint64_t>(biased_exponent) << fraction_bits) |
                                    (quanta - implicit_bit));
}

/// `value` (any arithmetic type) as F16 (5, 10) or BF16 (8, 7) bits, rounded
/// once, to nearest, ties to even, from the exact value: an int64 or a long
/// double is not first rounded to double.
template <class V>
std::uint16_t small_float_bits(V value, int exponent_bits, int fraction_bits) {
  const auto sign_bit = static_cast<std::uint16_t>(1u << (exponent_bits + fraction_bits));
  if constexpr (std::is_floating_point_v<V>) {
    const std::uint16_t sign = std::signbit(value) ? sign_bit : 0;
    const auto infinity = static_cast<std::uint16_t>(((1u << exponent_bits) - 1) << fraction_bits);
    if (std::isnan(value)) return static_cast<std::uint16_t>(sign | infinity | (1u << (fraction_bits - 1)));
    if (std::isinf(value)) return static_cast<std::uint16_t>(sign | infinity);
    if (value == 0) return sign;
    int exponent = 0;
    // |value| = m * 2^exponent with m in [0.5, 1): the top 64 bits of m are
    // an integer, and whatever is left below them only sets `sticky`.
    const V scaled = std::ldexp(std::frexp(std::fabs(value), &exponent), 64);
    const V whole = std::floor(scaled);
    const auto magnitude = static_cast<std::uint64_t>(whole);
    return static_cast<std::uint16_t>(
        sign | round_to_small_float(magnitude, exponent - 64, scaled != whole, exponent_bits, fraction_bits));
  } else {
    if (value == 0) return 0;
    bool negative = false;
    if constexpr (std::is_signed_v<V>) negative = value < 0;
    // Two's complement: the magnitude of the most negative value still fits in 64 bits.
    const auto magnitude = negative ? std::uint64_t{0} - static_cast<std::uint64_t>(value)
                                    : static_cast<std::uint64_t>(value);
    return static_cast<std::uint16_t>((negative ? sign_bit : 0) |
                                      round_to_small_float(magnitude, 0, false, exponent_bits, fraction_bits));
  }
}

inline std::uint16_t double_to_f16_bits(double value) { return small_float_bits(value, 5, 10); }
inline std::uint16_t double_to_bf16_bits(double value) { return small_float_bits(value, 8, 7); }

// ---- element conversion ----------------------------------------------------

/// Does integer `value` fit integer type To? (Compares through the widest
/// types, so no sign-conversion surprises.)
template <class To, class From>
bool integer_fits(From value) {
  using Limits = std::numeric_limits<To>;
  if constexpr (std::is_signed_v<From>) {
    const auto wide = static_cast<std::intmax_t>(value);
    if (wide < 0) return std::is_signed_v<To> && wide >= static_cast<std::intmax_t>(Limits::min());
    return static_cast<std::uintmax_t>(wide) <= static_cast<std::uintmax_t>(Limits::max());
  } else {
    return static_cast<std::uintmax_t>(value) <= static_cast<std::uintmax_t>(Limits::max());
  }
}

/// Convert one element; false when the value has no To (a NaN, an
/// out-of-range value or integer), where a plain cast would be undefined.
template <class To, class From>
bool convert_scalar(From value, To& out) {
  if constexpr (std::is_floating_point_v<To>) {
    // IEEE: a finite value beyond To's range rounds to inf, which is defined.
    out = static_cast<To>(value);
    return true;
  } else if constexpr (std::is_floating_point_v<From>) {
    using Wide = std::common_type_t<From, double>;
    const Wide truncated = std::trunc(static_cast<Wide>(value));
    const Wide limit = std::ldexp(Wide(1), std::numeric_limits<To>::digits);  // one past To's max, exact
    const Wide lowest = std::is_signed_v<To> ? -limit : Wide(0);
    if (!(truncated >= lowest && truncated < limit)) return false;  // also false for NaN
    out = static_cast<To>(truncated);
    return true;
  } else {
    if (!integer_fits<To>(value)) return false;
    out = static_cast<To>(value);
    return true;
  }
}

template <class T>
std::string type_description() {
  if constexpr (std::is_floating_point_v<T>) return std::to_string(sizeof(T) * 8) + "-bit float";
  else return std::string(std::is_signed_v<T> ? "int" : "uint") + std::to_string(sizeof(T) * 8);
}

template <class V>
std::string value_text(V value) {
  std::ostringstream text;
  text.precision(17);
  text << +value;  // + prints 8-bit integers as numbers
  return text.str();
}

template <class To, class From>
void convert_or_fail(From value, To& out, Index element, const std::string& context) {
  if (!convert_scalar(value, out))
    fail(context + ": element " + std::to_string(element) + " (" + value_text(value) + ") does not fit " +
         type_description<To>());
}

template <class Stored, class T>
void decode_elements(const unsigned char* source, Index count, T* out, const std::string& context) {
  for (Index i = 0; i < count; ++i) {
    Stored value;
    std::memcpy(&value, source + static_cast<std::size_t>(i) * sizeof(Stored), sizeof(Stored));
    convert_or_fail(value, out[i], i, context);
  }
}

template <class T, class Decode>
void decode_small_floats(const unsigned char* source, Index count, T* out, Decode decode, const std::string& context) {
  for (Index i = 0; i < count; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, source + static_cast<std::size_t>(i) * 2, 2);
    convert_or_fail(decode(bits), out[i], i, context);
  }
}

/// Convert `count` elements stored as `dtype` at `source` into `out`.
template <class T>
void decode_range(DType dtype, const unsigned char* source, Index count, T* out, const std::string& context) {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>,
                "read tensors as an arithmetic type other than bool (Tensor<bool> is std::vector<bool>)");
  switch (dtype) {
    case DType::F64: return decode_elements<double>(source, count, out, context);
    case DType::F32: return decode_elements<float>(source, count, out, context);
    case DType::F16: return decode_small_floats(source, count, out, f16_bits_to_float, context);
    case DType::BF16: return decode_small_floats(source, count, out, bf16_bits_to_float, context);
    case DType::I64: return decode_elements<std::int64_t>(source, count, out, context);
    case DType::I32: return decode_elements<std::int32_t>(source, count, out, context);
    case DType::I16: return decode_elements<std::int16_t>(source, count, out, context);
    case DType::I8: return decode_elements<std::int8_t>(source, count, out, context);
    case DType::U8: return decode_elements<std::uint8_t>(source, count, out, context);
    case DType::BOOL:
      // Any non-zero byte is true; reading the byte as a bool would be UB.
      for (Index i = 0; i < count; ++i) out[i] = source[i] != 0 ? T(1) : T(0);
      return;
  }
}

/// Convert every element of `t` into `out` (numel elements). The caller has
/// run check_consistent, which it needs before sizing `out` anyway.
template <class T>
void decode_into(const StoredTensor& t, T* out, const std::string& context) {
  decode_range(t.dtype, t.bytes.data(), t.numel(), out, context);
}

/// Where an AxisSlice lies in a row-major tensor: `runs` contiguous runs of
/// `run` elements, run i starting at element `start + i·stride`.
struct SliceLayout {
  std::vector<Index> shape;  ///< the slice's own shape
  Index runs = 0, run = 0, start = 0, stride = 0;
};

/// The layout of `part` of a tensor `name` of `shape`; shape_error when the
/// axis or the range is not in the tensor. The tensor's own size is checked.
inline SliceLayout slice_layout(const std::string& name, const std::vector<Index>& shape, DType dtype,
                                const headmix::AxisSlice* part) {
  const Index numel = checked_numel(shape, dtype, tensor_context(name));
  SliceLayout layout;
  layout.shape = shape;
  if (part == nullptr) {  // the whole tensor: one run
    layout.runs = numel == 0 ? 0 : 1;
    layout.run = numel;
    return layout;
  }
  const bool inside = part->axis < shape.size() && part->first >= 0 && part->count >= 0 &&
                      part->first <= shape[part->axis] - part->count;
  if (!inside)
    headmix::detail::throw_shape("io", name,
                                 "a tensor whose axis " + std::to_string(part->axis) + " holds entries [" +
                                     std::to_string(part->first) + ", " + std::to_string(part->first + part->count) +
                                     ")",
                                 headmix::detail::format_shape(shape));
  layout.shape[part->axis] = part->count;
  Index outer = 1, inner = 1;
  for (std::size_t a = 0; a < part->axis; ++a) outer *= shape[a];
  for (std::size_t a = part->axis + 1; a < shape.size(); ++a) inner *= shape[a];
  layout.runs = part->count == 0 || inner == 0 ? 0 : outer;
  layout.run = part->count * inner;
  layout.start = part->first * inner;
  layout.stride = shape[part->axis] * inner;
  return layout;
}

/// A Tensor, Matrix or Vector of `shape` (whose rank the caller checked).
template <class T>
headmix::Tensor<T> sized(const std::vector<Index>& shape, headmix::Tensor<T>*) {
  return headmix::Tensor<T>(shape);
}
template <class T>
headmix::Matrix<T> sized(const std::vector<Index>& shape, headmix::Matrix<T>*) {
  return headmix::Matrix<T>(shape[0], shape[1]);
}
template <class T>
headmix::Vector<T> sized(const std::vector<Index>& shape, headmix::Vector<T>*) {
  return headmix::Vector<T>(shape[0]);
}

/// A matrix read needs a rank-2 tensor, a vector read a rank-1 one.
inline void check_rank(const std::string& name, const std::vector<Index>& shape, std::size_t rank) {
  if (shape.size() != rank)
    headmix::detail::throw_shape("io", name, rank == 2 ? "a rank-2 tensor" : "a rank-1 tensor",
                                 headmix::detail::format_shape(shape));
}

/// Tensor `name` of `shape`, or `part` of it, as a Result (Tensor, Matrix
/// or Vector; rank 0: any rank): the one read TensorFile and
/// SafetensorsReader share. They differ only in where the bytes come from:
/// decode_run(first, count, out) decodes `count` stored elements from
/// element `first` on into `out`.
template <class Result, class DecodeRun>
Result read_tensor(const std::string& name, const std::vector<Index>& shape, DType dtype, std::size_t rank,
                   const headmix::AxisSlice* part, DecodeRun&& decode_run) {
  if (rank != 0) check_rank(name, shape, rank);
  const SliceLayout layout = slice_layout(name, shape, dtype, part);
  Result result = sized(layout.shape, static_cast<Result*>(nullptr));
  for (Index i = 0; i < layout.runs; ++i)
    decode_run(layout.start + i * layout.stride, layout.run, result.data() + i * layout.run);
  return result;
}

template <class Stored, class T>
void encode_elements(const T* in, Index count, unsigned char* target, const std::string& context) {
  for (Index i = 0; i < count; ++i) {
    Stored value;
    convert_or_fail(in[i], value, i, context);
    std::memcpy(target + static_cast<std::size_t>(i) * sizeof(Stored), &value, sizeof(Stored));
  }
}

template <class T>
void encode_small_floats(const T* in, Index count, unsigned char* target, int exponent_bits, int fraction_bits) {
  for (Index i = 0; i < count; ++i) {
    const std::uint16_t bits = small_float_bits(in[i], exponent_bits, fraction_bits);
    std::memcpy(target + static_cast<std::size_t>(i) * 2, &bits, 2);
  }
}

// ---- header ----------------------------------------------------------------

struct HeaderEntry {
  std::string name;
  DType dtype = DType::F64;
  std::vector<Index> shape;
  std::uint64_t begin = 0, end = 0;  ///< byte range in the data buffer
};

struct ParsedHeader {
  std::vector<HeaderEntry> tensors;  ///< sorted by begin
  std::map<std::string, std::string> metadata;
};

/// A string from the header as JSON text for an error message, cut short.
inline std::string json_string_text(const std::string& value) {
  std::string text = nlohmann::json(value).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 40) text = text.substr(0, 40) + "...";
  return text;
}

/// The start of a JSON library message: nlohmann quotes the whole token it
/// was reading, which a hostile header can make megabytes long.
inline std::string json_error_text(const char* what) {
  constexpr std::size_t kShown = 200;
  const std::string_view text(what);
  if (text.size() <= kShown) return std::string(text);
  return std::string(text.substr(0, kShown)) + "... (" + std::to_string(text.size()) + " bytes)";
}

/// Reads the header from SAX events straight into HeaderEntry values and
/// checks its layout as it goes: a root object of tensor entries, each an
/// object of exactly dtype, shape and data_offsets, plus an optional
/// "__metadata__" object of strings. No JSON DOM is built and the first
/// malformation ends the parse, so the parsed header costs its names, 8
/// bytes per shape extent and about 100 bytes per tensor: a few times its
/// text at most. (Nothing valid nests deeper than 3 levels, so neither does
/// anything this accepts.)
class HeaderReader : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderReader(std::uint64_t data_size) : data_size_(data_size) {}

  bool null() override { return wrong("null"); }
  bool boolean(bool value) override { return wrong(value ? "true" : "false"); }
  bool number_integer(number_integer_t value) override {  // negative, or "-0"
    return value == 0 ? count(0) : wrong(std::to_string(value));
  }
  bool number_unsigned(number_unsigned_t value) override { return count(value); }
  bool number_float(number_float_t, const string_t& text) override {
    return wrong(text.size() > 40 ? text.substr(0, 40) + "..." : text);
  }
  bool binary(binary_t&) override { return wrong("binary data"); }
  bool string(string_t& value) override {
    if (where_ == Where::metadata) {
      metadata_.emplace(key_, value);
      return true;
    }
    if (where_ != Where::entry || field_ != Field::dtype) return wrong(json_string_text(value));
    if (!dtype_from_name(value, entry_.dtype)) return problem(context() + ": " + unsupported_dtype(value));
    return true;
  }
  bool start_object(std::size_t) override {
    if (where_ == Where::root) return go(Where::top);
    if (where_ != Where::top) return wrong("an object");
    if (key_is_metadata_) return go(Where::metadata);
    entry_ = HeaderEntry{key_, DType::F64, {}, 0, 0};
    seen_fields_ = 0;
    return go(Where::entry);
  }
  bool key(string_t& name) override {
    if (where_ == Where::top) {
      key_is_metadata_ = name == "__metadata__";
      if (key_is_metadata_ && metadata_seen_) return problem("duplicate key " + quote_name(name) + " in the header");
      metadata_seen_ = metadata_seen_ || key_is_metadata_;
      key_ = name;  // duplicate tensor names are found after the parse
      return true;
    }
    if (where_ == Where::metadata) {
      if (metadata_.count(name)) return problem("duplicate __metadata__ key " + quote_name(name));
      key_ = name;
      return true;
    }
    // Inside a tensor entry. A field headmix does not know could change
    // what the bytes mean, so it is refused rather than ignored.
    for (int f = 0; f < 3; ++f) {
      if (name != kFields[f]) continue;
      if (seen_fields_ & (1u << f)) return problem(context() + ": duplicate key " + quote_name(name));
      seen_fields_ |= 1u << f;
      field_ = static_cast<Field>(f);
      return true;
    }
    return problem(context() + ": unknown field " + quote_name(name) +
                   " (a tensor entry holds dtype, shape and data_offsets)");
  }
  bool end_object() override {
    if (where_ == Where::entry) return finish_entry() && go(Where::top);
    if (where_ == Where::metadata) return go(Where::top);
    return go(Where::done);
  }
  bool start_array(std::size_t) override {
    if (where_ != Where::entry || field_ == Field::dtype) return wrong("an array");
    return go(field_ == Field::shape ? Where::shape : Where::offsets);
  }
  bool end_array() override {
    if (where_ == Where::offsets && offsets_read_ != 2)
      return problem(context() + ": data_offsets hold " + std::to_string(offsets_read_) +
                     " entries, not two non-negative integers");
    offsets_read_ = 0;
    return go(Where::entry);
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::json::exception& error) override {
    return problem("header is not valid JSON at byte " + std::to_string(position) + ": " +
                   json_error_text(error.what()));
  }

  const std::string& error() const { return problem_; }
  std::vector<HeaderEntry>& tensors() { return tensors_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }

 private:
  enum class Where { root, top, entry, metadata, shape, offsets, done };
  enum class Field { dtype, shape, offsets };
  static constexpr const char* kFields[] = {"dtype", "shape", "data_offsets"};  ///< by Field

  bool go(Where where) {
    where_ = where;
    return true;
  }
  bool problem(std::string text) {
    problem_ = std::move(text);
    return false;
  }
  std::string context() const { return tensor_context(entry_.name); }

  /// A value that does not belong where it is, described by `what`.
  bool wrong(const std::string& what) {
    switch (where_) {
      case Where::root: return problem("header is " + what + ", not a JSON object");
      case Where::top:
        if (key_is_metadata_) return problem("__metadata__ is " + what + ", not an object");
        return problem(tensor_context(key_) + ": header entry is " + what + ", not an object");
      case Where::metadata:
        return problem("__metadata__ value of " + quote_name(key_) + " is " + what + ", not a string");
      case Where::entry:
        if (field_ == Field::dtype) return problem(context() + ": dtype " + what + " is not a string");
        if (field_ == Field::shape) return problem(context() + ": shape " + what + " is not an array");
        return problem(context() + ": data_offsets " + what + " are not two non-negative integers");
      case Where::shape: return problem(context() + ": shape entry " + what + " is not a non-negative integer");
      case Where::offsets:
        return problem(context() + ": data_offsets entry " + what + " is not a non-negative integer");
      case Where::done: break;
    }
    return problem("header is not valid JSON");
  }

  bool count(std::uint64_t value) {
    if (where_ == Where::shape) {
      if (value > static_cast<std::uint64_t>(std::numeric_limits<Index>::max()))
        return problem(context() + ": shape entry " + std::to_string(value) + " is too large");
      if (entry_.shape.size() >= kMaxTensorRank)
        return problem(context() + ": shape has more than " + std::to_string(kMaxTensorRank) + " extents");
      entry_.shape.push_back(static_cast<Index>(value));
      return true;
    }
    if (where_ == Where::offsets) {
      if (offsets_read_ == 2) return problem(context() + ": data_offsets hold more than two entries");
      (offsets_read_++ == 0 ? entry_.begin : entry_.end) = value;
      return true;
    }
    return wrong(std::to_string(value));
  }

  bool finish_entry() {
    for (int f = 0; f < 3; ++f)
      if (!(seen_fields_ & (1u << f))) return problem(context() + ": missing '" + kFields[f] + "'");
    const std::uint64_t begin = entry_.begin, end = entry_.end;
    const std::string range = "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]";
    const auto byte_size =
        static_cast<std::uint64_t>(checked_numel(entry_.shape, entry_.dtype, context())) * dtype_size(entry_.dtype);
    if (begin > end) return problem(context() + ": " + range + " end before they begin");
    if (end > data_size_)
      return problem(context() + ": " + range + " run past the " + std::to_string(data_size_) + "-byte data buffer");
    if (end - begin != byte_size)
      return problem(context() + ": " + range + " hold " + std::to_string(end - begin) + " bytes, but shape " +
                     headmix::detail::format_shape(entry_.shape) + " of " + dtype_name(entry_.dtype) + " needs " +
                     std::to_string(byte_size));
    entry_.shape.shrink_to_fit();  // push_back's doubling would keep up to twice the extents
    tensors_.push_back(std::move(entry_));
    return true;
  }

  std::uint64_t data_size_;
  Where where_ = Where::root;
  Field field_ = Field::dtype;
  std::string key_;                ///< the key whose value comes next (top level or metadata)
  bool key_is_metadata_ = false;
  bool metadata_seen_ = false;
  unsigned seen_fields_ = 0;       ///< bit f: kFields[f] of the current entry
  int offsets_read_ = 0;
  HeaderEntry entry_;
  std::vector<HeaderEntry> tensors_;
  std::map<std::string, std::string> metadata_;
  std::string problem_;
};

/// Validate a header whose data buffer holds `data_size` bytes.
inline ParsedHeader parse_header(const char* text, std::size_t length, std::uint64_t data_size) {
  // nlohmann's lexer takes a NUL byte for the end of input, which would
  // silently drop whatever follows; raw NUL is never valid JSON text anyway.
  if (std::memchr(text, 0, length) != nullptr) fail("header is not valid JSON: it contains a NUL byte");
  HeaderReader reader(data_size);
  try {
    if (!nlohmann::json::sax_parse(text, text + length, &reader))
      fail(reader.error().empty() ? std::string("header is not valid JSON") : reader.error());
  } catch (const nlohmann::json::exception& error) {
    fail("header is not valid JSON: " + json_error_text(error.what()));
  }

  ParsedHeader header;
  header.tensors = std::move(reader.tensors());
  header.metadata = std::move(reader.metadata());
  auto& tensors = header.tensors;
  // Two entries of one name: readers could disagree on which one it means.
  std::sort(tensors.begin(), tensors.end(), [](const HeaderEntry& a, const HeaderEntry& b) { return a.name < b.name; });
  for (std::size_t i = 1; i < tensors.size(); ++i)
    if (tensors[i].name == tensors[i - 1].name) fail("duplicate key " + quote_name(tensors[i].name) + " in the header");

  std::sort(tensors.begin(), tensors.end(), [](const HeaderEntry& a, const HeaderEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Sorted by begin, a non-empty range overlaps an earlier one iff it starts
  // before the furthest end so far. Empty tensors occupy no bytes.
  const HeaderEntry* furthest = nullptr;
  for (const HeaderEntry& entry : tensors) {
    if (entry.begin == entry.end) continue;
    if (furthest && entry.begin < furthest->end)
      fail("tensors " + quote_name(furthest->name) + " and " + quote_name(entry.name) + " overlap in the data buffer");
    if (!furthest || entry.end > furthest->end) furthest = &entry;
  }
  return header;
}

/// The header length N from the first 8 bytes, checked against the size of
/// the whole file.
inline std::uint64_t read_header_length(const unsigned char* first8, std::uint64_t file_size) {
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | first8[i];
  if (length > kMaxHeaderBytes)
    fail("header length " + std::to_string(length) + " exceeds the " + std::to_string(kMaxHeaderBytes) +
         "-byte limit");
  if (length > file_size - 8)
    fail("header length " + std::to_string(length) + " runs past the end of the " + std::to_string(file_size) +
         "-byte file");
  return length;
}

inline void check_file_size(std::uint64_t file_size) {
  if (file_size < 8)
    fail("file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
}

/// Bytes a tensor takes in the data buffer (checked against its shape).
inline std::uint64_t stored_bytes(const std::string& name, const StoredTensor& tensor) {
  check_consistent(tensor, tensor_context(name));
  return tensor.bytes.size();
}
inline std::uint64_t stored_bytes(const std::string&, const TensorInfo& info) { return info.end - info.begin; }

/// The header text, padded with spaces so that the data buffer starts at a
/// multiple of 8, for `tensors` (a map from name to StoredTensor or
/// TensorInfo) laid out back to back in name order.
template <class Tensors>
std::string build_header(const std::map<std::string, std::string>& metadata, const Tensors& tensors) {
  std::string header = "{";
  try {
    if (!metadata.empty()) header += "\"__metadata__\":" + nlohmann::json(metadata).dump();
    std::uint64_t offset = 0;
    for (const auto& [name, tensor] : tensors) {
      if (name == "__metadata__") fail("a tensor may not be named \"__metadata__\"");
      const std::uint64_t end = offset + stored_bytes(name, tensor);
      const nlohmann::json entry = {
          {"dtype", dtype_name(tensor.dtype)}, {"shape", tensor.shape}, {"data_offsets", {offset, end}}};
      if (header.size() > 1) header += ',';
      header += nlohmann::json(name).dump() + ':' + entry.dump();
      offset = end;
    }
  } catch (const nlohmann::json::exception& error) {  // names or metadata that are not UTF-8
    fail(std::string("cannot write the header: ") + error.what());
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxHeaderBytes)
    fail("header of " + std::to_string(header.size()) + " bytes exceeds the " + std::to_string(kMaxHeaderBytes) +
         "-byte limit");
  return header;
}

/// Whatever the reader accepts, the writer must be able to write back. The
/// written header lays the tensors out in name order, whose offsets can take
/// more digits than the file's own (empty tensors at [0, 0], say), so a
/// header just under the limit can come out over it: such a file is refused.
template <class Tensors>
void check_writable(const std::map<std::string, std::string>& metadata, const Tensors& tensors) {
  try {
    (void)build_header(metadata, tensors);
  } catch (const io_error& error) {
    throw io_error(std::string(error.what()) + " when written back (tensors in name order)");
  }
}

inline void append_u64_le(std::string& out, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFF);
}

}  // namespace detail

// ---- StoredTensor ----------------------------------------------------------

inline Index StoredTensor::numel() const { return detail::checked_numel(shape, dtype, "stored tensor"); }

template <class T>
headmix::Tensor<T> StoredTensor::as() const {
  detail::check_consistent(*this, "stored tensor");
  headmix::Tensor<T> result(shape);
  detail::decode_into(*this, result.data(), "stored tensor");
  return result;
}

template <class T>
StoredTensor StoredTensor::from(const headmix::Tensor<T>& t, DType stored) {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, "safetensors elements are numbers");
  StoredTensor result{stored, t.shape(), {}};
  const Index count = result.numel();
  if (count != t.size())
    detail::fail("from: tensor of shape " + headmix::detail::format_shape(t.shape()) + " holds " +
                 std::to_string(t.size()) + " elements");
  result.bytes.resize(static_cast<std::size_t>(count) * dtype_size(stored));
  const std::string context = std::string("from: storing as ") + dtype_name(stored);
  unsigned char* target = result.bytes.data();
  const T* in = t.data();
  switch (stored) {
    case DType::F64: detail::encode_elements<double>(in, count, target, context); break;
    case DType::F32: detail::encode_elements<float>(in, count, target, context); break;
    case DType::F16: detail::encode_small_floats(in, count, target, 5, 10); break;
    case DType::BF16: detail::encode_small_floats(in, count, target, 8, 7); break;
    case DType::I64: detail::encode_elements<std::int64_t>(in, count, target, context); break;
    case DType::I32: detail::encode_elements<std::int32_t>(in, count, target, context); break;
    case DType::I16: detail::encode_elements<std::int16_t>(in, count, target, context); break;
    case DType::I8: detail::encode_elements<std::int8_t>(in, count, target, context); break;
    case DType::U8: detail::encode_elements<std::uint8_t>(in, count, target, context); break;
    case DType::BOOL:
      for (Index i = 0; i < count; ++i) target[i] = in[i] != T(0) ? 1 : 0;
      break;
  }
  return result;
}

// ---- TensorFile ------------------------------------------------------------

template <class T>
headmix::Tensor<T> TensorFile::get(const std::string& name) const {
  return read<headmix::Tensor<T>>(name, 0, nullptr);
}
template <class T>
headmix::Matrix<T> TensorFile::matrix(const std::string& name) const {
  return read<headmix::Matrix<T>>(name, 2, nullptr);
}
template <class T>
headmix::Vector<T> TensorFile::vector(const std::string& name) const {
  return read<headmix::Vector<T>>(name, 1, nullptr);
}
template <class T>
headmix::Tensor<T> TensorFile::get(const std::string& name, const headmix::AxisSlice& part) const {
  return read<headmix::Tensor<T>>(name, 0, &part);
}
template <class T>
headmix::Matrix<T> TensorFile::matrix(const std::string& name, const headmix::AxisSlice& part) const {
  return read<headmix::Matrix<T>>(name, 2, &part);
}
template <class T>
headmix::Vector<T> TensorFile::vector(const std::string& name, const headmix::AxisSlice& part) const {
  return read<headmix::Vector<T>>(name, 1, &part);
}

template <class Result>
Result TensorFile::read(const std::string& name, std::size_t rank, const headmix::AxisSlice* part) const {
  const StoredTensor& stored = at(name);
  const std::string context = detail::tensor_context(name);
  detail::check_consistent(stored, context);
  const std::size_t size = dtype_size(stored.dtype);
  auto decode_run = [&](Index first, Index count, auto* out) {
    detail::decode_range(stored.dtype, stored.bytes.data() + std::size_t(first) * size, count, out, context);
  };
  return detail::read_tensor<Result>(name, stored.shape, stored.dtype, rank, part, decode_run);
}

inline void TensorFile::put(const std::string& name, StoredTensor t) {
  if (name == "__metadata__") detail::fail("a tensor may not be named \"__metadata__\"");
  detail::check_consistent(t, detail::tensor_context(name));
  tensors[name] = std::move(t);
}

// ---- files -----------------------------------------------------------------

/// Parse a whole safetensors file held in memory.
inline TensorFile parse_safetensors(const unsigned char* data, std::size_t size) {
  detail::check_file_size(size);
  if (data == nullptr) detail::fail("null data pointer");
  const std::uint64_t header_length = detail::read_header_length(data, size);
  const std::uint64_t data_size = size - 8 - header_length;
  detail::ParsedHeader header =
      detail::parse_header(reinterpret_cast<const char*>(data + 8), static_cast<std::size_t>(header_length), data_size);

  TensorFile file;
  file.metadata = std::move(header.metadata);
  const unsigned char* buffer = data + 8 + header_length;
  for (detail::HeaderEntry& entry : header.tensors) {
    StoredTensor tensor{entry.dtype, std::move(entry.shape),
                        std::vector<unsigned char>(buffer + entry.begin, buffer + entry.end)};
    file.tensors.emplace(std::move(entry.name), std::move(tensor));
  }
  detail::check_writable(file.metadata, file.tensors);
  return file;
}

namespace detail {

#if defined(__unix__) || defined(__APPLE__)
/// An open file, read by offset. The path is stat()ed first and only a
/// regular file is opened: opening a device (a watchdog, a tty) can have
/// effects of its own. The open is non-blocking (a FIFO swapped in cannot
/// stall it), and the descriptor must then be the same regular file, so a
/// path swapped between the check and the open is refused too.
class InputFile {
 public:
  explicit InputFile(const std::string& path) {
    struct stat named {};
    if (::stat(path.c_str(), &named) != 0) throw_errno("cannot access");
    if (!S_ISREG(named.st_mode)) throw io_error("not a regular file");
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd_ < 0) throw_errno("cannot open for reading");
    try {
      struct stat opened {};
      if (::fstat(fd_, &opened) != 0) throw_errno("cannot read its size");
      if (!S_ISREG(opened.st_mode) || opened.st_dev != named.st_dev || opened.st_ino != named.st_ino)
        throw io_error("the path changed while it was opened");
      // O_NONBLOCK only guarded the open; reads get an ordinary descriptor.
      const int flags = ::fcntl(fd_, F_GETFL);
      if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) throw_errno("cannot make it blocking");
      size_ = static_cast<std::uint64_t>(opened.st_size);
    } catch (...) {
      ::close(fd_);  // the destructor does not run when the constructor throws
      throw;
    }
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  std::uint64_t size() const { return size_; }
  int descriptor() const { return fd_; }
  void read(std::uint64_t offset, void* out, std::size_t count) const {
    auto* target = static_cast<char*>(out);
    while (count > 0) {
      const ::ssize_t got = ::pread(fd_, target, std::min<std::size_t>(count, std::size_t{1} << 30),
                                    static_cast<::off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw_errno("read failed");
      if (got == 0) throw io_error("read failed (file shrank?)");
      target += got;
      offset += static_cast<std::uint64_t>(got);
      count -= static_cast<std::size_t>(got);
    }
  }

 private:
  /// io_error "<what>: <errno's text>" ("no such file" for ENOENT).
  [[noreturn]] static void throw_errno(const std::string& what) {
    const int error = errno;
    if (error == ENOENT) throw io_error("no such file");
    throw io_error(what + ": " + std::generic_category().message(error));
  }

  int fd_ = -1;
  std::uint64_t size_ = 0;
};
#else
/// Portable fallback: the path is checked, then opened (on these platforms
/// a swap in between is the caller's to prevent).
class InputFile {
 public:
  explicit InputFile(const std::string& path) {
    std::error_code error;
    const auto status = std::filesystem::status(path, error);
    if (status.type() == std::filesystem::file_type::not_found) throw io_error("no such file");
    if (error) throw io_error("cannot access: " + error.message());
    if (!std::filesystem::is_regular_file(status)) throw io_error("not a regular file");
    size_ = std::filesystem::file_size(path, error);
    if (error) throw io_error("cannot read its size: " + error.message());
    in_.open(path, std::ios::binary);
    if (!in_) throw io_error("cannot open for reading");
  }
  std::uint64_t size() const { return size_; }
  void read(std::uint64_t offset, void* out, std::size_t count) {
    in_.seekg(static_cast<std::streamoff>(offset));
    if (!in_.read(static_cast<char*>(out), static_cast<std::streamsize>(count)))
      throw io_error("read failed (file shrank?)");
  }

 private:
  std::ifstream in_;
  std::uint64_t size_ = 0;
};
#endif

}  // namespace detail

/// A safetensors file opened for reading on demand. Opening reads and checks
/// the header as load_safetensors does; tensor data is read only when asked
/// for, and a sliced read (AxisSlice) reads only the slice's bytes, so a
/// sharded layer's from_tensors holds just its own rows and columns. Reads
/// are positioned (pread), so threads may share one reader. Errors are
/// io_errors naming the path (shape_error for a read of the wrong rank or an
/// out-of-range slice, as TensorFile's).
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path) : path_(path) {
    try {
      in_ = std::make_unique<detail::InputFile>(path);
      const std::uint64_t file_size = in_->size();
      detail::check_file_size(file_size);
      unsigned char first8[8];
      in_->read(0, first8, 8);
      const std::uint64_t header_length = detail::read_header_length(first8, file_size);
      std::string header_text(static_cast<std::size_t>(header_length), '\0');
      in_->read(8, header_text.data(), header_text.size());
      detail::ParsedHeader header =
          detail::parse_header(header_text.data(), header_text.size(), file_size - 8 - header_length);
      data_start_ = 8 + header_length;
      metadata_ = std::move(header.metadata);
      for (detail::HeaderEntry& entry : header.tensors)
        tensors.emplace(std::move(entry.name), TensorInfo{entry.dtype, std::move(entry.shape), entry.begin, entry.end});
      detail::check_writable(metadata_, tensors);
    } catch (const io_error& error) {
      throw io_error(path + ": " + error.what());
    }
  }

  /// The header's entries, by name (read-only in spirit: what a read returns
  /// is checked against the entry, so editing one only breaks that read).
  std::map<std::string, TensorInfo> tensors;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors.count(name) != 0; }
  /// io_error "<path>: missing tensor 'name'" when absent.
  const TensorInfo& at(const std::string& name) const {
    const auto found = tensors.find(name);
    if (found == tensors.end()) throw io_error(path_ + ": missing tensor " + detail::quote_name(name));
    return found->second;
  }
  const std::vector<Index>& shape(const std::string& name) const { return at(name).shape; }

  /// Reads as TensorFile's (same conversions and errors), from the file.
  template <class T>
  headmix::Tensor<T> get(const std::string& name) const { return read<headmix::Tensor<T>>(name, 0, nullptr); }
  template <class T>
  headmix::Matrix<T> matrix(const std::string& name) const { return read<headmix::Matrix<T>>(name, 2, nullptr); }
  template <class T>
  headmix::Vector<T> vector(const std::string& name) const { return read<headmix::Vector<T>>(name, 1, nullptr); }
  template <class T>
  headmix::Tensor<T> get(const std::string& name, const headmix::AxisSlice& part) const {
    return read<headmix::Tensor<T>>(name, 0, &part);
  }
  template <class T>
  headmix::Matrix<T> matrix(const std::string& name, const headmix::AxisSlice& part) const {
    return read<headmix::Matrix<T>>(name, 2, &part);
  }
  template <class T>
  headmix::Vector<T> vector(const std::string& name, const headmix::AxisSlice& part) const {
    return read<headmix::Vector<T>>(name, 1, &part);
  }

  /// Tensor `name` as stored (its raw bytes).
  StoredTensor stored(const std::string& name) const {
    const TensorInfo& info = at(name);
    StoredTensor tensor{info.dtype, info.shape, std::vector<unsigned char>(static_cast<std::size_t>(info.end - info.begin))};
    read_bytes(info.begin, tensor.bytes.data(), tensor.bytes.size());
    return tensor;
  }

  /// Bytes of tensor data read so far (all threads), for checking that a
  /// sharded load read only its slices.
  std::uint64_t bytes_read() const { return bytes_read_->load(); }

 private:
  // Decoded in chunks, so a whole-tensor read holds at most this many raw
  // bytes besides its result.
  static constexpr std::size_t kChunkBytes = std::size_t{1} << 20;

  void read_bytes(std::uint64_t offset, void* out, std::size_t count) const {
    try {
      if (count > 0) in_->read(data_start_ + offset, out, count);
    } catch (const io_error& error) {
      throw io_error(path_ + ": " + error.what());
    }
    *bytes_read_ += count;
  }

  template <class Result>
  Result read(const std::string& name, std::size_t rank, const headmix::AxisSlice* part) const {
    const TensorInfo& info = at(name);
    const std::string context = path_ + ": " + detail::tensor_context(name);
    const std::size_t size = dtype_size(info.dtype);
    if (info.end - info.begin != static_cast<std::uint64_t>(detail::checked_numel(info.shape, info.dtype, context)) * size)
      throw io_error(context + ": its data_offsets do not match its shape");
    const Index chunk = std::max<Index>(1, static_cast<Index>(kChunkBytes / size));
    std::vector<unsigned char> bytes;
    auto decode_run = [&](Index first, Index count, auto* out) {  // chunk by chunk
      bytes.resize(static_cast<std::size_t>(std::min(chunk, count)) * size);
      for (Index done = 0; done < count; done += chunk) {
        const Index n = std::min(chunk, count - done);
        read_bytes(info.begin + std::uint64_t(first + done) * size, bytes.data(), std::size_t(n) * size);
        detail::decode_range(info.dtype, bytes.data(), n, out + done, context);
      }
    };
    return detail::read_tensor<Result>(name, info.shape, info.dtype, rank, part, decode_run);
  }

  std::string path_;
  std::unique_ptr<detail::InputFile> in_;
  std::uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<std::atomic<std::uint64_t>> bytes_read_ = std::make_unique<std::atomic<std::uint64_t>>(0);
};

/// Read a whole file without holding it twice in memory: the header first,
/// then each tensor's bytes straight into its StoredTensor.
inline TensorFile load_safetensors(const std::string& path) {
  const SafetensorsReader reader(path);
  TensorFile file;
  file.metadata = reader.metadata();
  for (const auto& named : reader.tensors) file.tensors.emplace(named.first, reader.stored(named.first));
  return file;
}

/// The bytes of a safetensors file: metadata, then tensors in name order,
/// laid out back to back after a header padded with spaces to a multiple of 8.
inline std::vector<unsigned char> serialize_safetensors(const TensorFile& file) {
  const std::string header = detail::build_header(file.metadata, file.tensors);
  std::string prefix;
  detail::append_u64_le(prefix, header.size());
  std::size_t total = prefix.size() + header.size();
  for (const auto& named : file.tensors) total += named.second.bytes.size();

  std::vector<unsigned char> out;
  out.reserve(total);
  out.insert(out.end(), prefix.begin(), prefix.end());
  out.insert(out.end(), header.begin(), header.end());
  for (const auto& named : file.tensors) out.insert(out.end(), named.second.bytes.begin(), named.second.bytes.end());
  return out;
}

/// Write a file, streaming the tensors rather than building it in memory.
inline void save_safetensors(const std::string& path, const TensorFile& file) {
  const std::string header = detail::build_header(file.metadata, file.tensors);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw io_error(path + ": cannot open for writing");
  std::string prefix;
  detail::append_u64_le(prefix, header.size());
  out.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& named : file.tensors)
    out.write(reinterpret_cast<const char*>(named.second.bytes.data()),
              static_cast<std::streamsize>(named.second.bytes.size()));
  out.close();
  if (!out) throw io_error(path + ": write failed");
}

}  // namespace headmix::io
