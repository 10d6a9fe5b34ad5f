// The checks GpuTransportService.PushKv applies to a prefill worker's messages before any GPU
// work: the header's token range, a chunk's place in its push and its size, and a CUDA IPC
// buffer's range within the mapped allocation. No CUDA here, so the fuzz target
// (tests/fuzz/gpu_channel_fuzz.cc) runs them everywhere.
//
//   KVPOOL_RETURN_IF_ERROR(CheckGpuPushHeader(request.header(), config.max_append_tokens));
//   KVPOOL_ASSIGN_OR_RETURN(size_t bytes, CheckGpuPushChunk(chunk, push_tokens, row_bytes));
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/v1/gpu_transport_service.pb.h"

namespace kvpool::server {

// InvalidArgument for an empty sequence id, num_tokens outside [1, max_append_tokens] or a
// token_start that would pass INT32_MAX with max_append_tokens more.
absl::Status CheckGpuPushHeader(const ::kvpool::v1::GpuPushHeader& h, int max_append_tokens);

// The bytes of the chunk's K (and of its V): num_tokens rows of `row_bytes`. InvalidArgument
// unless [token_offset, token_offset + num_tokens) is a non-empty range inside the push's
// `push_tokens` tokens.
absl::StatusOr<size_t> CheckGpuPushChunk(const ::kvpool::v1::GpuPushChunk& c, int push_tokens,
                                         size_t row_bytes);

// InvalidArgument unless `offset` is 16-byte aligned and [offset, offset + bytes) lies inside an
// allocation of `allocation_bytes`; `what` names the buffer ("k", "v").
absl::Status CheckIpcRange(uint64_t offset, size_t bytes, size_t allocation_bytes,
                           const char* what);

}  // namespace kvpool::server
