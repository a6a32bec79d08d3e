// Re-parameterise a trained multi-head attention layer as a CollabHead layer
// with a smaller shared query/key width.
//
//   collab_from_mha IN.safetensors OUT.safetensors --rank R [--heads H]
//                   [--iterations N] [--seed S]
//   collab_from_mha --small
//
// IN holds an MHA layer with the tensor names of conformance/mha.md
// (q.weight [H·Dk, D], q.bias, k.*, v.*, o.*; biases and o optional). The
// head count comes from --heads or from the file's "config" metadata
// ("num_heads"), as does a non-default "scale". OUT receives the CollabHead
// layer with the tensor names of conformance/collab.md (q.weight, k.weight,
// mixing, content_bias.weight, v.*, o.*) and a "config" that a CollabHead
// loader (or epfml's CollaborativeAttention) needs, in IN's float type.
// The program prints the CP reconstruction error, the output error of the
// new layer against the old one on a random input, and the parameter counts.
//
// --small builds its own small MHA file in a temporary folder (a layer whose
// heads share half of their query/key directions, plus noise), runs the
// whole flow on it at full and at half shared width, checks the results,
// and exits 0 only if every check passes.
#include <headmix/decomp.hpp>
#include <headmix/headmix.hpp>
#include <headmix/io.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>

using headmix::Index;
using headmix::Matrix;
using headmix::Vector;
namespace io = headmix::io;
namespace decomp = headmix::decomp;

