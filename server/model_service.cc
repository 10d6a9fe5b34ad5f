#include "server/model_service.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/grpc_reactor_order.h"
#include "server/logging/request_context.h"
#include "server/model_registration.h"
#include "server/proto_convert.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

// Stores and sequences counts of one model for ModelInfo.
void FillInfoWithTotals(const ServiceContext& ctx, const Model& m, v1::ModelInfo* out) {
  const auto totals = ctx.store->TotalsByModel(m.tenant);
  auto it = totals.find(m.id);
  const uint64_t seqs = it == totals.end() ? 0 : it->second.sequences;
  const uint64_t bytes = it == totals.end() ? 0 : it->second.pool_bytes;
  FillModelInfo(m, seqs, bytes, out);
}

class RegisterReactor final
    : public OrderedReactor<grpc::ServerReadReactor<v1::RegisterModelRequest>> {
 public:
  RegisterReactor(ServiceContext* ctx, grpc::CallbackServerContext* call,
                  v1::RegisterModelResponse* response)
      : ctx_(ctx), tenant_(TenantOf(*ctx, call)), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    AcquireFromGrpc(this);
    // gRPC runs reactions outside the interceptor's scope: the log lines of the registration
    // (and of its work on the worker pool) carry the call's request id from here.
    ScopedRequestId scope(request_id_);
    if (!ok) {  // the client half-closed (or the call ended)
      if (!have_spec_)
        return Finish(ToGrpcStatus(
            absl::InvalidArgumentError("RegisterModel: the first message must carry a spec")));
      if (spec_.rotation_source_case() == v1::ModelSpec::kUploadSize &&
          file_.size() != spec_.upload_size()) {
        return Finish(ToGrpcStatus(absl::InvalidArgumentError(
            absl::StrCat("rotation file upload ended after ", file_.size(), " of ",
                         spec_.upload_size(), " bytes"))));
      }
      if (!ctx_->workers->TrySubmit([this] { Finish(ToGrpcStatus(Complete())); })) {
        Finish(ToGrpcStatus(BusyError()));
      }
      return;
    }
    absl::Status s = Consume();
    if (!s.ok()) return Finish(ToGrpcStatus(s));
    StartRead(&request_);
  }

  void OnDone() override {
    AcquireFromGrpc(this);
    delete this;
  }

 private:
  absl::Status Consume() {
    const ServerConfig& cfg = *ctx_->config;
    if (!have_spec_) {
      if (request_.part_case() != v1::RegisterModelRequest::kSpec) {
        return absl::InvalidArgumentError("RegisterModel: the first message must carry a spec");
      }
      KVPOOL_RETURN_IF_ERROR(RefuseIfDraining(*ctx_, "RegisterModel"));
      spec_ = request_.spec();
      have_spec_ = true;
      switch (spec_.rotation_source_case()) {
        case v1::ModelSpec::kUploadSize:
          if (spec_.upload_size() == 0 || spec_.upload_size() > cfg.max_rotation_file_bytes) {
            return absl::InvalidArgumentError(absl::StrCat("upload_size must be in [1, ",
                                                           cfg.max_rotation_file_bytes, "], got ",
                                                           spec_.upload_size()));
          }
          // Nothing reserved up front: memory follows the bytes that arrive, not a size the
          // client states.
          break;
        case v1::ModelSpec::kServerPath:
        case v1::ModelSpec::kDataFree:
          break;
        default:
          return absl::InvalidArgumentError(
              "spec needs a rotation source: upload_size, server_path or data_free");
      }
      return absl::OkStatus();
    }
    if (request_.part_case() != v1::RegisterModelRequest::kRotationFileChunk) {
      return absl::InvalidArgumentError("RegisterModel: only the first message may carry a spec");
    }
    if (spec_.rotation_source_case() != v1::ModelSpec::kUploadSize) {
      return absl::InvalidArgumentError("rotation file chunks sent without upload_size");
    }
    const std::string& chunk = request_.rotation_file_chunk();
    if (chunk.size() > cfg.max_chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("rotation file chunk of ", chunk.size(),
                                                     " bytes exceeds max_chunk_bytes ",
                                                     cfg.max_chunk_bytes));
    }
    if (file_.size() + chunk.size() > spec_.upload_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rotation file chunks exceed upload_size ", spec_.upload_size()));
    }
    file_.append(chunk);
    return absl::OkStatus();
  }

  absl::Status Complete() {
    KVPOOL_ASSIGN_OR_RETURN(RegisterResult r,
                            RegisterModelSpec(*ctx_, tenant_, spec_, std::move(file_)));
    FillInfoWithTotals(*ctx_, *r.model, response_->mutable_model());
    response_->set_already_registered(r.already_registered);
    return absl::OkStatus();
  }

  ServiceContext* const ctx_;
  const TenantId tenant_;
  // Set by the request id interceptor while gRPC constructs this reactor in the handler.
  const std::string request_id_{CurrentRequestId()};
  v1::RegisterModelResponse* const response_;
  v1::RegisterModelRequest request_;
  v1::ModelSpec spec_;
  bool have_spec_ = false;
  std::string file_;
};

