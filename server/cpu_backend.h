// The CPU backend: the pool in anonymous host memory, the codec and attention from kernels/.
//
//   std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
//   auto arena = cpu->AllocateArena(256 << 20);
//
// Thread-safe (stateless apart from arenas it hands out).
#pragma once

#include <memory>

#include "server/backend.h"

namespace kvpool::server {

std::unique_ptr<ComputeBackend> NewCpuBackend();

// fp32 rows in host memory times M (Rotate) or M^T (Unrotate); identity copies bits.
absl::Status RotateHostFloat(const RotationSet& rotations, int layer, KvTensor t,
                             absl::Span<const float> in, absl::Span<float> out);
absl::Status UnrotateHostFloat(const RotationSet& rotations, int layer, KvTensor t,
                               absl::Span<const float> in, absl::Span<float> out);

// Host arena of `bytes` (mmap'ed, pages faulted in on first touch). Also used by tests.
absl::StatusOr<std::unique_ptr<Arena>> NewHostArena(size_t bytes);

}  // namespace kvpool::server
