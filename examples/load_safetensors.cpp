// Load an attention layer from a .safetensors file and run it on an input
// stored in the same file.
//
//   load_safetensors FILE [--prefix P] [--variant V] [--heads H] [--causal] [--dtype float|double]
//   load_safetensors --small
//
// The file holds the layer's tensors under a prefix, with the names of
// ../shared/conformance/<variant>.md (for MHA: `<P>q.weight`, `<P>q.bias`,
// ..., `<P>o.bias`), stored as F32, F16, BF16 or F64 and converted to the
// compute type on load, plus `input.query` [B, T, D] and optionally
// `input.key`, `input.key_padding_mask` and `expected.output`. Every
// conformance case is such a file, so
//
//   load_safetensors ../shared/conformance/talking_heads/xt_self_causal.safetensors
//
// runs a case: the variant and its options come from the file's metadata
// ("variant", "config"), or from --variant / --heads / --causal. Every
// variant is built with its from_tensors(): the tensor names of
// conformance/<variant>.md after the prefix.
//
// With --small it first writes a small random MHA layer, as a checkpoint
// might hold it (weights in BF16 and F16 under the prefix
// `encoder.layer.0.attention.`, biases in F32), an F32 input and the
// expected output to a temporary file with io::save_safetensors, then loads
// that file like any other.
//
// It prints the file's tensors, the layer it built, and the output. Exit
// code: 0 if the output is finite and, when the file has
// `expected.output`, within the file's tolerance (conformance/FORMAT.md:
// rtol/atol in double, rtol_f32/atol_f32 or 1e-4/1e-5 in float); 1 if
// not; 2 for a bad command line or an unreadable file.
#include <headmix/headmix.hpp>
#include <headmix/io/safetensors.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using headmix::Index;
namespace io = headmix::io;
using Json = nlohmann::json;

