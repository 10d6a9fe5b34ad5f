// Fuzz target: the safetensors reader (kernels/safetensors.h), which parses rotation files
// uploaded to kvpoold and K/V files read by the kvpool CLI. Any input either fails with
// InvalidArgument or parses into a file whose tensors lie inside the input with sizes matching
// their shapes, whose float tensors convert, and which the writer reproduces exactly.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

namespace kvpool {
namespace {

bool IsFloat(SafetensorsDtype d) {
  return d == SafetensorsDtype::kF32 || d == SafetensorsDtype::kF64 ||
         d == SafetensorsDtype::kF16 || d == SafetensorsDtype::kBF16;
}

void CheckConsistent(const SafetensorsFile& f) {
  for (const SafetensorsTensor& t : f.tensors()) {
    FUZZ_CHECK(
        t.bytes.size() == static_cast<size_t>(t.num_elements()) * SafetensorsDtypeSize(t.dtype),
        t.name);
    FUZZ_CHECK(f.Find(t.name) == &t, t.name);
    absl::StatusOr<std::vector<float>> values = f.ReadFloat32(t.name);
    FUZZ_CHECK(values.ok() == IsFloat(t.dtype), values.status().ToString());
    if (values.ok()) FUZZ_CHECK(values->size() == static_cast<size_t>(t.num_elements()), t.name);
  }
}

// The writer's bytes of the same tensors and metadata parse back to them.
void CheckRoundTrip(const SafetensorsFile& f) {
  SafetensorsWriter w;
  for (const auto& [key, value] : f.metadata()) w.SetMetadata(key, value);
  for (const SafetensorsTensor& t : f.tensors()) w.AddTensor(t.name, t.dtype, t.shape, t.bytes);
  absl::StatusOr<SafetensorsFile> back = SafetensorsFile::Parse(w.Serialize());
  FUZZ_CHECK(back.ok(), back.status().ToString());
  FUZZ_CHECK(back->metadata() == f.metadata(), "metadata changed");
  FUZZ_CHECK(back->tensors().size() == f.tensors().size(), "tensor count changed");
  for (const SafetensorsTensor& t : f.tensors()) {
    const SafetensorsTensor* b = back->Find(t.name);
    FUZZ_CHECK(b != nullptr, t.name);
    FUZZ_CHECK(b->dtype == t.dtype && b->shape == t.shape && b->bytes == t.bytes, t.name);
  }
}

}  // namespace
}  // namespace kvpool

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvpool::SafetensorsFile;
  absl::StatusOr<SafetensorsFile> f =
      SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!f.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(f.status()), f.status().ToString());
    return 0;
  }
  kvpool::CheckConsistent(*f);
  kvpool::CheckRoundTrip(*f);
  return 0;
}
