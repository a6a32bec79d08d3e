// Tests of the safetensors reader and writer: round trips of every dtype,
// exact F16/BF16 bit patterns, the conformance files, and hostile inputs that
// must each end in io_error (never a crash, an out-of-bounds read or a huge
// allocation).
#include "headmix/io/safetensors.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/inotify.h>
#endif

namespace {

using headmix::Index;
using headmix::Tensor;
using namespace headmix::io;

using Bytes = std::vector<unsigned char>;

const DType kAllDTypes[] = {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64,
                            DType::I32, DType::I16, DType::I8,  DType::U8,   DType::BOOL};

Tensor<double> tensor_of(std::vector<Index> shape, const std::vector<double>& values) {
  Tensor<double> t(std::move(shape));
  for (Index i = 0; i < t.size(); ++i) t[i] = values.at(static_cast<std::size_t>(i));
  return t;
}

/// A file from header text and a data buffer, the length prefix written as is.
Bytes make_file(const std::string& header, const Bytes& data) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>((std::uint64_t{header.size()} >> (8 * i)) & 0xFF));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes with_header_length(Bytes file, std::uint64_t length) {
  for (int i = 0; i < 8; ++i) file[static_cast<std::size_t>(i)] = static_cast<unsigned char>((length >> (8 * i)) & 0xFF);
  return file;
}

TensorFile parse(const Bytes& file) { return parse_safetensors(file.data(), file.size()); }

/// Either parses or throws io_error; any other exception fails the test.
void parse_or_io_error(const Bytes& file) {
  try {
    parse(file);
  } catch (const io_error&) {
  }
}

std::vector<std::uint16_t> bits16_of(const StoredTensor& t) {
  std::vector<std::uint16_t> bits(t.bytes.size() / 2);
  std::memcpy(bits.data(), t.bytes.data(), t.bytes.size());
  return bits;
}

StoredTensor stored_bits16(DType dtype, const std::vector<std::uint16_t>& bits) {
  StoredTensor t{dtype, {static_cast<Index>(bits.size())}, Bytes(bits.size() * 2)};
  std::memcpy(t.bytes.data(), bits.data(), t.bytes.size());
  return t;
}

std::uint16_t encode_one(double value, DType dtype) {
  return bits16_of(StoredTensor::from(tensor_of({1}, {value}), dtype)).at(0);
}

double decode_one(std::uint16_t bits, DType dtype) { return stored_bits16(dtype, {bits}).as<double>()[0]; }

// A 16-bit pattern and the value it stands for.
struct KnownBits {
  std::uint16_t bits;
  double value;
};

// Each pattern decodes to exactly its value, and the value encodes back to it.
void expect_known_bits(DType dtype, std::initializer_list<KnownBits> cases) {
  for (const KnownBits& c : cases) {
    SCOPED_TRACE(c.bits);
    EXPECT_EQ(decode_one(c.bits, dtype), c.value);
    EXPECT_EQ(encode_one(c.value, dtype), c.bits);
  }
}

// ---- dtypes and round trips --------------------------------------------------

TEST(Safetensors, DTypeNamesAndSizes) {
  for (DType dtype : kAllDTypes) EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype) << dtype_name(dtype);
  EXPECT_STREQ(dtype_name(DType::BF16), "BF16");
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
  try {
    parse_dtype("F8_E4M3");
    FAIL() << "no io_error";
  } catch (const io_error& error) {
    EXPECT_NE(std::string(error.what()).find("F8_E4M3"), std::string::npos) << error.what();
  }
}

TEST(Safetensors, RoundTripEveryDType) {
  // Values every dtype holds exactly.
  auto values_for = [](DType dtype) -> std::vector<double> {
    switch (dtype) {
      case DType::U8: return {0, 1, 255, 7, 128, 2};
      case DType::BOOL: return {0, 1, 1, 0, 1, 0};
      case DType::I64: case DType::I32: case DType::I16: case DType::I8: return {0, 1, -2, 127, -128, 5};
      default: return {0, 1, -2.5, 0.375, 1024, -0.0};
    }
  };
  TensorFile file;
  file.metadata = {{"variant", "test"}, {"note", "ünïcode \"quoted\"\n"}};
  for (DType dtype : kAllDTypes) {
    const std::string name = std::string("t.") + dtype_name(dtype);
    file.put(name, StoredTensor::from(tensor_of({2, 3}, values_for(dtype)), dtype));
    file.put(name + ".empty", StoredTensor::from(Tensor<double>({0, 3}), dtype));
    file.put(name + ".scalar", StoredTensor::from(tensor_of({}, {1}), dtype));
  }
  const Bytes bytes = serialize_safetensors(file);
  const TensorFile back = parse(bytes);
  EXPECT_EQ(back.metadata, file.metadata);
  ASSERT_EQ(back.tensors.size(), file.tensors.size());
  for (const auto& [name, original] : file.tensors) {
    SCOPED_TRACE(name);
    const StoredTensor& loaded = back.at(name);
    EXPECT_EQ(loaded.dtype, original.dtype);
    EXPECT_EQ(loaded.shape, original.shape);
    EXPECT_EQ(loaded.bytes, original.bytes);
  }
  for (DType dtype : kAllDTypes) {
    const std::string name = std::string("t.") + dtype_name(dtype);
    SCOPED_TRACE(name);
    const Tensor<double> t = back.get<double>(name);
    ASSERT_EQ(t.shape(), (std::vector<Index>{2, 3}));
    const std::vector<double> expected = values_for(dtype);
    for (Index i = 0; i < 6; ++i) EXPECT_EQ(t[i], expected[static_cast<std::size_t>(i)]) << i;
    EXPECT_EQ(back.get<double>(name + ".empty").size(), 0);
    EXPECT_EQ(back.get<double>(name + ".scalar").shape(), std::vector<Index>{});
    EXPECT_EQ(back.get<double>(name + ".scalar")[0], 1.0);
  }
  // The sign of -0.0 survives every float dtype.
  EXPECT_TRUE(std::signbit(back.get<double>("t.F16")[5]));
  EXPECT_TRUE(std::signbit(back.get<double>("t.BF16")[5]));
}

