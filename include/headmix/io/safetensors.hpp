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
// header, whose text is capped at 100 MB. Two things are stricter than the Rust
// reference implementation: duplicate JSON keys are rejected (two readers
// could otherwise disagree on which tensor a name means), and a shape's
// non-zero extents must multiply to a byte count that fits in 63 bits even
// when another extent is 0. Gaps between tensors in the data buffer are
// tolerated; overlapping tensors are not.
//
// Data is copied with memcpy, so the host must be little-endian, like every
// platform headmix targets (checked at compile time where the compiler says).
// Tensor<bool> is not usable (std::vector<bool>), so BOOL tensors are read as
// uint8_t or any other arithmetic type (false -> 0, true -> 1).
#pragma once

#include "headmix/core/error.hpp"
#include "headmix/core/types.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "headmix/io/safetensors.hpp copies little-endian tensor data with memcpy: big-endian hosts are not "
              "supported");
#endif

namespace headmix::io {

/// A malformed file, an unreadable path, a missing tensor, or a value that
/// does not fit the requested element type.
class io_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

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
  template <class T>
  headmix::Tensor<T> get(const std::string& name) const;
  /// A rank-2 tensor as a row-major [rows, cols] matrix; shape_error otherwise.
  template <class T>
  headmix::Matrix<T> matrix(const std::string& name) const;
  /// A rank-1 tensor as a vector; shape_error otherwise.
  template <class T>
  headmix::Vector<T> vector(const std::string& name) const;
  /// Insert or replace; io_error if the name is "__metadata__" or the bytes
  /// do not match dtype and shape.
  void put(const std::string& name, StoredTensor t);
};

namespace detail {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // as in the Rust reference reader
constexpr int kMaxHeaderDepth = 16;                     // a valid header needs 3 levels

/// Element count of a shape, checked so that (product of non-zero extents) *
/// element_size fits in an Index: then no partial product of the extents,
/// taken in any order (Tensor::count multiplies left to right), overflows.
inline Index checked_numel(const std::vector<Index>& shape, DType dtype, const std::string& context) {
  const auto max_bytes = static_cast<std::uint64_t>(
      std::min<std::uintmax_t>(std::numeric_limits<Index>::max(), std::numeric_limits<std::size_t>::max()));
  const std::uint64_t max_count = max_bytes / dtype_size(dtype);
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

/// Round a double to a binary format with `exponent_bits` and
/// `fraction_bits` (IEEE-style: bias, subnormals, inf, NaN) to nearest, ties
/// to even, and return its bits. Rounding directly from double avoids the
/// double rounding of going through float.
inline std::uint16_t round_double_to_small_float(double value, int exponent_bits, int fraction_bits) {
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const auto sign = static_cast<std::uint16_t>((bits >> 63) << (exponent_bits + fraction_bits));
  const auto infinity = static_cast<std::uint16_t>(((1u << exponent_bits) - 1) << fraction_bits);
  const int double_exponent_field = static_cast<int>((bits >> 52) & 0x7FF);
  std::uint64_t significand = bits & ((std::uint64_t{1} << 52) - 1);
  if (double_exponent_field == 0x7FF)  // inf, or NaN made quiet
    return static_cast<std::uint16_t>(sign | infinity | (significand ? 1u << (fraction_bits - 1) : 0u));
  // Zero, or a double subnormal: far below half the smallest F16/BF16 subnormal.
  if (double_exponent_field == 0) return sign;

  significand |= std::uint64_t{1} << 52;  // value = significand * 2^(exponent - 52)
  const int exponent = double_exponent_field - 1023;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int min_exponent = 1 - bias;
  // Below min_exponent the target's quantum stays 2^(min_exponent - fraction_bits): subnormals.
  int target_exponent = std::max(exponent, min_exponent);
  const int shift = 52 - fraction_bits + (target_exponent - exponent);
  if (shift >= 54) return sign;  // less than half the smallest subnormal
  std::uint64_t quanta = significand >> shift;
  const std::uint64_t remainder = significand & ((std::uint64_t{1} << shift) - 1);
  const std::uint64_t half = std::uint64_t{1} << (shift - 1);
  if (remainder > half || (remainder == half && (quanta & 1))) ++quanta;
  if (quanta >> (fraction_bits + 1)) {  // rounded up into the next binade
    quanta >>= 1;
    ++target_exponent;
  }
  const std::uint64_t implicit_bit = std::uint64_t{1} << fraction_bits;
  if (quanta < implicit_bit) return static_cast<std::uint16_t>(sign | quanta);  // subnormal
  const int biased_exponent = target_exponent + bias;
  if (biased_exponent >= (1 << exponent_bits) - 1) return static_cast<std::uint16_t>(sign | infinity);
  return static_cast<std::uint16_t>(sign | (static_cast<std::uint64_t>(biased_exponent) << fraction_bits) |
                                    (quanta - implicit_bit));
}

inline std::uint16_t double_to_f16_bits(double value) { return round_double_to_small_float(value, 5, 10); }
inline std::uint16_t double_to_bf16_bits(double value) { return round_double_to_small_float(value, 8, 7); }

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

/// Convert every element of `t` into `out` (numel elements). The caller has
/// run check_consistent, which it needs before sizing `out` anyway.
template <class T>
void decode_into(const StoredTensor& t, T* out, const std::string& context) {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>,
                "read tensors as an arithmetic type other than bool (Tensor<bool> is std::vector<bool>)");
  const Index count = t.numel();
  const unsigned char* source = t.bytes.data();
  switch (t.dtype) {
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

template <class Stored, class T>
void encode_elements(const T* in, Index count, unsigned char* target, const std::string& context) {
  for (Index i = 0; i < count; ++i) {
    Stored value;
    convert_or_fail(in[i], value, i, context);
    std::memcpy(target + static_cast<std::size_t>(i) * sizeof(Stored), &value, sizeof(Stored));
  }
}

template <class T, class Encode>
void encode_small_floats(const T* in, Index count, unsigned char* target, Encode encode) {
  for (Index i = 0; i < count; ++i) {
    const std::uint16_t bits = encode(static_cast<double>(in[i]));
    std::memcpy(target + static_cast<std::size_t>(i) * 2, &bits, 2);
  }
}

// ---- header ----------------------------------------------------------------

/// SAX pass over the header before building the DOM: rejects invalid JSON,
/// duplicate keys, and nesting deeper than any valid header needs.
class HeaderPrecheck : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    if (!enter()) return false;
    open_object_keys_.emplace_back();
    return true;
  }
  bool key(string_t& name) override {
    if (open_object_keys_.back().insert(name).second) return true;
    problem_ = "duplicate key " + quote_name(name) + " in the header";
    return false;
  }
  bool end_object() override {
    open_object_keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& error) override {
    problem_ = std::string("header is not valid JSON: ") + error.what();
    return false;
  }
  const std::string& problem() const { return problem_; }

 private:
  bool enter() {
    if (++depth_ <= kMaxHeaderDepth) return true;
    problem_ = "header JSON is nested deeper than " + std::to_string(kMaxHeaderDepth) + " levels";
    return false;
  }
  int depth_ = 0;
  std::vector<std::set<std::string>> open_object_keys_;
  std::string problem_;
};

struct HeaderEntry {
  std::string name;
  DType dtype;
  std::vector<Index> shape;
  std::uint64_t begin, end;  ///< byte range in the data buffer
};

struct ParsedHeader {
  std::vector<HeaderEntry> tensors;  ///< sorted by begin
  std::map<std::string, std::string> metadata;
};

/// A JSON value as text for an error message, cut short.
inline std::string json_text(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 40) text = text.substr(0, 40) + "...";
  return text;
}

/// A non-negative JSON integer ("-0" included); false for anything else.
inline bool read_count(const nlohmann::json& value, std::uint64_t& out) {
  if (value.is_number_unsigned()) {
    out = value.get<std::uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<std::int64_t>() == 0) {
    out = 0;
    return true;
  }
  return false;
}

inline const nlohmann::json& required_field(const nlohmann::json& entry, const char* field, const std::string& context) {
  const auto found = entry.find(field);
  if (found == entry.end()) fail(context + ": missing '" + field + "'");
  return *found;
}

