// UcxTransport: kvpoold's UCX data plane. Clients negotiate a session over gRPC
// (TransportService.Negotiate -> Accept), then push BF16 K/V layer by layer and call remote
// attention with ucp active messages (wire format: ucx_wire.h).
//
// Receiving: a chunk (K and V of some tokens of one layer) comes as two LAYER_DATA messages
// (always rendezvous), pulled straight into the two halves of one slot of the staging memory,
// registered with UCX once at start (ucp_mem_map). The chunk's first message takes a slot;
// when none is free it waits (the sender's request stays incomplete: backpressure, bounded by
// the sessions' in-flight limits). Its second message goes into the same slot at once, so a
// slot never waits on a message queued behind another slot's. A chunk with both halves is
// handed to the worker pool, which rotates and quantizes it into the push's SequenceStore
// transaction (the ingest engine, server/ingest/) and frees the slot; when a layer is complete the
// client gets LAYER_DONE; PUSH_COMMIT commits atomically once every layer is stored and answers
// PUSH_DONE.
//
// Connections: the transport runs a UCX listener (UCX's client-server path, a TCP address).
// Negotiate (Accept) opens a session for a tenant and answers the listener's address, the
// session id and a secret; the client connects and sends HELLO with both. A connection is bound
// to its session only by a valid HELLO (secret compared in constant time); one that sends
// anything else first, a wrong secret or nothing within hello_timeout is closed and counted
// (Stats().connections_refused); every later message must come on the session's own connection.
// No peer's packed UCX address ever reaches UCX.
//
// Tenants: every session lives in a SessionRegistry bound to the tenant that negotiated it, as on
// the other planes. CloseSession and WatchSession (an optional lease: the session ends when the
// watch does) find only the caller's own sessions; another tenant's answers NOT_FOUND and is
// counted with the refused connections (Stats().connections_refused).
//
// Faults: an endpoint error (UCX peer error handling; keepalive notices a killed process within
// about --transport_keepalive_ms) ends the session; a push with no progress for idle_timeout is
// rolled back (DEADLINE_EXCEEDED). Either way the transaction is dropped, so no half-written
// sequence stays, and staging slots return when their receives finish or fail.
//
//   UcxTransportOptions options;
//   options.runtime.tls = "posix,sysv,cma";
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> ucx,
//                           UcxTransport::Create(&service_context, options));
//   KVPOOL_ASSIGN_OR_RETURN(TransportSession s, ucx->Accept(tenant, offer));
//   ...
//   ucx->Shutdown();   // before the worker pool drains
//
// Thread-safe. All UCX work runs on one progress thread; codec math on the worker pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dataplane/ucx_runtime.h"
#include "dataplane/ucx_wire.h"
#include "server/ingest/ingest_append.h"
#include "server/service_context.h"
#include "server/transport/session_registry.h"
#include "server/transport/transport.h"

namespace kvpool::server {

struct UcxTransportOptions {
  ucx::UcxRuntimeOptions runtime;
  // Where the listener binds ("" = every address; port 0 = a free one).
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  // A connection must send HELLO within this long after it is accepted, and a session must be
  // connected within this long after Negotiate.
  absl::Duration hello_timeout = absl::Seconds(10);
  // Connections accepted and waiting for their HELLO; more are rejected.
  int max_unbound_connections = 64;
  // Registered staging memory, split into slots of two messages of message_bytes (the largest
  // LAYER_DATA: K or V of a chunk).
  size_t staging_bytes = size_t{64} << 20;
  size_t message_bytes = size_t{4} << 20;
  // LAYER_DATA messages one session may have in flight (0: two per slot).
  uint32_t max_inflight_messages = 0;
  // A push with no progress for this long is rolled back (the daemon's one idle limit,
  // --stream_idle_timeout_ms, which the push's admission ticket enforces too).
  absl::Duration idle_timeout = absl::Seconds(30);
  int max_sessions = 1024;
  int max_pushes_per_session = 256;
};

// Options from the daemon's flags (--ucx_tls, --ucx_listen, --transport_*).
UcxTransportOptions UcxTransportOptionsFromConfig(const ServerConfig& config);

class UcxTransport final : public Transport {
 public:
  // Starts UCX (Unavailable when it cannot: no usable transport) and the progress thread.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(
      ServiceContext* ctx, const UcxTransportOptions& options);
  ~UcxTransport() override;

  const TransportCapabilities& capabilities() const override;
  absl::StatusOr<TransportSession> Accept(const TenantId& tenant,
                                          const TransportOffer& offer) override;
  absl::StatusOr<int> Close(const TenantId& tenant, uint64_t session_id) override;
  absl::Status WatchSession(const TenantId& tenant, uint64_t session_id,
                            std::function<void(absl::Status)> on_end) override;
  TransportStats Stats() const override;
  void Shutdown() override;
  absl::StatusOr<std::unique_ptr<RegisteredMemory>> RegisterMemory(size_t bytes) override;

 private:
  struct Push;
  struct Session;
  struct Connection;
  struct Pending;
  struct Receive;
  struct Chunk;

  UcxTransport(ServiceContext* ctx, const UcxTransportOptions& options);
  absl::Status Init();