TEST(Safetensors, NaturalDTypesAndLittleEndianBytes) {
  Tensor<float> f({2});
  f[0] = 1.0f;
  f[1] = -0.5f;
  const StoredTensor stored = StoredTensor::from(f);
  EXPECT_EQ(stored.dtype, DType::F32);
  EXPECT_EQ(stored.bytes, (Bytes{0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xBF}));
  EXPECT_EQ(StoredTensor::from(Tensor<double>({1})).dtype, DType::F64);
  EXPECT_EQ(StoredTensor::from(Tensor<std::int64_t>({1})).dtype, DType::I64);
  EXPECT_EQ(StoredTensor::from(Tensor<std::int32_t>({1})).dtype, DType::I32);
  EXPECT_EQ(StoredTensor::from(Tensor<std::int16_t>({1})).dtype, DType::I16);
  EXPECT_EQ(StoredTensor::from(Tensor<std::int8_t>({1})).dtype, DType::I8);
  EXPECT_EQ(StoredTensor::from(Tensor<std::uint8_t>({1})).dtype, DType::U8);

  Tensor<std::int16_t> small({3});
  small[0] = -300;
  small[1] = 0x1234;
  small[2] = 7;
  const StoredTensor i16 = StoredTensor::from(small);
  EXPECT_EQ(i16.bytes[2], 0x34);
  EXPECT_EQ(i16.bytes[3], 0x12);
  const Tensor<std::int16_t> back = i16.as<std::int16_t>();
  for (Index i = 0; i < 3; ++i) EXPECT_EQ(back[i], small[i]);
  const Tensor<float> as_float = i16.as<float>();
  EXPECT_EQ(as_float[0], -300.0f);
}

TEST(Safetensors, SerializedLayout) {
  TensorFile file;
  file.metadata["variant"] = "mha";
  file.put("b", StoredTensor::from(tensor_of({3}, {1, 2, 3}), DType::I16));
  file.put("a", StoredTensor::from(tensor_of({2, 2}, {1, 2, 3, 4}), DType::F32));
  file.put("c", StoredTensor::from(Tensor<double>({0}), DType::F64));
  const Bytes bytes = serialize_safetensors(file);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | bytes[static_cast<std::size_t>(i)];
  EXPECT_EQ((8 + header_length) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_length + 16 + 6);
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_length));
  EXPECT_EQ(header.rfind("{\"__metadata__\":", 0), 0u) << header;
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));
  const nlohmann::json parsed = nlohmann::json::parse(header);
  EXPECT_EQ(parsed["a"]["data_offsets"], nlohmann::json({0, 16}));
  EXPECT_EQ(parsed["b"]["data_offsets"], nlohmann::json({16, 22}));
  EXPECT_EQ(parsed["c"]["data_offsets"], nlohmann::json({22, 22}));
  EXPECT_EQ(parsed["b"]["dtype"], "I16");
  EXPECT_EQ(parsed["a"]["shape"], nlohmann::json({2, 2}));
  EXPECT_EQ(parsed["__metadata__"]["variant"], "mha");

  // No metadata and no tensors is still a valid file.
  const Bytes empty = serialize_safetensors(TensorFile{});
  EXPECT_EQ(empty.size(), 16u);
  const TensorFile back = parse(empty);
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

// ---- F16 / BF16 bit patterns -------------------------------------------------

TEST(Safetensors, F16KnownBitPatterns) {
  expect_known_bits(DType::F16, {
      {0x3C00, 1.0},
      {0xC100, -2.5},
      {0x7BFF, 65504.0},
      {0x0001, std::ldexp(1.0, -24)},     // smallest subnormal
      {0x03FF, std::ldexp(1023.0, -24)},  // largest subnormal
      {0x0400, std::ldexp(1.0, -14)},     // smallest normal
      {0x3555, std::ldexp(1365.0, -12)},  // 0.333251953125
      {0x7C00, std::numeric_limits<double>::infinity()},
      {0xFC00, -std::numeric_limits<double>::infinity()},
      {0x0000, 0.0},
  });
  EXPECT_TRUE(std::signbit(decode_one(0x8000, DType::F16)));
  EXPECT_EQ(encode_one(-0.0, DType::F16), 0x8000);
  EXPECT_TRUE(std::isnan(decode_one(0x7E00, DType::F16)));
  EXPECT_TRUE(std::isnan(decode_one(0x7C01, DType::F16)));  // signalling NaN stays NaN, not inf
  EXPECT_EQ(encode_one(std::nan(""), DType::F16), 0x7E00);

  // Round to nearest, ties to even.
  EXPECT_EQ(encode_one(65519.0, DType::F16), 0x7BFF);
  EXPECT_EQ(encode_one(65520.0, DType::F16), 0x7C00);  // the tie past 65504 rounds to inf
  EXPECT_EQ(encode_one(-1e10, DType::F16), 0xFC00);
  EXPECT_EQ(encode_one(1.0 + std::ldexp(1.0, -11), DType::F16), 0x3C00);
  EXPECT_EQ(encode_one(1.0 + 3 * std::ldexp(1.0, -11), DType::F16), 0x3C02);
  EXPECT_EQ(encode_one(std::ldexp(1.0, -25), DType::F16), 0x0000);
  EXPECT_EQ(encode_one(std::ldexp(1.0, -25) * 1.0000001, DType::F16), 0x0001);
  EXPECT_EQ(encode_one(std::ldexp(3.0, -25), DType::F16), 0x0002);
  EXPECT_EQ(encode_one(std::ldexp(1023.5, -24), DType::F16), 0x0400);  // subnormal rounds up into the normals
  EXPECT_EQ(encode_one(1e-300, DType::F16), 0x0000);
  EXPECT_EQ(encode_one(std::numeric_limits<double>::denorm_min(), DType::F16), 0x0000);
}

