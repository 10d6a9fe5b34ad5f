#include "server/ingest/ingest_engine.h"

#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/ingest/append_checks.h"
#include "server/proto_convert.h"

namespace kvpool::server {

IngestEngine::IngestEngine(SequenceStore* store, ModelRegistry* registry, WorkerPool* workers,
                           int max_append_tokens)
    : store_(store),
      registry_(registry),
      workers_(workers),
      max_append_tokens_(max_append_tokens) {}

absl::StatusOr<std::shared_ptr<IngestAppend>> IngestEngine::Begin(const TenantId& tenant,
                                                                  const v1::AppendKvHeader& header,
                                                                  IngestOptions options) {
  KVPOOL_RETURN_IF_ERROR(ValidateAppendHeader(header, max_append_tokens_));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
                          store_->BeginAppend(tenant, header.sequence_id(), AppendSpecOf(header)));
  return std::make_shared<IngestAppend>(std::move(txn), header.sequence_id(), header.dtype(),
                                        std::move(options), workers_, store_, &counters_);
}

absl::StatusOr<AppendResult> IngestEngine::AppendDecode(const TenantId& tenant,
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
  AppendSpec spec = AppendSpecOf(header);
  spec.kind = AppendKind::kDecode;
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
                          store_->BeginAppend(tenant, req.sequence_id(), std::move(spec)));
  const Model& m = txn->model();
  const size_t per_layer = static_cast<size_t>(req.num_tokens()) * m.row_values();
  const size_t values = per_layer * m.num_layers;
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> k, DecodeToBf16(req.dtype(), req.k(), values, "k"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> v, DecodeToBf16(req.dtype(), req.v(), values, "v"));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    KVPOOL_RETURN_IF_ERROR(
        txn->StageLayer(layer, 0, absl::MakeConstSpan(k).subspan(layer * per_layer, per_layer),
                        absl::MakeConstSpan(v).subspan(layer * per_layer, per_layer)));
  }
  const int tokens = txn->num_tokens();
  const std::shared_ptr<const Model> model = txn->model_ptr();  // outlives the txn
  KVPOOL_ASSIGN_OR_RETURN(AppendResult r, store_->Commit(std::move(txn)));
  counters_.CountCommit(*model, tokens);
  return r;
}

}  // namespace kvpool::server
