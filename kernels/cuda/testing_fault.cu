// Poisoning a CUDA context for the device-health test (testing_fault.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/testing_fault.h"

namespace kvpool::cuda::testing {
namespace {

// A store to the first page of the address space, which CUDA never maps.
__global__ void StoreOutOfBoundsKernel(uintptr_t address) {
  *reinterpret_cast<volatile uint32_t*>(address) = 0xdeadbeefu;
}

}  // namespace

absl::Status PoisonCudaContext(int device) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorName(e)));
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorName(e)));
  }
  StoreOutOfBoundsKernel<<<1, 1, 0, stream>>>(uintptr_t{16});
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t done = cudaStreamSynchronize(stream);
  // A sticky error stays: the same call fails again after the error state is read.
  (void)cudaGetLastError();
  const cudaError_t after = cudaStreamQuery(stream);
  cudaStreamDestroy(stream);
  if (launched == cudaSuccess && done == cudaErrorIllegalAddress && after == done) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("the out-of-bounds store did not poison cuda:", device,
                                          " (launch ", cudaGetErrorName(launched), ", synchronize ",
                                          cudaGetErrorName(done), ", then ",
                                          cudaGetErrorName(after), ")"));
}

}  // namespace kvpool::cuda::testing