namespace {

struct Args {
  std::string file, prefix, variant;
  Index heads = 0;
  bool causal = false, small = false, use_double = false;
};

// ---- --small: write a checkpoint-like file ----------------------------------------

io::StoredTensor stored(const headmix::Matrix<double>& m, io::DType dtype) {
  headmix::Tensor<double> t({m.rows(), m.cols()});
  std::copy_n(m.data(), m.size(), t.data());
  return io::StoredTensor::from(t, dtype);
}

io::StoredTensor stored(const headmix::Vector<double>& v, io::DType dtype) {
  headmix::Tensor<double> t({v.size()});
  std::copy_n(v.data(), v.size(), t.data());
  return io::StoredTensor::from(t, dtype);
}

// A random MHA layer stored at reduced precision, an input, and the output
// of the layer as stored (its weights read back from the rounded tensors),
// computed in double.
void write_small_checkpoint(const std::string& path, const std::string& prefix) {
  const Index B = 2, T = 6, D = 32, H = 4;
  std::mt19937 rng(5);
  std::normal_distribution<double> n(0.0, 1.0);
  auto random = [&](Index rows, Index cols, double stddev) {
    headmix::Matrix<double> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = stddev * n(rng);
    return m;
  };

  io::TensorFile file;
  const char* names[] = {"q", "k", "v", "o"};
  const io::DType dtypes[] = {io::DType::BF16, io::DType::BF16, io::DType::F16, io::DType::F16};
  for (int p = 0; p < 4; ++p) {
    file.put(prefix + names[p] + ".weight", stored(random(D, D, 1.0 / std::sqrt(double(D))), dtypes[p]));
    file.put(prefix + names[p] + ".bias", stored(headmix::Vector<double>(random(D, 1, 0.1)), io::DType::F32));
  }
  headmix::Tensor<double> x({B, T, D});
  for (Index i = 0; i < x.size(); ++i) x[i] = n(rng);
  file.put("input.query", io::StoredTensor::from(x, io::DType::F32));

  // The reference output: the rounded weights and input, read back in double.
  headmix::MhaOptions opt;
  opt.num_heads = H;
  const auto layer = headmix::Mha<double>::from_tensors(file, prefix, opt);
  const headmix::Tensor<double> x_stored = file.get<double>("input.query");
  headmix::Workspace<double> ws;
  file.put("expected.output",
           io::StoredTensor::from(layer.forward(headmix::AttentionInput<double>{x_stored.batch(), {}, {}}, ws)));
  file.metadata["variant"] = "mha";
  file.metadata["config"] = Json{{"num_heads", H}, {"causal", false}}.dump();
  io::save_safetensors(path, file);
}

// ---- building a layer from the file ------------------------------------------------

Json config_of(const io::TensorFile& file, const Args& args) {
  Json config = Json::object();
  if (const auto it = file.metadata.find("config"); it != file.metadata.end()) config = Json::parse(it->second);
  if (args.heads > 0) config["num_heads"] = args.heads;
  if (args.causal) config["causal"] = true;
  if (!config.contains("num_heads"))
    throw std::runtime_error("the head count is neither in the file's metadata nor given with --heads");
  return config;
}

std::optional<double> scale_of(const Json& config) {
  if (config.contains("scale") && !config["scale"].is_null()) return config["scale"].get<double>();
  return std::nullopt;
}

template <class T>
struct Layer {
  std::string description;
  std::function<void(const headmix::AttentionInput<T>&, headmix::Tensor<T>&)> run;
  Index out_dim = 0;
};

// Wrap any headmix layer: they all share forward(AttentionInput, Workspace&).
template <class T, class L>
Layer<T> wrap(L layer, std::string description) {
  Layer<T> result;
  result.out_dim = layer.out_dim();
  result.description = std::move(description);
  auto shared = std::make_shared<L>(std::move(layer));
  auto ws = std::make_shared<headmix::Workspace<T>>();
  result.run = [shared, ws](const headmix::AttentionInput<T>& in, headmix::Tensor<T>& out) {
    out = shared->forward(in, *ws);
  };
  return result;
}

template <class T>
Layer<T> build(const std::string& variant, const io::TensorFile& f, const std::string& p, const Json& config) {
  const Index H = config.at("num_heads").get<Index>();
  const bool causal = config.value("causal", false);
  if (variant == "mha") {
    headmix::MhaOptions opt;
    opt.num_heads = H;
    opt.causal = causal;
    opt.scale = scale_of(config);
    auto layer = headmix::Mha<T>::from_tensors(f, p, opt);
    const std::string d = "MHA, H=" + std::to_string(H) + ", head_dim " + std::to_string(layer.head_dim());
    return wrap<T>(std::move(layer), d);
  }
  if (variant == "talking_heads") {
    headmix::TalkingHeadsOptions opt;
    opt.num_heads = config.value("heads_logits", H);
    opt.key_heads = config.value("heads_key", opt.num_heads);
    opt.value_heads = config.value("heads_value", opt.num_heads);
    opt.causal = causal;
    opt.scale = scale_of(config);
    auto layer = headmix::TalkingHeads<T>::from_tensors(f, p, opt);
    const std::string d = "Talking-Heads, h_k=" + std::to_string(layer.key_heads()) + " h=" +
                          std::to_string(layer.num_heads()) + " h_v=" + std::to_string(layer.value_heads()) +
                          (layer.has_pre_mix() ? ", pre mix" : "") + (layer.has_post_mix() ? ", post mix" : "");
    return wrap<T>(std::move(layer), d);
  }
  if (variant == "lsh") {
    headmix::LshOptions opt;
    opt.num_heads = H;
    opt.bucket_size = config.value("bucket_size", opt.bucket_size);
    opt.n_hashes = config.value("n_hashes", opt.n_hashes);
    opt.n_buckets = config.value("n_buckets", opt.n_buckets);
    opt.causal = causal;
    opt.attend_across_buckets = config.value("attend_across_buckets", true);
    opt.allow_duplicate_attention = config.value("allow_duplicate_attention", true);
    opt.rotations_per_head = config.value("random_rotations_per_head", false);
    auto layer = headmix::Lsh<T>::from_tensors(f, p, opt);
    const std::string d = "LSH, H=" + std::to_string(H) + ", bucket_size " + std::to_string(opt.bucket_size) +
                          ", n_hashes " + std::to_string(opt.n_hashes) +
                          (layer.weights().rotations.size() ? ", rotations from the file" : ", seeded rotations");
    return wrap<T>(std::move(layer), d);
  }
  if (variant == "collab") {
    headmix::CollabHeadOptions opt;
    opt.num_heads = H;
    opt.causal = causal;
    opt.scale = scale_of(config);
    auto layer = headmix::CollabHead<T>::from_tensors(f, p, opt, config.value("layer_norm_eps", 1e-5));
    const std::string d = "CollabHead, H=" + std::to_string(H) + ", shared_dim " + std::to_string(layer.shared_dim());
    return wrap<T>(std::move(layer), d);
  }
  if (variant == "dcmha") {
    headmix::DcmhaOptions opt;
    opt.num_heads = H;
    opt.groups = config.value("groups", Index(1));
    opt.rank = config.value("rank", Index(2));
    opt.use_pre = config.value("use_pre", true);
    opt.use_post = config.value("use_post", true);
    opt.query_wise = config.value("query_wise", true);
    opt.key_wise = config.value("key_wise", true);
    opt.static_w = config.value("static_w", false);
    opt.causal = causal;
    if (config.contains("window") && !config["window"].is_null()) opt.window = config["window"].get<Index>();
    opt.dw_norm_eps = config.value("dw_norm_eps", 1e-6);
    if (config.value("dw_gelu", std::string("erf")) == "tanh") opt.gelu = headmix::DcmhaGelu::tanh;
    opt.scale = scale_of(config);
    auto layer = headmix::Dcmha<T>::from_tensors(f, p, opt);
    const std::string d = "DCMHA, H=" + std::to_string(H) + ", groups " + std::to_string(layer.groups()) +
                          ", rank " + std::to_string(layer.rank());
    return wrap<T>(std::move(layer), d);
  }
  throw std::runtime_error("unknown variant '" + variant + "' (mha, talking_heads, lsh, collab, dcmha)");
}

// ---- running it ----------------------------------------------------------------------

std::string shape_text(const std::vector<Index>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

double metadata_number(const io::TensorFile& f, const char* key, double fallback) {
  const auto it = f.metadata.find(key);
  return it == f.metadata.end() ? fallback : std::stod(it->second);
}

template <class T>
int run(const io::TensorFile& file, const Args& args) {
  std::string variant = args.variant;
  if (variant.empty()) {
    const auto it = file.metadata.find("variant");
    if (it == file.metadata.end()) throw std::runtime_error("no --variant given and no \"variant\" in the metadata");
    variant = it->second;
  }
  const Json config = config_of(file, args);
  Layer<T> layer = build<T>(variant, file, args.prefix, config);
  std::cout << "layer: " << layer.description << (config.value("causal", false) ? ", causal" : "") << ", computing in "
            << (std::is_same_v<T, double> ? "double" : "float") << "\n";

  // The input, converted like the weights.
  const headmix::Tensor<T> query = file.get<T>("input.query");
  headmix::Tensor<T> key;
  headmix::Tensor<std::uint8_t> padding;
  headmix::AttentionInput<T> in;
  in.query = query.batch();
  if (file.contains("input.key")) {
    key = file.get<T>("input.key");
    in.key = key.batch();
  }
  if (file.contains("input.key_padding_mask")) {
    padding = file.get<std::uint8_t>("input.key_padding_mask");
    in.key_padding = {padding.data(), padding.dim(0), padding.dim(1)};
  }
  headmix::Tensor<T> out;
  layer.run(in, out);

  double norm = 0;
  bool finite = true;
  for (Index i = 0; i < out.size(); ++i) {
    norm += double(out[i]) * double(out[i]);
    finite = finite && std::isfinite(out[i]);
  }
  std::cout << "output " << shape_text(out.shape()) << ", |output| = " << std::sqrt(norm) << ", output[0, 0, :4] =";
  for (Index c = 0; c < std::min<Index>(4, out.dim(2)); ++c) std::cout << ' ' << out[c];
  std::cout << "\n";
  if (!finite) {
    std::cout << "FAIL: the output has a non-finite value\n";
    return 1;
  }
  if (!file.contains("expected.output")) {
    std::cout << "the file has no expected.output to compare with\n";
    return 0;
  }

  const headmix::Tensor<double> want = file.get<double>("expected.output");
  if (want.shape() != out.shape()) {
    std::cout << "FAIL: expected.output is " << shape_text(want.shape()) << "\n";
    return 1;
  }
  const bool f64 = std::is_same_v<T, double>;
  const double rtol = f64 ? metadata_number(file, "rtol", 1e-9) : metadata_number(file, "rtol_f32", 1e-4);
  const double atol = f64 ? metadata_number(file, "atol", 1e-12) : metadata_number(file, "atol_f32", 1e-5);
  double worst = 0;
  Index outside = 0;
  for (Index i = 0; i < want.size(); ++i) {
    const double err = std::abs(double(out[i]) - want[i]);
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::abs(want[i]))) ++outside;
  }
  std::cout << (outside == 0 ? "ok" : "FAIL") << ": max |output - expected.output| = " << worst << "; " << outside
            << " of " << want.size() << " values outside rtol " << rtol << " / atol " << atol << "\n";
  return outside == 0 ? 0 : 1;
}

