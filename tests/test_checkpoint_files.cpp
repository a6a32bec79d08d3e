// Hostile and unusual checkpoint files, generated here rather than stored:
// every file must end in an io_error / shape_error that names the tensor, or
// load exactly the tensors it describes and round-trip through the writer
// with the same bytes; and every variant's from_tensors must either throw or
// build the layer the file describes (fuzz/layer_check.hpp, shared with the
// fuzz target). With HEADMIX_WRITE_FUZZ_SEEDS=<folder>, WriteFuzzSeeds
// writes the small layer files there (how tests/fuzz/corpus/ was made).
// Last, typed over the variants of tests/variants.hpp: from_tensors reads
// each variant's own names under a prefix, in any storage type, and names
// the stored tensor in its errors.
#include "fuzz/layer_check.hpp"
#include "variants.hpp"

#include <headmix/io/safetensors.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using headmix::Index;
using namespace headmix::io;
using Bytes = std::vector<unsigned char>;

// ---- the generator -----------------------------------------------------------

/// A tensor as the file describes it. Without `offsets` it is laid out right
/// after the previous tensor.
struct Spec {
  std::string name;
  std::string dtype;
  std::vector<Index> shape;
  Bytes bytes;
  std::optional<std::pair<std::uint64_t, std::uint64_t>> offsets;
};

Spec f32(const std::string& name, std::vector<Index> shape, float first = 0.25f) {
  Index count = 1;
  for (const Index e : shape) count *= e;
  Bytes bytes(static_cast<std::size_t>(count) * 4);
  for (Index i = 0; i < count; ++i) {
    const float value = first + 0.125f * static_cast<float>(i % 17) - 0.5f * static_cast<float>(i % 3);
    std::memcpy(bytes.data() + 4 * i, &value, 4);
  }
  return {name, "F32", std::move(shape), std::move(bytes), std::nullopt};
}

/// An empty tensor at explicit offsets.
Spec empty_at(const std::string& name, std::vector<Index> shape, std::uint64_t at, const std::string& dtype = "F32") {
  return {name, dtype, std::move(shape), {}, std::make_pair(at, at)};
}

/// The file bytes: header text from `specs` (plus `extra`, raw JSON members
/// appended inside the root object), then the data buffer.
Bytes write_file(const std::vector<Spec>& specs, const std::string& extra = "") {
  std::string header = "{";
  Bytes data;
  std::uint64_t next = 0;
  for (const Spec& s : specs) {
    const auto [begin, end] = s.offsets.value_or(std::make_pair(next, next + s.bytes.size()));
    if (!s.bytes.empty() && end > data.size()) data.resize(end);  // an empty tensor does not grow the buffer
    std::copy(s.bytes.begin(), s.bytes.end(), data.begin() + static_cast<std::ptrdiff_t>(begin));
    if (!s.offsets) next = end;
    if (header.size() > 1) header += ',';
    header += nlohmann::json(s.name).dump() + ":{\"dtype\":\"" + s.dtype + "\",\"shape\":" +
              nlohmann::json(s.shape).dump() + ",\"data_offsets\":[" + std::to_string(begin) + "," +
              std::to_string(end) + "]}";
  }
  if (!extra.empty()) header += (header.size() > 1 ? "," : "") + extra;
  header += '}';
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>((std::uint64_t{header.size()} >> (8 * i)) & 0xFF));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<Spec> with(std::vector<Spec> specs, const Spec& replacement) {
  for (Spec& s : specs)
    if (s.name == replacement.name) {
      s = replacement;
      return specs;
    }
  specs.push_back(replacement);
  return specs;
}

std::vector<Spec> without(std::vector<Spec> specs, const std::string& name) {
  std::vector<Spec> kept;
  for (Spec& s : specs)
    if (s.name != name) kept.push_back(std::move(s));
  return kept;
}

// Valid layers for headmix_check's options: D = 4, two heads of 2.
std::vector<Spec> linear(const std::string& p, const std::string& name, bool bias, float first) {
  std::vector<Spec> specs = {f32(p + name + ".weight", {4, 4}, first)};
  if (bias) specs.push_back(f32(p + name + ".bias", {4}, first + 1));
  return specs;
}

