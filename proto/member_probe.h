// The live membership of a scale-out deployment, as client and daemon both compute it
// (docs/scale-out.md): the target's candidates (common/membership_target.h), each asked for its
// health (grpc.health.v1, overall service); those that answer SERVING within the probe timeout
// are the members. A draining daemon (NOT_SERVING) or a dead one drops out at the next probe.
// Also the call metadata and ErrorInfo keys the scale-out calls carry.
//
//   MemberProber prober(target, /*default_weight=*/1, absl::Seconds(1));
//   KVPOOL_ASSIGN_OR_RETURN(Membership live, prober.Probe());
//
// Thread-safe: Probe may run from several threads (channels are cached per endpoint).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/membership_target.h"
#include "common/placement.h"
#include "grpcpp/grpcpp.h"

namespace kvpool {

// Call metadata a routing client sends with every sequence-scoped call: its membership epoch
// and the placement key (64 hex digits each).
inline constexpr char kEpochMetadata[] = "kvpool-epoch";
inline constexpr char kPlacementKeyMetadata[] = "kvpool-placement-key";
// ErrorInfo metadata of a WRONG_OWNER answer: the daemon's epoch and the owner it expects.
inline constexpr char kWrongOwnerEpochKey[] = "epoch";
inline constexpr char kWrongOwnerOwnerKey[] = "owner";

// Channel arguments for a connection to a member: reconnect attempts stay frequent (at most a
// second apart) so a daemon that comes back or joins is seen at the next probe.
grpc::ChannelArguments MemberChannelArguments();

class MemberProber {
 public:
  // `always_live` (a daemon's own endpoint) is a member without being asked.
  MemberProber(MembershipTarget target, uint64_t default_weight, absl::Duration probe_timeout,
               std::string always_live = "");

  // Resolves the target and asks every candidate in parallel. Unavailable when the target does
  // not resolve; an empty membership when nobody answers.
  [[nodiscard]] absl::StatusOr<Membership> Probe();

 private:
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& endpoint);

  const MembershipTarget target_;
  const uint64_t default_weight_;
  const absl::Duration probe_timeout_;
  const std::string always_live_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool
