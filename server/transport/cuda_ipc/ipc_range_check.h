// The check of a CUDA IPC buffer a device push names (kvpool.v1.CudaIpcBuffer): the rows must lie
// inside the allocation the handle maps. No CUDA here, so the fuzz target
// (tests/fuzz/gpu_channel_fuzz.cc) runs it everywhere.
//
//   KVPOOL_RETURN_IF_ERROR(CheckIpcRange(buffer.offset, bytes, mapped_bytes, "k"));
//
// Pure function; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace kvpool::server {

// InvalidArgument unless `offset` is 16-byte aligned and [offset, offset + bytes) lies inside an
// allocation of `allocation_bytes`; `what` names the buffer ("k", "v").
absl::Status CheckIpcRange(uint64_t offset, size_t bytes, size_t allocation_bytes,
                           const char* what);

}  // namespace kvpool::server