  // Progress thread only.
  void OnConnectionRequest(ucp_conn_request_h request);
  ucs_status_t OnHello(const void* header, size_t header_length, size_t length,
                       const ucp_am_recv_param_t* param);
  // Whether a message came on a connection that has not sent its HELLO: that connection is then
  // refused (once the handler has returned) and the message is to be dropped.
  bool FromUnboundConnection(const ucp_am_recv_param_t* param, const char* what);
  // The session `session_id` when it is bound to the connection the message came on; null
  // (drop the message) otherwise.
  std::shared_ptr<Session> SessionOf(uint64_t session_id, const ucp_am_recv_param_t* param);
  // Closes a connection: forcefully when UCX reported its failure, or when `force` and the
  // endpoints have peer error handling. Refuse also counts it.
  void CloseConnection(const std::shared_ptr<Connection>& c, bool force);
  void Refuse(const std::shared_ptr<Connection>& c, const std::string& why);
  ucs_status_t OnPushBegin(const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param);
  ucs_status_t OnLayerData(const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param);
  ucs_status_t OnPushControl(bool commit, const void* header, size_t header_length,
                             const ucp_am_recv_param_t* param);
  ucs_status_t OnAttend(const void* header, size_t header_length, void* data, size_t length,
                        const ucp_am_recv_param_t* param);
  // The chunk `h` is a half of: the one its other half opened, else (when `may_open`) a new one
  // on a free slot; null when there is none. InvalidArgument when `h` does not fit its chunk.
  absl::StatusOr<std::shared_ptr<Chunk>> ChunkFor(const std::shared_ptr<Push>& push,
                                                  const ucx::wire::LayerDataHeader& h,
                                                  bool may_open);
  void StartReceive(const std::shared_ptr<Session>& session, const std::shared_ptr<Push>& push,
                    const ucx::wire::LayerDataHeader& h, void* data, size_t length, bool rndv,
                    bool in_handler, const std::shared_ptr<Chunk>& chunk,
                    ucs_status_t* handler_status);
  void OnChunkStaged(const std::shared_ptr<Session>& session, const std::shared_ptr<Push>& push,
                     int layer, const std::shared_ptr<Chunk>& chunk, const absl::Status& status,
                     bool layer_complete);
  // Frees the chunk's slot (once) and forgets the chunk.
  void ReleaseChunk(const std::shared_ptr<Push>& push, const std::shared_ptr<Chunk>& chunk);
  void ReleaseSlot(int slot);
  void ServePending();
  // Rolls the push back and answers PUSH_DONE with `why` once the sequence is free again, or at
  // once with `answer_now` (the session is ending and its endpoint closes right after).
  void FailPush(const std::shared_ptr<Session>& session, const std::shared_ptr<Push>& push,
                const absl::Status& why, bool answer_now = false);
  void MaybeCommit(const std::shared_ptr<Session>& session, const std::shared_ptr<Push>& push);
  // The engine ended the push (committed, or rolled back): PUSH_DONE unless answered already.
  void OnPushEnded(const std::shared_ptr<Session>& session, const std::shared_ptr<Push>& push,
                   const absl::StatusOr<AppendResult>& result);
  // Counts the push out of the open ones (once).
  void CountEnded(Push& push, bool committed);
  void SendPushDone(const std::shared_ptr<Session>& session, uint64_t push_id,
                    const absl::StatusOr<AppendResult>& result);
  void RunAttention(const std::shared_ptr<Session>& session, const ucx::wire::AttendHeader& h,
                    const std::string& payload);
  void SendAttendError(const std::shared_ptr<Session>& session, uint64_t call_id,
                       const absl::Status& status);
  // Ends a session. `force`: the peer failed (no goodbye, forced close). `peer_gone`: its process
  // has exited, so receives still in flight from it can never complete and their staging slots
  // are reclaimed now (nothing can write into them any more). Its watchers hear `why`, or OK
  // when `closed` (CloseSession).
  void EndSession(const std::shared_ptr<Session>& session, const absl::Status& why, bool force,
                  bool peer_gone = false, bool closed = false);
  void OnTick();
  std::shared_ptr<Session> FindSession(uint64_t id);

  ServiceContext* const ctx_;
  const UcxTransportOptions options_;
  // Connections: accepted and waiting for HELLO (by endpoint), and closed ones kept a while
  // (UCX may still call their error handlers). Declared before the runtime, which is destroyed
  // first. Progress thread only.
  absl::flat_hash_map<ucp_ep_h, std::shared_ptr<Connection>> unbound_;
  std::deque<std::shared_ptr<Connection>> retired_;
  std::unique_ptr<ucx::UcxRuntime> rt_;
  std::unique_ptr<ucx::UcxListener> listener_;  // destroyed on the progress thread (Shutdown)
  bool peer_error_handling_ = true;             // of every endpoint; else processes are watched
  std::unique_ptr<ucx::UcxMemory> staging_;
  size_t half_bytes_ = 0;  // one message (K or V of a chunk); a slot is two halves
  size_t slot_bytes_ = 0;
  int num_slots_ = 0;
  uint32_t max_inflight_ = 0;

  // Live sessions and their tenants (thread-safe); added and ended on the progress thread.
  SessionRegistry<Session> sessions_;
  // Progress thread only.
  std::vector<int> free_slots_;
  std::deque<Pending> pending_;
  bool serving_ = false;  // ServePending is running
  bool serve_again_ = false;
  // Ended sessions, kept a while: UCX may still hold their error handlers.
  std::vector<std::shared_ptr<Session>> ended_;

  std::atomic<bool> shut_down_{false};
  std::atomic<uint32_t> open_pushes_{0};
  std::atomic<uint32_t> slots_in_use_{0};
  std::atomic<uint32_t> pending_count_{0};
  std::atomic<uint64_t> pushes_committed_{0};
  std::atomic<uint64_t> pushes_aborted_{0};
  std::atomic<uint64_t> peer_errors_{0};
  std::atomic<uint64_t> timeouts_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> attention_calls_{0};
  std::atomic<uint64_t> connections_refused_{0};
};

}  // namespace kvpool::server
