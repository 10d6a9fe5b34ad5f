#include "common/nccl_status.h"

#include <nccl.h>

#include "absl/strings/str_cat.h"

namespace kvpool {

absl::Status NcclStatus(int nccl_result, const char* what) {
  const auto r = static_cast<ncclResult_t>(nccl_result);
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace kvpool
