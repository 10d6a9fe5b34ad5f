// UcxChannel: a client's persistent UCX data channel to kvpoold, for layer-wise KV pushes from
// prefill workers and remote attention from decode workers without gRPC on the hot path.
//
// Connect negotiates over gRPC (TransportService.Negotiate, offering UCX then grpc_inline); when
// the daemon picks UCX the channel connects a ucp endpoint to the daemon's UCX listener (UCX's
// client-server path, by socket address), binds it to the negotiated session with HELLO (the
// session id and the secret from Negotiate) and keeps it (one channel per worker process or
// thread group; it is thread-safe). When the daemon answers
// grpc_inline, Connect fails with FailedPrecondition: the caller then uses the inline RPCs
// (SequenceService.AppendKv, AttentionService.Attend), which always work.
//
//   UcxChannelOptions options;
//   options.runtime.tls = "posix,sysv,cma";
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<UcxChannel> ch,
//                           UcxChannel::Connect(grpc_channel, options));
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<UcxLayerPush> push, ch->BeginPush(spec));
//   for (int layer = 0; layer < layers; ++layer) {
//     ComputeLayer(layer, k[layer], v[layer]);
//     KVPOOL_RETURN_IF_ERROR(push->PushLayer(layer, 0, tokens, k[layer], v[layer]));  // returns
//   }                                     // as soon as it is posted; k, v are read until stored
//   KVPOOL_ASSIGN_OR_RETURN(UcxPushResult r, push->Finish());          // committed atomically
//
//   std::vector<UcxAttentionResult> out;                                // a decode step
//   KVPOOL_RETURN_IF_ERROR(ch->Attend("llama", layer, /*query_values=*/64 * 128, batch, &out));
//
// Errors: UNAVAILABLE when the daemon's endpoint fails (process gone: UCX peer error handling
// and keepalive, or on the same host a watch of the daemon's process, notice within seconds),
// DEADLINE_EXCEEDED past UcxChannelOptions::deadline, and the daemon's own status codes
// (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...).
//
// Thread-safety: UcxChannel is thread-safe. A UcxLayerPush is used by one thread at a time and
// must be destroyed before its channel.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataplane/ucx_runtime.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool::client {

struct UcxChannelOptions {
  // UCX settings of the client's worker (UCX_TLS etc.).
  ucx::UcxRuntimeOptions runtime;
  // Longest wait for anything: a push's completion, an attention answer, backpressure, the
  // negotiation RPC.
  absl::Duration deadline = absl::Seconds(120);
  // Shown in the daemon's log.
  std::string client_name = "kvpool-client";
};

// What a push appends (AppendKvHeader's fields).
struct UcxPushSpec {
  std::string sequence_id;
  uint32_t token_start = 0;
  uint32_t num_tokens = 0;
  bool end_of_prefill = false;
  std::vector<uint32_t> token_ids;  // empty or num_tokens ids
};

// A committed push (AppendKvResponse's counts).
struct UcxPushResult {
  uint32_t total_tokens = 0;  // the sequence's length after the commit
  uint32_t to_sink = 0;
  uint32_t to_history = 0;
  uint32_t to_recent = 0;
  uint64_t pool_bytes = 0;
};

// One sequence of a remote-attention batch: fp32 queries [num_queries][q_heads][head_dim],
// unrotated (not owned).
struct UcxSequenceQuery {
  std::string sequence_id;
  uint32_t num_queries = 1;
  const float* q = nullptr;
};
struct UcxAttentionResult {
  uint32_t attended_tokens = 0;
  std::vector<float> out;  // [num_queries][q_heads][head_dim], original basis
  std::vector<float> lse;  // [num_queries][q_heads], natural log
};

class UcxChannel;

// A layer-wise push in progress. States: open (PushLayer, WaitLayer allowed) -> finished
// (Finish returned, or the push failed: every call then returns its error). Destroying an open
// push aborts it (the daemon rolls it back).
//
// No copy of the payload: the daemon pulls K and V straight from the caller's buffers
// (zero-copy rendezvous), so PushLayer's buffers must stay valid and unchanged until that
// layer is stored (WaitLayer returned OK) or the push has ended (Finish or Abort returned, or
// the push was destroyed); those wait for every send of the push to complete.
class UcxLayerPush {
 public:
  ~UcxLayerPush();
  UcxLayerPush(const UcxLayerPush&) = delete;
  UcxLayerPush& operator=(const UcxLayerPush&) = delete;

