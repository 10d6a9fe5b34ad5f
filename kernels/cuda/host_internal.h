// Internal host helpers shared by the CUDA host entry points (cuda_codec.cc,
// cuda_attention.cc): CUDA errors as statuses and the device block geometry of a pool view.
#pragma once

#include "absl/status/status.h"
#include "kernels/cuda/codec_params.h"
#include "kernels/cuda/cuda_codec.h"

namespace kvpool::cuda::internal {

// OK for 0 (cudaSuccess), else Internal naming `what` and the CUDA error.
absl::Status CudaStatus(int cuda_error, const char* what);

// The byte geometry of `kv`'s blocks for device code.
BlockGeometry MakeGeometry(const PagedKvView& kv);

}  // namespace kvpool::cuda::internal
