// ShmAttentionClient: a decode worker's side of kvpoold's same-host attention channel (a
// SHARED_MEMORY session, negotiated through kvpool.v1.TransportService): remote attention whose
// queries and outputs move through shared memory, with no gRPC and no socket on the hot path. A
// call writes its header and queries into a slot of the region, rings the daemon's doorbell and
// waits for the slot's answer (spinning briefly, then blocking on a futex).
//
//   KVPOOL_ASSIGN_OR_RETURN(auto attn, ShmAttentionClient::Connect(grpc_channel, {}));
//   KVPOOL_ASSIGN_OR_RETURN(RemoteAttentionPlan plan, attn->SetPlan("llama", {"s1", "s2"}, 1));
//   for (int layer = 0; layer < plan.num_layers; ++layer) {
//     // q: [2][1][Hq][D] float32, unrotated; out the same shape; lse [2][1][Hq]
//     KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens, attn->Attend(plan, layer, q, out,
//     lse));
//   }
//
// A worker that can compute its projections straight into the region saves the copies in and
// out: it holds a slot and reads and writes the call's buffers where the daemon does.
//
//   KVPOOL_ASSIGN_OR_RETURN(ShmAttentionClient::InPlaceCall call, attn->HoldSlot(plan));
//   ProjectQueries(layer, call.queries());                         // written in place
//   KVPOOL_RETURN_IF_ERROR(attn->AttendInPlace(call, layer).status());
//   Consume(call.out(), call.lse());                                // read in place
//
// A call that fails for its own reasons (a released sequence: NOT_FOUND, a bad layer:
// INVALID_ARGUMENT, ...) returns the daemon's status and the channel keeps working; a daemon that
// does not answer within the call timeout gives DEADLINE_EXCEEDED and the channel is closed.
//
// Thread-safe: concurrent calls take different slots (a call waits while every slot is busy).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/transport/attention_plan_rpc.h"
#include "dataplane/shm_wire.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool::client {

struct ShmAttentionOptions {
  uint32_t slots = 1;            // calls in flight at once
  bool device_io = false;        // device mailboxes (shm_device_attention.h; GPU daemon only)
  uint64_t max_query_bytes = 0;  // per call; 0 = the daemon's default (4 MiB)
  absl::Duration call_timeout = absl::Seconds(60);
  // How long a call spins on its slot before it blocks, at most: it spins about twice as long
  // as the last call took (at least 50 us), then blocks on a futex.
  absl::Duration spin = absl::Milliseconds(2);
};

class ShmAttentionClient {
 public:
  // Negotiates a shared-memory session, connects its Unix socket and maps the region.
  // UNIMPLEMENTED-like FailedPrecondition when the daemon chose another transport (it does not
  // host shared memory), the daemon's errors, Unavailable (socket), Internal (mapping).
  static absl::StatusOr<std::unique_ptr<ShmAttentionClient>> Connect(
      std::shared_ptr<grpc::Channel> channel, const ShmAttentionOptions& options);
  ~ShmAttentionClient();  // Close()

  ShmAttentionClient(const ShmAttentionClient&) = delete;
  ShmAttentionClient& operator=(const ShmAttentionClient&) = delete;

  absl::StatusOr<RemoteAttentionPlan> SetPlan(const std::string& model_id,
                                              const std::vector<std::string>& sequence_ids,
                                              int num_queries = 1);
  absl::Status DropPlan(const RemoteAttentionPlan& plan);

  // One call of `plan` over `layer`: queries [rows][q_heads][head_dim] float32 (unrotated), out
  // the same shape (original basis), lse [rows][q_heads] (natural log), host memory. Returns the
  // attended tokens per sequence, or the call's error (out and lse are then unspecified).
  absl::StatusOr<std::vector<uint32_t>> Attend(const RemoteAttentionPlan& plan, int layer,
                                               absl::Span<const float> queries,
                                               absl::Span<float> out, absl::Span<float> lse);

  // A slot held for calls whose queries and answers stay in the region (shared memory the
  // daemon reads and writes). Gives the slot back when destroyed; movable, not copyable. The
  // spans stay valid while the call object lives; the daemon writes out() and lse() only during
  // AttendInPlace.
  class InPlaceCall {
   public:
    InPlaceCall(InPlaceCall&& other) noexcept;
    InPlaceCall& operator=(InPlaceCall&& other) = delete;
    ~InPlaceCall();
    absl::Span<float> queries() const { return queries_; }  // [rows][q_heads][head_dim]
    absl::Span<const float> out() const { return out_; }    // same shape, original basis
    absl::Span<const float> lse() const { return lse_; }    // [rows][q_heads], natural log

   private:
    friend class ShmAttentionClient;
    InPlaceCall(ShmAttentionClient* client, uint32_t slot, const RemoteAttentionPlan& plan);
    ShmAttentionClient* client_;  // null once moved from
    uint32_t slot_;
    RemoteAttentionPlan plan_;
    absl::Span<float> queries_, out_, lse_;
  };
  // Takes a free slot for `plan`'s calls (waiting while none is free). InvalidArgument when the
  // plan's calls do not fit the slots, FailedPrecondition once the channel is closed.
  absl::StatusOr<InPlaceCall> HoldSlot(const RemoteAttentionPlan& plan);
  // One call of the held slot's plan over `layer`, its queries already in call.queries().
  // Returns the attended tokens per sequence; on error out() and lse() are unspecified.
  absl::StatusOr<std::vector<uint32_t>> AttendInPlace(const InPlaceCall& call, int layer);

  // Ends the session (CloseSession, then the socket; the mapping goes with the client).
  // Idempotent; later calls answer FailedPrecondition.
  absl::Status Close();

  uint64_t session_id() const { return session_id_; }
  // The daemon's compute device: -1 for the CPU, else its CUDA device.
  int daemon_device() const { return device_; }
  const server::ShmLayout& layout() const { return layout_; }

  // Test hook: writes `header` (any bytes) into a slot as a call and returns the daemon's status.
  absl::Status SendRawHeaderForTesting(absl::Span<const uint8_t> header);

  // The pieces of a call, for callers that bring their own I/O (shm_device_attention.h):
  // a free slot (waiting while none is), given back after its call.
  uint32_t TakeSlot();
  void GiveSlot(uint32_t slot);
  // The slot's device mailbox handles (kShmMailboxBytes; zero without device_io).
  const uint8_t* MailboxHandles(uint32_t slot) const;
  // Writes the call header of `plan` and `layer` and the I/O kind into `slot` (its queries are in
  // place), publishes it and waits for the answer: the attended tokens, or the call's error.
  absl::StatusOr<std::vector<uint32_t>> CallInSlot(uint32_t slot, const RemoteAttentionPlan& plan,
                                                   int layer, uint32_t io_kind);

 private:
  ShmAttentionClient() = default;
  // Publishes the call in `slot` (header and queries written) and waits for the answer.
  absl::StatusOr<server::CallStatus> Call(uint32_t slot);

  std::unique_ptr<::kvpool::v1::TransportService::Stub> stub_;
  ShmAttentionOptions options_;
  uint64_t session_id_ = 0;
  int device_ = -1;
  int socket_ = -1;
  uint8_t* region_ = nullptr;
  server::ShmLayout layout_;
  std::atomic<uint64_t> next_call_{1};
  std::atomic<int64_t> last_call_ns_{0};
  absl::Mutex mu_;
  std::vector<bool> busy_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvpool::client
