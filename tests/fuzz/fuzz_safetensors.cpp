// libFuzzer target for the safetensors reader: any byte string must either
// parse into tensors whose sizes match their shapes, or throw io_error.
// What parses must survive a round trip through the writer with the same
// names, dtypes, shapes and bytes, and every variant's from_tensors must
// either throw shape_error / io_error or build the layer the tensors
// describe (layer_check.hpp). Anything else (a crash, a sanitizer report,
// another exception) is a bug.
#include "layer_check.hpp"

#include <headmix/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "fuzz_safetensors: %s\n", what.c_str());
  std::abort();
}

void check_same(const headmix::io::TensorFile& a, const headmix::io::TensorFile& b) {
  if (a.metadata != b.metadata) bug("round trip changed the metadata");
  if (a.tensors.size() != b.tensors.size()) bug("round trip changed the tensor count");
  for (auto x = a.tensors.begin(), y = b.tensors.begin(); x != a.tensors.end(); ++x, ++y) {
    if (x->first != y->first) bug("round trip changed a name");
    if (x->second.dtype != y->second.dtype || x->second.shape != y->second.shape || x->second.bytes != y->second.bytes)
      bug("round trip changed tensor '" + x->first + "'");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace headmix::io;
  TensorFile file;
  try {
    file = parse_safetensors(data, size);
  } catch (const io_error&) {
    return 0;
  }
  for (const auto& [name, t] : file.tensors) {
    if (t.bytes.size() != static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype)) bug("size mismatch: " + name);
    (void)t.as<double>();  // converting must be safe for every dtype that parsed
  }
  // Whatever the reader accepts, the writer writes, and reads back the same.
  const auto bytes = serialize_safetensors(file);
  check_same(file, parse_safetensors(bytes.data(), bytes.size()));
  for (const headmix_check::Built& built : headmix_check::build_every_variant(file, "")) {
    if (!built.mismatch.empty()) bug(built.variant + " built another layer than the file describes: " + built.mismatch);
  }
  return 0;
}