TEST(Safetensors, WideIntegersAndLongDoublesRoundOnce) {
  // 2^62 + 2^54 + 1 lies just above the midpoint between the BF16 values
  // 2^62 (0x5E80) and 2^62 + 2^55 (0x5E81), so it rounds up; through double
  // it would first become the midpoint 2^62 + 2^54 and then tie to even.
  const std::int64_t wide = (std::int64_t{1} << 62) + (std::int64_t{1} << 54) + 1;
  headmix::Tensor<std::int64_t> ints({2});
  ints[0] = wide;
  ints[1] = -wide;
  EXPECT_EQ(bits16_of(StoredTensor::from(ints, DType::BF16)), (std::vector<std::uint16_t>{0x5E81, 0xDE81}));
  headmix::Tensor<std::int64_t> extremes({2});
  extremes[0] = std::numeric_limits<std::int64_t>::min();  // -2^63 exactly: 0xDF00
  extremes[1] = std::numeric_limits<std::int64_t>::max();  // rounds up to 2^63: 0x5F00
  EXPECT_EQ(bits16_of(StoredTensor::from(extremes, DType::BF16)), (std::vector<std::uint16_t>{0xDF00, 0x5F00}));
  // 1 + 2^-11 + 2^-60 is just above the F16 midpoint 1 + 2^-11 between 0x3C00 and 0x3C01.
  if (std::numeric_limits<long double>::digits > 61) {
    headmix::Tensor<long double> longs({1});
    longs[0] = 1.0L + std::ldexp(1.0L, -11) + std::ldexp(1.0L, -60);
    EXPECT_EQ(bits16_of(StoredTensor::from(longs, DType::F16)).at(0), 0x3C01);
  }

  // Against a naive search over every finite BF16 value, for int64 (exact in
  // an 80-bit long double): the nearest, ties to the even bit pattern.
  if (std::numeric_limits<long double>::digits < 64) GTEST_SKIP() << "needs a 64-bit long double significand";
  std::vector<long double> finite;  // value of positive pattern b at finite[b]
  for (std::uint32_t b = 0; b < 0x7F80; ++b) finite.push_back(decode_one(static_cast<std::uint16_t>(b), DType::BF16));
  // Every sample is a tie between two BF16 values or one off it: the 8
  // significant bits from the leading one, then the half-quantum bit set and
  // zeros below (tie), plus 0, 1 or -1.
  std::mt19937_64 random(7);
  headmix::Tensor<std::int64_t> samples({300});
  for (Index i = 0; i < samples.size(); ++i) {
    const int bits = 9 + static_cast<int>(random() % 54);  // 9..62: room for a half-quantum below 8 bits
    const std::int64_t value = static_cast<std::int64_t>(random() >> (64 - bits)) | (std::int64_t{1} << (bits - 1));
    const int dropped = bits - 8;  // bits below BF16's quantum
    const std::int64_t tie = (value >> dropped << dropped) | (std::int64_t{1} << (dropped - 1));
    samples[i] = tie + (i % 3 == 0 ? 0 : i % 3 == 1 ? 1 : -1);
  }
  const std::vector<std::uint16_t> encoded = bits16_of(StoredTensor::from(samples, DType::BF16));
  for (Index i = 0; i < samples.size(); ++i) {
    const long double v = static_cast<long double>(samples[i]);
    std::uint32_t best = 0;
    for (std::uint32_t b = 1; b < finite.size(); ++b) {
      const long double d = std::fabs(finite[b] - v), best_d = std::fabs(finite[best] - v);
      if (d < best_d || (d == best_d && (b & 1) == 0)) best = b;
    }
    EXPECT_EQ(encoded[static_cast<std::size_t>(i)], best) << samples[i];
  }
}

TEST(Safetensors, BF16KnownBitPatterns) {
  expect_known_bits(DType::BF16, {
      {0x4049, 3.140625},
      {0x3F80, 1.0},
      {0xC020, -2.5},
      {0x7F7F, std::ldexp(255.0, 120)},  // largest finite
      {0x0001, std::ldexp(1.0, -133)},   // smallest subnormal
      {0x0080, std::ldexp(1.0, -126)},   // smallest normal
      {0x7F80, std::numeric_limits<double>::infinity()},
      {0xFF80, -std::numeric_limits<double>::infinity()},
  });
  EXPECT_TRUE(std::isnan(decode_one(0x7FC0, DType::BF16)));
  EXPECT_EQ(encode_one(-std::nan(""), DType::BF16), 0xFFC0);
  EXPECT_EQ(encode_one(3.14159265358979, DType::BF16), 0x4049);
  EXPECT_EQ(encode_one(1.0 + std::ldexp(1.0, -8), DType::BF16), 0x3F80);      // tie to even
  EXPECT_EQ(encode_one(1.0 + 3 * std::ldexp(1.0, -8), DType::BF16), 0x3F82);  // tie to even, upward
  // Just above the tie: going through float first would round twice and land on 0x3F80.
  EXPECT_EQ(encode_one(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40), DType::BF16), 0x3F81);
  EXPECT_EQ(encode_one(std::ldexp(1.0, 128), DType::BF16), 0x7F80);
}

