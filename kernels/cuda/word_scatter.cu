#include <cuda_runtime.h>

#include "kernels/cuda/host_internal.h"
#include "kernels/cuda/word_scatter.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    ScatterWordsKernel(int32_t* dst, const WordWrite* writes, int n) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i < n) dst[writes[i].index] = writes[i].value;
}

}  // namespace

absl::Status ScatterWords(int32_t* dst, const WordWrite* writes, int n, Stream stream) {
  if (n <= 0) return absl::OkStatus();
  const unsigned grid = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  ScatterWordsKernel<<<grid, kThreads, 0, stream>>>(dst, writes, n);
  return CudaStatus(cudaGetLastError(), "ScatterWords");
}

}  // namespace kvpool::cuda