std::vector<Spec> concat(std::initializer_list<std::vector<Spec>> parts) {
  std::vector<Spec> all;
  for (const auto& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

std::vector<Spec> mha_layer(const std::string& p) {
  return concat({linear(p, "q", true, 0.5f), linear(p, "k", true, -0.25f), linear(p, "v", true, 0.75f),
                 linear(p, "o", true, 0.125f)});
}
std::vector<Spec> talking_heads_layer(const std::string& p) {
  return concat({linear(p, "q", false, 0.5f), linear(p, "k", false, -0.25f), linear(p, "v", false, 0.75f),
                 linear(p, "o", false, 0.125f), {f32(p + "pre_softmax.weight", {2, 2}, 1.0f)},
                 {f32(p + "post_softmax.weight", {2, 2}, 0.5f)}});
}
std::vector<Spec> collab_layer(const std::string& p) {
  return concat({{f32(p + "q.weight", {4, 4}, 0.5f), f32(p + "k.weight", {4, 4}, -0.25f), f32(p + "mixing", {2, 4}, 1),
                  f32(p + "content_bias.weight", {2, 4}, 0.1f)},
                 linear(p, "v", true, 0.75f), linear(p, "o", true, 0.125f),
                 {f32(p + "layer_norm.weight", {4}, 1), f32(p + "layer_norm.bias", {4}, 0)}});
}
std::vector<Spec> lsh_layer(const std::string& p) {
  return concat({linear(p, "qk", false, 0.5f), linear(p, "v", false, 0.75f), linear(p, "o", true, 0.125f),
                 {f32(p + "rotations", {1, 2, 2, 2}, -0.5f)}});
}
std::vector<Spec> dcmha_layer(const std::string& p, bool static_w) {
  std::vector<Spec> specs =
      concat({linear(p, "q", false, 0.5f), linear(p, "k", false, -0.25f), linear(p, "v", false, 0.75f),
              linear(p, "o", false, 0.125f),
              {f32(p + "dc.dw1", {4, 1, 4, 2}, 0.1f), f32(p + "dc.qkw", {1, 4, 2, 4, 2}, -0.1f),
               f32(p + "dc.dd", {4, 1, 8}, 0.2f)}});
  if (static_w) specs = concat({specs, {f32(p + "dc.pre_w", {1, 2, 2}, 0.3f), f32(p + "dc.post_w", {1, 2, 2}, -0.3f)}});
  return specs;
}

// The message of the io_error `fn` throws, or why there is none.
template <class Fn>
std::string io_error_message(Fn&& fn) {
  try {
    fn();
  } catch (const io_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not an io_error: ") + e.what() + ">";
  }
  return "<no exception>";
}

// ---- file-level catalogue ----------------------------------------------------

struct FileCase {
  std::string name;
  Bytes file;
  std::vector<Spec> described;  ///< what must load, when `error` is empty
  std::string error;            ///< else a piece of the io_error's message
};

std::vector<FileCase> file_cases() {
  std::vector<FileCase> cases;
  auto loads = [&](const std::string& name, const std::vector<Spec>& specs, const std::string& extra = "") {
    cases.push_back({name, write_file(specs, extra), specs, ""});
  };
  auto fails = [&](const std::string& name, const std::vector<Spec>& specs, const std::string& extra,
                   const std::string& error) { cases.push_back({name, write_file(specs, extra), {}, error}); };

  loads("Empty", {});
  loads("ValidMha", mha_layer("attn."));
  loads("ValidDcmhaStatic", dcmha_layer("", true));
  loads("MetadataOnly", {}, R"("__metadata__":{"variant":"mha","note":"\u00e9\n"})");
  loads("EmptyTensorsAtZero", concat({mha_layer(""), {empty_at("z0", {0}, 0), empty_at("z1", {0, 0}, 0),
                                                        empty_at("z2", {3, 0, 5}, 0, "BF16")}}));
  loads("EmptyTensorInsideAnother", concat({{f32("a", {4})}, {empty_at("b", {0, 7}, 8, "I64")}}));
  loads("RankZeroScalars", {f32("s", {}), {"u", "U8", {}, {0xFF}, std::nullopt}, {"b", "BOOL", {}, {2}, std::nullopt}});
  loads("RankAtTheCap", {empty_at("r", std::vector<Index>(1024, 0), 0, "U8")});
  loads("ReverseNameOrder", {f32("z", {3}), f32("m", {2, 1}), f32("a", {1})});
  loads("GapsInTheBuffer", {f32("a", {2}), {"b", "I16", {2}, {1, 0, 2, 0}, std::make_pair(std::uint64_t{40}, std::uint64_t{44})}});
  loads("UnicodeAndEscapedNames", {f32("\xc3\xa9t\xc3\xa9", {1}), f32("tab\there", {1}), f32("", {1})});
  loads("LongName", {f32(std::string(100000, 'n'), {1})});
  loads("PrefixedOptionLikeName", concat({mha_layer("attn."), {{"attn.num_heads", "I64", {}, Bytes(8, 0), std::nullopt}}}));

  fails("RankOverTheCap", {empty_at("deep", std::vector<Index>(1025, 0), 0, "U8")}, "", "'deep': shape has more than 1024");
  fails("UnknownField", {}, R"("x":{"dtype":"F32","shape":[],"data_offsets":[0,4],"byte_order":"big"})",
        "'x': unknown field 'byte_order'");
  fails("DuplicateShapeField", {}, R"("x":{"dtype":"U8","shape":[0],"shape":[],"data_offsets":[0,0]})",
        "'x': duplicate key 'shape'");
  fails("DuplicateMetadataKey", {}, R"("__metadata__":{"k":"a","k":"b"})", "duplicate __metadata__ key 'k'");
  fails("DuplicateTensor", {f32("x", {1})}, R"("x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})", "duplicate key 'x'");
  fails("DuplicateMetadata", {}, R"("__metadata__":{},"__metadata__":{})", "duplicate key '__metadata__'");
  fails("EmptyTensorPastTheEnd", {f32("a", {1}), empty_at("e", {0}, 100)}, "", "'e': data_offsets [100, 100] run past");
  fails("ShapeOfObjects", {}, R"("x":{"dtype":"U8","shape":[{}],"data_offsets":[0,0]})", "'x': shape entry an object");
  fails("ShapeIsObject", {}, R"("x":{"dtype":"U8","shape":{},"data_offsets":[0,0]})", "'x': shape an object");
  fails("OffsetsNested", {}, R"("x":{"dtype":"U8","shape":[0],"data_offsets":[[0],[0]]})", "'x': data_offsets entry an array");
  fails("ThreeOffsets", {}, R"("x":{"dtype":"U8","shape":[0],"data_offsets":[0,0,0]})", "'x': data_offsets hold more than two");
  fails("OneOffset", {}, R"("x":{"dtype":"U8","shape":[0],"data_offsets":[0]})", "'x': data_offsets hold 1 entries");
  fails("DtypeIsArray", {}, R"("x":{"dtype":["U8"],"shape":[0],"data_offsets":[0,0]})", "'x': dtype an array");
  fails("MissingOffsets", {}, R"("x":{"dtype":"U8","shape":[0]})", "'x': missing 'data_offsets'");
  fails("NegativeZeroIsZeroButMinusOneIsNot", {}, R"("x":{"dtype":"U8","shape":[-0,-1],"data_offsets":[0,0]})",
        "'x': shape entry -1");
  fails("FloatExtent", {}, R"("x":{"dtype":"U8","shape":[1e3],"data_offsets":[0,0]})", "'x': shape entry 1e3");
  fails("MetadataNumber", {}, R"("__metadata__":{"k":7})", "__metadata__ value of 'k' is 7");
  fails("MetadataAsTensorEntry", {}, R"("__metadata__":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})",
        "__metadata__ value of 'shape' is an array");
  fails("EntryIsString", {}, R"("x":"F32")", "'x': header entry is \"F32\"");
  return cases;
}

void PrintTo(const FileCase& c, std::ostream* out) { *out << c.name; }

class CheckpointFile : public testing::TestWithParam<FileCase> {};

TEST_P(CheckpointFile, LoadsExactlyOrNamesTheProblem) {
  const FileCase& c = GetParam();
  if (!c.error.empty()) {
    try {
      parse_safetensors(c.file.data(), c.file.size());
      FAIL() << "parsed without error";
    } catch (const io_error& e) {
      EXPECT_NE(std::string(e.what()).find(c.error), std::string::npos) << e.what();
    }
    return;
  }
  const TensorFile file = parse_safetensors(c.file.data(), c.file.size());
  ASSERT_EQ(file.tensors.size(), c.described.size());
  for (const Spec& s : c.described) {
    SCOPED_TRACE(s.name.substr(0, 40));
    ASSERT_TRUE(file.contains(s.name));
    const StoredTensor& t = file.at(s.name);
    EXPECT_STREQ(dtype_name(t.dtype), s.dtype.c_str());
    EXPECT_EQ(t.shape, s.shape);
    EXPECT_EQ(t.bytes, s.bytes);
  }
  // The writer writes it back, and the copy reads the same, byte for byte.
  const Bytes again = serialize_safetensors(file);
  const TensorFile copy = parse_safetensors(again.data(), again.size());
  EXPECT_EQ(copy.metadata, file.metadata);
  ASSERT_EQ(copy.tensors.size(), file.tensors.size());
  for (const auto& [name, t] : file.tensors) {
    const StoredTensor& u = copy.at(name);
    EXPECT_TRUE(u.dtype == t.dtype && u.shape == t.shape && u.bytes == t.bytes) << name.substr(0, 40);
  }
}

INSTANTIATE_TEST_SUITE_P(Generated, CheckpointFile, testing::ValuesIn(file_cases()),
                         [](const testing::TestParamInfo<FileCase>& info) { return info.param.name; });

// ---- layer-level catalogue ---------------------------------------------------

using Outcome = headmix_check::Built::Outcome;

struct LayerCase {
  std::string name;
  std::vector<Spec> specs;  ///< under the prefix "attn."
  std::string variant;      ///< the variant the file is meant for (headmix_check's names)
  std::string error;        ///< empty: builds; else a piece of the error's message
  Outcome outcome = Outcome::shape_error;  ///< the error's kind, when there is one
};

std::vector<LayerCase> layer_cases(const std::string& p) {
  const Spec q_bias_at_64 = empty_at(p + "q.bias", {0}, 64);
  return {
      {"MhaValid", mha_layer(p), "mha", ""},
      {"MhaWithoutBiasesAndO", concat({linear(p, "q", false, 1), linear(p, "k", false, 2), linear(p, "v", false, 3)}),
       "mha", ""},
      {"MhaQBiasShapeZero", with(mha_layer(p), q_bias_at_64), "mha", "[io] " + p + "q.bias: expected a tensor with"},
      {"MhaQBiasRankZero", with(mha_layer(p), f32(p + "q.bias", {})), "mha", p + "q.bias: expected a rank-1 tensor"},
      {"MhaOWeightZeroByZero", with(without(mha_layer(p), p + "o.bias"), empty_at(p + "o.weight", {0, 0}, 0)), "mha",
       p + "o.weight: expected a tensor with"},
      {"MhaOWeightAndBiasEmpty", with(with(mha_layer(p), empty_at(p + "o.weight", {0, 0}, 0)), empty_at(p + "o.bias", {0}, 0)),
       "mha", p + "o.weight: expected a tensor with"},
      {"MhaOBiasWithoutWeight", without(mha_layer(p), p + "o.weight"), "mha", "missing tensor '" + p + "o.weight'",
       Outcome::io_error},
      // A name under one of the layer's stems that is not one of its tensors
      // (a q bias changes the output) is refused; other stems belong to
      // other layers under a broader prefix and stay allowed.
      {"MhaQWeightScale", with(mha_layer(p), f32(p + "q.weight_scale", {4})), "mha",
       "'" + p + "q.weight_scale' is not a tensor of this layer", Outcome::io_error},
      {"MhaForeignStems", concat({mha_layer(p), {f32(p + "qkv.weight", {4, 4}), f32(p + "mlp.fc.weight", {2, 2})}}),
       "mha", ""},
      {"TalkingHeadsValid", talking_heads_layer(p), "talking_heads", ""},
      {"TalkingHeadsPreMixZero", with(talking_heads_layer(p), empty_at(p + "pre_softmax.weight", {0, 2}, 0)),
       "talking_heads", p + "pre_softmax.weight: expected a tensor with"},
      {"CollabValid", collab_layer(p), "collab", ""},
      {"CollabQAndKBias", concat({collab_layer(p), {f32(p + "q.bias", {4}), f32(p + "k.bias", {4})}}), "collab",
       "'" + p + "k.bias' is not a tensor of this layer", Outcome::io_error},
      {"CollabMixingBias", with(collab_layer(p), f32(p + "mixing.bias", {2})), "collab",
       "'" + p + "mixing.bias' is not a tensor of this layer", Outcome::io_error},
      {"CollabContentBiasTwoByZero", with(collab_layer(p), empty_at(p + "content_bias.weight", {2, 0}, 0)), "collab",
       p + "content_bias.weight: expected a tensor with"},
      {"CollabContentBiasTwoByOne", with(collab_layer(p), f32(p + "content_bias.weight", {2, 1})), "collab",
       "[collab] " + p + "content_bias.weight: expected [2, 4], got [2, 1]"},
      {"CollabLayerNormEmpty",
       with(with(collab_layer(p), empty_at(p + "layer_norm.weight", {0}, 0)), empty_at(p + "layer_norm.bias", {0}, 0)),
       "collab", p + "layer_norm.weight: expected a tensor with"},
      {"LshValid", lsh_layer(p), "lsh", ""},
      {"LshWithoutRotations", without(lsh_layer(p), p + "rotations"), "lsh", ""},
      {"LshRotationsRankZero", with(lsh_layer(p), f32(p + "rotations", {})), "lsh", p + "rotations: expected a tensor with"},
      {"DcmhaValid", dcmha_layer(p, false), "dcmha", ""},
      {"DcmhaStaticValid", dcmha_layer(p, true), "dcmha_static_w", ""},
      // A static term for a stage the options leave out would be kept and
      // never applied; one the options need must be in the file.
      {"DcmhaStaticPreWithoutPreStage", dcmha_layer(p, true), "dcmha_static_post_only",
       "[dcmha] " + p + "dc.pre_w: expected none (use_pre is false"},
      {"DcmhaStaticPostOnlyValid", without(dcmha_layer(p, true), p + "dc.pre_w"), "dcmha_static_post_only", ""},
      {"DcmhaStaticWithoutPreW", without(dcmha_layer(p, true), p + "dc.pre_w"), "dcmha_static_w",
       "missing tensor '" + p + "dc.pre_w'", Outcome::io_error},
      {"DcmhaUnknownDcTensor", with(dcmha_layer(p, false), f32(p + "dc.qw", {2})), "dcmha",
       "'" + p + "dc.qw' is not a tensor of this layer", Outcome::io_error},
      {"DcmhaPreWRankZero", with(dcmha_layer(p, false), f32(p + "dc.pre_w", {})), "dcmha",
       p + "dc.pre_w: expected a tensor with"},
      {"DcmhaPreWWithoutStaticW", with(dcmha_layer(p, false), f32(p + "dc.pre_w", {1, 1, 1})), "dcmha",
       "[dcmha] " + p + "dc.pre_w: expected none (static_w is false)"},
  };
}

void PrintTo(const LayerCase& c, std::ostream* out) { *out << c.name; }

class CheckpointLayer : public testing::TestWithParam<LayerCase> {};

TEST_P(CheckpointLayer, BuildsWhatTheFileDescribesOrNamesTheTensor) {
  const LayerCase& c = GetParam();
  const Bytes bytes = write_file(c.specs);
  const TensorFile file = parse_safetensors(bytes.data(), bytes.size());
  for (const headmix_check::Built& built : headmix_check::build_every_variant(file, "attn.")) {
    SCOPED_TRACE(built.variant);
    // Whatever the variant, a layer that builds holds exactly the file's tensors.
    EXPECT_EQ(built.mismatch, "");
    if (built.variant != c.variant) continue;
    if (c.error.empty()) {
      EXPECT_EQ(built.outcome, Outcome::built) << built.message;
    } else {
      EXPECT_EQ(built.outcome, c.outcome) << built.message;
      EXPECT_NE(built.message.find(c.error), std::string::npos) << built.message;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Generated, CheckpointLayer, testing::ValuesIn(layer_cases("attn.")),
                         [](const testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

TEST(CheckpointFiles, OptionErrorsKeepTheirNames) {
  // A tensor named like an option must not turn the option's error into a
  // tensor's: options are never tensors.
  const Bytes bytes =
      write_file(concat({mha_layer("attn."), {{"attn.num_heads", "I64", {}, Bytes(8, 0), std::nullopt}}}));
  const TensorFile file = parse_safetensors(bytes.data(), bytes.size());
  headmix::MhaOptions options;
  const auto message = [&] {
    return headmix_test::shape_error_message([&] { (void)headmix::Mha<double>::from_tensors(file, "attn.", options); });
  };
  options.num_heads = 0;
  const std::string zero = message();
  EXPECT_EQ(zero.rfind("[mha] num_heads: ", 0), 0u) << zero;
  // A tensor's error still gets the prefix.
  options.num_heads = 3;
  const std::string three = message();
  EXPECT_EQ(three.rfind("[mha] attn.q.weight: ", 0), 0u) << three;
}

TEST(CheckpointFiles, AHeaderThatCannotBeWrittenBackIsRefused) {
  // 300 empty tensors at [0, 0] after a 1000-byte tensor in name order: the
  // writer puts them at [1000, 1000], 6 bytes more each, so a header within
  // 1800 bytes of the 100 MB limit would come out over it.
  std::vector<Spec> specs = {{"a", "U8", {1000}, Bytes(1000, 7), std::nullopt}};
  for (int i = 0; i < 300; ++i) specs.push_back(empty_at("b" + std::to_string(1000 + i), {0, 0}, 0, "U8"));
  const Bytes small = write_file(specs);
  const std::size_t header_now = small.size() - 8 - 1000;
  // Pad with metadata to a header of 100,000,000 - 1000 bytes.
  const std::string filler_member = R"("__metadata__":{"pad":""})";
  const std::size_t pad = 100'000'000 - 1000 - header_now - filler_member.size() - 1;
  const Bytes big = write_file(specs, R"("__metadata__":{"pad":")" + std::string(pad, 'x') + "\"}");
  ASSERT_EQ(big.size(), 8 + 100'000'000 - 1000 + 1000u);
  const std::string msg = io_error_message([&] { parse_safetensors(big.data(), big.size()); });
  EXPECT_NE(msg.find("when written back"), std::string::npos) << msg;
}

TEST(CheckpointFiles, AHugeRankIsRefusedEarly) {
  // 5 million zero extents: before the rank cap this parsed (numel 0) into
  // hundreds of MB of JSON values and shape.
  std::string shape = "[0";
  for (int i = 1; i < 5'000'000; ++i) shape += ",0";
  shape += ']';
  const Bytes file = write_file({}, R"("x":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,0]})");
  const std::string msg = io_error_message([&] { parse_safetensors(file.data(), file.size()); });
  EXPECT_NE(msg.find("'x': shape has more than 1024 extents"), std::string::npos) << msg;
}

TEST(CheckpointFiles, WriteFuzzSeeds) {
  const char* folder = std::getenv("HEADMIX_WRITE_FUZZ_SEEDS");
  if (folder == nullptr) GTEST_SKIP() << "set HEADMIX_WRITE_FUZZ_SEEDS=<folder> to write the seeds";
  for (const LayerCase& c : layer_cases("")) {
    const Bytes bytes = write_file(c.specs);
    std::ofstream out(std::filesystem::path(folder) / ("layer_" + c.name + ".safetensors"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good());
  }
}

}  // namespace

// ---- from_tensors: each variant's names under a prefix ------------------------

namespace {

using headmix::Tensor;
namespace vt = headmix_test::variants;

// A weight as a tensor to store: a matrix [rows, cols], a vector [n].
Tensor<double> as_tensor(const headmix::Matrix<double>& m) {
  Tensor<double> t({m.rows(), m.cols()});
  std::copy_n(m.data(), m.size(), t.data());
  return t;
}
Tensor<double> as_tensor(const headmix::Vector<double>& v) {
  Tensor<double> t({v.size()});
  std::copy_n(v.data(), v.size(), t.data());
  return t;
}
const Tensor<double>& as_tensor(const Tensor<double>& t) { return t; }
bool absent(const Tensor<double>& t) { return t.rank() == 0 || t.size() == 0; }
template <class M> bool absent(const M& m) { return m.size() == 0; }

// What a stored tensor holds, read back into the weight's own type.
void read_back(const TensorFile& f, const std::string& name, headmix::Matrix<double>& m) { m = f.matrix<double>(name); }
void read_back(const TensorFile& f, const std::string& name, headmix::Vector<double>& v) {
  const Tensor<double> t = f.get<double>(name);
  v = Eigen::Map<const headmix::Vector<double>>(t.data(), t.size());
}
void read_back(const TensorFile& f, const std::string& name, Tensor<double>& t) { t = f.get<double>(name); }

// Weights w written to f under `prefix` with the variant's names, the n-th
// present one stored as F64, F32, BF16, F16 in turn: the weights as the file
// holds them, and how far (relative) the storage moved any value.
template <class W>
struct Stored {
  W w;
  double worst = 0;
};
template <class V, class W>
Stored<W> store(TensorFile& f, const std::string& prefix, const W& w) {
  const DType storage[] = {DType::F64, DType::F32, DType::BF16, DType::F16};
  Stored<W> r{w};
  std::size_t n = 0;
  V::for_each_tensor(r.w, [&](const std::string& name, auto& value) {
    if (absent(value)) return;
    const Tensor<double> before = as_tensor(value);
    f.put(prefix + name, StoredTensor::from(before, storage[n++ % 4]));
    read_back(f, prefix + name, value);
    const Tensor<double>& after = as_tensor(value);
    for (Index i = 0; i < before.size(); ++i)
      r.worst = std::max(r.worst, std::abs(after[i] - before[i]) / (std::abs(before[i]) + 1e-6));
  });
  return r;
}

std::string shape_text(const std::vector<Index>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i == 0 ? "" : ", ") + std::to_string(shape[i]);
  return s + "]";
}

template <class V>
class FromTensors : public testing::Test {};
TYPED_TEST_SUITE(FromTensors, vt::AllVariants, vt::VariantName);

// from_tensors reads the variant's names (<variant>.md) under a prefix,
// stored as F64, F32, BF16 or F16: the layer holds exactly the file's
// tensors (headmix_check::compare_layer) and computes, bit for bit, what
// the layer built directly from the weights as the file holds them does.
TYPED_TEST(FromTensors, ReadsTheVariantsNamesUnderAPrefix) {
  using V = TypeParam;
  using Layer = typename V::template Layer<double>;
  const std::string prefix = "model.layers.3.attn.";
  const auto shapes = V::checkpoint_shapes();
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto p = V::template make<double>(shapes[i], 50 + static_cast<unsigned>(i));
    SCOPED_TRACE(p.describe());
    TensorFile f;
    const auto stored = store<V>(f, prefix, p.w);
    EXPECT_GT(stored.worst, 0.0) << "the storage types rounded nothing";
    EXPECT_LE(stored.worst, 1.0 / 256) << "more than BF16's rounding";
    const Layer loaded = Layer::from_tensors(f, prefix, p.options());
    EXPECT_EQ(headmix_check::compare_layer(f, prefix, loaded), "");
    const Layer direct(stored.w, p.options());
    headmix::Workspace<double> ws;
    Tensor<double> loaded_probs, direct_probs;
    const Tensor<double> a = loaded.forward(p.input(), ws, &loaded_probs);
    const Tensor<double> b = direct.forward(p.input(), ws, &direct_probs);
    EXPECT_TRUE(headmix_test::bit_identical("output", a, b));
    EXPECT_TRUE(headmix_test::bit_identical("weights", loaded_probs, direct_probs));
  }
}

// Every stored tensor given another shape (its last extent one longer)
// either builds a layer that holds exactly the file (the tensor sets a
// size, as q.weight sets D) or is a shape_error naming a stored tensor,
// prefix and all, with the shape the layer expects and the stored one (the
// original shape, when it names the changed tensor), or naming a size. A bias whose weight is
// missing, or a prefix the file does not hold, is an io_error naming the
// missing tensor; an option's error keeps the option's name.
TYPED_TEST(FromTensors, ErrorsNameTheStoredTensor) {
  using V = TypeParam;
  using Layer = typename V::template Layer<double>;
  const std::string prefix = "model.layers.0.self_attn.";
  const auto p = V::template make<double>(V::checkpoint_shapes()[0], 36);
  TensorFile f;
  store<V>(f, prefix, p.w);
  int named_itself = 0;
  for (const auto& [name, t] : f.tensors) {
    SCOPED_TRACE(name);
    std::vector<Index> bad = t.shape;
    bad.back() += 1;
    Tensor<double> wrong_value(bad);
    wrong_value.set_zero();
    TensorFile wrong = f;
    wrong.put(name, StoredTensor::from(wrong_value));
    try {
      EXPECT_EQ(headmix_check::compare_layer(wrong, prefix, Layer::from_tensors(wrong, prefix, p.options())), "");
    } catch (const headmix::shape_error& e) {
      EXPECT_EQ("[" + e.variant() + "]", V::tag);
      if (wrong.contains(e.argument())) {
        EXPECT_EQ(e.actual(), shape_text(wrong.at(e.argument()).shape));
      } else {  // a size the tensors set (CollabHead's out_dim against D), never a tensor the file lacks
        EXPECT_NE(e.argument().rfind(prefix, 0), 0u) << e.what();
      }
      EXPECT_EQ(std::string(e.what()),
                std::string(V::tag) + " " + e.argument() + ": expected " + e.expected() + ", got " + e.actual());
      if (e.argument() == name) {
        EXPECT_EQ(e.expected(), shape_text(t.shape));
        ++named_itself;
      }
    }
  }
  EXPECT_GT(named_itself, 0);
  for (const auto& [name, t] : f.tensors) {
    const std::size_t at = name.size() - 5;
    if (name.size() < 5 || name.compare(at, 5, ".bias") != 0 || !f.contains(name.substr(0, at) + ".weight")) continue;
    TensorFile broken = f;
    broken.tensors.erase(name.substr(0, at) + ".weight");
    const std::string msg = io_error_message([&] { (void)Layer::from_tensors(broken, prefix, p.options()); });
    EXPECT_NE(msg.find("'" + name.substr(0, at) + ".weight'"), std::string::npos) << msg;
  }
  const std::string msg = io_error_message([&] { (void)Layer::from_tensors(f, "model.layers.4.attn.", p.options()); });
  EXPECT_NE(msg.find("'model.layers.4.attn."), std::string::npos) << msg;
  if constexpr (V::has_block_rows) {
    auto options = p.options();
    options.block_rows = -1;
    EXPECT_EQ(headmix_test::shape_error_message([&] { (void)Layer::from_tensors(f, prefix, options); }),
              std::string(V::tag) + " block_rows: expected >= 0 (0 = automatic), got -1");
  }
}

// ---- from_tensors: each variant's own optional parts ---------------------------

// LSH: without o (the output is the concatenated heads) and without
// rotations (seeded); a bias without its weight names the weight.
TEST(FromTensorsOwn, LshOutputProjectionAndRotationsAreOptional) {
  const auto p = vt::Lsh::make<double>(lsh_case::Shape(), 26);
  TensorFile bare;
  bare.put("qk.weight", StoredTensor::from(as_tensor(p.w.qk.weight)));
  bare.put("v.weight", StoredTensor::from(as_tensor(p.w.v.weight)));
  const auto minimal = headmix::Lsh<double>::from_tensors(bare, "", p.options());
  EXPECT_EQ(minimal.out_dim(), p.s.H * p.s.dv);
  EXPECT_TRUE(minimal.weights().rotations.shape().empty());
  EXPECT_EQ(headmix_check::compare_layer(bare, "", minimal), "");
}

// CollabHead: a LayerNorm needs both its tensors.
TEST(FromTensorsOwn, CollabLayerNormNeedsBothTensors) {
  collab_case::Shape s;
  s.layer_norm = true;
  const auto p = vt::CollabHead::make<double>(s, 35);
  TensorFile f;
  store<vt::CollabHead>(f, "encoder.", p.w);
  for (const char* part : {"encoder.layer_norm.bias", "encoder.layer_norm.weight"}) {
    TensorFile half = f;
    half.tensors.erase(part);
    EXPECT_THROW((void)headmix::CollabHead<double>::from_tensors(half, "encoder.", p.options()), io_error) << part;
  }
}

// MHA: grouped-query K and V ([Hkv·Dk, D], [Hkv·Dv, D]) are read under the
// same names with num_kv_heads set; read as a standard MHA, the stored
// k.weight is named.
TEST(FromTensorsOwn, MhaGroupedQueryKvNeedTheirOption) {
  mha_case::Shape s;
  s.D = 8, s.H = 4, s.Hkv = 2, s.Dk = 2, s.Dv = 2, s.out = 8;
  const auto p = vt::Mha::make<double>(s, 43);
  const std::string prefix = "model.layers.1.self_attn.";
  TensorFile f;
  store<vt::Mha>(f, prefix, p.w);
  auto options = p.options();
  EXPECT_EQ(headmix::Mha<double>::from_tensors(f, prefix, options).num_kv_heads(), 2);
  options.num_kv_heads = 0;
  EXPECT_EQ(headmix_test::shape_error_message([&] { (void)headmix::Mha<double>::from_tensors(f, prefix, options); }),
            "[mha] model.layers.1.self_attn.k.weight: expected [8, 8], got [4, 8]");
}

}  // namespace
