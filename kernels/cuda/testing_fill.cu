// GPU random fills for tests and benchmarks (testing_fill.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/host_internal.h"
#include "kernels/cuda/testing_fill.h"

namespace kvpool::cuda::testing {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float Gaussian(uint64_t seed, size_t i) {
  const uint64_t h = SplitMix64(seed ^ SplitMix64(i));
  const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);
  const float u2 = static_cast<float>((h >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void FillRealLikeKernel(uint16_t* dst, size_t count, int row_len, uint64_t seed,
                                   float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % row_len);
    const bool outlier = c == 3 || c == 17 || c == 40 || c == 61;
    const float v = Gaussian(seed, i) * (outlier ? 10.0f : 1.0f) * scale;
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

__global__ void FillGaussianKernel(float* dst, size_t count, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = Gaussian(seed, i) * scale;
  }
}

}  // namespace

absl::Status FillRealLikeBf16(uint16_t* dst, size_t count, int row_len, uint64_t seed, float scale,
                              Stream stream) {
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr || row_len < 1) return absl::InvalidArgumentError("bad fill arguments");
  FillRealLikeKernel<<<1024, 256, 0, stream>>>(dst, count, row_len, seed, scale);
  return internal::CudaStatus(cudaGetLastError(), "FillRealLikeBf16");
}

absl::Status FillGaussianF32(float* dst, size_t count, uint64_t seed, float scale, Stream stream) {
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("bad fill arguments");
  FillGaussianKernel<<<1024, 256, 0, stream>>>(dst, count, seed, scale);
  return internal::CudaStatus(cudaGetLastError(), "FillGaussianF32");
}

}  // namespace kvpool::cuda::testing
