#include "server/transport/device_push_reactor.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/ingest/append_checks.h"
#include "server/ingest/ingest_engine.h"
#include "server/ingest_stream_reactor.h"
#include "server/scaleout/ownership_check.h"
#include "server/transport/device_push.h"
#include "server/transport/session_routing.h"
#include "server/transport/transport_proto.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

class DevicePushReactor final : public IngestStreamReactor<v1::DevicePushRequest> {
 public:
  DevicePushReactor(ServiceContext* ctx, grpc::CallbackServerContext* call,
                    v1::AppendKvResponse* response)
      : IngestStreamReactor(call, response, "PushKv"), ctx_(ctx), tenant_(TenantOf(*ctx, call)) {
    StartReading(ctx_->ingest, tenant_);
  }

 private:
  absl::StatusOr<std::shared_ptr<IngestAppend>> Begin(v1::DevicePushRequest& first,
                                                      IngestOptions options) override {
    if (first.part_case() != v1::DevicePushRequest::kHeader) {
      return absl::InvalidArgumentError("PushKv: the first message must be a header");
    }
    const v1::DevicePushHeader& h = first.header();
    // Before the transport acts on the push: a push for a sequence owned elsewhere is
    // redirected like AppendKv (docs/scale-out.md).
    KVPOOL_RETURN_IF_ERROR(CheckOwnership(*ctx_, call(), tenant_, {h.append().sequence_id()}));
    const uint64_t id = h.session_id();
    std::function<bool()> cancelled = options.cancelled;
    KVPOOL_ASSIGN_OR_RETURN(
        push_, ForSession<absl::StatusOr<std::shared_ptr<DevicePush>>>(
                   ctx_->transports, &TransportCapabilities::device_pushes,
                   "device pushes need kvpoold --device=cuda:N built with CUDA (and NCCL)", id,
                   [&](Transport* t) { return t->OpenDevicePush(tenant_, id, cancelled); }));
    if (h.append().dtype() != v1::DTYPE_BF16) {
      return absl::InvalidArgumentError(
          "a device push carries BF16 rows: dtype must be DTYPE_BF16");
    }
    sequence_id_ = h.append().sequence_id();
    // Reads pause while every slot of the transport holds a chunk of this push.
    options.max_pending_chunks = push_->max_pending_chunks();
    return ctx_->ingest->Begin(tenant_, call()->peer(), h.append(), std::move(options));
  }

  absl::StatusOr<bool> Stage(v1::DevicePushRequest& message, IngestAppend& append) override {
    if (message.part_case() != v1::DevicePushRequest::kChunk) {
      return absl::InvalidArgumentError("PushKv: only the first message may be a header");
    }
    const v1::DevicePushChunk& c = message.chunk();
    // Checked before the transport acts on it (posts a receive, maps a buffer).
    KVPOOL_RETURN_IF_ERROR(append.CheckChunk(c.layer(), c.token_offset(), c.num_tokens()));
    KVPOOL_ASSIGN_OR_RETURN(const size_t bytes,
                            ChunkBytes(c.num_tokens(), append.model().row_values() * sizeof(Bf16)));
    return push_->Stage(DeviceChunkFromProto(c, bytes), append);
  }

  void Ended(const absl::Status& status) override {
    if (push_ != nullptr) push_->End(status, sequence_id_);
  }

  ServiceContext* const ctx_;
  const TenantId tenant_;
  std::shared_ptr<DevicePush> push_;
  std::string sequence_id_;
};

}  // namespace

grpc::ServerReadReactor<v1::DevicePushRequest>* NewDevicePushReactor(
    ServiceContext* ctx, grpc::CallbackServerContext* call, v1::AppendKvResponse* response) {
  return new DevicePushReactor(ctx, call, response);
}

}  // namespace kvpool::server