TEST(Safetensors, EverySixteenBitPatternDecodesExactlyAndReencodes) {
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  for (DType dtype : {DType::F16, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int exponent_bits = dtype == DType::F16 ? 5 : 8, fraction_bits = dtype == DType::F16 ? 10 : 7;
    const int bias = (1 << (exponent_bits - 1)) - 1;
    const Tensor<double> decoded = stored_bits16(dtype, all).as<double>();
    const std::vector<std::uint16_t> reencoded = bits16_of(StoredTensor::from(decoded, dtype));
    for (std::size_t i = 0; i < all.size(); ++i) {
      const unsigned bits = all[i];
      const unsigned exponent = (bits >> fraction_bits) & ((1u << exponent_bits) - 1);
      const unsigned fraction = bits & ((1u << fraction_bits) - 1);
      const double sign = (bits >> 15) ? -1.0 : 1.0;
      const double value = decoded[static_cast<Index>(i)];
      if (exponent == (1u << exponent_bits) - 1) {
        if (fraction == 0) {
          EXPECT_EQ(value, sign * std::numeric_limits<double>::infinity()) << bits;
        } else {
          EXPECT_TRUE(std::isnan(value)) << bits;
          EXPECT_EQ(std::signbit(value), sign < 0) << bits;
          EXPECT_TRUE(std::isnan(decode_one(reencoded[i], dtype))) << bits;
        }
        continue;
      }
      // The textbook formula, independent of the bit-level decoder.
      const double expected =
          exponent == 0 ? sign * std::ldexp(fraction, 1 - bias - fraction_bits)
                        : sign * std::ldexp((1u << fraction_bits) + fraction, int(exponent) - bias - fraction_bits);
      ASSERT_EQ(value, expected) << bits;
      ASSERT_EQ(std::signbit(value), sign < 0) << bits;
      ASSERT_EQ(reencoded[i], bits) << bits;
    }
  }
}

// ---- conversions and accessors ---------------------------------------------

TEST(Safetensors, ConversionsThatDoNotFitThrow) {
  Tensor<std::int64_t> big({2});
  big[0] = std::int64_t{1} << 40;
  big[1] = -1;
  const StoredTensor i64 = StoredTensor::from(big);
  EXPECT_EQ(i64.as<std::int64_t>()[0], big[0]);
  EXPECT_EQ(i64.as<double>()[0], std::ldexp(1.0, 40));
  EXPECT_THROW(i64.as<std::int32_t>(), io_error);
  EXPECT_THROW(i64.as<std::uint64_t>(), io_error);  // -1

  const StoredTensor f64 = StoredTensor::from(tensor_of({3}, {2.9, -2.9, 255.5}));
  const Tensor<int> truncated = f64.as<int>();
  EXPECT_EQ(truncated[0], 2);
  EXPECT_EQ(truncated[1], -2);
  EXPECT_THROW(f64.as<std::uint8_t>(), io_error);  // -2.9 truncates to -2
  EXPECT_THROW(StoredTensor::from(tensor_of({1}, {std::nan("")})).as<int>(), io_error);
  EXPECT_THROW(StoredTensor::from(tensor_of({1}, {1e19})).as<std::int64_t>(), io_error);
  EXPECT_EQ(StoredTensor::from(tensor_of({1}, {-9223372036854775808.0})).as<std::int64_t>()[0],
            std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(StoredTensor::from(tensor_of({1}, {1e300})).as<float>()[0], std::numeric_limits<float>::infinity());

  // Writing integer dtypes checks the range too.
  EXPECT_THROW(StoredTensor::from(tensor_of({1}, {300}), DType::U8), io_error);
  EXPECT_THROW(StoredTensor::from(tensor_of({1}, {-129}), DType::I8), io_error);
  EXPECT_THROW(StoredTensor::from(tensor_of({1}, {std::nan("")}), DType::I32), io_error);
  EXPECT_EQ(StoredTensor::from(tensor_of({1}, {-128.7}), DType::I8).as<int>()[0], -128);
  const StoredTensor flags = StoredTensor::from(tensor_of({3}, {0, 2.5, -1}), DType::BOOL);
  EXPECT_EQ(flags.bytes, (Bytes{0, 1, 1}));

  // A BOOL byte other than 0/1 reads as true.
  const StoredTensor odd_bool{DType::BOOL, {2}, {0, 7}};
  EXPECT_EQ(odd_bool.as<std::uint8_t>()[1], 1);
}

TEST(Safetensors, Accessors) {
  TensorFile file;
  file.put("q.weight", StoredTensor::from(tensor_of({2, 3}, {1, 2, 3, 4, 5, 6}), DType::F32));
  file.put("q.bias", StoredTensor::from(tensor_of({2}, {7, 8})));
  file.put("cube", StoredTensor::from(Tensor<double>({3, 4, 5})));
  EXPECT_TRUE(file.contains("q.weight"));
  EXPECT_FALSE(file.contains("k.weight"));

  const headmix::Matrix<double> w = file.matrix<double>("q.weight");
  ASSERT_EQ(w.rows(), 2);
  ASSERT_EQ(w.cols(), 3);
  EXPECT_EQ(w(0, 2), 3.0);  // row-major
  EXPECT_EQ(w(1, 0), 4.0);
  const headmix::Matrix<float> wf = file.matrix<float>("q.weight");
  EXPECT_EQ(wf(1, 2), 6.0f);
  const headmix::Vector<double> b = file.vector<double>("q.bias");
  ASSERT_EQ(b.size(), 2);
  EXPECT_EQ(b(1), 8.0);
  EXPECT_EQ(file.get<float>("q.bias")[0], 7.0f);

  try {
    file.matrix<double>("cube");
    FAIL() << "no shape_error";
  } catch (const headmix::shape_error& error) {
    EXPECT_STREQ(error.what(), "[io] cube: expected a rank-2 tensor, got [3, 4, 5]");
  }
  try {
    file.vector<double>("q.weight");
    FAIL() << "no shape_error";
  } catch (const headmix::shape_error& error) {
    EXPECT_STREQ(error.what(), "[io] q.weight: expected a rank-1 tensor, got [2, 3]");
  }
  try {
    file.at("k.weight");
    FAIL() << "no io_error";
  } catch (const io_error& error) {
    EXPECT_NE(std::string(error.what()).find("missing tensor 'k.weight'"), std::string::npos) << error.what();
  }
  EXPECT_THROW(file.matrix<double>("k.weight"), io_error);
  EXPECT_THROW(file.get<double>("k.weight"), io_error);
}

TEST(Safetensors, InconsistentTensorsAreRejected) {
  TensorFile file;
  EXPECT_THROW(file.put("__metadata__", StoredTensor::from(Tensor<double>({1}))), io_error);
  EXPECT_THROW(file.put("short", StoredTensor{DType::F32, {3}, Bytes(8)}), io_error);
  EXPECT_THROW(file.put("negative", StoredTensor{DType::U8, {-1}, Bytes{}}), io_error);
  EXPECT_THROW((StoredTensor{DType::F32, {Index{1} << 40, Index{1} << 40}, Bytes{}}.numel()), io_error);
  EXPECT_THROW((StoredTensor{DType::F32, {3}, Bytes(8)}.as<double>()), io_error);

  // The map is public; the writer checks again.
  file.tensors["bad"] = StoredTensor{DType::F64, {2}, Bytes(15)};
  EXPECT_THROW(serialize_safetensors(file), io_error);
  file.tensors.clear();
  file.tensors["\xff\xfe not utf-8"] = StoredTensor{DType::U8, {1}, Bytes{1}};
  EXPECT_THROW(serialize_safetensors(file), io_error);
}

// ---- files -------------------------------------------------------------------

std::filesystem::path temp_path(const std::string& stem) {
  std::random_device entropy;
  return std::filesystem::temp_directory_path() /
         ("headmix_test_safetensors_" + stem + "_" + std::to_string(entropy()) + ".safetensors");
}

TEST(Safetensors, SaveAndLoad) {
  TensorFile file;
  file.metadata["variant"] = "mha";
  file.put("w", StoredTensor::from(tensor_of({2, 2}, {1, -2, 3.5, 4}), DType::BF16));
  file.put("mask", StoredTensor::from(tensor_of({3}, {0, 1, 1}), DType::U8));
  const std::filesystem::path path = temp_path("roundtrip");
  save_safetensors(path.string(), file);
  const TensorFile back = load_safetensors(path.string());
  EXPECT_EQ(back.metadata, file.metadata);
  EXPECT_EQ(back.at("w").bytes, file.at("w").bytes);
  EXPECT_EQ(back.at("mask").bytes, file.at("mask").bytes);
  EXPECT_EQ(back.matrix<double>("w")(1, 0), 3.5);

  // Truncated on disk: an io_error naming the path.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  try {
    load_safetensors(path.string());
    FAIL() << "no io_error";
  } catch (const io_error& error) {
    EXPECT_NE(std::string(error.what()).find(path.string()), std::string::npos) << error.what();
  }
  std::filesystem::remove(path);
}

TEST(Safetensors, UnreadablePathsNameThePath) {
  const std::string missing = (std::filesystem::temp_directory_path() / "headmix_no_such_file.safetensors").string();
  try {
    load_safetensors(missing);
    FAIL() << "no io_error";
  } catch (const io_error& error) {
    EXPECT_NE(std::string(error.what()).find(missing), std::string::npos) << error.what();
  }
  EXPECT_THROW(load_safetensors(std::filesystem::temp_directory_path().string()), io_error);
  EXPECT_THROW(save_safetensors(missing + "/not_a_dir/x.safetensors", TensorFile{}), io_error);
}

TEST(Safetensors, FifosAndDevicesAreRefusedWithoutBlocking) {
  // A FIFO with no writer is refused at once instead of stalling the open.
  const std::filesystem::path fifo = temp_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
#ifdef __linux__
  // ... and is never opened at all: opening a device (a watchdog, a tty)
  // can have effects of its own. inotify sees every open of the path.
  const int watcher = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ASSERT_GE(watcher, 0);
  ASSERT_GE(::inotify_add_watch(watcher, fifo.c_str(), IN_OPEN), 0);
#endif
  try {
    load_safetensors(fifo.string());
    FAIL() << "read a FIFO";
  } catch (const io_error& error) {
    EXPECT_NE(std::string(error.what()).find("not a regular file"), std::string::npos) << error.what();
  }
#ifdef __linux__
  alignas(inotify_event) char events[4096];
  EXPECT_LT(::read(watcher, events, sizeof events), 0) << "the FIFO was opened";
  ::close(watcher);
#endif
  std::filesystem::remove(fifo);
  if (std::filesystem::exists("/dev/zero")) {
    EXPECT_THROW(load_safetensors("/dev/zero"), io_error);
  }
}

TEST(Safetensors, TheOpenedFileIsBlockingAgain) {
  // O_NONBLOCK only guards the open: the descriptor that is read is left as
  // an ordinary blocking one.
  const std::filesystem::path path = temp_path("blocking");
  save_safetensors(path.string(), TensorFile{});
  {
    const headmix::io::detail::InputFile in(path.string());
    EXPECT_EQ(::fcntl(in.descriptor(), F_GETFL) & O_NONBLOCK, 0);
  }
  std::filesystem::remove(path);
}

TEST(Safetensors, TheWriterRefusesWhatTheReaderWould) {
  // A rank over the reader's cap cannot be stored either.
  StoredTensor deep{DType::U8, std::vector<Index>(1025, 0), {}};
  TensorFile file;
  EXPECT_THROW(file.put("deep", deep), io_error);
  deep.shape.resize(1024);
  EXPECT_NO_THROW(file.put("deep", deep));
}

TEST(Safetensors, ConformanceFilesLoad) {
  const std::filesystem::path root = HEADMIX_CONFORMANCE_DIR;
  if (!std::filesystem::is_directory(root)) HEADMIX_CONFORMANCE_MISSING() << "no conformance folder at " << root;
  int loaded = 0;
  for (const auto& item : std::filesystem::recursive_directory_iterator(root)) {
    if (item.path().extension() != ".safetensors") continue;
    SCOPED_TRACE(item.path().string());
    const TensorFile file = load_safetensors(item.path().string());
    EXPECT_FALSE(file.tensors.empty());
    EXPECT_TRUE(file.metadata.count("variant"));
    for (const auto& [name, tensor] : file.tensors) EXPECT_EQ(file.get<double>(name).size(), tensor.numel()) << name;

    // From memory, and after our own writer, the same tensors come back.
    std::ifstream in(item.path(), std::ios::binary);
    const Bytes raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const TensorFile from_memory = parse(raw);
    const TensorFile rewritten = parse(serialize_safetensors(file));
    for (const TensorFile* other : {&from_memory, &rewritten}) {
      EXPECT_EQ(other->metadata, file.metadata);
      ASSERT_EQ(other->tensors.size(), file.tensors.size());
      for (const auto& [name, tensor] : file.tensors) {
        EXPECT_EQ(other->at(name).dtype, tensor.dtype) << name;
        EXPECT_EQ(other->at(name).shape, tensor.shape) << name;
        EXPECT_EQ(other->at(name).bytes, tensor.bytes) << name;
      }
    }
    ++loaded;
  }
  EXPECT_GT(loaded, 0);

  const std::filesystem::path mha = root / "mha" / "self_basic.safetensors";
  if (!std::filesystem::exists(mha)) HEADMIX_CONFORMANCE_MISSING() << "no " << mha;
  const TensorFile file = load_safetensors(mha.string());
  EXPECT_EQ(file.metadata.at("variant"), "mha");
  EXPECT_EQ(file.at("q.weight").dtype, DType::F64);
  EXPECT_EQ(file.at("q.weight").shape, (std::vector<Index>{16, 16}));
  EXPECT_EQ(file.matrix<double>("q.weight").rows(), 16);
  EXPECT_EQ(file.vector<double>("q.bias").size(), 16);
  EXPECT_EQ(nlohmann::json::parse(file.metadata.at("config")).at("num_heads"), 2);
}

// ---- hostile input -----------------------------------------------------------

// A valid file: "a" F32 [2, 2] at [0, 16), "b" I16 [3] at [16, 22).
const Bytes kData(22, 0x5A);
const std::string kValidHeader =
    R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
    R"("b":{"dtype":"I16","shape":[3],"data_offsets":[16,22]},"__metadata__":{"k":"v"}})";

Bytes valid_file() { return make_file(kValidHeader, kData); }

/// The valid header with `from` replaced by `to` (once; it must occur).
Bytes edited(const std::string& from, const std::string& to) {
  std::string header = kValidHeader;
  const std::size_t at = header.find(from);
  if (at == std::string::npos) throw std::logic_error("test bug: '" + from + "' not in the header");
  header.replace(at, from.size(), to);
  return make_file(header, kData);
}

Bytes prefix_of(const Bytes& file, std::size_t length) { return Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(length)); }

