// The C API's device path in a build without the CUDA kernels: every call answers UNAVAILABLE.
#include "kernels/capi/device_attention.h"

namespace kvpool::capi {
namespace {

absl::Status NoCuda() {
  return absl::UnavailableError(
      "this libkvpool_attention was built without CUDA; use device -1 (host memory)");
}

}  // namespace

bool DevicePathBuilt() { return false; }

absl::StatusOr<size_t> DeviceWorkspaceBytes(int, const QuantConfig&, int, const PagedKvBatch&) {
  return NoCuda();
}

absl::Status DeviceDecodeAttention(int, const QuantConfig&, int, const PagedKvBatch&,
                                   const DeviceIo&, void*) {
  return NoCuda();
}

}  // namespace kvpool::capi
