// PollBackoff: the pause between two polls of something the GPU or NCCL will finish soon (an
// event, a non-blocking communicator). The first ~100 us only yield the core: a chunk's transfer
// or kernel takes tens of microseconds, and a sleep would cost the kernel's timer slack (50 us by
// default) on every poll. After that the pauses grow to `max_sleep`, so a long wait (a slow or
// dead peer) does not burn a core.
//
//   PollBackoff backoff;
//   while (cudaEventQuery(ev) == cudaErrorNotReady) backoff.Pause();
//
// Not thread-safe (one per wait).
#pragma once

#include <sched.h>

#include <algorithm>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvpool::server {

class PollBackoff {
 public:
  explicit PollBackoff(absl::Duration max_sleep = absl::Microseconds(100))
      : start_(absl::Now()), max_sleep_(max_sleep) {}

  void Pause() {
    const absl::Duration waited = absl::Now() - start_;
    if (waited < kSpin) {
      sched_yield();
      return;
    }
    sleep_ = std::min(max_sleep_, sleep_ * 2);
    absl::SleepFor(sleep_);
  }

 private:
  static constexpr absl::Duration kSpin = absl::Microseconds(100);
  const absl::Time start_;
  const absl::Duration max_sleep_;
  absl::Duration sleep_ = absl::Microseconds(5);
};

}  // namespace kvpool::server
