#include "server/backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/cpu_backend.h"
#include "server/cuda_backend.h"

namespace kvpool::server {

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(
    absl::string_view name, const cuda::KernelTuning& cuda_tuning) {
  if (name == "cpu") return NewCpuBackend();
  if (absl::StartsWith(name, "cuda:")) {
    int device = -1;
    if (!absl::SimpleAtoi(name.substr(5), &device) || device < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad device '", name, "' (expected cpu or cuda:N with N >= 0)"));
    }
    return NewCudaBackend(device, cuda_tuning);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", name, "' (expected cpu or cuda:N)"));
}

}  // namespace kvpool::server
