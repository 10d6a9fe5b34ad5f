// NewCudaBackend in builds without nvcc: the CPU backend is all there is.
#include "absl/strings/str_cat.h"
#include "server/cuda_backend.h"

namespace kvpool::server {

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int device,
                                                               const cuda::KernelTuning&) {
  return absl::UnavailableError(
      absl::StrCat("device cuda:", device, " is not available: this build has no CUDA"));
}

}  // namespace kvpool::server
