#include "server/transport/gpu/gpu_attention_service.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "dataplane/attention_wire.h"
#include "kvpool/v1/gpu_attention_service.grpc.pb.h"
#include "server/transport/gpu/attention_channel.h"
#include "server/transport/gpu/join_admission.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

class GpuAttentionServiceImpl final : public v1::GpuAttentionService::CallbackService {
 public:
  explicit GpuAttentionServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  ~GpuAttentionServiceImpl() override {
    std::map<uint64_t, std::shared_ptr<AttentionChannel>> channels;
    {
      absl::MutexLock lock(&mu_);
      channels.swap(channels_);
    }
    for (auto& [id, ch] : channels) ch->Close();
  }

  grpc::ServerWriteReactor<v1::OpenAttentionChannelResponse>* OpenAttentionChannel(
      grpc::CallbackServerContext* call, const v1::OpenAttentionChannelRequest* request) override;

  grpc::ServerUnaryReactor* SetAttentionPlan(grpc::CallbackServerContext* call,
                                             const v1::SetAttentionPlanRequest* request,
                                             v1::SetAttentionPlanResponse* response) override {
    grpc::ServerUnaryReactor* reactor = call->DefaultReactor();
    auto set = [&]() -> absl::Status {
      KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<AttentionChannel> ch, Channel(request->channel_id()));
      const int num_queries =
          request->num_queries() == 0
              ? 1
              : static_cast<int>(std::min<uint32_t>(request->num_queries(), kMaxPlanQueries + 1));
      KVPOOL_ASSIGN_OR_RETURN(AttentionPlanInfo plan,
                              ch->AddPlan(request->model_id(),
                                          std::vector<std::string>(request->sequence_ids().begin(),
                                                                   request->sequence_ids().end()),
                                          num_queries));
      response->set_plan_id(plan.plan_id);
      response->set_q_heads(static_cast<uint32_t>(plan.shape.q_heads));
      response->set_head_dim(static_cast<uint32_t>(plan.shape.head_dim));
      response->set_num_layers(static_cast<uint32_t>(plan.num_layers));
      response->set_query_bytes(plan.shape.query_bytes());
      response->set_lse_bytes(plan.shape.lse_bytes());
      return absl::OkStatus();
    };
    reactor->Finish(ToGrpcStatus(set()));
    return reactor;
  }

  grpc::ServerUnaryReactor* DropAttentionPlan(
      grpc::CallbackServerContext* call, const v1::DropAttentionPlanRequest* request,
      v1::DropAttentionPlanResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = call->DefaultReactor();
    absl::StatusOr<std::shared_ptr<AttentionChannel>> ch = Channel(request->channel_id());
    reactor->Finish(ToGrpcStatus(ch.ok() ? (*ch)->DropPlan(request->plan_id()) : ch.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* CloseAttentionChannel(
      grpc::CallbackServerContext* call, const v1::CloseAttentionChannelRequest* request,
      v1::CloseAttentionChannelResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = call->DefaultReactor();
    reactor->Finish(ToGrpcStatus(
        Remove(request->channel_id())
            ? absl::OkStatus()
            : absl::NotFoundError(absl::StrCat("no attention channel ", request->channel_id()))));
    return reactor;
  }

  ServiceContext* ctx() const { return ctx_; }
  PendingJoins& joins() { return joins_; }

  uint64_t Add(std::shared_ptr<AttentionChannel> ch) {
    const uint64_t id = next_channel_.fetch_add(1);
    absl::MutexLock lock(&mu_);
    channels_[id] = std::move(ch);
    return id;
  }

  // Closes the channel (its loop has ended when this returns, unless called from that loop) and
  // forgets it. False when absent.
  bool Remove(uint64_t id) {
    std::shared_ptr<AttentionChannel> ch;
    {
      absl::MutexLock lock(&mu_);
      auto it = channels_.find(id);
      if (it == channels_.end()) return false;
      ch = std::move(it->second);
      channels_.erase(it);
    }
    ch->Close();
    return true;
  }

  absl::StatusOr<std::shared_ptr<AttentionChannel>> Channel(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(id);
    if (it == channels_.end()) {
      return absl::NotFoundError(absl::StrCat("no attention channel ", id));
    }
    return it->second;
  }

 private:
  ServiceContext* const ctx_;
  PendingJoins joins_;
  std::atomic<uint64_t> next_channel_{1};
  absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<AttentionChannel>> channels_ ABSL_GUARDED_BY(mu_);
};

// One OpenAttentionChannel call: joins the communicator on a thread, answers the channel id,
// then keeps the stream open as the channel's lease. The stream ends when the channel does
// (Close, an abort) and the channel is closed when the stream ends first (the client cancelled
// or went away).
//
// Finish is deferred while the join thread or a write is outstanding ("holds"). The reactor is
// shared: gRPC's reference ends in OnDone, and the join thread and the channel's end callback
// hold their own, so they may still call End after OnDone (a no-op then).
class OpenReactor final : public grpc::ServerWriteReactor<v1::OpenAttentionChannelResponse> {
 public:
  static OpenReactor* Start(GpuAttentionServiceImpl* service, grpc::CallbackServerContext* call,
                            const v1::OpenAttentionChannelRequest& request) {
    std::shared_ptr<OpenReactor> r(new OpenReactor(service));
    r->self_ = r;
    const absl::StatusOr<absl::Duration> timeout = JoinTimeout(request.timeout_ms());
    if (!timeout.ok() || !service->joins().TryAcquire()) {
      r->End(!timeout.ok()
                 ? timeout.status()
                 : absl::ResourceExhaustedError(absl::StrCat(
                       kMaxPendingJoins, " attention channels are joining; retry later")));
      r->Release();  // no join thread
      return r.get();
    }
    // Joining waits for the client's rank: off the gRPC thread.
    std::thread([r, service, tenant = TenantOf(call), id = request.nccl_unique_id(),
                 timeout = *timeout, name = request.client_name(),
                 blocking = request.blocking_ops()] {
      r->JoinAndAnswer(tenant, id, timeout, name, blocking);
      service->joins().Release();
    }).detach();
    return r.get();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::CancelledError("the client went away"));
      service_->Remove(ChannelId());
    }
    Release();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    End(absl::CancelledError("OpenAttentionChannel cancelled"));
    service_->Remove(ChannelId());
  }

  void OnDone() override {
    service_->Remove(ChannelId());  // after an abort the channel is still listed
    std::shared_ptr<OpenReactor> self = std::move(self_);  // may be the last reference
  }

 private:
  explicit OpenReactor(GpuAttentionServiceImpl* service) : service_(service) {}

  void JoinAndAnswer(const TenantId& tenant, const std::string& unique_id, absl::Duration timeout,
                     const std::string& name, bool blocking_ops) {
    absl::StatusOr<std::unique_ptr<AttentionChannel>> joined = AttentionChannel::Join(
        service_->ctx(), tenant, unique_id, timeout, name, [this] { return cancelled(); },
        blocking_ops);
    if (!joined.ok()) {
      End(joined.status());
      Release();
      return;
    }
    std::shared_ptr<AttentionChannel> ch = std::move(*joined);
    const uint64_t id = service_->Add(ch);
    {
      absl::MutexLock lock(&mu_);
      channel_id_ = id;
    }
    spdlog::info("attention channel {} open with {} on cuda:{}", id, name, ch->device());
    // self_ stays set until OnDone, which cannot come before this thread's Release.
    ch->Start([r = self_](absl::Status why) { r->End(why); });
    {
      absl::MutexLock lock(&mu_);
      if (!cancelled_ && !end_.has_value()) {
        response_.set_channel_id(id);
        response_.set_device(static_cast<uint32_t>(ch->device()));
        response_.set_call_header_bytes(kCallHeaderBytes);
        response_.set_call_status_bytes(kCallStatusBytes);
        response_.set_max_query_bytes(kMaxCallQueryBytes);
        ++holds_;  // the write
        StartWrite(&response_);
      }
    }
    if (cancelled()) service_->Remove(id);  // OnCancel may have run before the id was known
    ch.reset();
    Release();  // the join thread's hold
  }

  bool cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  uint64_t ChannelId() {
    absl::MutexLock lock(&mu_);
    return channel_id_;
  }

  // The call's outcome (the first one wins); finishes now unless something holds the reactor.
  void End(const absl::Status& why) {
    grpc::Status s;
    {
      absl::MutexLock lock(&mu_);
      if (end_.has_value()) return;
      end_ = ToGrpcStatus(why);
      if (holds_ > 0) return;
      finishing_ = true;
      s = *end_;
    }
    Finish(s);
  }

  void Release() {
    grpc::Status s;
    {
      absl::MutexLock lock(&mu_);
      --holds_;
      if (holds_ > 0 || !end_.has_value() || finishing_) return;
      finishing_ = true;
      s = *end_;
    }
    Finish(s);
  }

  GpuAttentionServiceImpl* const service_;
  std::shared_ptr<OpenReactor> self_;  // gRPC's reference, dropped in OnDone
  v1::OpenAttentionChannelResponse response_;
  absl::Mutex mu_;
  int holds_ ABSL_GUARDED_BY(mu_) = 1;  // the join thread
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
  uint64_t channel_id_ ABSL_GUARDED_BY(mu_) = 0;
};

grpc::ServerWriteReactor<v1::OpenAttentionChannelResponse>*
GpuAttentionServiceImpl::OpenAttentionChannel(grpc::CallbackServerContext* call,
                                              const v1::OpenAttentionChannelRequest* request) {
  return OpenReactor::Start(this, call, *request);
}

}  // namespace

std::unique_ptr<grpc::Service> NewGpuAttentionService(ServiceContext* ctx) {
  if (ctx->backend->device() < 0) {
    return NewUnavailableGpuAttentionService(
        absl::StrCat("NCCL attention channels need kvpoold --device=cuda:N; this one runs on '",
                     ctx->backend->name(), "'"));
  }
  return std::make_unique<GpuAttentionServiceImpl>(ctx);
}

}  // namespace kvpool::server
