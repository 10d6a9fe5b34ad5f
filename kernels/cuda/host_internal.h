// Internal host helpers shared by the CUDA host entry points (cuda_codec.cc,
// cuda_attention.cc): the device block geometry of a pool view (CUDA errors as statuses come
// from common/cuda_status.h).
#pragma once

#include "absl/status/status.h"
#include "common/cuda_status.h"
#include "kernels/cuda/codec_params.h"
#include "kernels/cuda/cuda_codec.h"

namespace kvpool::cuda::internal {

// The byte geometry of `kv`'s blocks for device code.
BlockGeometry MakeGeometry(const PagedKvView& kv);

}  // namespace kvpool::cuda::internal
