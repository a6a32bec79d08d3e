// headmix_conformance [--dtype float|double] [--allow-skip] PATH...
//
// Runs every conformance case (<variant>/<case>.safetensors) found in the
// given files or folders and compares every expected tensor the case holds
// with what the layer produced, element-wise:
// |got - expected| <= atol + rtol * |expected|, with the case's own
// tolerances. expected.output, expected.probs (the final weights) and
// expected.softmax (the weights before a post-softmax mix) are compared
// here; a case holding one the adapter produced nothing for fails, and so
// does any other expected.* tensor that the adapter did not check itself.
// A folder without any case is an error (exit 2), not an empty success.
// Prints one line per case and a closing "N passed, N failed, N skipped"
// line; exits 0 only if at least one case ran, nothing failed and, without
// --allow-skip, nothing was skipped.
#include "adapters.hpp"  // every case_<variant>.hpp, listed by CMake

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace headmix;
using namespace headmix::conformance;

namespace {

struct Comparison {
  bool ok = true;
  double max_abs = 0, max_ref = 0;
  std::string problem;
};

void compare(const std::string& name, const Tensor<double>& got, const Tensor<double>& want, double rtol, double atol,
             Comparison& c) {
  if (got.shape() != want.shape()) {
    c.ok = false;
    c.problem += name + " shape " + detail::format_shape(got.shape()) + " != expected " +
                 detail::format_shape(want.shape()) + "; ";
    return;
  }
  Index bad = 0;
  for (Index i = 0; i < got.size(); ++i) {
    const double d = std::abs(got[i] - want[i]);
    c.max_ref = std::max(c.max_ref, std::abs(want[i]));
    if (!(d <= atol + rtol * std::abs(want[i]))) ++bad;  // NaN fails too
    c.max_abs = std::isnan(d) ? d : std::max(c.max_abs, d);
  }
  if (bad) {
    c.ok = false;
    c.problem += name + ": " + std::to_string(bad) + " of " + std::to_string(got.size()) + " outside tolerance; ";
  }
}

double metadata_number(const io::TensorFile& f, const std::string& key, double fallback) {
  auto it = f.metadata.find(key);
  return it == f.metadata.end() ? fallback : std::stod(it->second);
}

std::vector<fs::path> collect(const std::vector<std::string>& paths) {
  std::vector<fs::path> files;
  for (const auto& p : paths) {
    if (fs::is_directory(p)) {
      const std::size_t before = files.size();
      for (const auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path());
      if (files.size() == before) throw std::runtime_error("no case (*.safetensors) under " + p);
    } else if (fs::exists(p)) {
      files.emplace_back(p);
    } else {
      throw std::runtime_error("no such file or folder: " + p);
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  bool use_float = false, allow_skip = false;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dtype" && i + 1 < argc) {
      std::string d = argv[++i];
      if (d != "float" && d != "double") {
        std::cerr << "--dtype takes float or double, not " << d << "\n";
        return 2;
      }
      use_float = d == "float";
    } else if (a == "--allow-skip") {
      allow_skip = true;
    } else if (a == "-h" || a == "--help") {
      std::cout << "usage: headmix_conformance [--dtype float|double] [--allow-skip] PATH...\n";
      return 0;
    } else {
      paths.push_back(a);
    }
  }
  if (paths.empty()) {
    std::cerr << "usage: headmix_conformance [--dtype float|double] [--allow-skip] PATH...\n";
    return 2;
  }

  int passed = 0, failed = 0, skipped = 0;
  std::vector<fs::path> files;
  try {
    files = collect(paths);
  } catch (const std::exception& e) {
    std::cerr << "headmix_conformance: " << e.what() << "\n";
    return 2;
  }
  for (const auto& path : files) {
    const std::string file = path.filename().string();
    std::string variant = "?";
    try {
      const io::TensorFile f = io::load_safetensors(path.string());
      auto v = f.metadata.find("variant");
      if (v == f.metadata.end()) throw std::runtime_error("no 'variant' in __metadata__");
      variant = v->second;
      auto it = adapters().find(variant);
      if (it == adapters().end()) {
        std::printf("SKIP %s %s (variant not implemented)\n", variant.c_str(), file.c_str());
        ++skipped;
        continue;
      }
      const double rtol = use_float ? metadata_number(f, "rtol_f32", 1e-4) : metadata_number(f, "rtol", 1e-9);
      const double atol = use_float ? metadata_number(f, "atol_f32", 1e-5) : metadata_number(f, "atol", 1e-12);
      const CaseOutputs got = use_float ? it->second.in_float(f) : it->second.in_double(f);

      Comparison c;
      if (!f.contains("expected.output")) throw std::runtime_error("no expected.output");
      for (const auto& entry : f.tensors) {
        const std::string& name = entry.first;
        if (name.rfind("expected.", 0) != 0) continue;
        const std::optional<Tensor<double>>* weights =
            name == "expected.probs" ? &got.probs : name == "expected.softmax" ? &got.softmax : nullptr;
        if (name == "expected.output") {
          compare(name, got.output, f.get<double>(name), rtol, atol, c);
        } else if (weights && *weights) {
          compare(name, **weights, f.get<double>(name), rtol, atol, c);
        } else if (weights) {
          c.ok = false;
          c.problem += name + ": the adapter returned no weights; ";
        } else if (std::find(got.checked.begin(), got.checked.end(), name) == got.checked.end()) {
          c.ok = false;
          c.problem += name + " is not compared; ";
        }
      }
      const double max_rel = c.max_ref > 0 ? c.max_abs / c.max_ref : c.max_abs;
      std::printf("%s %s %s max_abs=%.3g max_rel=%.3g%s%s\n", c.ok ? "PASS" : "FAIL", variant.c_str(), file.c_str(),
                  c.max_abs, max_rel, c.ok ? "" : "  ", c.problem.c_str());
      (c.ok ? passed : failed)++;
    } catch (const std::exception& e) {
      std::printf("FAIL %s %s error: %s\n", variant.c_str(), file.c_str(), e.what());
      ++failed;
    }
  }
  std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return passed > 0 && failed == 0 && (allow_skip || skipped == 0) ? 0 : 1;
}
