// libFuzzer target for the safetensors reader: any byte string must either
// parse into tensors whose sizes match their shapes, or throw io_error.
// Anything else (a crash, a sanitizer report, another exception) is a bug.
#include <headmix/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace headmix::io;
  try {
    const TensorFile file = parse_safetensors(data, size);
    for (const auto& [name, t] : file.tensors) {
      if (t.bytes.size() != static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype)) std::abort();
      // Converting must be safe for every dtype that parsed.
      (void)t.as<double>();
    }
    // What parses must survive a round trip.
    const auto bytes = serialize_safetensors(file);
    const TensorFile again = parse_safetensors(bytes.data(), bytes.size());
    if (again.tensors.size() != file.tensors.size()) std::abort();
  } catch (const io_error&) {
  }
  return 0;
}
