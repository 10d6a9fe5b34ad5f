#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/status_macros.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/host_internal.h"
#include "kernels/cuda/page_checksum_cuda.h"

namespace kvpool::cuda {
namespace {

using internal::kFullMask;
using internal::kWarpSize;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int64_t kBlockStride = 16;

// One flat launch: warp w takes span w % spans of range w / spans (spans = the larger geometry's
// count; a range of the other kind skips the spans it lacks). Its lanes read consecutive words
// (coalesced), all of a lane's loads are independent, and the warp's sum goes to out[range] with
// one atomic add. The sum is mod 2^32 and order-free, so it equals the CPU's.
__global__ void __launch_bounds__(kThreads)
    PageChecksumKernel(const uint8_t* pool, PageChecksumGeometry history, PageChecksumGeometry bf16,
                       const ChecksumRange* ranges, int n, uint32_t spans, uint32_t* out) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (item >= static_cast<int64_t>(n) * spans) return;
  const int lane = threadIdx.x % kWarpSize;
  const int range = static_cast<int>(item / spans);
  const uint32_t span = static_cast<uint32_t>(item % spans);
  const ChecksumRange r = ranges[range];
  const PageChecksumGeometry& g = r.history != 0 ? history : bf16;
  if (r.count <= 0 || span >= g.num_spans()) return;
  const uint32_t begin = g.SpanOffset(span, static_cast<uint32_t>(r.first_slot));
  const uint32_t words = g.SpanBytes(span, static_cast<uint32_t>(r.count)) / 4;
  if (words == 0) return;
  const uint32_t* p = reinterpret_cast<const uint32_t*>(
      pool + static_cast<int64_t>(r.block) * kBlockStride + begin);
  uint32_t sum = 0;
#pragma unroll 4
  for (uint32_t i = lane; i < words; i += kWarpSize) sum += PageChecksumTerm(p[i], begin + 4 * i);
  sum = __reduce_add_sync(kFullMask, sum);
  if (lane == 0) atomicAdd(out + range, sum);
}

}  // namespace

absl::Status PageChecksums(const uint8_t* pool, const PageChecksumGeometry& history,
                           const PageChecksumGeometry& bf16, const ChecksumRange* ranges, int n,
                           uint32_t* out, Stream stream) {
  if (n <= 0) return absl::OkStatus();
  KVPOOL_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(out, 0, static_cast<size_t>(n) * sizeof(uint32_t), stream), "PageChecksums"));
  const uint32_t spans = std::max(history.num_spans(), bf16.num_spans());
  if (spans == 0) return absl::OkStatus();
  const int64_t warps = static_cast<int64_t>(n) * spans;
  const unsigned grid = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  PageChecksumKernel<<<grid, kThreads, 0, stream>>>(pool, history, bf16, ranges, n, spans, out);
  return CudaStatus(cudaGetLastError(), "PageChecksums");
}

}  // namespace kvpool::cuda
