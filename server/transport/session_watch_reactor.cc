#include "server/transport/session_watch_reactor.h"

#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/grpc_reactor_order.h"
#include "server/transport/session_routing.h"
#include "server/transport/transport.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

// Finish is deferred while the first write is outstanding ("holds"). The reactor is shared:
// gRPC's reference ends in OnDone, and the session's end callback holds its own, so it may still
// call End after OnDone (a no-op then).
class SessionWatchReactor final
    : public OrderedReactor<grpc::ServerWriteReactor<v1::WatchSessionResponse>> {
 public:
  static SessionWatchReactor* Start(ServiceContext* ctx, grpc::CallbackServerContext* call,
                                    uint64_t session_id) {
    std::shared_ptr<SessionWatchReactor> r(new SessionWatchReactor(*ctx, call, session_id));
    r->self_ = r;
    std::weak_ptr<SessionWatchReactor> weak = r;
    Transport* holder = nullptr;
    const absl::Status watched =
        ForSession<absl::Status>(ctx->transports, nullptr, "", session_id, [&](Transport* t) {
          absl::Status s = t->WatchSession(r->tenant_, session_id, [weak](absl::Status why) {
            if (std::shared_ptr<SessionWatchReactor> self = weak.lock()) self->End(why);
          });
          if (s.ok()) holder = t;
          // A transport without leases does not hold this session: ask the next.
          return absl::IsUnimplemented(s) ? absl::NotFoundError("") : s;
        });
    if (!watched.ok()) {
      r->End(watched);
      return r.get();
    }
    {
      absl::MutexLock lock(&r->mu_);
      r->transport_ = holder;
      if (!r->end_.has_value()) {
        ++r->holds_;
        r->StartWrite(&r->response_);
      }
    }
    return r.get();
  }

  void OnWriteDone(bool ok) override {
    AcquireFromGrpc(this);
    if (!ok) CloseSession();  // the client went away
    Release();
  }

  // The client ended the lease: the session ends, and its end answers the stream.
  void OnCancel() override { CloseSession(); }

  void OnDone() override {
    AcquireFromGrpc(this);
    std::shared_ptr<SessionWatchReactor> self = std::move(self_);  // may be the last reference
  }

 private:
  SessionWatchReactor(const ServiceContext& ctx, grpc::CallbackServerContext* call,
                      uint64_t session_id)
      : tenant_(TenantOf(ctx, call)), session_id_(session_id) {}

  void CloseSession() {
    Transport* t;
    {
      absl::MutexLock lock(&mu_);
      t = transport_;
    }
    if (t != nullptr) (void)t->Close(tenant_, session_id_);
  }

  // The call's outcome (the first one wins); finishes now unless a write is outstanding.
  void End(const absl::Status& why) {
    grpc::Status s;
    {
      absl::MutexLock lock(&mu_);
      if (end_.has_value()) return;
      end_ = ToGrpcStatus(why);
      if (holds_ > 0 || finishing_) return;
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

  const TenantId tenant_;
  const uint64_t session_id_;
  std::shared_ptr<SessionWatchReactor> self_;  // gRPC's reference, dropped in OnDone
  v1::WatchSessionResponse response_;
  absl::Mutex mu_;
  Transport* transport_ ABSL_GUARDED_BY(mu_) = nullptr;
  int holds_ ABSL_GUARDED_BY(mu_) = 0;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerWriteReactor<v1::WatchSessionResponse>* StartSessionWatch(
    ServiceContext* ctx, grpc::CallbackServerContext* call, uint64_t session_id) {
  return SessionWatchReactor::Start(ctx, call, session_id);
}

}  // namespace kvpool::server
