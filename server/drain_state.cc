#include "server/drain_state.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/status.h"

namespace kvpool::server {

bool DrainState::Begin(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (started_ != absl::InfinitePast()) return false;
  started_ = absl::Now();
  deadline_ = deadline;
  return true;
}

bool DrainState::draining() const {
  absl::MutexLock lock(&mu_);
  return started_ != absl::InfinitePast();
}

absl::Time DrainState::started() const {
  absl::MutexLock lock(&mu_);
  return started_;
}

absl::Time DrainState::deadline() const {
  absl::MutexLock lock(&mu_);
  return deadline_;
}

absl::Status DrainState::RefuseIfDraining(absl::string_view what) const {
  if (!draining()) return absl::OkStatus();
  return WithReason(
      absl::UnavailableError(absl::StrCat(
          what, " refused: this daemon is draining (shutting down); use another replica")),
      ErrorReason::kDraining);
}

void DrainState::CallStarted() {
  absl::MutexLock lock(&mu_);
  ++in_flight_;
}

void DrainState::CallEnded() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

int64_t DrainState::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

bool DrainState::AwaitIdle(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ <= 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void FillServingState(const DrainState& state, v1::ServingState* out) {
  const absl::Time started = state.started();
  const bool draining = started != absl::InfinitePast();
  out->set_state(draining ? v1::ServingState::DRAINING : v1::ServingState::SERVING);
  out->set_drain_started_unix_ms(draining ? absl::ToUnixMillis(started) : 0);
  out->set_drain_deadline_unix_ms(draining ? absl::ToUnixMillis(state.deadline()) : 0);
  out->set_in_flight_calls(static_cast<uint64_t>(std::max<int64_t>(0, state.in_flight())));
}

bool DrainWaitsFor(absl::string_view method) {
  return !absl::StartsWith(method, "/grpc.health.v1.Health/") &&
         !absl::StartsWith(method, "/kvpool.v1.AdminService/") &&
         !absl::StartsWith(method, "/grpc.reflection.") &&
         method != "/kvpool.v1.KvEventService/SubscribeKvEvents" &&
         method != "/kvpool.v1.TransportService/WatchSession";
}

namespace {

// Counts its call from creation (the call's start) to destruction (the call is done, however it
// ended).
class InFlightInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit InFlightInterceptor(DrainState* state) : state_(state) {
    if (state_ != nullptr) state_->CallStarted();
  }
  ~InFlightInterceptor() override {
    if (state_ != nullptr) state_->CallEnded();
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  DrainState* const state_;  // null: not counted
};

class InFlightInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit InFlightInterceptorFactory(DrainState* state) : state_(state) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method();
    const bool counted = method != nullptr && DrainWaitsFor(method);
    return new InFlightInterceptor(counted ? state_ : nullptr);
  }

 private:
  DrainState* const state_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewInFlightInterceptorFactory(DrainState* state) {
  return std::make_unique<InFlightInterceptorFactory>(state);
}

}  // namespace kvpool::server