TEST(Safetensors, ValidBaseFileParses) {
  const TensorFile file = parse(valid_file());
  EXPECT_EQ(file.at("a").shape, (std::vector<Index>{2, 2}));
  EXPECT_EQ(file.at("b").dtype, DType::I16);
  EXPECT_EQ(file.metadata.at("k"), "v");
  // Trailing spaces in the header and gaps in the data buffer are allowed.
  EXPECT_NO_THROW(parse(make_file(kValidHeader + "    ", kData)));
  Bytes longer = kData;
  longer.resize(40);
  EXPECT_NO_THROW(parse(make_file(kValidHeader, longer)));
  // An empty tensor may sit anywhere, even inside another's range.
  EXPECT_NO_THROW(parse(edited(R"("__metadata__")", R"("e":{"dtype":"F64","shape":[4,0],"data_offsets":[8,8]},"__metadata__")")));
}

struct HostileCase {
  std::string name;
  Bytes file;
};

std::vector<HostileCase> hostile_cases() {
  const Bytes valid = valid_file();
  const std::size_t header_end = 8 + kValidHeader.size();
  std::vector<HostileCase> cases = {
      {"Empty", {}},
      {"OneByte", {0x10}},
      {"SevenBytes", prefix_of(valid, 7)},
      {"OnlyLength", prefix_of(valid, 8)},
      {"TruncatedInHeader", prefix_of(valid, 8 + kValidHeader.size() / 2)},
      {"TruncatedInData", prefix_of(valid, valid.size() - 1)},
      {"TruncatedAtDataStart", prefix_of(valid, header_end)},
      {"HeaderLengthPastEnd", with_header_length(valid, valid.size() - 7)},
      {"HeaderLength2Pow63", with_header_length(valid, std::uint64_t{1} << 63)},
      {"HeaderLengthMaxU64", with_header_length(valid, std::numeric_limits<std::uint64_t>::max())},
      {"HeaderLengthOver100MB", with_header_length(valid, 100'000'001)},
      {"HeaderLengthZero", with_header_length(valid, 0)},
      {"HeaderLengthShort", with_header_length(valid, kValidHeader.size() - 1)},
      {"InvalidJson", make_file(R"({"a": {"dtype": )", kData)},
      {"TrailingGarbage", make_file(kValidHeader + " x", kData)},
      {"NulInHeader", make_file(kValidHeader + std::string(1, '\0'), kData)},
      {"NulThenSecondHeader", make_file(kValidHeader + std::string(1, '\0') + R"({"x":1})", kData)},
      {"HeaderIsArray", make_file("[1,2,3]", kData)},
      {"HeaderIsString", make_file(R"("a")", kData)},
      {"HeaderIsNull", make_file("null", kData)},
      {"InvalidUtf8Name", edited(R"("a":)", "\"\xC3\x28\":")},
      {"DeepNesting", make_file(std::string(100000, '[') + std::string(100000, ']'), kData)},
      {"DeepNestingUnclosed", make_file(std::string(1000000, '['), kData)},
      {"EntryNotObject", edited(R"("b":{"dtype":"I16","shape":[3],"data_offsets":[16,22]})", R"("b":3)")},
      {"MissingDtype", edited(R"("dtype":"I16",)", "")},
      {"MissingShape", edited(R"("shape":[3],)", "")},
      {"MissingDataOffsets", edited(R"(,"data_offsets":[16,22])", "")},
      {"UnknownDtype", edited(R"("I16")", R"("F8_E4M3")")},
      {"LowercaseDtype", edited(R"("I16")", R"("i16")")},
      {"DtypeNotString", edited(R"("I16")", "16")},
      {"NegativeShape", edited("[3]", "[-3]")},
      {"NegativeShapePair", edited("[2,2]", "[-2,-2]")},
      {"FractionalShape", edited("[3]", "[3.0]")},
      {"StringShape", edited("[3]", R"(["3"])")},
      {"ShapeNotArray", edited("[3]", "3")},
      {"NestedShape", edited("[3]", "[[3]]")},
      {"ShapeOverflow", edited("[3]", "[1099511627776,1099511627776]")},
      {"ShapeOverflowBehindZero", edited("[3]", "[0,1099511627776,1099511627776]")},
      {"ShapeExtentPastInt64", edited("[3]", "[9223372036854775808]")},
      {"ShapeExtentPastUint64", edited("[3]", "[18446744073709551616]")},
      {"ShapeHugeButFinite", edited("[3]", "[4611686018427387904]")},
      {"OffsetsPastEnd", edited("[16,22]", "[100,106]")},
      {"OffsetsEndPastEnd", edited("[16,22]", "[17,23]")},
      {"OffsetsBeginAfterEnd", edited("[16,22]", "[22,16]")},
      {"OffsetsHuge", edited("[16,22]", "[18446744073709551610,18446744073709551615]")},
      {"OffsetsOneEntry", edited("[16,22]", "[16]")},
      {"OffsetsThreeEntries", edited("[16,22]", "[16,22,22]")},
      {"OffsetsNegative", edited("[0,16]", "[-16,0]")},
      {"OffsetsFractional", edited("[16,22]", "[16.0,22.0]")},
      {"OffsetsNotArray", edited("[16,22]", "16")},
      {"SizeMismatchShape", edited("[3]", "[4]")},
      {"SizeMismatchDtype", edited(R"("I16")", R"("I8")")},
      {"Overlapping", edited("[16,22]", "[10,16]")},
      {"OverlappingIdentical", edited(R"("b":{"dtype":"I16","shape":[3],"data_offsets":[16,22]})",
                                      R"("b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})")},
      {"OverlappingContained", edited(R"("__metadata__")", R"("c":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},"__metadata__")")},
      {"MetadataNonString", edited(R"({"k":"v"})", R"({"k":1})")},
      {"MetadataNestedObject", edited(R"({"k":"v"})", R"({"k":{"x":"y"}})")},
      {"MetadataNotObject", edited(R"({"k":"v"})", R"(["k","v"])")},
      {"MetadataNull", edited(R"({"k":"v"})", "null")},
      {"DuplicateTensor", edited(R"("__metadata__")", R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__")")},
      {"DuplicateField", edited(R"("dtype":"I16")", R"("dtype":"I16","dtype":"I8")")},
  };
  return cases;
}

