#include "common/cuda_status.h"

#include <cuda_runtime.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace kvpool {

absl::Status CudaStatus(int cuda_error, const char* what) {
  const auto e = static_cast<cudaError_t>(cuda_error);
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  return e == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                        : absl::InternalError(message);
}

}  // namespace kvpool