namespace {

// ---- safetensors <-> weights -------------------------------------------------

headmix::Linear<double> read_linear(const io::TensorFile& f, const std::string& name) {
  headmix::Linear<double> lin;
  if (f.contains(name + ".weight")) lin.weight = f.matrix<double>(name + ".weight");
  if (f.contains(name + ".bias")) lin.bias = f.vector<double>(name + ".bias");
  return lin;
}

void put_matrix(io::TensorFile& f, const std::string& name, const Matrix<double>& m, io::DType dtype) {
  headmix::Tensor<double> t({m.rows(), m.cols()});
  std::copy(m.data(), m.data() + m.size(), t.data());  // both row-major
  f.put(name, io::StoredTensor::from(t, dtype));
}

void put_vector(io::TensorFile& f, const std::string& name, const Vector<double>& v, io::DType dtype) {
  headmix::Tensor<double> t({v.size()});
  std::copy(v.data(), v.data() + v.size(), t.data());
  f.put(name, io::StoredTensor::from(t, dtype));
}

void put_linear(io::TensorFile& f, const std::string& name, const headmix::Linear<double>& lin, io::DType dtype) {
  if (lin.empty()) return;
  put_matrix(f, name + ".weight", lin.weight, dtype);
  if (lin.has_bias()) put_vector(f, name + ".bias", lin.bias, dtype);
}

struct MhaFile {
  headmix::MhaWeights<double> weights;
  headmix::MhaOptions options;
  io::DType dtype = io::DType::F64;
};

MhaFile read_mha(const std::string& path, Index heads) {
  const io::TensorFile f = io::load_safetensors(path);
  MhaFile m;
  m.weights = {read_linear(f, "q"), read_linear(f, "k"), read_linear(f, "v"), read_linear(f, "o")};
  m.dtype = f.at("q.weight").dtype;
  nlohmann::json config = nlohmann::json::object();
  if (auto it = f.metadata.find("config"); it != f.metadata.end()) config = nlohmann::json::parse(it->second);
  m.options.num_heads = heads > 0 ? heads : config.value("num_heads", Index(0));
  if (m.options.num_heads <= 0) throw std::runtime_error(path + ": no num_heads in its config; pass --heads H");
  if (config.contains("scale") && config["scale"].is_number()) m.options.scale = config["scale"].get<double>();
  m.options.causal = config.value("causal", false);
  return m;
}

void write_mha(const std::string& path, const headmix::MhaWeights<double>& w, Index heads) {
  io::TensorFile f;
  put_linear(f, "q", w.q, io::DType::F64);
  put_linear(f, "k", w.k, io::DType::F64);
  put_linear(f, "v", w.v, io::DType::F64);
  put_linear(f, "o", w.o, io::DType::F64);
  f.metadata["variant"] = "mha";
  f.metadata["config"] = nlohmann::json{{"num_heads", heads},
                                        {"embed_dim", w.q.in_features()},
                                        {"head_dim", w.q.out_features() / heads},
                                        {"v_head_dim", w.v.out_features() / heads},
                                        {"out_dim", w.o.out_features()}}
                             .dump();
  io::save_safetensors(path, f);
}

void write_collab(const std::string& path, const headmix::CollabHeadWeights<double>& w,
                  const headmix::CollabHeadOptions& options, io::DType dtype) {
  io::TensorFile f;
  put_matrix(f, "q.weight", w.q, dtype);
  put_matrix(f, "k.weight", w.k, dtype);
  put_matrix(f, "mixing", w.mixing, dtype);
  put_matrix(f, "content_bias.weight", w.content_bias, dtype);
  put_linear(f, "v", w.v, dtype);
  put_linear(f, "o", w.o, dtype);
  const headmix::CollabHead<double> layer(w, options);
  f.metadata["variant"] = "collab";
  f.metadata["config"] = nlohmann::json{{"num_heads", options.num_heads},
                                        {"embed_dim", layer.embed_dim()},
                                        {"shared_dim", layer.shared_dim()},
                                        {"value_dim", w.v.out_features()},
                                        {"out_dim", layer.out_dim()},
                                        {"use_dense_layer", !w.o.empty()},
                                        {"use_layer_norm", false},
                                        {"causal", options.causal},
                                        {"scale", layer.scale_value()}}
                             .dump();
  io::save_safetensors(path, f);
}

headmix::CollabHead<double> read_collab(const std::string& path) {
  const io::TensorFile f = io::load_safetensors(path);
  const auto config = nlohmann::json::parse(f.metadata.at("config"));
  headmix::CollabHeadWeights<double> w;
  w.q = f.matrix<double>("q.weight");
  w.k = f.matrix<double>("k.weight");
  w.mixing = f.matrix<double>("mixing");
  w.content_bias = f.matrix<double>("content_bias.weight");
  w.v = read_linear(f, "v");
  w.o = read_linear(f, "o");
  headmix::CollabHeadOptions options;
  options.num_heads = config.at("num_heads").get<Index>();
  options.causal = config.value("causal", false);
  options.scale = config.at("scale").get<double>();
  return headmix::CollabHead<double>(std::move(w), options);
}

// ---- the conversion flow ---------------------------------------------------------

Index parameters(const headmix::MhaWeights<double>& w) {
  return decomp::query_key_parameters(w) + w.v.weight.size() + w.v.bias.size() + w.o.weight.size() + w.o.bias.size();
}
Index parameters(const headmix::CollabHeadWeights<double>& w) {
  return decomp::query_key_parameters(w) + w.v.weight.size() + w.v.bias.size() + w.o.weight.size() + w.o.bias.size();
}

struct Report {
  double reconstruction_error = 0, output_error = 0, reload_difference = 0, seconds = 0;
  Index iterations = 0, params_before = 0, params_after = 0, qk_before = 0, qk_after = 0;
};

double relative_difference(const headmix::Tensor<double>& want, const headmix::Tensor<double>& got) {
  double num = 0, den = 0;
  for (Index i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

Report convert(const std::string& in_path, const std::string& out_path, Index rank, Index heads,
               const decomp::CpAlsOptions& cp) {
  const MhaFile mha_file = read_mha(in_path, heads);
  const headmix::Mha<double> mha(mha_file.weights, mha_file.options);

  const auto start = std::chrono::steady_clock::now();
  const auto converted = decomp::mha_to_collab(mha, rank, cp);
  Report r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.reconstruction_error = converted.relative_error;
  r.iterations = converted.iterations;
  write_collab(out_path, converted.weights, converted.options, mha_file.dtype);

  // Output error on a random batch (self-attention, or cross-attention when
  // the key width differs from D).
  const Index B = 2, T = 32, D = mha.embed_dim(), Dkv = mha.key_dim();
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  headmix::Tensor<double> x({B, T, D}), xk({B, T, Dkv});
  for (Index i = 0; i < x.size(); ++i) x[i] = normal(rng);
  for (Index i = 0; i < xk.size(); ++i) xk[i] = normal(rng);
  headmix::AttentionInput<double> input{x.batch(), {}, {}};
  if (Dkv != D) input.key = xk.batch();
  headmix::Workspace<double> ws;
  const auto want = mha.forward(input, ws);
  const headmix::CollabHead<double> collab(converted.weights, converted.options);
  const auto got = collab.forward(input, ws);
  r.output_error = relative_difference(want, got);
  // The file must give the layer back (bit for bit when it was written as F64).
  const auto reloaded = read_collab(out_path).forward(input, ws);
  r.reload_difference = relative_difference(got, reloaded);

  r.params_before = parameters(mha_file.weights);
  r.params_after = parameters(converted.weights);
  r.qk_before = decomp::query_key_parameters(mha_file.weights);
  r.qk_after = decomp::query_key_parameters(converted.weights);
  return r;
}

void print(const Report& r, Index rank) {
  std::cout << "  shared dim R = " << rank << ": reconstruction error " << r.reconstruction_error << " after "
            << r.iterations << " ALS sweeps (" << r.seconds << " s)\n"
            << "  output error vs the MHA on a random input: " << r.output_error << "\n"
            << "  parameters: " << r.params_before << " -> " << r.params_after << " (query/key side "
            << r.qk_before << " -> " << r.qk_after << ")\n";
}

// ---- --small: a self-contained run with sanity checks -----------------------------

int run_small() {
  const Index D = 32, H = 4, Dk = 8, Dv = 8, shared = H * Dk / 2;
  std::mt19937 rng(2024);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto gaussian = [&](Index rows, Index cols, double sd) {
    Matrix<double> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = sd * normal(rng);
    return m;
  };
  // Heads that share `shared` query/key directions (each a window of Dk of
  // them), plus a little noise: a half-width CollabHead can represent it.
  const Matrix<double> a = gaussian(D, shared, 0.4), b = gaussian(D, shared, 0.4), mix = gaussian(H, shared, 1.0);
  headmix::MhaWeights<double> w;
  w.q.weight = gaussian(H * Dk, D, 1e-3);
  w.k.weight = gaussian(H * Dk, D, 1e-3);
  for (Index h = 0; h < H; ++h)
    for (Index d = 0; d < Dk; ++d) {
      const Index r = (h * Dk / 2 + d) % shared;
      w.q.weight.row(h * Dk + d) += mix(h, r) * a.col(r).transpose();
      w.k.weight.row(h * Dk + d) += b.col(r).transpose();
    }
  w.q.bias = gaussian(H * Dk, 1, 0.3);
  w.k.bias = gaussian(H * Dk, 1, 0.3);
  w.v = {gaussian(H * Dv, D, 1 / std::sqrt(double(D))), gaussian(H * Dv, 1, 0.3)};
  w.o = {gaussian(D, H * Dv, 1 / std::sqrt(double(H * Dv))), gaussian(D, 1, 0.3)};

  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("headmix_collab_from_mha_" +
                        std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  fs::create_directories(dir);
  const std::string mha_path = (dir / "mha.safetensors").string();
  write_mha(mha_path, w, H);

  bool ok = true;
  auto check = [&](bool pass, const std::string& what) {
    std::cout << (pass ? "  ok:   " : "  FAIL: ") << what << "\n";
    ok = ok && pass;
  };
  std::cout << "small MHA layer D=" << D << " H=" << H << " Dk=" << Dk << " written to " << mha_path << "\n";
  try {
    const Report full = convert(mha_path, (dir / "collab_full.safetensors").string(), H * Dk, 0, {});
    print(full, H * Dk);
    check(full.reconstruction_error == 0 && full.output_error < 1e-12, "full width is an exact copy");
    check(full.reload_difference == 0, "the written full-width layer reads back bit for bit");

    const Report half = convert(mha_path, (dir / "collab_half.safetensors").string(), shared, 0, {});
    print(half, shared);
    // A half-width fit of heads without shared structure leaves ~0.45 of
    // the tensor; this layer's floor is ~2e-3 (the noise), but ALS may stop
    // in a local minimum above it, so the check only asks for a fit that
    // found the shared directions.
    check(half.reconstruction_error < 0.05, "half width finds the shared directions (error < 0.05)");
    check(half.output_error < 0.05, "half width reproduces the MHA output (error < 0.05)");
    check(half.reload_difference == 0, "the written half-width layer reads back bit for bit");
    check(half.qk_after < half.qk_before, "fewer query/key parameters");
  } catch (const std::exception& e) {
    check(false, std::string("exception: ") + e.what());
  }
  fs::remove_all(dir);
  std::cout << (ok ? "all checks passed\n" : "some checks FAILED\n");
  return ok ? 0 : 1;
}

int usage() {
  std::cerr << "usage: collab_from_mha IN.safetensors OUT.safetensors --rank R [--heads H] [--iterations N] "
               "[--seed S]\n       collab_from_mha --small\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--small") == 0) return run_small();
  std::vector<std::string> files;
  Index rank = 0, heads = 0;
  decomp::CpAlsOptions cp;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--rank" && has_value)
      rank = std::atol(argv[++i]);
    else if (a == "--heads" && has_value)
      heads = std::atol(argv[++i]);
    else if (a == "--iterations" && has_value)
      cp.max_iterations = std::atol(argv[++i]);
    else if (a == "--seed" && has_value)
      cp.seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a.rfind("--", 0) == 0)
      return usage();
    else
      files.push_back(a);
  }
  if (files.size() != 2 || rank <= 0) return usage();
  try {
    std::cout << files[0] << " -> " << files[1] << "\n";
    print(convert(files[0], files[1], rank, heads, cp), rank);
  } catch (const std::exception& e) {
    std::cerr << "collab_from_mha: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
