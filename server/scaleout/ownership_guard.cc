#include "server/scaleout/ownership_guard.h"

#include <iterator>
#include <optional>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/membership_target.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "proto/status.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, advertise, "",
          "This daemon's endpoint (HOST:PORT) as clients reach it, e.g. the pod IP; turns on "
          "scale-out ownership checks (docs/scale-out.md)");
ABSL_FLAG(std::string, peers, "",
          "The scale-out membership: HOST:PORT[=WEIGHT],... or dns:///NAME:PORT (all A records); "
          "members without a weight weigh this daemon's pool bytes");
ABSL_FLAG(absl::Duration, peers_refresh, absl::Seconds(2),
          "How often --peers is resolved and its members' health asked");
ABSL_FLAG(absl::Duration, peer_probe_timeout, absl::Seconds(1),
          "How long a member has to answer the health probe");

namespace kvpool::server {

ScaleOutConfig ScaleOutConfigFromFlags() {
  ScaleOutConfig c;
  c.advertise = absl::GetFlag(FLAGS_advertise);
  c.peers = absl::GetFlag(FLAGS_peers);
  c.peers_refresh = absl::GetFlag(FLAGS_peers_refresh);
  c.peer_probe_timeout = absl::GetFlag(FLAGS_peer_probe_timeout);
  return c;
}

absl::StatusOr<std::unique_ptr<OwnershipGuard>> OwnershipGuard::Start(const ScaleOutConfig& config,
                                                                      uint64_t pool_bytes) {
  auto guard = std::unique_ptr<OwnershipGuard>(new OwnershipGuard(config));
  if (config.advertise.empty()) {
    if (!config.peers.empty()) return absl::InvalidArgumentError("--peers needs --advertise");
    return guard;
  }
  if (config.peers_refresh <= absl::ZeroDuration() ||
      config.peer_probe_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--peers_refresh and --peer_probe_timeout must be > 0");
  }
  const uint64_t weight = pool_bytes > 0 ? pool_bytes : 1;
  KVPOOL_ASSIGN_OR_RETURN(MembershipTarget self, ParseMembershipTarget(config.advertise));
  if (self.is_dns() || self.entries.size() != 1 || self.entries[0].weight.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--advertise ", Quote(config.advertise), " must be one HOST:PORT"));
  }
  MembershipTarget peers;
  if (config.peers.empty()) {
    peers = self;
  } else {
    KVPOOL_ASSIGN_OR_RETURN(peers, ParseMembershipTarget(config.peers));
  }
  guard->prober_ = std::make_unique<MemberProber>(std::move(peers), weight,
                                                  config.peer_probe_timeout, config.advertise);
  {
    KVPOOL_ASSIGN_OR_RETURN(Membership only_self,
                            Membership::Create({Member{config.advertise, weight}}));
    absl::MutexLock lock(&guard->mu_);
    guard->membership_ = std::make_shared<const Membership>(std::move(only_self));
  }
  guard->Refresh();
  guard->refresher_ = std::thread([g = guard.get()] { g->RefreshLoop(); });
  return guard;
}

OwnershipGuard::~OwnershipGuard() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

std::shared_ptr<const Membership> OwnershipGuard::membership() const {
  absl::MutexLock lock(&mu_);
  return membership_;
}

void OwnershipGuard::Refresh() {
  absl::StatusOr<Membership> live = prober_->Probe();
  if (!live.ok()) {
    spdlog::warn("scale-out: membership refresh failed, keeping the last one: {}",
                 live.status().ToString());
    return;
  }
  absl::MutexLock lock(&mu_);
  if (membership_ == nullptr || membership_->epoch() != live->epoch()) {
    spdlog::info("scale-out: membership epoch {} ({} members)", live->epoch_hex().substr(0, 16),
                 live->members().size());
  }
  membership_ = std::make_shared<const Membership>(*std::move(live));
}

void OwnershipGuard::RefreshLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), config_.peers_refresh)) return;
    }
    Refresh();
  }
}

absl::Status OwnershipGuard::WrongOwner(const Membership& members, const std::string& owner) const {
  return WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          config_.advertise, " does not own this sequence under membership epoch ",
          members.epoch_hex().substr(0, 16), owner.empty() ? "" : "; its owner is ", owner)),
      ErrorReason::kWrongOwner,
      {{kWrongOwnerEpochKey, members.epoch_hex()}, {kWrongOwnerOwnerKey, owner}});
}

absl::Status OwnershipGuard::Check(const grpc::CallbackServerContext* call,
                                   absl::FunctionRef<bool()> held_here) const {
  if (!enabled()) return absl::OkStatus();
  const auto& metadata = call->client_metadata();
  const auto keys = metadata.equal_range(kPlacementKeyMetadata);
  const auto epochs = metadata.equal_range(kEpochMetadata);
  if (keys.first == keys.second && epochs.first == epochs.second) return absl::OkStatus();
  if (std::distance(keys.first, keys.second) > 1 ||
      std::distance(epochs.first, epochs.second) > 1) {
    return absl::InvalidArgumentError("scale-out metadata: more than one epoch or key");
  }
  std::optional<PlacementKey> key;
  if (keys.first != keys.second) {
    const grpc::string_ref value = keys.first->second;
    KVPOOL_ASSIGN_OR_RETURN(key,
                            PlacementKey::FromHex(absl::string_view(value.data(), value.size())));
  }
  std::string client_epoch;
  if (epochs.first != epochs.second) {
    const grpc::string_ref value = epochs.first->second;
    client_epoch = absl::AsciiStrToLower(absl::string_view(value.data(), value.size()));
    if (!PlacementKey::FromHex(client_epoch).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scale-out metadata: epoch must be 64 hex digits, got ", Quote(client_epoch)));
    }
  }
  const std::shared_ptr<const Membership> members = membership();
  if (key.has_value()) {
    const std::string& owner = members->OwnerOf(*key).endpoint;
    if (owner == config_.advertise || held_here()) return absl::OkStatus();
    return WrongOwner(*members, owner);
  }
  if (client_epoch.empty() || client_epoch == members->epoch_hex() || held_here()) {
    return absl::OkStatus();
  }
  return WrongOwner(*members, "");
}

}  // namespace kvpool::server