inline HeaderEntry parse_entry(const std::string& name, const nlohmann::json& entry, std::uint64_t data_size) {
  const std::string context = tensor_context(name);
  if (!entry.is_object()) fail(context + ": header entry is " + json_text(entry) + ", not an object");
  HeaderEntry parsed{name, DType::F64, {}, 0, 0};

  const nlohmann::json& dtype = required_field(entry, "dtype", context);
  if (!dtype.is_string()) fail(context + ": dtype " + json_text(dtype) + " is not a string");
  if (!dtype_from_name(dtype.get<std::string>(), parsed.dtype))
    fail(context + ": " + unsupported_dtype(dtype.get<std::string>()));

  const nlohmann::json& shape = required_field(entry, "shape", context);
  if (!shape.is_array()) fail(context + ": shape " + json_text(shape) + " is not an array");
  parsed.shape.reserve(shape.size());
  for (const nlohmann::json& extent : shape) {
    std::uint64_t count = 0;
    if (!read_count(extent, count))
      fail(context + ": shape entry " + json_text(extent) + " is not a non-negative integer");
    if (count > static_cast<std::uint64_t>(std::numeric_limits<Index>::max()))
      fail(context + ": shape entry " + std::to_string(count) + " is too large");
    parsed.shape.push_back(static_cast<Index>(count));
  }
  const auto byte_size =
      static_cast<std::uint64_t>(checked_numel(parsed.shape, parsed.dtype, context)) * dtype_size(parsed.dtype);

  const nlohmann::json& offsets = required_field(entry, "data_offsets", context);
  if (!offsets.is_array() || offsets.size() != 2 || !read_count(offsets[0], parsed.begin) ||
      !read_count(offsets[1], parsed.end))
    fail(context + ": data_offsets " + json_text(offsets) + " are not two non-negative integers");
  if (parsed.begin > parsed.end)
    fail(context + ": data_offsets [" + std::to_string(parsed.begin) + ", " + std::to_string(parsed.end) +
         "] end before they begin");
  if (parsed.end > data_size)
    fail(context + ": data_offsets [" + std::to_string(parsed.begin) + ", " + std::to_string(parsed.end) +
         "] run past the " + std::to_string(data_size) + "-byte data buffer");
  if (parsed.end - parsed.begin != byte_size)
    fail(context + ": data_offsets [" + std::to_string(parsed.begin) + ", " + std::to_string(parsed.end) + "] hold " +
         std::to_string(parsed.end - parsed.begin) + " bytes, but shape " +
         headmix::detail::format_shape(parsed.shape) + " of " + dtype_name(parsed.dtype) + " needs " +
         std::to_string(byte_size));
  return parsed;
}

inline std::map<std::string, std::string> parse_metadata(const nlohmann::json& metadata) {
  if (!metadata.is_object()) fail("__metadata__ is " + json_text(metadata) + ", not an object");
  std::map<std::string, std::string> parsed;
  for (auto item = metadata.begin(); item != metadata.end(); ++item) {
    if (!item.value().is_string())
      fail("__metadata__ value of " + quote_name(item.key()) + " is " + json_text(item.value()) + ", not a string");
    parsed.emplace(item.key(), item.value().get<std::string>());
  }
  return parsed;
}

