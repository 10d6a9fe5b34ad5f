// Many small device-to-device copies in one launch: how a fetch moves a sequence's pool blocks
// and BF16 rows into a decode worker's GPU arena (server/transport/device_fetch.h). A copy call
// per block costs more in API calls than the block's bytes take to move.
//
//   // ranges: device memory holding n CopyRange entries
//   KVPOOL_RETURN_IF_ERROR(CopyRanges(ranges, n, stream));
//
// Thread-safety: no state; enqueued on `stream`.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_codec.h"

namespace kvpool::cuda {

// `rows` rows of `bytes` bytes each, row r from src + r * src_pitch to dst + r * dst_pitch
// (device addresses the kernel can use: this device's memory or a peer's mapped through CUDA
// IPC). The ranges must not overlap; their bounds are the caller's to check.
struct CopyRange {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t bytes = 0;
  uint64_t rows = 1;
  uint64_t dst_pitch = 0;
  uint64_t src_pitch = 0;
};

[[nodiscard]] absl::Status CopyRanges(const CopyRange* ranges, int n, Stream stream);

}  // namespace kvpool::cuda
