#include "server/transport/cuda_ipc/ipc_mappings.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvpool::server {
namespace {

// Size of the allocation holding `ptr` (device memory of this process, IPC-mapped included),
// through the driver's cuMemGetAddressRange fetched from the runtime (kvpoold does not link the
// driver library, so it still starts on machines without one).
absl::StatusOr<size_t> AllocationBytes(const void* ptr, const void** base) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) return absl::UnavailableError("cuMemGetAddressRange is not available");
  CUdeviceptr b = 0;
  size_t size = 0;
  if (fn(&b, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("not a device allocation");
  }
  *base = reinterpret_cast<const void*>(b);
  return size;
}

}  // namespace

absl::StatusOr<std::pair<uint8_t*, size_t>> IpcMappings::Open(int device,
                                                              const std::string& handle) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, got ", handle.size()));
  }
  absl::MutexLock lock(&mu_);
  auto it = maps_.find(handle);
  if (it == maps_.end()) {
    if (cudaSetDevice(device) != cudaSuccess) return absl::InternalError("cudaSetDevice");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* ptr = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat("cannot map the CUDA IPC handle: ", cudaGetErrorString(e)));
    }
    const void* base = nullptr;
    absl::StatusOr<size_t> size = AllocationBytes(ptr, &base);
    if (!size.ok() || base != ptr) {
      cudaIpcCloseMemHandle(ptr);
      return size.ok() ? absl::InternalError("IPC mapping is not an allocation base")
                       : size.status();
    }
    it = maps_.emplace(handle, Mapping{static_cast<uint8_t*>(ptr), *size, 0}).first;
  }
  ++it->second.refs;
  return std::make_pair(it->second.ptr, it->second.bytes);
}

void IpcMappings::Close(int device, const std::string& handle) {
  absl::MutexLock lock(&mu_);
  auto it = maps_.find(handle);
  if (it == maps_.end() || --it->second.refs > 0) return;
  cudaSetDevice(device);
  cudaIpcCloseMemHandle(it->second.ptr);
  maps_.erase(it);
}

}  // namespace kvpool::server
