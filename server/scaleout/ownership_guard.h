// Ownership of sequences in a scale-out deployment (docs/scale-out.md), checked in one place for
// every sequence-scoped RPC: a routing client sends its membership epoch and the sequence's
// placement key in the call metadata (proto/member_probe.h); a daemon that does not own the key
// under its own membership answers FAILED_PRECONDITION, reason WRONG_OWNER, with its epoch and
// the owner it expects (ErrorInfo metadata "epoch", "owner"), unless it already holds the
// sequence (what is here stays usable: nothing migrates). Calls without the metadata
// (single-daemon clients) and daemons without --advertise are not checked.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto guard, OwnershipGuard::Start(ScaleOutConfigFromFlags(), bytes));
//   KVPOOL_RETURN_IF_ERROR(guard->Check(call, [&] { return HeldHere(id); }));
//
// Membership: --peers resolved and probed every --peers_refresh (MemberProber), the daemon's own
// --advertise endpoint always included; weights from the list, else the daemon's pool bytes.
// Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/placement.h"
#include "grpcpp/grpcpp.h"
#include "proto/member_probe.h"

namespace kvpool::server {

struct ScaleOutConfig {
  std::string advertise;  // this daemon's endpoint as clients reach it; "" = no scale-out
  std::string peers;      // membership target (common/membership_target.h); "" = only itself
  absl::Duration peers_refresh = absl::Seconds(2);
  absl::Duration peer_probe_timeout = absl::Seconds(1);
};
// From --advertise, --peers, --peers_refresh, --peer_probe_timeout.
ScaleOutConfig ScaleOutConfigFromFlags();

class OwnershipGuard {
 public:
  // Validates `config`, computes the first membership and starts its refresh (InvalidArgument
  // for a malformed endpoint or target). `pool_bytes` is this daemon's weight.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<OwnershipGuard>> Start(
      const ScaleOutConfig& config, uint64_t pool_bytes);
  ~OwnershipGuard();

  bool enabled() const { return !config_.advertise.empty(); }
  // This daemon's endpoint (--advertise).
  const std::string& advertise() const { return config_.advertise; }
  // The membership in force now.
  std::shared_ptr<const Membership> membership() const;

  // OK when the call may proceed here: no scale-out metadata, or this daemon owns the key, or
  // `held_here()` (the call's sequences are all here). InvalidArgument for malformed metadata;
  // WRONG_OWNER otherwise. A call with an epoch and no key (Attend over several sequences) is
  // redirected only when its epoch differs from the daemon's and `held_here()` is false.
  [[nodiscard]] absl::Status Check(const grpc::CallbackServerContext* call,
                                   absl::FunctionRef<bool()> held_here) const;

 private:
  explicit OwnershipGuard(const ScaleOutConfig& config) : config_(config) {}
  void RefreshLoop();
  void Refresh();
  absl::Status WrongOwner(const Membership& members, const std::string& owner) const;

  const ScaleOutConfig config_;
  std::unique_ptr<MemberProber> prober_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Membership> membership_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace kvpool::server
