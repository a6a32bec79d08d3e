// Hostile and unusual checkpoint files, generated here rather than stored:
// every file must end in an io_error / shape_error that names the tensor, or
// load exactly the tensors it describes and round-trip through the writer
// with the same bytes; and every variant's from_tensors must either throw or
// build the layer the file describes (fuzz/layer_check.hpp, shared with the
// fuzz target). With HEADMIX_WRITE_FUZZ_SEEDS=<folder>, WriteFuzzSeeds
// writes the small layer files there (how tests/fuzz/corpus/ was made).
#include "fuzz/layer_check.hpp"

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
  options.num_heads = 0;
  try {
    headmix::Mha<double>::from_tensors(file, "attn.", options);
    FAIL() << "built with num_heads = 0";
  } catch (const headmix::shape_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[mha] num_heads: ", 0), 0u) << e.what();
  }
  // A tensor's error still gets the prefix.
  options.num_heads = 3;
  try {
    headmix::Mha<double>::from_tensors(file, "attn.", options);
    FAIL() << "built with num_heads = 3";
  } catch (const headmix::shape_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[mha] attn.q.weight: ", 0), 0u) << e.what();
  }
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
  try {
    parse_safetensors(big.data(), big.size());
    FAIL() << "accepted a file the writer cannot write back";
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("when written back"), std::string::npos) << e.what();
  }
}

TEST(CheckpointFiles, AHugeRankIsRefusedEarly) {
  // 5 million zero extents: before the rank cap this parsed (numel 0) into
  // hundreds of MB of JSON values and shape.
  std::string shape = "[0";
  for (int i = 1; i < 5'000'000; ++i) shape += ",0";
  shape += ']';
  const Bytes file = write_file({}, R"("x":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,0]})");
  try {
    parse_safetensors(file.data(), file.size());
    FAIL() << "parsed";
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("'x': shape has more than 1024 extents"), std::string::npos) << e.what();
  }
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
