#include "server/transport/nccl/nccl_offer.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/transport/nccl/join_admission.h"

namespace kvpool::server {

absl::StatusOr<NcclJoinRequest> ParseNcclOffer(const TransportOffer& offer) {
  if (offer.kind != TransportKind::kNccl) {
    return absl::InvalidArgumentError("the NCCL transport got an offer of another kind");
  }
  if (offer.nccl.unique_id.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("nccl.unique_id must be ", kNcclUniqueIdBytes,
                                                   " bytes, got ", offer.nccl.unique_id.size()));
  }
  if (offer.nccl.use != static_cast<int>(NcclUse::kIngest) &&
      offer.nccl.use != static_cast<int>(NcclUse::kAttention)) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl.use must be NCCL_CHANNEL_USE_INGEST or NCCL_CHANNEL_USE_ATTENTION, got ",
                     offer.nccl.use));
  }
  NcclJoinRequest join;
  KVPOOL_ASSIGN_OR_RETURN(join.timeout, JoinTimeout(offer.nccl.timeout_ms));
  join.unique_id = offer.nccl.unique_id;
  join.blocking_ops = offer.nccl.blocking_ops;
  join.use = static_cast<NcclUse>(offer.nccl.use);
  return join;
}

}  // namespace kvpool::server
