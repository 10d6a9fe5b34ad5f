#include "client/transport/gpu_client_common.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda_status.h"
#include "common/nccl_status.h"
#include "common/status_macros.h"

namespace kvpool::client::gpu_internal {

void DisableNvlinkMulticast() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

bool WantBlockingOps() {
  const char* v = std::getenv("KVPOOL_NCCL_BLOCKING_OPS");
  return v == nullptr || v[0] != '0';
}

absl::Status AwaitComm(ncclComm_t comm, const char* what, absl::Time deadline,
                       const std::function<absl::Status()>& give_up) {
  while (true) {
    ncclResult_t state = ncclInProgress;
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, what);
    KVPOOL_RETURN_IF_ERROR(give_up());
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": the daemon did not take part"));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

absl::StatusOr<ncclComm_t> SplitBlocking(ncclComm_t parent, absl::Time deadline,
                                         const std::function<absl::Status()>& give_up) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t child = nullptr;
  const ncclResult_t r = ncclCommSplit(parent, /*color=*/0, /*key=*/0, &child, &config);
  absl::Status s = (r == ncclSuccess || r == ncclInProgress)
                       ? AwaitComm(parent, "splitting the NCCL communicator", deadline, give_up)
                       : NcclStatus(r, "ncclCommSplit");
  ncclCommAbort(parent);  // the child has resources of its own (splitShare is off)
  if (!s.ok()) return s;
  if (child == nullptr) return absl::InternalError("ncclCommSplit gave no communicator");
  return child;
}

}  // namespace kvpool::client::gpu_internal
