// The snapshot a cursor read answers from (ReadBlocks, FetchToDevice), and where its data
// begins. A reader that is up to date, a decode worker asking each step whether its sequence
// grew, is answered from a snapshot without page references: a full snapshot takes one per
// page of every layer read, a cost that grows with the context and that such a read never uses.
//
//   KVPOOL_ASSIGN_OR_RETURN(ReadSnapshot r,
//                           SnapshotForRead(*store, tenant, id, layers, &request.since()));
//   // r.snap->layers()[i] lists no page when SendsNothing(r.starts, ...): nothing is read.
//
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/v1/read_service.pb.h"
#include "server/read_cursor.h"
#include "server/sequence_snapshot.h"
#include "server/sequence_store.h"

namespace kvpool::server {

struct ReadSnapshot {
  std::unique_ptr<SequenceSnapshot> snap;
  ReadStarts starts;
};

// The tiers of a snapshot (the same for every layer).
SequenceTiers TiersOf(const SequenceSnapshot& s);

// A snapshot of `layers` of `id` for a read from `since` (null: a full read) and its starts
// (PlanRead against that same snapshot). Without page references when the read sends nothing.
// The errors of SequenceStore::Snapshot and of PlanRead.
absl::StatusOr<ReadSnapshot> SnapshotForRead(const SequenceStore& store, const TenantId& tenant,
                                             const std::string& id, absl::Span<const int> layers,
                                             const v1::ReadBlocksCursor* since);

}  // namespace kvpool::server
