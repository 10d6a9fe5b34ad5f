// JoinAdmission: bounds on the NCCL joins that clients start (TransportService.Negotiate offering
// NCCL, nccl_transport.h). A join runs on a thread of its own and waits, up to
// the client's timeout_ms, for the client's rank at the address inside its ncclUniqueId, holding
// a thread, an NCCL communicator being initialised and (attention) device buffers meanwhile: so
// the timeout has a ceiling and only a few joins may wait at once, else a client could pile up
// threads and GPU memory for days with ids that name nobody.
//
//   KVPOOL_ASSIGN_OR_RETURN(absl::Duration timeout, JoinTimeout(request.timeout_ms()));
//   if (!joins.TryAcquire()) return absl::ResourceExhaustedError(...);
//   std::thread([&joins] { ...; joins.Release(); }).detach();
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvpool::server {

// A join's timeout when the request names none, the largest accepted, and how many joins of
// one service may wait for their client at once.
inline constexpr uint32_t kDefaultJoinTimeoutMs = 60000;
inline constexpr uint32_t kMaxJoinTimeoutMs = 600000;
inline constexpr int kMaxPendingJoins = 8;

// The timeout of a join requested with `timeout_ms` (0 = the default); InvalidArgument above
// kMaxJoinTimeoutMs.
inline absl::StatusOr<absl::Duration> JoinTimeout(uint32_t timeout_ms) {
  if (timeout_ms == 0) return absl::Milliseconds(kDefaultJoinTimeoutMs);
  if (timeout_ms > kMaxJoinTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms must be at most ", kMaxJoinTimeoutMs, ", got ", timeout_ms));
  }
  return absl::Milliseconds(timeout_ms);
}

// Joins in flight, at most kMaxPendingJoins.
class PendingJoins {
 public:
  // Takes a place (true), or none when kMaxPendingJoins joins are waiting (false).
  bool TryAcquire() {
    int n = count_.load();
    while (n < kMaxPendingJoins) {
      if (count_.compare_exchange_weak(n, n + 1)) return true;
    }
    return false;
  }
  // Gives back a place taken by TryAcquire.
  void Release() { count_.fetch_sub(1); }

 private:
  std::atomic<int> count_{0};
};

}  // namespace kvpool::server
