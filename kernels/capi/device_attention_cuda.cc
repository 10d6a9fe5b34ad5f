// The C API's device path where the CUDA kernels are built: checks that every pointer is memory
// the device can read (a host pointer would fault inside the kernel and poison the caller's
// context), selects the device for the call and puts the caller's current device back.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/capi/device_attention.h"
#include "kernels/cuda/cuda_attention.h"

namespace kvpool::capi {
namespace {

// Makes `device` current for its lifetime and restores the previous one.
class ScopedDevice {
 public:
  ScopedDevice() = default;
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice() {
    if (previous_ >= 0 && previous_ != current_) (void)cudaSetDevice(previous_);
  }

  absl::Status Enter(int device) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
    if (device >= count) {
      return absl::UnavailableError(
          absl::StrCat("CUDA device ", device, " does not exist (", count, " devices)"));
    }
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice"));
    current_ = previous_;
    if (previous_ != device) {
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
      current_ = device;
    }
    return absl::OkStatus();
  }

 private:
  int previous_ = -1;
  int current_ = -1;
};

// OK when `device` can read `p` (device memory of that device, managed memory, or host memory
// mapped for the device); `what` names the pointer otherwise.
absl::Status CheckDevicePointer(const void* p, int device, const char* what) {
  if (p == nullptr) return absl::OkStatus();  // the kernel's checks decide where null is legal
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(what, " is not CUDA memory"));
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      if (a.device != device) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " is memory of device ", a.device, ", not of device ", device));
      }
      return absl::OkStatus();
    case cudaMemoryTypeManaged:
      return absl::OkStatus();
    case cudaMemoryTypeHost:
      if (a.devicePointer == p) return absl::OkStatus();  // mapped at the same address
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is pinned host memory the device sees at another address"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is host memory; the device path needs device memory"));
  }
}

absl::Status CheckPointers(int device, const PagedKvBatch& b, const DeviceIo* io) {
  const struct {
    const void* p;
    const char* what;
  } pointers[] = {
      {b.history_pool.pool, "history_pool.base"},
      {b.bf16_pool.pool, "bf16_pool.base"},
      {b.sink.block_tables, "sink.block_tables"},
      {b.sink.first_token, "sink.first_token"},
      {b.sink.num_tokens, "sink.num_tokens"},
      {b.history.block_tables, "history.block_tables"},
      {b.history.first_token, "history.first_token"},
      {b.history.num_tokens, "history.num_tokens"},
      {b.recent.block_tables, "recent.block_tables"},
      {b.recent.first_token, "recent.first_token"},
      {b.recent.num_tokens, "recent.num_tokens"},
      {io != nullptr ? io->queries : nullptr, "queries"},
      {io != nullptr ? io->rotation_k : nullptr, "rotation_k"},
      {io != nullptr ? io->rotation_v : nullptr, "rotation_v"},
      {io != nullptr ? io->out : nullptr, "out"},
      {io != nullptr ? io->lse : nullptr, "lse"},
      {io != nullptr ? io->workspace : nullptr, "workspace"},
  };
  for (const auto& ptr : pointers) {
    KVPOOL_RETURN_IF_ERROR(CheckDevicePointer(ptr.p, device, ptr.what));
  }
  return absl::OkStatus();
}

cuda::DecodeAttentionShape ShapeOf(const QuantConfig& cfg, int q_heads) {
  cuda::DecodeAttentionShape shape;
  shape.cfg = cfg;
  shape.q_heads = q_heads;
  return shape;
}

}  // namespace

bool DevicePathBuilt() { return true; }

absl::StatusOr<size_t> DeviceWorkspaceBytes(int device, const QuantConfig& cfg, int q_heads,
                                            const PagedKvBatch& batch) {
  ScopedDevice scope;
  KVPOOL_RETURN_IF_ERROR(scope.Enter(device));
  return cuda::DecodeAttentionWorkspaceBytes(ShapeOf(cfg, q_heads), batch);
}

absl::Status DeviceDecodeAttention(int device, const QuantConfig& cfg, int q_heads,
                                   const PagedKvBatch& batch, const DeviceIo& io, void* stream) {
  ScopedDevice scope;
  KVPOOL_RETURN_IF_ERROR(scope.Enter(device));
  KVPOOL_RETURN_IF_ERROR(CheckPointers(device, batch, &io));
  const cuda::DecodeIo dio{io.queries, io.rotation_k, io.rotation_v, io.out, io.lse};
  return cuda::DecodeAttention(ShapeOf(cfg, q_heads), batch, dio, io.workspace, io.workspace_bytes,
                               static_cast<cuda::Stream>(stream));
}

}  // namespace kvpool::capi