  // Posts K and V of `layer` for the push's tokens [token_offset, token_offset + num_tokens)
  // (BF16 [num_tokens][kv_heads][head_dim] each; `k` and `v` equally long) and returns without
  // waiting for the transfer: chunks of at most the session's max_message_bytes per tensor, each
  // a K message and a V message that the daemon pulls from `k` and `v` (rendezvous). Blocks
  // only while the session's max_inflight_messages are in flight (backpressure: the daemon
  // pulls a chunk only when it has a free staging slot), up to the deadline. `k` and `v` must
  // stay valid and unchanged until the layer is stored or the push has ended (see above).
  [[nodiscard]] absl::Status PushLayer(int layer, uint32_t token_offset, uint32_t num_tokens,
                                       absl::string_view k, absl::string_view v);
  // Waits until the daemon has stored every token of `layer` (rotated and quantized) and the
  // layer's buffers are no longer read.
  [[nodiscard]] absl::Status WaitLayer(int layer);
  // Layers fully stored so far (completions received).
  std::set<int> StoredLayers() const;
  // Asks the daemon to commit once every layer is stored and waits for the answer (and for
  // every send of the push to complete).
  [[nodiscard]] absl::StatusOr<UcxPushResult> Finish();
  // Aborts (the daemon rolls back) and waits for the push's sends to complete (up to the
  // deadline); further calls return CANCELLED.
  void Abort();

  uint64_t id() const { return id_; }
  uint64_t bytes_posted() const { return bytes_posted_; }

 private:
  friend class UcxChannel;
  struct State;
  UcxLayerPush(UcxChannel* channel, uint64_t id, std::shared_ptr<State> state)
      : channel_(channel), id_(id), state_(std::move(state)) {}
  // Waits (up to the deadline) until no send of the push reads the caller's buffers.
  void AwaitSends();

  UcxChannel* const channel_;
  const uint64_t id_;
  std::shared_ptr<State> state_;
  uint64_t messages_ = 0;
  uint64_t bytes_posted_ = 0;
  bool finished_ = false;
};

class UcxChannel {
 public:
  // Negotiates over `grpc_channel` and connects. FailedPrecondition when the daemon chose
  // grpc_inline (no UCX there); Unavailable when UCX cannot start here or the daemon cannot be
  // reached; the RPC's status otherwise.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxChannel>> Connect(
      std::shared_ptr<grpc::Channel> grpc_channel, const UcxChannelOptions& options = {});
  // Closes the endpoint and the session (the daemon rolls back pushes still open).
  ~UcxChannel();
  UcxChannel(const UcxChannel&) = delete;
  UcxChannel& operator=(const UcxChannel&) = delete;

  const ::kvpool::v1::UcxSession& session() const { return session_; }
  const std::string& transports() const { return rt_->transports(); }

  // Begins a push (PUSH_BEGIN; the daemon's answer to a bad begin arrives as the push's error,
  // seen by the next PushLayer, WaitLayer or Finish). Unavailable when the channel has failed.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<UcxLayerPush>> BeginPush(UcxPushSpec spec);

  // Remote attention for a batch of sequences of one model and one layer; `query_values` is
  // q_heads x head_dim of the model. `out` gets one result per query entry, in order: the same
  // results as AttentionService.Attend.
  [[nodiscard]] absl::Status Attend(const std::string& model_id, int layer, size_t query_values,
                                    const std::vector<UcxSequenceQuery>& batch,
                                    std::vector<UcxAttentionResult>* out);

  // OK while the endpoint to the daemon works; its error after that.
  absl::Status health() const;

 private:
  friend class UcxLayerPush;
  struct Call;
  UcxChannel() = default;
  absl::Status Init(std::shared_ptr<grpc::Channel> grpc_channel, const UcxChannelOptions& options);
  // Progress thread.
  void OnPeerError(ucs_status_t status);
  ucs_status_t OnHelloDone(const void* header, size_t header_length);
  ucs_status_t OnLayerDone(const void* header, size_t header_length);
  ucs_status_t OnPushDone(const void* header, size_t header_length, void* data, size_t length);
  ucs_status_t OnAttendDone(const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param);
  void FailAll(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts a send to the progress thread; `done` (may be null) gets the completion. Every message
  // names its connection (UCP_AM_SEND_FLAG_REPLY), which is how the daemon attributes it.
  absl::Status Send(uint16_t id, ucx::AmMessage msg, std::function<void(absl::Status)> done);

  UcxChannelOptions options_;
  std::unique_ptr<::kvpool::v1::TransportService::Stub> stub_;
  ::kvpool::v1::UcxSession session_;
  std::unique_ptr<ucx::UcxRuntime> rt_;
  ucp_ep_h ep_ = nullptr;   // progress thread
  bool ep_failed_ = false;  // progress thread: UCX reported its error (close it forcefully)
  std::function<void(ucs_status_t)> on_error_;
  bool peer_error_handling_ = true;  // as the daemon's endpoint; else its process is watched
  ucx::ProcessIdentity daemon_;      // progress thread, set before it reads them
  bool watch_daemon_ = false;

  mutable absl::Mutex mu_;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  bool connected_ ABSL_GUARDED_BY(mu_) = false;  // HELLO_DONE received
  // LAYER_DATA messages of every push in flight, at most max_inflight_ (the session's limit).
  uint32_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t max_inflight_ = 2;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::shared_ptr<UcxLayerPush::State>> pushes_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::client