/// Validate a header whose data buffer holds `data_size` bytes.
inline ParsedHeader parse_header(const char* text, std::size_t length, std::uint64_t data_size) {
  // nlohmann's lexer takes a NUL byte for the end of input, which would
  // silently drop whatever follows; raw NUL is never valid JSON text anyway.
  if (std::memchr(text, 0, length) != nullptr) fail("header is not valid JSON: it contains a NUL byte");
  HeaderPrecheck precheck;
  nlohmann::json root;
  try {
    if (!nlohmann::json::sax_parse(text, text + length, &precheck))
      fail(precheck.problem().empty() ? std::string("header is not valid JSON") : precheck.problem());
    root = nlohmann::json::parse(text, text + length);
  } catch (const nlohmann::json::exception& error) {
    fail(std::string("header is not valid JSON: ") + error.what());
  }
  if (!root.is_object()) fail("header is " + json_text(root) + ", not a JSON object");

  ParsedHeader header;
  header.tensors.reserve(root.size());
  for (auto item = root.begin(); item != root.end(); ++item) {
    if (item.key() == "__metadata__")
      header.metadata = parse_metadata(item.value());
    else
      header.tensors.push_back(parse_entry(item.key(), item.value(), data_size));
  }

  std::sort(header.tensors.begin(), header.tensors.end(), [](const HeaderEntry& a, const HeaderEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Sorted by begin, a non-empty range overlaps an earlier one iff it starts
  // before the furthest end so far. Empty tensors occupy no bytes.
  const HeaderEntry* furthest = nullptr;
  for (const HeaderEntry& entry : header.tensors) {
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

/// The header text, padded with spaces so that the data buffer starts at a
/// multiple of 8, and each tensor's begin offset, in name order.
inline std::string build_header(const TensorFile& file) {
  std::string header = "{";
  try {
    if (!file.metadata.empty()) header += "\"__metadata__\":" + nlohmann::json(file.metadata).dump();
    std::uint64_t offset = 0;
    for (const auto& [name, tensor] : file.tensors) {
      if (name == "__metadata__") fail("a tensor may not be named \"__metadata__\"");
      check_consistent(tensor, tensor_context(name));
      const std::uint64_t end = offset + tensor.bytes.size();
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
  if (header.size() > kMaxHeaderBytes) fail("header of " + std::to_string(header.size()) + " bytes is too large");
  return header;
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
    case DType::F16: detail::encode_small_floats(in, count, target, detail::double_to_f16_bits); break;
    case DType::BF16: detail::encode_small_floats(in, count, target, detail::double_to_bf16_bits); break;
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
  const StoredTensor& stored = at(name);
  const std::string context = detail::tensor_context(name);
  detail::check_consistent(stored, context);
  headmix::Tensor<T> result(stored.shape);
  detail::decode_into(stored, result.data(), context);
  return result;
}

template <class T>
headmix::Matrix<T> TensorFile::matrix(const std::string& name) const {
  const StoredTensor& stored = at(name);
  if (stored.shape.size() != 2)
    headmix::detail::throw_shape("io", name, "a rank-2 tensor", headmix::detail::format_shape(stored.shape));
  const std::string context = detail::tensor_context(name);
  detail::check_consistent(stored, context);
  headmix::Matrix<T> result(stored.shape[0], stored.shape[1]);
  detail::decode_into(stored, result.data(), context);
  return result;
}

template <class T>
headmix::Vector<T> TensorFile::vector(const std::string& name) const {
  const StoredTensor& stored = at(name);
  if (stored.shape.size() != 1)
    headmix::detail::throw_shape("io", name, "a rank-1 tensor", headmix::detail::format_shape(stored.shape));
  const std::string context = detail::tensor_context(name);
  detail::check_consistent(stored, context);
  headmix::Vector<T> result(stored.shape[0]);
  detail::decode_into(stored, result.data(), context);
  return result;
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
  return file;
}

/// Read a file without holding it twice in memory: the header first, then
/// each tensor's bytes straight into its StoredTensor.
inline TensorFile load_safetensors(const std::string& path) {
  try {
    std::error_code error;
    const auto status = std::filesystem::status(path, error);
    if (status.type() == std::filesystem::file_type::not_found) throw io_error("no such file");
    if (error) throw io_error("cannot access: " + error.message());
    // A directory or device has no trustworthy size to check offsets against.
    if (!std::filesystem::is_regular_file(status)) throw io_error("not a regular file");
    const std::uint64_t file_size = std::filesystem::file_size(path, error);
    if (error) throw io_error("cannot read its size: " + error.message());
    std::ifstream in(path, std::ios::binary);
    if (!in) throw io_error("cannot open for reading");

    detail::check_file_size(file_size);
    unsigned char first8[8];
    if (!in.read(reinterpret_cast<char*>(first8), 8)) throw io_error("read failed (file shrank?)");
    const std::uint64_t header_length = detail::read_header_length(first8, file_size);
    std::string header_text(static_cast<std::size_t>(header_length), '\0');
    if (!in.read(header_text.data(), static_cast<std::streamsize>(header_length)))
      throw io_error("read failed (file shrank?)");
    detail::ParsedHeader header =
        detail::parse_header(header_text.data(), header_text.size(), file_size - 8 - header_length);
    header_text = std::string();

    TensorFile file;
    file.metadata = std::move(header.metadata);
    for (detail::HeaderEntry& entry : header.tensors) {
      StoredTensor tensor{entry.dtype, std::move(entry.shape),
                          std::vector<unsigned char>(static_cast<std::size_t>(entry.end - entry.begin))};
      if (!tensor.bytes.empty()) {
        in.seekg(static_cast<std::streamoff>(8 + header_length + entry.begin));
        if (!in.read(reinterpret_cast<char*>(tensor.bytes.data()), static_cast<std::streamsize>(tensor.bytes.size())))
          throw io_error("read failed (file shrank?)");
      }
      file.tensors.emplace(std::move(entry.name), std::move(tensor));
    }
    return file;
  } catch (const io_error& error) {
    throw io_error(path + ": " + error.what());
  }
}

/// The bytes of a safetensors file: metadata, then tensors in name order,
/// laid out back to back after a header padded with spaces to a multiple of 8.
inline std::vector<unsigned char> serialize_safetensors(const TensorFile& file) {
  const std::string header = detail::build_header(file);
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
  const std::string header = detail::build_header(file);
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
