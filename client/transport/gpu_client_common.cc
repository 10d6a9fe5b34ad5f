#include "client/transport/gpu_client_common.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvpool::client::gpu_internal {

void DisableNvlinkMulticast() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

absl::Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status NcclCheck(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

absl::Status FromGrpc(const grpc::Status& s, const char* what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

bool WantBlockingOps() {
  const char* v = std::getenv("KVPOOL_NCCL_BLOCKING_OPS");
  return v == nullptr || v[0] != '0';
}

absl::StatusOr<ncclComm_t> SplitBlocking(ncclComm_t parent, absl::Time deadline,
                                         const std::function<absl::Status()>& give_up) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t child = nullptr;
  ncclResult_t r = ncclCommSplit(parent, /*color=*/0, /*key=*/0, &child, &config);
  absl::Status s =
      (r == ncclSuccess || r == ncclInProgress) ? absl::OkStatus() : NcclCheck(r, "ncclCommSplit");
  while (s.ok()) {
    ncclResult_t state = ncclInProgress;
    if (ncclCommGetAsyncError(parent, &state) != ncclSuccess) state = ncclInternalError;
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      s = NcclCheck(state, "splitting the NCCL communicator");
    } else if (absl::Now() > deadline) {
      s = absl::DeadlineExceededError("the daemon did not split the NCCL communicator");
    } else {
      s = give_up();
      if (s.ok()) absl::SleepFor(absl::Microseconds(200));
    }
  }
  ncclCommAbort(parent);  // the child has resources of its own (splitShare is off)
  if (!s.ok()) return s;
  if (child == nullptr) return absl::InternalError("ncclCommSplit gave no communicator");
  return child;
}

}  // namespace kvpool::client::gpu_internal
