// DrainState: whether the daemon is draining, and the calls a drain waits for. One per daemon;
// KvpoolServer::Drain (SIGTERM and AdminService.Drain alike) begins it, the ingest engine
// refuses new appends through it, GetStats reports it.
//
//   if (absl::Status s = drain.RefuseIfDraining("CreateSequence"); !s.ok()) return s;
//   drain.Begin(absl::Now() + grace);           // false when already draining
//   drain.AwaitIdle(deadline);                  // true once no counted call is in flight
//
// Calls are counted by an interceptor (NewInFlightInterceptorFactory) from the moment gRPC
// hands them to the daemon until they are done. Health checks, AdminService calls and the
// subscriptions that only end when their caller leaves (SubscribeKvEvents, WatchSession) are
// not counted: a drain does not wait for them. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"
#include "kvpool/v1/stats_service.pb.h"

namespace kvpool::server {

class DrainState {
 public:
  // Enters the drain, to end by `deadline`; false (nothing changes) when already draining.
  bool Begin(absl::Time deadline);
  bool draining() const;
  // When the drain began and when it must end (InfinitePast while serving).
  absl::Time started() const;
  absl::Time deadline() const;

  // OK while serving; UNAVAILABLE with reason DRAINING naming `what` while draining.
  absl::Status RefuseIfDraining(absl::string_view what) const;

  void CallStarted();
  void CallEnded();
  int64_t in_flight() const;
  // Blocks until no counted call is in flight or `deadline` passes; whether none is left.
  bool AwaitIdle(absl::Time deadline) const;

 private:
  mutable absl::Mutex mu_;
  absl::Time started_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time deadline_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

// The state as GetStats and AdminService.Drain report it.
void FillServingState(const DrainState& state, ::kvpool::v1::ServingState* out);

// Whether a call of `method` ("/pkg.Service/Method") is one a drain waits for.
bool DrainWaitsFor(absl::string_view method);

// An interceptor factory counting the calls DrainWaitsFor in `state` (which outlives the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewInFlightInterceptorFactory(DrainState* state);

}  // namespace kvpool::server
