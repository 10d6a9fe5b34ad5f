#include "server/attention_service.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/proto_convert.h"
#include "server/read_ticket.h"
#include "server/scaleout/ownership_check.h"

namespace kvpool::server {
namespace {

// An upper bound of the AttendResponse's encoded size: per sequence its FP32 output rows and LSE
// values, its id (at most 128 bytes) and the fields' tags and lengths.
size_t AttendResponseBound(const v1::AttendRequest& request, const Model& model) {
  constexpr size_t kPerSequenceOverhead = 128 + 64;
  const size_t per_row =
      (static_cast<size_t>(model.q_heads) * model.head_dim + model.q_heads) * sizeof(float);
  size_t bytes = 0;
  for (const v1::SequenceQuery& sq : request.queries()) {
    const size_t rows = sq.num_queries() == 0 ? 1 : sq.num_queries();
    bytes += rows * per_row + kPerSequenceOverhead;
  }
  return bytes;
}

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const TenantId tenant = TenantOf(*ctx_, context);
  ServiceContext* ctx = ctx_;
  auto start = [&]() -> absl::Status {
    std::vector<absl::string_view> ids;
    for (const v1::SequenceQuery& sq : request->queries()) ids.push_back(sq.sequence_id());
    KVPOOL_RETURN_IF_ERROR(CheckOwnership(*ctx, context, tenant, ids));
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx->registry->Get(tenant, request->model_id()));
    const int batch = request->queries_size();
    if (batch < 1 || batch > ctx->config->max_attention_batch) {
      return absl::InvalidArgumentError(absl::StrCat("batch of ", batch,
                                                     " sequences; must be in [1, ",
                                                     ctx->config->max_attention_batch, "]"));
    }
    for (const v1::SequenceQuery& sq : request->queries()) {
      if (sq.num_queries() > 1024) {
        return absl::InvalidArgumentError("num_queries must be at most 1024");
      }
    }
    // The answer must fit in one message: refused before any work rather than after it.
    const size_t answer = AttendResponseBound(*request, *model);
    if (answer > ctx->config->max_message_bytes) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "Attend: the answer (FP32 outputs and LSE of ", batch,
              " sequences) would take up to ", answer, " bytes, over max_message_bytes ",
              ctx->config->max_message_bytes, "; send fewer sequences or query rows per call")),
          ErrorReason::kLimit,
          {{"limit", "max_message_bytes"},
           {"value", absl::StrCat(ctx->config->max_message_bytes)},
           {"needed", absl::StrCat(answer)}});
    }
    v1::DType dtype = request->dtype();
    if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_FP32;
    // The queries are decoded once, straight into the buffer the backend reads. It is sized by
    // the payloads (so by the message size, whatever the counts claim); each sequence's payload
    // is checked against its count before it is decoded.
    const size_t per_query = static_cast<size_t>(model->q_heads) * model->head_dim;
    const size_t elem = DTypeSize(dtype);
    size_t values = 0;
    for (const v1::SequenceQuery& sq : request->queries()) {
      if (elem > 0) values += sq.q().size() / elem;
    }
    // Admitted before any decoding: the decoded queries and the answer are what it holds.
    std::shared_ptr<CallCancellation> cancellation =
        CancellationOf(context, &ctx->counters.cancellation);
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<ReadTicket> ticket,
                            ReadTicket::Open(ctx->admission, context, tenant, "Attend",
                                             values * sizeof(float) + answer, cancellation));
    AttentionRequest queries;
    queries.sequence_ids.reserve(batch);
    queries.num_queries.reserve(batch);
    queries.queries.resize(values);
    size_t at = 0;
    for (const v1::SequenceQuery& sq : request->queries()) {
      const int num_queries = sq.num_queries() == 0 ? 1 : static_cast<int>(sq.num_queries());
      const size_t n = per_query * num_queries;
      KVPOOL_RETURN_IF_ERROR(CheckPayload(dtype, sq.q(), n, "q"));
      KVPOOL_RETURN_IF_ERROR(
          DecodeToFloat(dtype, sq.q(), absl::MakeSpan(queries.queries).subspan(at, n), "q"));
      at += n;
      queries.sequence_ids.push_back(sq.sequence_id());
      queries.num_queries.push_back(num_queries);
    }
    ctx->counters.attention_calls++;
    ctx->counters.attention_sequences += batch;
    const size_t per_lse = static_cast<size_t>(model->q_heads);
    return ctx->attention->Start(
        tenant, std::move(model), request->layer(), std::move(queries),
        [request, response, reactor, per_query, per_lse,
         ticket](absl::StatusOr<AttentionAnswer> answer) {
          // The answer's bytes stay held until it is handed to gRPC; the context may go once
          // the call is finished.
          if (!answer.ok()) {
            ticket->Close();
            return reactor->Finish(ToGrpcStatus(answer.status()));
          }
          // Built from the buffers the backend wrote (the one copy the message needs).
          size_t row = 0;
          for (int i = 0; i < request->queries_size(); ++i) {
            const v1::SequenceQuery& sq = request->queries(i);
            const size_t rows = sq.num_queries() == 0 ? 1 : sq.num_queries();
            v1::SequenceAttention* out = response->add_results();
            out->set_sequence_id(sq.sequence_id());
            out->set_out(reinterpret_cast<const char*>(answer->out.data() + row * per_query),
                         rows * per_query * sizeof(float));
            out->mutable_lse()->Assign(answer->lse.begin() + row * per_lse,
                                       answer->lse.begin() + (row + rows) * per_lse);
            out->set_attended_tokens(answer->attended_tokens[i]);
            row += rows;
          }
          ticket->Close();
          reactor->Finish(grpc::Status::OK);
        },
        std::move(cancellation));
  };
  if (absl::Status s = start(); !s.ok()) reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

}  // namespace kvpool::server
