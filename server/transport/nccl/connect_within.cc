#include "server/transport/nccl/connect_within.h"

#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace kvpool::server {

absl::Status ConnectWithin(std::function<absl::Status()> connect, std::function<void()> abandon,
                           absl::Duration timeout, const std::function<bool()>& cancelled,
                           bool* abandoned) {
  *abandoned = false;
  struct State {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    bool abandoned ABSL_GUARDED_BY(mu) = false;
    absl::Status status ABSL_GUARDED_BY(mu);
  };
  auto state = std::make_shared<State>();
  std::thread([state, connect = std::move(connect), abandon = std::move(abandon)] {
    absl::Status s = connect();
    bool abandoned = false;
    {
      absl::MutexLock lock(&state->mu);
      state->done = true;
      state->status = std::move(s);
      abandoned = state->abandoned;
    }
    if (abandoned) abandon();
  }).detach();
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&state->mu);
  while (!state->done) {
    const bool gave_up = cancelled() || absl::Now() > deadline;
    if (gave_up) {
      state->abandoned = true;
      *abandoned = true;
      return cancelled() ? absl::CancelledError("cancelled while connecting the NCCL channel")
                         : absl::DeadlineExceededError(
                               "the client did not connect the NCCL channel in time");
    }
    state->mu.AwaitWithTimeout(absl::Condition(&state->done), absl::Milliseconds(10));
  }
  return state->status;
}

}  // namespace kvpool::server
