// Transport: one way of moving bulk K/V and attention traffic between clients and kvpoold (the
// data plane of docs/architecture.md, "Planes"). gRPC stays the control plane: a client negotiates
// a transport through TransportService.Negotiate (proto/kvpool/v1/transport_service.proto), the
// daemon picks one of the transports it hosts and the transport answers with what the client
// needs to reach it.
//
// The interface, after NIXL's backend engine: first what a transport can do (capabilities),
// then the few operations every transport implements (accept a client's offer = connect, close
// a session = release, statistics, shutdown), then optional groups with defaults (accepting
// asynchronously, for a transport whose accept waits on its peer; registering memory the
// transport receives into; device pushes; remote attention plans; a session's lease), the others
// returning UNIMPLEMENTED. One folder per transport:
//   grpc_inline/  the bytes inside AppendKv / Attend (always available, the fallback)
//   ucx/          UCX active messages into registered staging memory
//   nccl/         GPU to GPU over a two-rank NCCL communicator: pushes and attention channels
//   cuda_ipc/     GPU to GPU on one host through the client's exported buffers: pushes
// (device/ holds what the two GPU transports share.)
//
//   std::vector<std::unique_ptr<Transport>> transports = ...;   // hosted by KvpoolServer
//   for (auto& t : transports) {
//     if (t->capabilities().kind != offer.kind) continue;
//     t->AcceptAsync(tenant, offer, cancelled, [](absl::StatusOr<TransportSession> s) {
//       ...                                                        // answer the client
//     });
//   }
//
// Thread-safety: every method may be called from any thread, concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "dataplane/attention_wire.h"
#include "server/tenant.h"

namespace kvpool::server {

class DevicePush;  // server/transport/device_push.h

// Matches kvpool.v1.TransportKind.
enum class TransportKind : int {
  kGrpcInline = 1,
  kUcx = 2,
  kNccl = 3,
  kCudaIpc = 4,
  kSharedMemory = 5
};

// What an NCCL session carries; matches kvpool.v1.NcclChannelUse.
enum class NcclUse : int { kIngest = 1, kAttention = 2 };

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
  // Carries device pushes (TransportService.PushKv: OpenDevicePush).
  bool device_pushes = false;
  // Its attention calls follow plans (TransportService.SetAttentionPlan).
  bool attention_plans = false;
  // Maps clients' device allocations for fetches into them (TransportService.FetchToDevice).
  bool device_fetches = false;
};

// A process that may be watched on the same host (kvpool.v1.TransportOffer's pid fields).
struct PeerProcess {
  std::string boot_id;
  uint32_t pid = 0;
  uint64_t start_time = 0;
};

// NCCL: the communicator a client offers to join (kvpool.v1.NcclOffer), as received.
struct NcclOfferFields {
  std::string unique_id;
  uint32_t timeout_ms = 0;
  bool blocking_ops = false;
  int use = 0;  // a kvpool.v1.NcclChannelUse value, unchecked
};

// A client's offer of one transport (kvpool.v1.TransportOffer).
struct TransportOffer {
  TransportKind kind = TransportKind::kGrpcInline;
  uint32_t wire_version = 0;  // UCX: the client's wire format version
  std::string peer_transports;
  std::string client_name;
  PeerProcess peer_process;
  NcclOfferFields nccl;
  // Shared memory: slots and the most query bytes of a call the client asks for (0: defaults).
  uint32_t shm_slots = 0;
  uint64_t shm_max_query_bytes = 0;
  bool shm_device_io = false;
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
  // NCCL and CUDA IPC: the daemon's GPU.
  int device = -1;
  // NCCL: what the session carries; ingest: the largest chunk's K (or V); attention: the call
  // header's and status block's bytes, the most query bytes of a call, and how long the daemon
  // waits for the session's watch.
  NcclUse nccl_use = NcclUse::kIngest;
  size_t max_chunk_bytes = 0;
  uint32_t call_header_bytes = 0;
  uint32_t call_status_bytes = 0;
  size_t max_query_bytes = 0;
  uint32_t watch_timeout_ms = 0;
  // Shared memory: the Unix socket to connect to (secret above), the region's layout
  // (call_header_bytes, call_status_bytes and max_query_bytes above) and how long the daemon
  // waits for the client's hello.
  std::string socket_path;
  uint32_t slots = 0;
  size_t max_lse_bytes = 0;
  size_t region_bytes = 0;
  uint32_t hello_timeout_ms = 0;
  bool device_io = false;
};

