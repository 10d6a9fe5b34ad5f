#include "proto/member_probe.h"

#include <future>
#include <utility>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"

namespace kvpool {

grpc::ChannelArguments MemberChannelArguments() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

MemberProber::MemberProber(MembershipTarget target, uint64_t default_weight,
                           absl::Duration probe_timeout, std::string always_live)
    : target_(std::move(target)),
      default_weight_(default_weight),
      probe_timeout_(probe_timeout),
      always_live_(std::move(always_live)) {}

std::shared_ptr<grpc::Channel> MemberProber::ChannelTo(const std::string& endpoint) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[endpoint];
  if (channel == nullptr) {
    channel = grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(),
                                        MemberChannelArguments());
  }
  return channel;
}

absl::StatusOr<Membership> MemberProber::Probe() {
  absl::StatusOr<std::vector<Member>> candidates =
      ResolveMembershipTarget(target_, default_weight_);
  if (!candidates.ok()) return candidates.status();
  std::vector<std::future<bool>> answers;
  for (const Member& m : *candidates) {
    if (m.endpoint == always_live_) {
      answers.push_back(std::async(std::launch::deferred, [] { return true; }));
      continue;
    }
    std::shared_ptr<grpc::Channel> channel = ChannelTo(m.endpoint);
    const absl::Duration timeout = probe_timeout_;
    answers.push_back(std::async(std::launch::async, [channel, timeout] {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
      // Not wait-for-ready: a refused connection answers at once; a connection attempt under
      // way is waited for, up to the timeout.
      context.set_wait_for_ready(false);
      grpc::health::v1::HealthCheckRequest request;
      grpc::health::v1::HealthCheckResponse response;
      const grpc::Status s =
          grpc::health::v1::Health::NewStub(channel)->Check(&context, request, &response);
      return s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    }));
  }
  std::vector<Member> live;
  for (size_t i = 0; i < answers.size(); ++i) {
    if (answers[i].get()) live.push_back((*candidates)[i]);
  }
  if (!always_live_.empty()) {
    bool listed = false;
    for (const Member& m : live) listed |= m.endpoint == always_live_;
    if (!listed) live.push_back(Member{always_live_, default_weight_});
  }
  return Membership::Create(std::move(live));
}

}  // namespace kvpool
