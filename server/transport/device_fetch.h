// TransportService.FetchToDevice: an incremental ReadBlocks whose data the daemon copies from its
// pool (on a GPU) straight into a decode worker's exported mirror arena over a CUDA IPC session,
// answering which arena slot holds what (proto/kvpool/v1/transport_service.proto).
//
//   KVPOOL_RETURN_IF_ERROR(FetchToDevice(ctx, tenant, request, &response));
//
// AssignFetchSlots is the pure part (which slot each new block and page takes), checked and
// tested without a device. Thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/v1/transport_service.pb.h"
#include "server/backend.h"
#include "server/read_cursor.h"
#include "server/sequence_snapshot.h"
#include "server/service_context.h"
#include "server/tenant.h"

namespace kvpool::server {

// Arena slots of one layer's copied data, as DeviceLayerWrites says: history blocks from
// starts.history_block, sink pages from the chunk of starts.sink_token, recent pages from the
// chunk of starts.recent_token.
struct LayerFetchSlots {
  std::vector<int32_t> history;
  std::vector<int32_t> sink;
  std::vector<int32_t> recent;
};

// The slots of `layers` layers' new data for `request` (its free lists, held tail slots and
// region sizes), reading `now` from `starts` (PlanRead's, for request.read().since()).
// INVALID_ARGUMENT (a slot outside its region, `held` not one entry per layer when a cursor is
// given, a tail slot missing where the answer extends the caller's page or block),
// RESOURCE_EXHAUSTED (too few free slots).
absl::StatusOr<std::vector<LayerFetchSlots>> AssignFetchSlots(
    const v1::FetchToDeviceRequest& request, const SequenceTiers& now, const ReadStarts& starts,
    int block_tokens, int layers);

// The copies of a fetch of `snap` from `starts` into an arena whose regions begin at
// `arena_history` and `arena_bf16` (slots as AssignFetchSlots gave), the pool pages they read
// verified first: DATA_LOSS (reason CORRUPT) for one failing its checksum.
absl::StatusOr<std::vector<DeviceCopy>> PlanDeviceCopies(
    ComputeBackend* backend, const SequenceSnapshot& snap, const ReadStarts& starts,
    absl::Span<const LayerFetchSlots> slots, uint8_t* arena_history, uint8_t* arena_bf16);

// The whole call for `tenant`: UNAVAILABLE on a daemon whose pool is not on a GPU or that hosts
// no transport mapping client buffers; otherwise ReadBlocks' errors, the session's, the arena's
// range, AssignFetchSlots', DATA_LOSS for pages failing their checksum. Copies nothing on error.
absl::Status FetchToDevice(ServiceContext* ctx, const TenantId& tenant,
                           const v1::FetchToDeviceRequest& request,
                           v1::FetchToDeviceResponse* response);

}  // namespace kvpool::server