class DescribeReactor final
    : public OrderedReactor<grpc::ServerWriteReactor<v1::DescribeModelResponse>> {
 public:
  DescribeReactor(ServiceContext* ctx, std::shared_ptr<const Model> model, bool include_rotation)
      : model_(std::move(model)), include_rotation_(include_rotation) {
    FillInfoWithTotals(*ctx, *model_, message_.mutable_model());
    StartWrite(&message_);
  }

  void OnWriteDone(bool ok) override {
    AcquireFromGrpc(this);
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
    if (!include_rotation_ || next_layer_ >= model_->num_layers) return Finish(grpc::Status::OK);
    const int layer = next_layer_++;
    message_.Clear();
    v1::RotationLayer* r = message_.mutable_rotation();
    r->set_layer(layer);
    const std::vector<float> k = model_->codec.rotations.Matrix(layer, KvTensor::kKey);
    const std::vector<float> v = model_->codec.rotations.Matrix(layer, KvTensor::kValue);
    r->set_k_matrix(reinterpret_cast<const char*>(k.data()), k.size() * sizeof(float));
    r->set_v_matrix(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    StartWrite(&message_);
  }

  void OnDone() override {
    AcquireFromGrpc(this);
    delete this;
  }

 private:
  const std::shared_ptr<const Model> model_;
  const bool include_rotation_;
  int next_layer_ = 0;
  v1::DescribeModelResponse message_;
};

class ErrorWriteReactor final
    : public OrderedReactor<grpc::ServerWriteReactor<v1::DescribeModelResponse>> {
 public:
  explicit ErrorWriteReactor(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
  void OnDone() override {
    AcquireFromGrpc(this);
    delete this;
  }
};

}  // namespace

grpc::ServerReadReactor<v1::RegisterModelRequest>* ModelServiceImpl::RegisterModel(
    grpc::CallbackServerContext* context, v1::RegisterModelResponse* response) {
  return new RegisterReactor(ctx_, context, response);
}

grpc::ServerUnaryReactor* ModelServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                       const v1::ListModelsRequest* /*request*/,
                                                       v1::ListModelsResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  const auto totals = ctx_->store->TotalsByModel(tenant);
  for (const auto& m : ctx_->registry->List(tenant)) {
    auto it = totals.find(m->id);
    FillModelInfo(*m, it == totals.end() ? 0 : it->second.sequences,
                  it == totals.end() ? 0 : it->second.pool_bytes, response->add_models());
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<v1::DescribeModelResponse>* ModelServiceImpl::DescribeModel(
    grpc::CallbackServerContext* context, const v1::DescribeModelRequest* request) {
  auto model = ctx_->registry->Get(TenantOf(*ctx_, context), request->model_id());
  if (!model.ok()) return new ErrorWriteReactor(model.status());
  return new DescribeReactor(ctx_, *std::move(model), request->include_rotation());
}

grpc::ServerUnaryReactor* ModelServiceImpl::DeleteModel(grpc::CallbackServerContext* context,
                                                        const v1::DeleteModelRequest* request,
                                                        v1::DeleteModelResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const TenantId tenant = TenantOf(*ctx_, context);
  auto run = [&]() -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx_->registry->Get(tenant, request->model_id()));
    if (!request->force()) {
      const auto totals = ctx_->store->TotalsByModel(tenant);
      auto it = totals.find(model->id);
      if (it != totals.end() && it->second.sequences > 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("model ", Quote(model->id), " still has ", it->second.sequences,
                         " sequences: release them or delete with force"));
      }
    }
    KVPOOL_RETURN_IF_ERROR(ctx_->registry->Remove(tenant, model->id).status());
    const auto [sequences, bytes] = ctx_->store->ReleaseModel(tenant, model->id);
    const size_t cached = ctx_->index->DropModel(tenant, model->id);
    response->set_released_sequences(sequences);
    response->set_freed_bytes(bytes + cached);
    spdlog::info("deleted model '{}' ({} sequences released, {} bytes freed)", model->id, sequences,
                 bytes + cached);
    return absl::OkStatus();
  };
  reactor->Finish(ToGrpcStatus(run()));
  return reactor;
}

}  // namespace kvpool::server
