#include <cuda_runtime.h>

#include "kernels/cuda/copy_ranges.h"
#include "kernels/cuda/host_internal.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill the device many times over; each walks ranges blockIdx.x,
// blockIdx.x + gridDim.x, ...
constexpr int kMaxBlocks = 2048;

// One range: the threads of the block take its (row, 16-byte vector) pairs in turn, or its bytes
// one by one when the range is not 16-byte aligned (BF16 rows starting mid-page).
__device__ void CopyOne(const DeviceCopy& c) {
  const uint64_t aligned = reinterpret_cast<uintptr_t>(c.dst) | reinterpret_cast<uintptr_t>(c.src) |
                           c.bytes | (c.rows > 1 ? (c.dst_pitch | c.src_pitch) : 0);
  if (aligned % 16 == 0) {
    const uint64_t per_row = c.bytes / 16;
    const uint64_t total = per_row * c.rows;
    for (uint64_t i = threadIdx.x; i < total; i += kThreads) {
      const uint64_t row = i / per_row, v = i % per_row;
      const uint4 x = *reinterpret_cast<const uint4*>(c.src + row * c.src_pitch + v * 16);
      *reinterpret_cast<uint4*>(c.dst + row * c.dst_pitch + v * 16) = x;
    }
    return;
  }
  const uint64_t total = c.bytes * c.rows;
  for (uint64_t i = threadIdx.x; i < total; i += kThreads) {
    const uint64_t row = i / c.bytes, b = i % c.bytes;
    c.dst[row * c.dst_pitch + b] = c.src[row * c.src_pitch + b];
  }
}

__global__ void __launch_bounds__(kThreads) CopyRangesKernel(const DeviceCopy* ranges, int n) {
  for (int r = blockIdx.x; r < n; r += gridDim.x) {
    const DeviceCopy c = ranges[r];
    if (c.bytes == 0 || c.rows == 0) continue;
    CopyOne(c);
  }
}

}  // namespace

absl::Status CopyRanges(const DeviceCopy* ranges, int n, Stream stream) {
  if (n <= 0) return absl::OkStatus();
  const unsigned grid = static_cast<unsigned>(n < kMaxBlocks ? n : kMaxBlocks);
  CopyRangesKernel<<<grid, kThreads, 0, stream>>>(ranges, n);
  return CudaStatus(cudaGetLastError(), "CopyRanges");
}

}  // namespace kvpool::cuda
