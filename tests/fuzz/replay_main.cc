// A plain driver for a fuzz target built without libFuzzer: runs every file of each directory
// given (sorted by name, not recursive) and every file given through LLVMFuzzerTestOneInput, so
// that CTest replays the committed corpora (label fuzz-replay). A crash or sanitizer report
// fails the run; so does finding no input at all (a corpus path that went missing).
//
//   safetensors_fuzz tests/fuzz/corpus/safetensors_fuzz [more files or directories]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

// The files `arg` names: itself, or a directory's regular files in name order.
std::vector<fs::path> InputsOf(const fs::path& arg) {
  std::error_code ec;
  if (!fs::is_directory(arg, ec)) return {arg};
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::directory_iterator(arg, ec)) {
    if (e.is_regular_file(ec)) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  size_t runs = 0;
  for (int i = 1; i < argc; ++i) {
    for (const fs::path& file : InputsOf(argv[i])) {
      std::ifstream in(file, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "replay: cannot read %s\n", file.c_str());
        return 1;
      }
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++runs;
    }
  }
  std::printf("replay: %zu inputs ran\n", runs);
  std::fflush(stdout);
  return runs > 0 ? 0 : 1;
}
