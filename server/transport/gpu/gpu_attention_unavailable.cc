// The GpuAttentionService of a kvpoold that cannot serve NCCL attention channels: every call is
// answered UNAVAILABLE with the reason.
#include <utility>

#include "kvpool/v1/gpu_attention_service.grpc.pb.h"
#include "server/transport/gpu/gpu_attention_service.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

class UnavailableGpuAttentionService final : public v1::GpuAttentionService::CallbackService {
 public:
  explicit UnavailableGpuAttentionService(std::string reason) : reason_(std::move(reason)) {}

  grpc::ServerWriteReactor<v1::OpenAttentionChannelResponse>* OpenAttentionChannel(
      grpc::CallbackServerContext* /*call*/,
      const v1::OpenAttentionChannelRequest* /*request*/) override {
    return new Refusal(Status());
  }
  grpc::ServerUnaryReactor* SetAttentionPlan(grpc::CallbackServerContext* call,
                                             const v1::SetAttentionPlanRequest* /*request*/,
                                             v1::SetAttentionPlanResponse* /*response*/) override {
    return Refuse(call);
  }
  grpc::ServerUnaryReactor* DropAttentionPlan(
      grpc::CallbackServerContext* call, const v1::DropAttentionPlanRequest* /*request*/,
      v1::DropAttentionPlanResponse* /*response*/) override {
    return Refuse(call);
  }
  grpc::ServerUnaryReactor* CloseAttentionChannel(
      grpc::CallbackServerContext* call, const v1::CloseAttentionChannelRequest* /*request*/,
      v1::CloseAttentionChannelResponse* /*response*/) override {
    return Refuse(call);
  }

 private:
  // Ends a server stream at once.
  class Refusal final : public grpc::ServerWriteReactor<v1::OpenAttentionChannelResponse> {
   public:
    explicit Refusal(const grpc::Status& s) { Finish(s); }
    void OnDone() override { delete this; }
  };

  grpc::Status Status() const { return grpc::Status(grpc::StatusCode::UNAVAILABLE, reason_); }
  grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* call) const {
    grpc::ServerUnaryReactor* reactor = call->DefaultReactor();
    reactor->Finish(Status());
    return reactor;
  }

  const std::string reason_;
};

}  // namespace

std::unique_ptr<grpc::Service> NewUnavailableGpuAttentionService(std::string reason) {
  return std::make_unique<UnavailableGpuAttentionService>(std::move(reason));
}

}  // namespace kvpool::server
