#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/host_internal.h"
#include "kernels/cuda/page_checksum_cuda.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kBlockStride = 16;

// One CTA per range: threads stride over the words of each of its spans, then a block reduce.
// The sum is mod 2^32 and order-free, so it equals the CPU's.
__global__ void PageChecksumKernel(const uint8_t* pool, PageChecksumGeometry history,
                                   PageChecksumGeometry bf16, const ChecksumRange* ranges,
                                   uint32_t* out) {
  const ChecksumRange r = ranges[blockIdx.x];
  const PageChecksumGeometry& g = r.history != 0 ? history : bf16;
  const uint8_t* page = pool + static_cast<int64_t>(r.block) * kBlockStride;
  uint32_t sum = 0;
  if (r.count > 0) {
    for (uint32_t span = 0; span < g.num_spans(); ++span) {
      const uint32_t begin = g.SpanOffset(span, static_cast<uint32_t>(r.first_slot));
      const uint32_t words = g.SpanBytes(span, static_cast<uint32_t>(r.count)) / 4;
      const uint32_t* p = reinterpret_cast<const uint32_t*>(page + begin);
      for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) {
        sum += PageChecksumTerm(p[i], begin + 4 * i);
      }
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ uint32_t warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    out[blockIdx.x] = total;
  }
}

}  // namespace

absl::Status PageChecksums(const uint8_t* pool, const PageChecksumGeometry& history,
                           const PageChecksumGeometry& bf16, const ChecksumRange* ranges, int n,
                           uint32_t* out, Stream stream) {
  if (n <= 0) return absl::OkStatus();
  PageChecksumKernel<<<n, kThreads, 0, stream>>>(pool, history, bf16, ranges, out);
  return CudaStatus(cudaGetLastError(), "PageChecksums");
}

}  // namespace kvpool::cuda