void PrintTo(const HostileCase& hostile, std::ostream* out) { *out << hostile.name; }

class HostileInput : public testing::TestWithParam<HostileCase> {};

TEST_P(HostileInput, ThrowsIoError) {
  const Bytes& file = GetParam().file;
  try {
    parse(file);
    FAIL() << "parsed without error";
  } catch (const io_error& error) {
    EXPECT_NE(std::string(error.what()), "");
  }
}

INSTANTIATE_TEST_SUITE_P(Safetensors, HostileInput, testing::ValuesIn(hostile_cases()),
                         [](const testing::TestParamInfo<HostileCase>& info) { return info.param.name; });

TEST(Safetensors, HostileInputMessagesSayWhatIsWrong) {
  auto message = [](const Bytes& file) -> std::string {
    try {
      parse(file);
    } catch (const io_error& error) {
      return error.what();
    }
    return "(no error)";
  };
  EXPECT_NE(message(edited(R"("I16")", R"("F8_E4M3")")).find("F8_E4M3"), std::string::npos);
  EXPECT_NE(message(edited("[16,22]", "[10,16]")).find("overlap"), std::string::npos);
  EXPECT_NE(message(edited("[3]", "[-3]")).find("'b'"), std::string::npos);
  EXPECT_NE(message(with_header_length(valid_file(), std::uint64_t{1} << 63)).find("header length"), std::string::npos);
  EXPECT_NE(message(edited(R"({"k":"v"})", R"({"k":1})")).find("__metadata__"), std::string::npos);
  EXPECT_NE(message(edited(R"("dtype":"I16")", R"("dtype":"I16","dtype":"I8")")).find("'b': duplicate key 'dtype'"),
            std::string::npos);
  EXPECT_NE(message(edited(R"({"k":"v"})", R"({"k":"v","k":"w"})")).find("duplicate __metadata__ key 'k'"),
            std::string::npos);
}

