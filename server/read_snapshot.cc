#include "server/read_snapshot.h"

#include <utility>

#include "common/status_macros.h"

namespace kvpool::server {

SequenceTiers TiersOf(const SequenceSnapshot& s) {
  return {s.incarnation(), s.sink(), s.history(), s.recent()};
}

absl::StatusOr<ReadSnapshot> SnapshotForRead(const SequenceStore& store, const TenantId& tenant,
                                             const std::string& id, absl::Span<const int> layers,
                                             const v1::ReadBlocksCursor* since) {
  ReadSnapshot r;
  auto plan = [&]() -> absl::Status {
    const Model& m = r.snap->model();
    KVPOOL_ASSIGN_OR_RETURN(
        r.starts, PlanRead(since, TiersOf(*r.snap), m.codec.quant.sink_tokens, m.block_tokens()));
    return absl::OkStatus();
  };
  if (since != nullptr) {
    KVPOOL_ASSIGN_OR_RETURN(r.snap, store.Snapshot(tenant, id, layers, SnapshotPages::kNone));
    KVPOOL_RETURN_IF_ERROR(plan());
    if (SendsNothing(r.starts, TiersOf(*r.snap), r.snap->model().block_tokens())) return r;
  }
  // Something to send: the pages, and the starts against the tiers they show (the sequence may
  // have grown since the look above).
  KVPOOL_ASSIGN_OR_RETURN(r.snap, store.Snapshot(tenant, id, layers));
  KVPOOL_RETURN_IF_ERROR(plan());
  return r;
}

}  // namespace kvpool::server
