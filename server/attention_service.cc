#include "server/attention_service.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/proto_convert.h"

namespace kvpool::server {

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const TenantId tenant = TenantOf(context);
  ServiceContext* ctx = ctx_;
  auto start = [&]() -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx->registry->Get(tenant, request->model_id()));
    const int batch = request->queries_size();
    if (batch < 1 || batch > ctx->config->max_attention_batch) {
      return absl::InvalidArgumentError(absl::StrCat("batch of ", batch,
                                                     " sequences; must be in [1, ",
                                                     ctx->config->max_attention_batch, "]"));
    }
    v1::DType dtype = request->dtype();
    if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_FP32;
    std::vector<AttentionQuery> queries;
    queries.reserve(batch);
    const size_t per_query = static_cast<size_t>(model->q_heads) * model->head_dim;
    for (const v1::SequenceQuery& sq : request->queries()) {
      AttentionQuery q;
      q.sequence_id = sq.sequence_id();
      q.num_queries = sq.num_queries() == 0 ? 1 : static_cast<int>(sq.num_queries());
      if (sq.num_queries() > 1024) {
        return absl::InvalidArgumentError("num_queries must be at most 1024");
      }
      KVPOOL_ASSIGN_OR_RETURN(q.q, DecodeToFloat(dtype, sq.q(), per_query * q.num_queries, "q"));
      queries.push_back(std::move(q));
    }
    ctx->counters.attention_calls++;
    ctx->counters.attention_sequences += batch;
    return ctx->attention->Start(
        tenant, std::move(model), request->layer(), std::move(queries),
        [response, reactor](absl::StatusOr<std::vector<AttentionResult>> results) {
          if (!results.ok()) return reactor->Finish(ToGrpcStatus(results.status()));
          for (const AttentionResult& r : *results) {
            v1::SequenceAttention* out = response->add_results();
            out->set_sequence_id(r.sequence_id);
            out->set_out(reinterpret_cast<const char*>(r.out.data()), r.out.size() * sizeof(float));
            out->mutable_lse()->Assign(r.lse.begin(), r.lse.end());
            out->set_attended_tokens(r.attended_tokens);
          }
          reactor->Finish(grpc::Status::OK);
        });
  };
  if (absl::Status s = start(); !s.ok()) reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

}  // namespace kvpool::server
