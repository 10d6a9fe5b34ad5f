// The C API's device path (kvpool::cuda::DecodeAttention on a chosen device and stream), behind
// a header without CUDA types: device_attention_cuda.cc implements it where the CUDA kernels are
// built, device_attention_unavailable.cc (UNAVAILABLE) elsewhere.
//
//   KVPOOL_ASSIGN_OR_RETURN(size_t bytes, DeviceWorkspaceBytes(0, cfg, q_heads, batch));
//   KVPOOL_RETURN_IF_ERROR(DeviceDecodeAttention(0, cfg, q_heads, batch, io, stream));
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec_config.h"
#include "kernels/paged_kv.h"

namespace kvpool::capi {

// Device buffers of one call (cuda::DecodeIo plus the workspace).
struct DeviceIo {
  const float* queries = nullptr;
  const float* rotation_k = nullptr;
  const float* rotation_v = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Whether this build has the device path.
bool DevicePathBuilt();

// cuda::DecodeAttentionWorkspaceBytes on `device`. The calling thread's current device is
// restored afterwards. UNAVAILABLE without CUDA or when `device` does not exist.
[[nodiscard]] absl::StatusOr<size_t> DeviceWorkspaceBytes(int device, const QuantConfig& cfg,
                                                          int q_heads, const PagedKvBatch& batch);

// cuda::DecodeAttention on `device`, enqueued on `stream` (a cudaStream_t). Every pointer of
// `batch` and `io` must be memory `device` can read (device or managed memory, or mapped host
// memory): INVALID_ARGUMENT otherwise. The current device is restored afterwards.
[[nodiscard]] absl::Status DeviceDecodeAttention(int device, const QuantConfig& cfg, int q_heads,
                                                 const PagedKvBatch& batch, const DeviceIo& io,
                                                 void* stream);

}  // namespace kvpool::capi
