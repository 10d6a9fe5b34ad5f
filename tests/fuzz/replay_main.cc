// A plain driver for a fuzz target built without libFuzzer: runs every file of each directory
// given (sorted by name, not recursive) and every file given through LLVMFuzzerTestOneInput, so
// that CTest replays the committed corpora (label fuzz-replay). A crash or sanitizer report
// fails the run; so does finding no input at all (a corpus path that went missing), and, as
// libFuzzer's -malloc_limit_mb does, a single C++ allocation above kMallocLimitBytes.
//
//   safetensors_fuzz tests/fuzz/corpus/safetensors_fuzz [more files or directories]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

// The limit `make fuzz` runs with (run_fuzz.sh): an allocation this large from a small input is
// a size taken from the input without a check.
constexpr size_t kMallocLimitBytes = size_t{256} << 20;

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

// Every C++ allocation of the process goes through these (replaceable global allocation
// functions); the standard operator new[] and the sized and array deletes forward to them.
void* operator new(size_t size) {
  if (size > kMallocLimitBytes) {
    std::fprintf(stderr, "replay: allocation of %zu bytes exceeds the %zu-byte limit\n", size,
                 kMallocLimitBytes);
    std::abort();
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t /*size*/) noexcept { std::free(p); }

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
