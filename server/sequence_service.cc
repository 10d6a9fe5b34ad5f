#include "server/sequence_service.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/ingest/append_response.h"
#include "server/ingest/ingest_engine.h"
#include "server/ingest_stream_reactor.h"
#include "server/proto_convert.h"
#include "server/scaleout/ownership_check.h"

namespace kvpool::server {
namespace {

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One AppendKv stream: the header begins an append in the ingest engine, each chunk message is
// handed to it as it arrives (its payload stays in the message until staged), the half-close
// commits (IngestStreamReactor).
class AppendKvReactor final : public IngestStreamReactor<v1::AppendKvRequest> {
 public:
  AppendKvReactor(ServiceContext* ctx, grpc::CallbackServerContext* call,
                  v1::AppendKvResponse* response)
      : IngestStreamReactor(call, response, "AppendKv"), ctx_(ctx), tenant_(TenantOf(*ctx, call)) {
    StartReading(ctx_->ingest, tenant_);
  }

 private:
  absl::StatusOr<std::shared_ptr<IngestAppend>> Begin(v1::AppendKvRequest& first,
                                                      IngestOptions options) override {
    if (first.part_case() != v1::AppendKvRequest::kHeader) {
      return absl::InvalidArgumentError("AppendKv: the first message must be a header");
    }
    KVPOOL_RETURN_IF_ERROR(CheckOwnership(*ctx_, call(), tenant_, {first.header().sequence_id()}));
    return ctx_->ingest->Begin(tenant_, call()->peer(), first.header(), std::move(options));
  }

  absl::StatusOr<bool> Stage(v1::AppendKvRequest& message, IngestAppend& append) override {
    if (message.part_case() != v1::AppendKvRequest::kChunk) {
      return absl::InvalidArgumentError("AppendKv: only the first message may be a header");
    }
    auto chunk = std::make_shared<v1::KvChunk>();
    chunk->Swap(message.mutable_chunk());
    const size_t max_chunk = ctx_->config->max_chunk_bytes;
    if (chunk->k().size() > max_chunk || chunk->v().size() > max_chunk) {
      return absl::InvalidArgumentError(absl::StrCat("chunk payload of ",
                                                     std::max(chunk->k().size(), chunk->v().size()),
                                                     " bytes exceeds max_chunk_bytes ", max_chunk));
    }
    // The message holds the rows until they are staged.
    return append.Stage(chunk->layer(), chunk->token_offset(), chunk->num_tokens(), chunk->k(),
                        chunk->v(), [chunk](absl::Status, bool) {});
  }

  ServiceContext* const ctx_;
  const TenantId tenant_;
};

}  // namespace

grpc::ServerUnaryReactor* SequenceServiceImpl::CreateSequence(
    grpc::CallbackServerContext* context, const v1::CreateSequenceRequest* request,
    v1::CreateSequenceResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  auto run = [&]() -> absl::Status {
    KVPOOL_RETURN_IF_ERROR(RefuseIfDraining(*ctx_, "CreateSequence"));
    KVPOOL_RETURN_IF_ERROR(CheckOwnership(*ctx_, context, tenant, {request->sequence_id()}));
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx_->registry->Get(tenant, request->model_id()));
    if (request->prefix_token_ids_size() > ctx_->config->max_append_tokens) {
      return absl::InvalidArgumentError("prefix_token_ids is longer than max_append_tokens");
    }
    const std::vector<uint32_t> ids(request->prefix_token_ids().begin(),
                                    request->prefix_token_ids().end());
    KVPOOL_ASSIGN_OR_RETURN(auto created,
                            ctx_->store->Create(tenant, model, request->sequence_id(), ids,
                                                absl::Milliseconds(request->ttl_ms())));
    FillSequenceInfo(created.first, response->mutable_sequence());
    response->set_reused_tokens(created.first.reused_tokens);
    for (const PrefixUnitKey& k : created.second) FillPrefixUnit(k, response->add_reused_units());
    return absl::OkStatus();
  };
  return FinishNow(context, run());
}

grpc::ServerReadReactor<v1::AppendKvRequest>* SequenceServiceImpl::AppendKv(
    grpc::CallbackServerContext* context, v1::AppendKvResponse* response) {
  return new AppendKvReactor(ctx_, context, response);
}

