// Fuzz target: the .npy reader of the kvpool CLI (client/npy.h, ParseNpy) and the conversions
// it feeds (NpyToFloat, TokenIdsFromNpy). Any input either fails with InvalidArgument or parses
// into an array whose data matches its shape and which serializes and parses back unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "client/kv_files.h"
#include "client/npy.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::client;
  absl::StatusOr<NpyArray> a = ParseNpy(std::string(reinterpret_cast<const char*>(data), size));
  if (!a.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(a.status()), a.status().ToString());
    return 0;
  }
  FUZZ_CHECK(a->data.size() == static_cast<size_t>(a->num_elements()) * NpyDtypeSize(a->dtype),
             "data size does not match the shape");
  absl::StatusOr<std::string> bytes = SerializeNpy(a->dtype, a->shape, a->data);
  FUZZ_CHECK(bytes.ok(), bytes.status().ToString());
  absl::StatusOr<NpyArray> back = ParseNpy(*bytes);
  FUZZ_CHECK(back.ok(), back.status().ToString());
  FUZZ_CHECK(back->dtype == a->dtype && back->shape == a->shape && back->data == a->data,
             "array changed in a round trip");
  absl::StatusOr<std::vector<float>> floats = NpyToFloat(*a);
  if (floats.ok()) FUZZ_CHECK(floats->size() == static_cast<size_t>(a->num_elements()), "floats");
  absl::StatusOr<std::vector<uint32_t>> ids = TokenIdsFromNpy(*a);
  if (ids.ok()) FUZZ_CHECK(ids->size() == static_cast<size_t>(a->num_elements()), "token ids");
  return 0;
}
