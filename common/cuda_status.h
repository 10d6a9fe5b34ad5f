// CUDA runtime errors as absl::Status, one conversion for the whole project. The header has no
// CUDA types (the error is an int), so code compiled without CUDA headers can declare it.
//
//   KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(...), "copying the queries"));
#pragma once

#include "absl/status/status.h"

namespace kvpool {

// OK for cudaSuccess (0). Otherwise the error names `what` and CUDA's name and description of
// the error: ResourceExhausted for an out-of-memory error, Internal for the others. The calling
// thread's last-error state is cleared (a sticky error stays sticky in the context).
[[nodiscard]] absl::Status CudaStatus(int cuda_error, const char* what);

}  // namespace kvpool
