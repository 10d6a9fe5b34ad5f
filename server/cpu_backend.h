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

// Host arena of `bytes` (mmap'ed, pages faulted in on first touch). Also used by tests.
absl::StatusOr<std::unique_ptr<Arena>> NewHostArena(size_t bytes);

}  // namespace kvpool::server
