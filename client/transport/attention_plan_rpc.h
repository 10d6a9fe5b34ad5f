// TransportService.SetAttentionPlan / DropAttentionPlan for the clients of plan-based attention
// channels (gpu_attention.h over NCCL, shm_attention.h over shared memory): the plan's id and the
// shape every call of it moves, checked for consistency.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool::client {

// A plan of an open channel: the batch shape every call of it moves.
struct RemoteAttentionPlan {
  uint32_t id = 0;
  int batch = 0;        // sequences
  int num_queries = 0;  // query rows per sequence
  int q_heads = 0;
  int head_dim = 0;
  int num_layers = 0;
  size_t query_bytes = 0;  // queries (and out): [batch][num_queries][q_heads][head_dim] float32
  size_t lse_bytes = 0;    // lse: [batch][num_queries][q_heads] float32
  size_t rows() const { return static_cast<size_t>(batch) * num_queries; }
};

// Fixes a call shape on session `session_id`: `sequence_ids` of `model_id`, `num_queries` query
// rows each. The daemon's errors; Internal for an inconsistent answer.
absl::StatusOr<RemoteAttentionPlan> SetAttentionPlanRpc(
    ::kvpool::v1::TransportService::StubInterface& stub, uint64_t session_id,
    const std::string& model_id, const std::vector<std::string>& sequence_ids, int num_queries,
    absl::Duration timeout);
absl::Status DropAttentionPlanRpc(::kvpool::v1::TransportService::StubInterface& stub,
                                  uint64_t session_id, uint32_t plan_id, absl::Duration timeout);

}  // namespace kvpool::client
