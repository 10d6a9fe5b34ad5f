// ConnectWithin: a bounded wait for a step that may block on the host without a way to time it
// out (the first group on a blocking NCCL communicator, nccl_channel.h): the step runs on a
// thread of its own, which is abandoned, not joined, when the wait gives up.
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvpool::server {

// Runs `connect` on a thread of its own and waits for it up to `timeout`, or until
// `cancelled()`: the first group on a blocking communicator connects its paths and waits on the
// host until the peer takes part, which a peer that stays alive but never does would make
// endless. On time out (DeadlineExceeded) or cancellation (Cancelled) the thread is left to
// finish alone and runs `abandon` once `connect` returns (a peer that exits ends it with an
// error), so it must own what `connect` uses; `*abandoned` says which happened. Otherwise
// `connect`'s own status is returned.
absl::Status ConnectWithin(std::function<absl::Status()> connect, std::function<void()> abandon,
                           absl::Duration timeout, const std::function<bool()>& cancelled,
                           bool* abandoned);

}  // namespace kvpool::server
