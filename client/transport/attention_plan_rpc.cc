#include "client/transport/attention_plan_rpc.h"

#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "proto/status.h"

namespace kvpool::client {

namespace v1 = ::kvpool::v1;

absl::StatusOr<RemoteAttentionPlan> SetAttentionPlanRpc(
    v1::TransportService::StubInterface& stub, uint64_t session_id, const std::string& model_id,
    const std::vector<std::string>& sequence_ids, int num_queries, absl::Duration timeout) {
  if (num_queries < 1) return absl::InvalidArgumentError("num_queries must be >= 1");
  v1::SetAttentionPlanRequest req;
  req.set_session_id(session_id);
  req.set_model_id(model_id);
  for (const std::string& id : sequence_ids) req.add_sequence_ids(id);
  req.set_num_queries(static_cast<uint32_t>(num_queries));
  v1::SetAttentionPlanResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  KVPOOL_RETURN_IF_ERROR(
      FromGrpcStatus(stub.SetAttentionPlan(&ctx, req, &resp), "SetAttentionPlan"));
  RemoteAttentionPlan p;
  p.id = resp.plan_id();
  p.batch = static_cast<int>(sequence_ids.size());
  p.num_queries = num_queries;
  p.q_heads = static_cast<int>(resp.q_heads());
  p.head_dim = static_cast<int>(resp.head_dim());
  p.num_layers = static_cast<int>(resp.num_layers());
  p.query_bytes = resp.query_bytes();
  p.lse_bytes = resp.lse_bytes();
  if (p.id == 0 || p.query_bytes != p.rows() * p.q_heads * p.head_dim * sizeof(float) ||
      p.lse_bytes != p.rows() * p.q_heads * sizeof(float)) {
    return absl::InternalError("SetAttentionPlan answered an inconsistent plan");
  }
  return p;
}

absl::Status DropAttentionPlanRpc(v1::TransportService::StubInterface& stub, uint64_t session_id,
                                  uint32_t plan_id, absl::Duration timeout) {
  v1::DropAttentionPlanRequest req;
  req.set_session_id(session_id);
  req.set_plan_id(plan_id);
  v1::DropAttentionPlanResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return FromGrpcStatus(stub.DropAttentionPlan(&ctx, req, &resp), "DropAttentionPlan");
}

}  // namespace kvpool::client
