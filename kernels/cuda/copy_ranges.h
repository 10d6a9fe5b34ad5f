// Many small device-to-device copies in one launch: how a fetch moves a sequence's pool blocks
// and BF16 rows into a decode worker's GPU arena (server/transport/device_fetch.h). A copy call
// per block costs more in API calls than the block's bytes take to move.
//
//   // ranges: device memory holding n DeviceCopy entries (kernels/device_copy.h)
//   KVPOOL_RETURN_IF_ERROR(CopyRanges(ranges, n, stream));
//
// Thread-safety: no state; enqueued on `stream`.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/device_copy.h"

namespace kvpool::cuda {

// Each range's addresses are device addresses the kernel can use (this device's memory or a
// peer's mapped through CUDA IPC). The ranges must not overlap; their bounds are the caller's to
// check. Empty ranges (no bytes or no rows) are skipped.
[[nodiscard]] absl::Status CopyRanges(const DeviceCopy* ranges, int n, Stream stream);

}  // namespace kvpool::cuda