TEST(Safetensors, ParseErrorsStayShortAndSayWhere) {
  // nlohmann's message quotes the whole token it was reading: an unclosed
  // string of a megabyte must not make a megabyte of error text.
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},")" + std::string(1'000'000, 'x');
  try {
    parse(make_file(header, Bytes(4)));
    FAIL() << "parsed";
  } catch (const io_error& error) {
    const std::string what = error.what();
    EXPECT_LT(what.size(), 400u) << what.substr(0, 400);
    // Bytes count from 1: the closing quote was due just past the last one.
    EXPECT_NE(what.find("header is not valid JSON at byte " + std::to_string(header.size() + 1) + ": "),
              std::string::npos)
        << what.substr(0, 400);
  }
}

TEST(Safetensors, ParsedShapesHoldNoSpareCapacity) {
  // The parsed header costs a small multiple of its text: a shape of n
  // extents keeps n, not the next power of two.
  const TensorFile file = parse(make_file(R"({"z":{"dtype":"U8","shape":[0,0,0,0,0],"data_offsets":[0,0]}})", {}));
  EXPECT_EQ(file.at("z").shape.capacity(), 5u);
}

TEST(Safetensors, EveryTruncationParsesOrThrowsIoError) {
  TensorFile file;
  file.metadata["variant"] = "mha";
  file.put("w", StoredTensor::from(tensor_of({2, 3}, {1, 2, 3, 4, 5, 6}), DType::F16));
  file.put("m", StoredTensor::from(tensor_of({2}, {0, 1}), DType::BOOL));
  file.put("z", StoredTensor::from(Tensor<double>({0})));
  const Bytes full = serialize_safetensors(file);
  for (std::size_t length = 0; length < full.size(); ++length) {
    SCOPED_TRACE(length);
    EXPECT_THROW(parse(prefix_of(full, length)), io_error);
  }
  EXPECT_NO_THROW(parse(full));
}

TEST(Safetensors, RandomCorruptionParsesOrThrowsIoError) {
  // A cheap fuzz with a fixed seed: mutate bytes (mostly in the header,
  // where the parser's decisions are) and require io_error or success.
  const Bytes valid = valid_file();
  const std::size_t header_end = 8 + kValidHeader.size();
  const char kInteresting[] = "{}[],:\"0123456789-.e \\\x00\xff";
  const std::string interesting(kInteresting, sizeof kInteresting - 1);  // keeps the NUL
  std::mt19937 random(12345);
  for (int trial = 0; trial < 20000; ++trial) {
    Bytes file = valid;
    const int edits = 1 + static_cast<int>(random() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = random() % 8 == 0 ? random() % file.size() : random() % header_end;
      file[at] = random() % 2 ? static_cast<unsigned char>(interesting[random() % interesting.size()])
                              : static_cast<unsigned char>(random());
    }
    if (random() % 4 == 0) file.resize(random() % (file.size() + 1));
    parse_or_io_error(file);
  }
}

// ---- reading on demand (SafetensorsReader) and sliced reads ----------------

/// Bytes written to a temp file, removed with the object.
struct TempFile {
  std::filesystem::path path;
  TempFile(const std::string& stem, const Bytes& bytes) : path(temp_path(stem)) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  TempFile(const std::string& stem, const TensorFile& file) : path(temp_path(stem)) {
    save_safetensors(path.string(), file);
  }
  ~TempFile() { std::filesystem::remove(path); }
};

// Element (i, j, k) of the [3, 4, 5] test tensor: exact in every float dtype.
double element(Index i, Index j, Index k) { return double(16 * i + 4 * j + k) - 20; }

