// The CUDA backend: kvpoold's pool in GPU memory (one cudaMalloc arena, never managed memory)
// and every codec and attention path on the kernels/cuda kernels.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ComputeBackend> gpu,
//                           NewCudaBackend(/*device=*/0, cuda::KernelTuning{}));
//
// Each call takes a "lane" (a CUDA stream with its staging buffers) from a pool, so concurrent
// worker threads run ingest, demotion and attention on different streams; a call returns once its
// stream has finished (its status depends on the kernels' data checks). Pool blocks are
// addressed by their byte offset / 16 (the kernels' block_stride), so the arena is at most
// 32 GiB. Builds without CUDA get Unavailable from NewCudaBackend.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/cuda/kernel_tuning.h"
#include "server/backend.h"

namespace kvpool::server {

// Unavailable when this build has no CUDA or the machine no such device. Every arrival, demotion
// and attention call runs the kernels with `tuning`.
absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int device,
                                                               const cuda::KernelTuning& tuning);

}  // namespace kvpool::server
