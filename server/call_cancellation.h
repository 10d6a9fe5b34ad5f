// CallCancellation: whether the caller of one call still wants its answer (it has not cancelled
// and its deadline has not passed), checked by long work between its units (a sequence of an
// Attend batch, a layer of a read), so abandoned work stops instead of holding the workers.
//
//   auto cancel = std::make_shared<CallCancellation>(deadline, [ctx] { return ctx->IsCancelled();
//   },
//                                                    &counters);
//   for (size_t i = 0; i < units; ++i) {
//     if (cancel->Cancelled()) { cancel->Skip(units - i); return cancel->status(); }
//     ...one unit...
//   }
//
// A call's admission (server/read_ticket.h) may end it too: Expire makes every later check stop
// it with the expiry's status, and each check that lets work go on counts as the call's progress
// (SetProgress), which keeps its idle timeout from running out.
//
// Thread-safe: one call's units may check it from several workers at once. A default-constructed
// one is never cancelled.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvpool::server {

// Counted since start, shown by GetStats (lifecycle.calls_cancelled, units_skipped).
struct CancellationCounters {
  std::atomic<uint64_t> calls_cancelled{0};  // calls that stopped before their work was done
  std::atomic<uint64_t> units_skipped{0};    // units of work those calls did not do
};

class CallCancellation {
 public:
  CallCancellation() = default;
  // `caller_cancelled` (may be empty) says whether the caller went away; the call also counts
  // as cancelled once `deadline` has passed. `counters` may be null.
  CallCancellation(absl::Time deadline, std::function<bool()> caller_cancelled,
                   CancellationCounters* counters)
      : deadline_(deadline), caller_cancelled_(std::move(caller_cancelled)), counters_(counters) {}

  CallCancellation(const CallCancellation&) = delete;
  CallCancellation& operator=(const CallCancellation&) = delete;

  // Called by every check that lets the work go on; set before the call's work starts.
  void SetProgress(std::function<void()> progress) { progress_ = std::move(progress); }

  // True once the caller cancelled, the deadline passed or the call expired (and from then on);
  // the first time, counts the call as cancelled (an expiry is counted by the admission).
  bool Cancelled() {
    if (stopped_.load(std::memory_order_acquire)) return true;
    const bool expired = absl::Now() >= deadline_;
    if (!expired && !(caller_cancelled_ && caller_cancelled_())) {
      if (progress_) progress_();
      return false;
    }
    if (!stopped_.exchange(true, std::memory_order_acq_rel)) {
      deadline_passed_.store(expired, std::memory_order_relaxed);
      if (counters_ != nullptr) counters_->calls_cancelled.fetch_add(1);
    }
    return true;
  }

  // Marks the call cancelled (counted once) whatever the caller's state says: for a stream whose
  // transport already reported the caller gone.
  void Stop() {
    if (!stopped_.exchange(true, std::memory_order_acq_rel) && counters_ != nullptr) {
      counters_->calls_cancelled.fetch_add(1);
    }
  }

  // The call's admission expired: it stops with `why` (DEADLINE_EXCEEDED, reason LIMIT).
  void Expire(absl::Status why) {
    {
      absl::MutexLock lock(&mu_);
      if (expiry_.ok()) expiry_ = std::move(why);
    }
    stopped_.store(true, std::memory_order_release);
  }

  // Counts `units` units of work the call will not do.
  void Skip(size_t units) {
    if (counters_ != nullptr && units > 0) counters_->units_skipped.fetch_add(units);
  }

  // What a call that stopped answers: its expiry's status, DEADLINE_EXCEEDED or CANCELLED.
  absl::Status status() const {
    {
      absl::MutexLock lock(&mu_);
      if (!expiry_.ok()) return expiry_;
    }
    return deadline_passed_.load(std::memory_order_relaxed)
               ? absl::DeadlineExceededError("the call's deadline passed; its work was stopped")
               : absl::CancelledError("the caller cancelled; the call's work was stopped");
  }

 private:
  const absl::Time deadline_ = absl::InfiniteFuture();
  const std::function<bool()> caller_cancelled_;
  CancellationCounters* const counters_ = nullptr;
  std::function<void()> progress_;
  mutable absl::Mutex mu_;
  absl::Status expiry_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopped_{false};
  std::atomic<bool> deadline_passed_{false};
};

}  // namespace kvpool::server
