#include "server/ingest/ingest_engine.h"

#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/ingest/append_checks.h"
#include "server/proto_convert.h"

namespace kvpool::server {
namespace {

// The expiry of a ticket that Begin opened itself: aborts the append, also when the ticket
// expires before the append exists (then at Bind).
class ExpiryTarget {
 public:
  void Expire(absl::Status why) {
    std::shared_ptr<IngestAppend> append;
    {
      absl::MutexLock lock(&mu_);
      why_ = why;
      append = append_.lock();
    }
    if (append != nullptr) append->Abort(std::move(why));
  }
  void Bind(const std::shared_ptr<IngestAppend>& append) {
    absl::Status why;
    {
      absl::MutexLock lock(&mu_);
      append_ = append;
      why = why_;
    }
    if (!why.ok()) append->Abort(std::move(why));
  }

 private:
  absl::Mutex mu_;
  std::weak_ptr<IngestAppend> append_ ABSL_GUARDED_BY(mu_);
  absl::Status why_ ABSL_GUARDED_BY(mu_);
};

// Counts the append's pages against `ticket` as the store reserves them; `counted` says how
// much, to give back when the append does not begin.
SequenceStore::AdmitPages AdmitPagesOn(const std::shared_ptr<Admission::Ticket>& ticket,
                                       size_t* counted) {
  if (ticket == nullptr) return nullptr;
  return [ticket, counted](size_t bytes) {
    KVPOOL_RETURN_IF_ERROR(ticket->Reserve(bytes));
    *counted += bytes;
    return absl::OkStatus();
  };
}

}  // namespace

IngestEngine::IngestEngine(SequenceStore* store, ModelRegistry* registry, WorkerPool* workers,
                           int max_append_tokens, Admission* admission)
    : store_(store),
      registry_(registry),
      workers_(workers),
      max_append_tokens_(max_append_tokens),
      admission_(admission) {}

absl::StatusOr<std::shared_ptr<Admission::Ticket>> IngestEngine::Admit(
    const TenantId& tenant, const std::string& connection, const std::string& what,
    Admission::OnExpire on_expire) {
  // Streams admitted before a drain began finish; nothing new starts.
  if (drain_ != nullptr) KVPOOL_RETURN_IF_ERROR(drain_->RefuseIfDraining(what));
  if (admission_ == nullptr) return nullptr;
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Admission::Ticket> ticket,
                          admission_->Open(tenant, connection, what, std::move(on_expire)));
  return std::shared_ptr<Admission::Ticket>(std::move(ticket));
}

absl::StatusOr<std::shared_ptr<IngestAppend>> IngestEngine::Begin(const TenantId& tenant,
                                                                  const std::string& connection,
                                                                  const v1::AppendKvHeader& header,
                                                                  IngestOptions options) {
  KVPOOL_RETURN_IF_ERROR(ValidateAppendHeader(header, max_append_tokens_));
  options.tenant = tenant;
  if (options.codec_health == nullptr) options.codec_health = codec_health_;
  std::shared_ptr<ExpiryTarget> target;
  if (options.ticket == nullptr) {
    target = std::make_shared<ExpiryTarget>();
    KVPOOL_ASSIGN_OR_RETURN(options.ticket,
                            Admit(tenant, connection, "append",
                                  [target](absl::Status why) { target->Expire(std::move(why)); }));
  }
  size_t counted = 0;
  absl::StatusOr<std::unique_ptr<AppendTxn>> txn = store_->BeginAppend(
      tenant, header.sequence_id(), AppendSpecOf(header), AdmitPagesOn(options.ticket, &counted));
  if (!txn.ok()) {
    if (options.ticket != nullptr) options.ticket->Unreserve(counted);
    return txn.status();
  }
  auto append =
      std::make_shared<IngestAppend>(*std::move(txn), header.sequence_id(), header.dtype(),
                                     std::move(options), workers_, store_, &counters_);
  if (target != nullptr) target->Bind(append);
  return append;
}

absl::StatusOr<AppendResult> IngestEngine::AppendDecode(const TenantId& tenant,
                                                        const std::string& connection,
                                                        const v1::AppendDecodeRequest& req) {
  v1::AppendKvHeader header;
  header.set_sequence_id(req.sequence_id());
  header.set_token_start(req.token_start());
  header.set_num_tokens(req.num_tokens());
  header.set_dtype(req.dtype());
  *header.mutable_token_ids() = req.token_ids();
  KVPOOL_RETURN_IF_ERROR(ValidateAppendHeader(header, max_append_tokens_));
  {
    // The payload's size is checked against the sequence's model before anything is reserved,
    // so a request with too little data never touches the pool. (Checked again below, against
    // the model the transaction holds.)
    KVPOOL_ASSIGN_OR_RETURN(SequenceInfo info, store_->Describe(tenant, req.sequence_id()));
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            registry_->Get(tenant, info.model_id));
    const size_t values = static_cast<size_t>(req.num_tokens()) * model->row_values() *
                          static_cast<size_t>(model->num_layers);
    KVPOOL_RETURN_IF_ERROR(CheckPayload(req.dtype(), req.k(), values, "k"));
    KVPOOL_RETURN_IF_ERROR(CheckPayload(req.dtype(), req.v(), values, "v"));
  }
  // Runs to its end on this thread: the ticket counts it and its pages, and never needs to
  // interrupt it.
  KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<Admission::Ticket> ticket,
                          Admit(tenant, connection, "AppendDecode", nullptr));
  AppendSpec spec = AppendSpecOf(header);
  spec.kind = AppendKind::kDecode;
  size_t counted = 0;  // given back with the ticket
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
                          store_->BeginAppend(tenant, req.sequence_id(), std::move(spec),
                                              AdmitPagesOn(ticket, &counted)));
  const Model& m = txn->model();
  const size_t per_layer = static_cast<size_t>(req.num_tokens()) * m.row_values();
  const size_t values = per_layer * m.num_layers;
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> k, DecodeToBf16(req.dtype(), req.k(), values, "k"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> v, DecodeToBf16(req.dtype(), req.v(), values, "v"));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    const absl::Span<const Bf16> k_layer =
        absl::MakeConstSpan(k).subspan(layer * per_layer, per_layer);
    const absl::Span<const Bf16> v_layer =
        absl::MakeConstSpan(v).subspan(layer * per_layer, per_layer);
    KVPOOL_RETURN_IF_ERROR(txn->StageLayer(layer, 0, k_layer, v_layer));
    if (codec_health_ != nullptr && codec_health_->ShouldSample()) {
      codec_health_->Sample(m, layer, k_layer, v_layer);
    }
  }
  const int tokens = txn->num_tokens();
  const std::shared_ptr<const Model> model = txn->model_ptr();  // outlives the txn
  KVPOOL_ASSIGN_OR_RETURN(AppendResult r, store_->Commit(std::move(txn)));
  counters_.CountCommit(*model, tokens);
  return r;
}

}  // namespace kvpool::server
