// GPU random fills for tests and benchmarks (testing_fill.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/host_internal.h"
#include "kernels/cuda/mma.cuh"
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

// out[0..127]: C fragments of A (all codes 3 at CodePos 0, i.e. 3 * 2^-24) times B (all 1.0);
// out[128..159]: movmatrix of a lane-distinct pattern.
__global__ void ProbeKernel(float* out, uint32_t* moved) {
  const uint32_t a[4] = {0x00030003u, 0x00030003u, 0x00030003u, 0x00030003u};
  const uint32_t b[2] = {0x3c003c00u, 0x3c003c00u};
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  internal::MmaF16(c, a, b);
  for (int k = 0; k < 4; ++k) out[threadIdx.x * 4 + k] = c[k];
  const uint32_t lane = threadIdx.x;
  // Element (row r, col c) of the 8x8 matrix holds r * 8 + c.
  const uint32_t r = lane / 4, col = 2 * (lane % 4);
  moved[lane] = internal::Transpose8x8((r * 8 + col) | ((r * 8 + col + 1) << 16));
}

}  // namespace

absl::Status ProbeTensorCoreAssumptions() {
  float* out = nullptr;
  uint32_t* moved = nullptr;
  if (cudaMalloc(&out, 128 * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&moved, 32 * sizeof(uint32_t)) != cudaSuccess) {
    cudaFree(out);
    return absl::ResourceExhaustedError("probe allocation failed");
  }
  ProbeKernel<<<1, 32>>>(out, moved);
  float h_out[128];
  uint32_t h_moved[32];
  int err = static_cast<int>(cudaGetLastError());
  if (err == 0) {
    err = static_cast<int>(cudaMemcpy(h_out, out, sizeof(h_out), cudaMemcpyDeviceToHost));
  }
  if (err == 0) {
    err = static_cast<int>(cudaMemcpy(h_moved, moved, sizeof(h_moved), cudaMemcpyDeviceToHost));
  }
  cudaFree(out);
  cudaFree(moved);
  if (err != 0) return CudaStatus(err, "tensor core probe");
  const float want = 48.0f / 16777216.0f;  // 16 products of 3 * 2^-24
  for (int i = 0; i < 128; ++i) {
    if (h_out[i] != want) {
      return absl::InternalError(absl::StrCat("mma with subnormal fp16 input gave ", h_out[i],
                                              " instead of ", want, " at ", i));
    }
  }
  for (uint32_t lane = 0; lane < 32; ++lane) {
    const uint32_t r = lane / 4, col = 2 * (lane % 4);
    const uint32_t want_moved = (col * 8 + r) | (((col + 1) * 8 + r) << 16);
    if (h_moved[lane] != want_moved) {
      return absl::InternalError(absl::StrCat("movmatrix.trans gave ", h_moved[lane],
                                              " instead of ", want_moved, " at lane ", lane));
    }
  }
  return absl::OkStatus();
}

absl::Status FillRealLikeBf16(uint16_t* dst, size_t count, int row_len, uint64_t seed, float scale,
                              Stream stream) {
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr || row_len < 1) return absl::InvalidArgumentError("bad fill arguments");
  FillRealLikeKernel<<<1024, 256, 0, stream>>>(dst, count, row_len, seed, scale);
  return CudaStatus(cudaGetLastError(), "FillRealLikeBf16");
}

absl::Status FillGaussianF32(float* dst, size_t count, uint64_t seed, float scale, Stream stream) {
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("bad fill arguments");
  FillGaussianKernel<<<1024, 256, 0, stream>>>(dst, count, seed, scale);
  return CudaStatus(cudaGetLastError(), "FillGaussianF32");
}

}  // namespace kvpool::cuda::testing
