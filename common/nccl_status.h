// NCCL results as absl::Status, one conversion for the whole project. The header has no NCCL
// types (the result is an int).
//
//   KVPOOL_RETURN_IF_ERROR(NcclStatus(ncclCommInitRank(...), "joining the channel"));
#pragma once

#include "absl/status/status.h"

namespace kvpool {

// OK for ncclSuccess (0); otherwise Unavailable (a peer, the network or the communicator
// failed: the caller may reconnect) naming `what` and NCCL's description of the result.
[[nodiscard]] absl::Status NcclStatus(int nccl_result, const char* what);

}  // namespace kvpool
