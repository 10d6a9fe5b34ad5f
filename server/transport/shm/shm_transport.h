// ShmTransport: same-host remote attention through shared memory (TransportKind SHARED_MEMORY,
// proto/kvpool/v1/transport_service.proto). Negotiate answers a session id, a secret and the
// path of the transport's Unix socket (in a directory of mode 0700, the socket 0600); the
// client connects, sends its hello (dataplane/shm_wire.h) and receives its channel's region as a
// descriptor; the channel (shm_channel.h) serves its calls from then on. The connection is the
// session's lease. Works with every backend (the CPU daemon computes on the channel's thread).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ShmTransport> t, ShmTransport::Create(&ctx, opts));
//   ctx.transports.push_back(t.get());
//
// Limits: max_sessions sessions (one loop thread each), each region at most max_region_bytes;
// a connection that does not send a valid hello within hello_timeout is dropped, at most
// kMaxPendingHellos are waited on at once, and a session nobody connects within hello_timeout
// ends.
//
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/service_context.h"
#include "server/transport/transport.h"

namespace kvpool::server {

struct ShmTransportOptions {
  std::string socket_dir;  // "" = a fresh private directory under $XDG_RUNTIME_DIR or /tmp
  size_t max_sessions = 32;
  size_t max_region_bytes = 64u << 20;
  absl::Duration hello_timeout = absl::Seconds(10);
};

// Binds the Unix socket and starts accepting. Unavailable when the socket cannot be made.
absl::StatusOr<std::unique_ptr<Transport>> NewShmTransport(ServiceContext* ctx,
                                                           const ShmTransportOptions& options);

}  // namespace kvpool::server