TEST(SafetensorsReader, SlicesAreTheNaiveSlicesInEveryDType) {
  const Index extent[3] = {3, 4, 5};
  Tensor<double> t({3, 4, 5});
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 4; ++j)
      for (Index k = 0; k < 5; ++k) t[(i * 4 + j) * 5 + k] = element(i, j, k);
  for (const DType dtype : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I16}) {
    SCOPED_TRACE(dtype_name(dtype));
    TensorFile file;
    file.put("t", StoredTensor::from(t, dtype));
    const TempFile saved("slices", file);
    const SafetensorsReader reader(saved.path.string());
    for (std::size_t axis = 0; axis < 3; ++axis) {
      const Index e = extent[axis];
      for (const auto& [first, count] : {std::pair<Index, Index>{0, e}, {1, 1}, {e - 2, 2}, {e, 0}, {1, e - 1}}) {
        const std::uint64_t before = reader.bytes_read();
        const Tensor<double> got = reader.get<double>("t", {axis, first, count});
        std::vector<Index> shape = {3, 4, 5};
        shape[axis] = count;
        ASSERT_EQ(got.shape(), shape) << "axis " << axis << " [" << first << ", +" << count << ")";
        EXPECT_EQ(reader.bytes_read() - before, std::uint64_t(got.size()) * dtype_size(dtype));
        const Tensor<double> in_memory = file.get<double>("t", {axis, first, count});
        Index n = 0;
        for (Index i = 0; i < shape[0]; ++i)
          for (Index j = 0; j < shape[1]; ++j)
            for (Index k = 0; k < shape[2]; ++k, ++n) {
              Index at[3] = {i, j, k};
              at[axis] += first;
              EXPECT_EQ(got[n], element(at[0], at[1], at[2])) << "axis " << axis << " element " << n;
              EXPECT_EQ(in_memory[n], got[n]);
            }
      }
    }
    // Whole reads equal the in-memory file's.
    EXPECT_EQ(reader.get<float>("t").shape(), file.get<float>("t").shape());
    const Tensor<double> whole = reader.get<double>("t");
    for (Index n = 0; n < whole.size(); ++n) EXPECT_EQ(whole[n], t[n]);
  }
}

TEST(SafetensorsReader, MatrixAndVectorSlices) {
  TensorFile file;
  file.put("m", StoredTensor::from(tensor_of({2, 3}, {1, 2, 3, 4, 5, 6}), DType::BF16));
  file.put("v", StoredTensor::from(tensor_of({4}, {7, 8, 9, 10}), DType::F32));
  file.metadata["format"] = "pt";
  const TempFile saved("matrix", file);
  const SafetensorsReader reader(saved.path.string());
  EXPECT_EQ(reader.metadata(), file.metadata);
  EXPECT_EQ(reader.shape("m"), (std::vector<Index>{2, 3}));
  const headmix::Matrix<float> columns = reader.matrix<float>("m", {1, 1, 2});
  ASSERT_EQ(columns.rows(), 2);
  ASSERT_EQ(columns.cols(), 2);
  EXPECT_EQ(columns(0, 0), 2);
  EXPECT_EQ(columns(0, 1), 3);
  EXPECT_EQ(columns(1, 0), 5);
  EXPECT_EQ(columns(1, 1), 6);
  const headmix::Matrix<double> row = reader.matrix<double>("m", {0, 1, 1});
  EXPECT_EQ(row, file.matrix<double>("m").middleRows(1, 1));
  const headmix::Vector<double> middle = reader.vector<double>("v", {0, 1, 2});
  ASSERT_EQ(middle.size(), 2);
  EXPECT_EQ(middle(0), 8);
  EXPECT_EQ(middle(1), 9);
  EXPECT_EQ(reader.vector<double>("v"), file.vector<double>("v"));
  // load_safetensors reads through the same reader: the same bytes.
  const TensorFile loaded = load_safetensors(saved.path.string());
  EXPECT_EQ(loaded.at("m").bytes, file.at("m").bytes);
  EXPECT_EQ(reader.stored("v").bytes, file.at("v").bytes);
}

TEST(SafetensorsReader, ErrorsNameTheTensorAndThePath) {
  TensorFile file;
  file.put("t", StoredTensor::from(tensor_of({2, 3}, {1, 2, 3, 4, 5, 300}), DType::I16));
  const TempFile saved("errors", file);
  const SafetensorsReader reader(saved.path.string());
  const std::string path = saved.path.string();
  auto message = [](auto&& read) -> std::string {
    try {
      read();
    } catch (const std::exception& error) {
      return error.what();
    }
    return "no error";
  };
  const std::string missing = message([&] { reader.get<double>("absent"); });
  EXPECT_NE(missing.find(path), std::string::npos) << missing;
  EXPECT_NE(missing.find("missing tensor 'absent'"), std::string::npos) << missing;
  EXPECT_THROW(reader.get<double>("absent"), io_error);
  // Reads of the wrong rank and slices outside the tensor: shape_error, as TensorFile's.
  EXPECT_THROW(reader.vector<double>("t"), headmix::shape_error);
  EXPECT_THROW(file.vector<double>("t"), headmix::shape_error);
  for (const headmix::AxisSlice bad : {headmix::AxisSlice{2, 0, 1}, headmix::AxisSlice{0, 1, 2},
                                       headmix::AxisSlice{1, -1, 1}, headmix::AxisSlice{1, 0, -1}}) {
    EXPECT_THROW(reader.get<double>("t", bad), headmix::shape_error) << bad.axis << " " << bad.first << " " << bad.count;
    EXPECT_THROW(file.get<double>("t", bad), headmix::shape_error);
  }
  const std::string outside = message([&] { reader.matrix<double>("t", {0, 1, 2}); });
  EXPECT_NE(outside.find("axis 0 holds entries [1, 3)"), std::string::npos) << outside;
  // A value that does not fit the type: io_error naming the path; the slice
  // without it reads.
  const std::string narrow = message([&] { reader.get<std::int8_t>("t"); });
  EXPECT_NE(narrow.find(path), std::string::npos) << narrow;
  EXPECT_EQ(reader.get<std::int8_t>("t", {1, 0, 2}).size(), 4);
  // The file shrinks after it was opened.
  std::filesystem::resize_file(saved.path, std::filesystem::file_size(saved.path) - 2);
  const std::string shrank = message([&] { reader.get<double>("t"); });
  EXPECT_NE(shrank.find(path), std::string::npos) << shrank;
  EXPECT_THROW(reader.get<double>("t"), io_error);
}

TEST(SafetensorsReader, RefusesWhatTheParserRefuses) {
  for (const HostileCase& hostile : hostile_cases()) {
    SCOPED_TRACE(hostile.name);
    const TempFile saved("hostile", hostile.file);
    EXPECT_THROW(SafetensorsReader(saved.path.string()), io_error);
  }
  const TempFile valid("valid", valid_file());
  const SafetensorsReader reader(valid.path.string());
  const TensorFile parsed = parse(valid_file());
  EXPECT_EQ(reader.tensors.size(), parsed.tensors.size());
  for (const auto& [name, tensor] : parsed.tensors) EXPECT_EQ(reader.stored(name).bytes, tensor.bytes) << name;
}

}  // namespace