// A remote-attention plan's id and the shape of its calls (NCCL attention channels).
struct AttentionPlanInfo {
  uint32_t plan_id = 0;
  AttentionPlanShape shape;
  int num_layers = 0;
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
  // UCX: connections refused before joining a session (another session's id, a wrong secret);
  // NCCL, CUDA IPC: calls that named another tenant's session.
  uint64_t connections_refused = 0;
  std::string transports;  // UCX: the transports in use
};

// Memory registered with a transport; deregistered when destroyed.
class RegisteredMemory {
 public:
  virtual ~RegisteredMemory() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
};

// A client's device allocation mapped into the daemon (CUDA IPC); unmapped when destroyed.
class MappedClientBuffer {
 public:
  virtual ~MappedClientBuffer() = default;
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
  // Accept for a transport whose accepting waits on the peer (NCCL joins a communicator): runs
  // `done` once decided, possibly on another thread; gives up once `cancelled()` (the client
  // went away). By default Accept on the calling thread.
  virtual void AcceptAsync(const TenantId& tenant, const TransportOffer& offer,
                           std::function<bool()> /*cancelled*/,
                           std::function<void(absl::StatusOr<TransportSession>)> done) {
    done(Accept(tenant, offer));
  }

  // Registers `bytes` of memory that the transport may receive into.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<RegisteredMemory>> RegisterMemory(
      size_t /*bytes*/) {
    return Unimplemented("register memory");
  }

  // Device pushes (capabilities().device_pushes): a push over session `session_id` of `tenant`,
  // whose chunks the transport brings into GPU memory (device_push.h); `cancelled()` says the
  // client went away. NotFound (session), FailedPrecondition (a session that carries no pushes).
  [[nodiscard]] virtual absl::StatusOr<std::shared_ptr<DevicePush>> OpenDevicePush(
      const TenantId& /*tenant*/, uint64_t /*session_id*/, std::function<bool()> /*cancelled*/) {
    return Unimplemented("carry device pushes");
  }

  // Remote attention plans (capabilities().attention_plans): fixes the shape of the calls of
  // session `session_id`: `sequence_ids` of `model_id`, `num_queries` query rows each. NotFound
  // (session, model), FailedPrecondition (not an attention session), InvalidArgument (shape),
  // ResourceExhausted (plans).
  [[nodiscard]] virtual absl::StatusOr<AttentionPlanInfo> SetAttentionPlan(
      const TenantId& /*tenant*/, uint64_t /*session_id*/, const std::string& /*model_id*/,
      std::vector<std::string> /*sequence_ids*/, int /*num_queries*/) {
    return Unimplemented("carry attention plans");
  }
  // NotFound (session, plan).
  [[nodiscard]] virtual absl::Status DropAttentionPlan(const TenantId& /*tenant*/,
                                                       uint64_t /*session_id*/,
                                                       uint32_t /*plan_id*/) {
    return Unimplemented("carry attention plans");
  }

  // Device fetches (capabilities().device_fetches): the client allocation exported as `handle`
  // (a cudaIpcMemHandle_t's bytes), mapped for a fetch over session `session_id` of `tenant`.
  // NotFound (session), InvalidArgument (a handle that cannot be mapped).
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<MappedClientBuffer>> MapClientBuffer(
      const TenantId& /*tenant*/, uint64_t /*session_id*/, const std::string& /*handle*/) {
    return Unimplemented("map client buffers");
  }

  // A session's lease: runs `on_end(reason)` once when the session ends (OK after Close). NotFound
  // (session).
  [[nodiscard]] virtual absl::Status WatchSession(const TenantId& /*tenant*/,
                                                  uint64_t /*session_id*/,
                                                  std::function<void(absl::Status)> /*on_end*/) {
    return Unimplemented("watch sessions");
  }

 private:
  absl::Status Unimplemented(absl::string_view what) const {
    return absl::UnimplementedError(absl::StrCat(name(), " does not ", what));
  }
};

}  // namespace kvpool::server
