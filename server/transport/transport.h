// Transport: one way of moving bulk K/V and attention traffic between clients and kvpoold (the
// data plane of docs/architecture.md, "Planes"). gRPC stays the control plane: a client negotiates
// a transport through TransportService.Negotiate (proto/kvpool/v1/transport_service.proto), the
// daemon picks one of the transports it hosts and the transport answers with what the client
// needs to reach it.
//
// The interface, after NIXL's backend engine: first what a transport can do (capabilities),
// then the few operations every transport implements (accept a client's offer = connect, close
// a session = release, statistics, shutdown), then an optional group with defaults that return
// UNIMPLEMENTED (registering memory the transport receives into). One folder per transport:
//   grpc_inline/  the bytes inside AppendKv / Attend (always available, the fallback)
//   ucx/          UCX active messages into registered staging memory
//
//   std::vector<std::unique_ptr<Transport>> transports = ...;   // hosted by KvpoolServer
//   for (auto& t : transports) {
//     if (!t->capabilities().Accepts(offer.kind)) continue;
//     KVPOOL_ASSIGN_OR_RETURN(TransportSession session, t->Accept(tenant, offer));
//     ...                                                          // answer the client
//   }
//
// Thread-safety: every method may be called from any thread, concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/tenant.h"

namespace kvpool::server {

// Matches kvpool.v1.TransportKind.
enum class TransportKind : int { kGrpcInline = 1, kUcx = 2 };

absl::string_view TransportKindName(TransportKind kind);

// What a transport can do.
struct TransportCapabilities {
  TransportKind kind = TransportKind::kGrpcInline;
  // Memory it moves: host (CPU) memory, device (GPU) memory.
  bool host_memory = true;
  bool device_memory = false;
  // Peers it reaches: on this host, on other hosts.
  bool local_peers = true;
  bool remote_peers = true;
  // Receives straight into registered memory (no copy through a socket buffer).
  bool zero_copy = false;
  // Tells the peer when each layer of a push is stored (not only when the push commits).
  bool layer_notifications = false;
  // Carries remote-attention calls.
  bool remote_attention = true;
};

// A process that may be watched on the same host (kvpool.v1.TransportOffer's pid fields).
struct PeerProcess {
  std::string boot_id;
  uint32_t pid = 0;
  uint64_t start_time = 0;
};

// A client's offer of one transport (kvpool.v1.TransportOffer).
struct TransportOffer {
  TransportKind kind = TransportKind::kGrpcInline;
  uint32_t wire_version = 0;  // UCX: the client's wire format version
  std::string peer_transports;
  std::string client_name;
  PeerProcess peer_process;
};

// What the client needs to use an accepted transport (kvpool.v1.UcxSession for UCX).
struct TransportSession {
  TransportKind kind = TransportKind::kGrpcInline;
  uint64_t session_id = 0;
  // UCX: the listener to connect to (IP literal; a wildcard when it serves every address) and
  // the secret that binds a connection to this session.
  std::string listener_host;
  uint16_t listener_port = 0;
  std::string secret;
  uint32_t wire_version = 0;
  size_t max_message_bytes = 0;
  uint32_t max_inflight_messages = 0;
  size_t staging_bytes = 0;
  uint32_t idle_timeout_ms = 0;
  std::string transports;
  PeerProcess daemon_process;
  bool peer_error_handling = false;
};

// Counters of one transport (kvpool.v1.TransportStats sums them).
struct TransportStats {
  uint32_t sessions = 0;
  uint32_t open_pushes = 0;
  size_t staging_bytes_in_use = 0;
  size_t staging_capacity_bytes = 0;
  uint32_t pending_messages = 0;
  uint64_t pushes_committed = 0;
  uint64_t pushes_aborted = 0;
  uint64_t peer_errors = 0;
  uint64_t timeouts = 0;
  uint64_t bytes_received = 0;
  uint64_t attention_calls = 0;
  uint64_t connections_refused = 0;  // UCX: connections refused before joining a session
  std::string transports;            // UCX: the transports in use
};

// Memory registered with a transport; deregistered when destroyed.
class RegisteredMemory {
 public:
  virtual ~RegisteredMemory() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // --- What it can do ---
  virtual const TransportCapabilities& capabilities() const = 0;
  absl::string_view name() const { return TransportKindName(capabilities().kind); }

  // --- Operations every transport implements ---
  // Opens a session for the client of `offer` (of this transport's kind), bound to `tenant`,
  // and returns what the client needs to reach it. InvalidArgument (malformed or unacceptable
  // offer), ResourceExhausted (sessions).
  [[nodiscard]] virtual absl::StatusOr<TransportSession> Accept(const TenantId& tenant,
                                                                const TransportOffer& offer) = 0;
  // Ends a session: rolls back its uncommitted pushes and releases what it holds; returns the
  // number of pushes rolled back. NotFound for an unknown session (of this tenant).
  [[nodiscard]] virtual absl::StatusOr<int> Close(const TenantId& tenant, uint64_t session_id) = 0;
  virtual TransportStats Stats() const = 0;
  // Ends every session (rolling their pushes back) and stops; later Accepts fail with
  // Unavailable. Idempotent.
  virtual void Shutdown() = 0;

  // --- Optional ---
  // Registers `bytes` of memory that the transport may receive into.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<RegisteredMemory>> RegisterMemory(
      size_t /*bytes*/) {
    return absl::UnimplementedError(std::string(name()) + " does not register memory");
  }
};

}  // namespace kvpool::server