grpc::ServerUnaryReactor* SequenceServiceImpl::AppendDecode(grpc::CallbackServerContext* context,
                                                            const v1::AppendDecodeRequest* request,
                                                            v1::AppendDecodeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const TenantId tenant = TenantOf(*ctx_, context);
  if (absl::Status owner = CheckOwnership(*ctx_, context, tenant, {request->sequence_id()});
      !owner.ok()) {
    return FinishNow(context, owner);
  }
  ServiceContext* ctx = ctx_;
  const uint64_t units = IngestUnits(request->k().size() + request->v().size());
  if (!ctx_->workers->TrySubmit(
          tenant, units, [ctx, tenant, peer = context->peer(), request, response, reactor] {
            absl::StatusOr<AppendResult> r = ctx->ingest->AppendDecode(tenant, peer, *request);
            if (r.ok()) FillAppendDecodeResponse(*r, response);
            reactor->Finish(ToGrpcStatus(r.status()));
          })) {
    reactor->Finish(ToGrpcStatus(BusyError()));
  }
  return reactor;
}

grpc::ServerUnaryReactor* SequenceServiceImpl::SealSequence(grpc::CallbackServerContext* context,
                                                            const v1::SealSequenceRequest* request,
                                                            v1::SealSequenceResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  if (absl::Status owner = CheckOwnership(*ctx_, context, tenant, {request->sequence_id()});
      !owner.ok()) {
    return FinishNow(context, owner);
  }
  absl::StatusOr<SequenceInfo> info = ctx_->store->Seal(tenant, request->sequence_id());
  if (info.ok()) FillSequenceInfo(*info, response->mutable_sequence());
  return FinishNow(context, info.status());
}

grpc::ServerUnaryReactor* SequenceServiceImpl::ReleaseSequence(
    grpc::CallbackServerContext* context, const v1::ReleaseSequenceRequest* request,
    v1::ReleaseSequenceResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  if (absl::Status owner = CheckOwnership(*ctx_, context, tenant, {request->sequence_id()});
      !owner.ok()) {
    return FinishNow(context, owner);
  }
  absl::StatusOr<size_t> freed = ctx_->store->Release(tenant, request->sequence_id());
  if (freed.ok()) response->set_freed_bytes(*freed);
  return FinishNow(context, freed.status());
}

grpc::ServerUnaryReactor* SequenceServiceImpl::DescribeSequence(
    grpc::CallbackServerContext* context, const v1::DescribeSequenceRequest* request,
    v1::SequenceInfo* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  if (absl::Status owner = CheckOwnership(*ctx_, context, tenant, {request->sequence_id()});
      !owner.ok()) {
    return FinishNow(context, owner);
  }
  absl::StatusOr<SequenceInfo> info = ctx_->store->Describe(tenant, request->sequence_id());
  if (info.ok()) FillSequenceInfo(*info, response);
  return FinishNow(context, info.status());
}

grpc::ServerUnaryReactor* SequenceServiceImpl::LookupPrefix(grpc::CallbackServerContext* context,
                                                            const v1::LookupPrefixRequest* request,
                                                            v1::LookupPrefixResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  auto run = [&]() -> absl::Status {
    KVPOOL_RETURN_IF_ERROR(CheckOwnership(*ctx_, context, tenant, {}));
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx_->registry->Get(tenant, request->model_id()));
    if (request->token_ids_size() > ctx_->config->max_append_tokens) {
      return absl::InvalidArgumentError("token_ids is longer than max_append_tokens");
    }
    const std::vector<uint32_t> ids(request->token_ids().begin(), request->token_ids().end());
    const PrefixContext pctx = SequenceStore::ContextOf(*model);
    const std::vector<PrefixUnitKey> chain = ComputePrefixChain(pctx, ids);
    const std::vector<PrefixMatch> hits = ctx_->index->Match(pctx, chain, /*take_refs=*/false);
    uint32_t matched = 0;
    for (const PrefixMatch& hit : hits) {
      FillPrefixUnit(hit.key, response->add_units());
      matched = hit.key.token_start + hit.key.token_count;
    }
    response->set_matched_tokens(matched);
    response->set_codec_version(model->version_hex);
    return absl::OkStatus();
  };
  return FinishNow(context, run());
}

}  // namespace kvpool::server