int usage() {
  std::cerr << "usage: load_safetensors FILE [--prefix P] [--variant mha|talking_heads|lsh|collab|dcmha] [--heads H]\n"
               "                        [--causal] [--dtype float|double]\n"
               "       load_safetensors --small\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--small") args.small = true;
    else if (a == "--causal") args.causal = true;
    else if (a == "--prefix" && has_value) args.prefix = argv[++i];
    else if (a == "--variant" && has_value) args.variant = argv[++i];
    else if (a == "--heads" && has_value) args.heads = std::atoi(argv[++i]);
    else if (a == "--dtype" && has_value) {
      const std::string d = argv[++i];
      if (d != "float" && d != "double") return usage();
      args.use_double = d == "double";
    } else if (!a.empty() && a[0] != '-' && args.file.empty()) args.file = a;
    else return usage();
  }

  std::string temporary;
  if (args.small) {
    temporary = (std::filesystem::temp_directory_path() /
                 ("headmix_load_example_" + std::to_string(std::random_device{}()) + ".safetensors"))
                    .string();
    args.file = temporary;
    args.prefix = "encoder.layer.0.attention.";
    write_small_checkpoint(temporary, args.prefix);
    std::cout << "wrote a small random MHA layer to " << temporary << "\n";
  }
  if (args.file.empty()) return usage();

  int status = 2;
  try {
    const io::TensorFile file = io::load_safetensors(args.file);
    std::cout << args.file << ": " << file.tensors.size() << " tensors\n";
    for (const auto& [name, t] : file.tensors)
      std::cout << "  " << name << "  " << io::dtype_name(t.dtype) << " " << shape_text(t.shape) << "\n";
    status = args.use_double ? run<double>(file, args) : run<float>(file, args);
  } catch (const io::io_error& e) {  // unreadable file, missing tensor
    std::cerr << "error: " << e.what() << "\n";
  } catch (const headmix::shape_error& e) {  // a tensor of the wrong shape
    std::cerr << "error: " << e.what() << "\n";
    status = 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
  }
  if (!temporary.empty()) std::filesystem::remove(temporary);
  return status;
}
