// What a client's NCCL offer (kvpool.v1.NcclOffer) asks the daemon to join, checked before
// anything is started: the communicator's id, the join's timeout and the channel's use. No NCCL
// here, so it is built and tested everywhere.
//
//   KVPOOL_ASSIGN_OR_RETURN(NcclJoinRequest join, ParseNcclOffer(offer));
//   ... NcclChannel::Join(device, join.unique_id, join.timeout, ...) ...
//
// Pure function; thread-safe.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/transport/transport.h"

namespace kvpool::server {

// Bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kNcclUniqueIdBytes = 128;

struct NcclJoinRequest {
  std::string unique_id;  // kNcclUniqueIdBytes
  absl::Duration timeout;
  bool blocking_ops = false;
  NcclUse use = NcclUse::kIngest;
};

// InvalidArgument for an offer of another kind, an id of the wrong size, a timeout above
// kMaxJoinTimeoutMs (join_admission.h) or a use that names no channel kind.
absl::StatusOr<NcclJoinRequest> ParseNcclOffer(const TransportOffer& offer);

}  // namespace kvpool::server
