// Unix-domain socket messages that carry a file descriptor (SCM_RIGHTS): how the daemon hands a
// same-host client the shared-memory region of its channel (shm_wire.h) without giving the
// memory a name.
//
//   KVPOOL_RETURN_IF_ERROR(SendWithFd(sock, reply_bytes, region_fd));
//   KVPOOL_ASSIGN_OR_RETURN(int fd, ReceiveWithFd(sock, absl::MakeSpan(reply), absl::Seconds(5)));
//
// Thread-safe (the socket is the caller's).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvpool::server {

// Sends `bytes` (one message) on connected socket `sock`, with `fd` attached when fd >= 0.
absl::Status SendWithFd(int sock, absl::Span<const uint8_t> bytes, int fd);
// Receives exactly out.size() bytes within `timeout`; returns the attached descriptor (the caller
// owns it) or -1 when none came. DeadlineExceeded, Unavailable (peer closed, socket errors),
// InvalidArgument (a short message, more than one descriptor).
absl::StatusOr<int> ReceiveWithFd(int sock, absl::Span<uint8_t> out, absl::Duration timeout);

}  // namespace kvpool::server
