// Runs the fuzz target over files (the seed corpus and every input the
// fuzzer ever crashed on, kept in regressions/) with an ordinary compiler,
// so ctest checks them on every build. Fails when a folder is missing or
// when no file at all was replayed: a replay of nothing proves nothing.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv) {
  int files = 0;
  for (int i = 1; i < argc; ++i) {
    std::error_code error;
    if (!std::filesystem::is_directory(argv[i], error)) {
      std::cerr << "replay: " << argv[i] << " is not a folder\n";
      return 1;
    }
    for (const auto& entry : std::filesystem::directory_iterator(argv[i])) {
      // Hidden files (regressions/.keep holds the empty folder in git) are not inputs.
      if (!entry.is_regular_file() || entry.path().filename().string().rfind('.', 0) == 0) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) {
        std::cerr << "replay: cannot read " << entry.path() << "\n";
        return 1;
      }
      LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++files;
    }
  }
  std::cout << "replayed " << files << " inputs\n";
  if (files == 0) std::cerr << "replay: no input files: the corpus is missing or empty\n";
  return files > 0 ? 0 : 1;
}
