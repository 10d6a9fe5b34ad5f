// GpuAttentionClient: a decode worker's side of kvpoold's NCCL attention channel (an NCCL session
// of use ATTENTION, negotiated through kvpool.v1.TransportService, proto/kvpool/v1/
// transport_service.proto, and kept by its WatchSession lease): remote attention whose
// queries and outputs stay in this process's GPU memory and move GPU to GPU over NCCL (this
// process is rank 0), one NCCL round trip per call, no gRPC on the hot path.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto attn, GpuAttentionClient::Create(grpc_channel, /*device=*/0));
//   KVPOOL_RETURN_IF_ERROR(attn->Open(absl::Seconds(60)));
//   KVPOOL_ASSIGN_OR_RETURN(GpuAttentionPlan plan, attn->SetPlan("llama", {"s1", "s2"}, 1));
//   for (int layer = 0; layer < plan.num_layers; ++layer) {
//     // d_q: [2][1][Hq][D] float32, unrotated; d_out the same shape; d_lse [2][1][Hq]
//     KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens,
//                             attn->Attend(plan, layer, d_q, d_out, d_lse, stream));
//   }
//   KVPOOL_RETURN_IF_ERROR(attn->Close());
//
// A call that fails for its own reasons (a released sequence: NOT_FOUND, a bad layer:
// INVALID_ARGUMENT, ...) returns the daemon's status and the channel keeps working. When the
// channel itself breaks (the daemon aborted it, an NCCL error, the call's timeout) the call
// returns UNAVAILABLE / DEADLINE_EXCEEDED and later calls FAILED_PRECONDITION until Open again.
//
// Create sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
// in this process (NVLink multicast off on shared hosts). Thread-safe: calls are serialized (one
// round trip at a time per channel; give each concurrent decode stream its own client).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/transport/attention_plan_rpc.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace kvpool::client {

// A plan of an open channel (SetPlan): the batch shape every call of it moves.
using GpuAttentionPlan = RemoteAttentionPlan;

class GpuAttentionClient {
 public:
  // A client on GPU `device` of this process. Internal (CUDA errors).
  static absl::StatusOr<std::unique_ptr<GpuAttentionClient>> Create(
      std::shared_ptr<grpc::Channel> channel, int device);
  // Closes the channel if open.
  ~GpuAttentionClient();

  GpuAttentionClient(const GpuAttentionClient&) = delete;
  GpuAttentionClient& operator=(const GpuAttentionClient&) = delete;

  // Opens the channel: negotiates an NCCL attention session (an ncclUniqueId over gRPC), joins
  // as rank 0 while the daemon joins as rank 1, then holds the session's lease (WatchSession).
  // FailedPrecondition (already open), UNAVAILABLE (daemon not on a GPU, NCCL errors),
  // DEADLINE_EXCEEDED (no join within `timeout`).
  absl::Status Open(absl::Duration timeout);

  // Fixes a call shape: `sequence_ids` of `model_id`, `num_queries` query rows each. The
  // daemon's errors (NOT_FOUND model, INVALID_ARGUMENT shape, RESOURCE_EXHAUSTED plans).
  absl::StatusOr<GpuAttentionPlan> SetPlan(const std::string& model_id,
                                           const std::vector<std::string>& sequence_ids,
                                           int num_queries = 1);
  // Forgets a plan on the daemon.
  absl::Status DropPlan(const GpuAttentionPlan& plan);

  // One remote attention call of `plan` over `layer`: `queries` ([batch][num_queries][q_heads]
  // [head_dim] float32, unrotated) go to the daemon; `out` (same shape, original basis) and `lse`
  // ([batch][num_queries][q_heads], natural log) are written; all three are this client's GPU
  // memory. When `stream` is given the call starts after the work queued on it (the queries'
  // producer); the outputs are complete when Attend returns, whatever the outcome (zeros on a
  // call error). Returns the attended tokens per sequence of the plan, or the call's error.
  absl::StatusOr<std::vector<uint32_t>> Attend(const GpuAttentionPlan& plan, int layer,
                                               const float* queries, float* out, float* lse,
                                               CUstream_st* stream = nullptr);

  // Closes the channel on both ends (idempotent).
  absl::Status Close();

  bool is_open() const;
  uint64_t channel_id() const;
  // How long one Attend waits for its answer before it aborts the channel (default 60 s).
  void set_call_timeout(absl::Duration timeout);

  // Test hook: sends a call header whose magic is wrong (the daemon must abort the channel) and
  // returns the status the daemon ended the channel with, waiting up to `timeout`.
  absl::Status SendUnparseableHeaderForTesting(absl::Duration timeout);
  // Test hook for fault tests: sends a valid call header of `plan` and returns without sending
  // the queries (the daemon then waits for them; the caller dies mid-call).
  absl::Status SendHeaderOnlyForTesting(const GpuAttentionPlan& plan);

 private:
  GpuAttentionClient(std::shared_ptr<grpc::Channel> channel, int device);
  absl::Status CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts this end of the communicator after a broken call; returns `why`.
  absl::Status Broken(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the event `event` (polling NCCL errors, the lease and `deadline`).
  absl::Status Wait(void* event, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Enqueues the grouped NCCL calls issued by `issue` and waits until NCCL accepted them.
  absl::Status Enqueue(const std::function<void()>& issue, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The connect exchange on `comm` (ncclComm_t) while opening, before the daemon's answer:
  // gives up with give_up()'s error or after `deadline`.
  absl::Status ConnectPeer(void* comm, absl::Time deadline,
                           const std::function<absl::Status()>& give_up)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lease stream's end status once it ended (the daemon closed or aborted the channel).
  bool LeaseEnded(absl::Status* why) const;

  std::unique_ptr<kvpool::v1::TransportService::Stub> stub_;
  const int device_;

  mutable absl::Mutex mu_;
  absl::Duration call_timeout_ ABSL_GUARDED_BY(mu_) = absl::Seconds(60);
  void* comm_ ABSL_GUARDED_BY(mu_) = nullptr;  // ncclComm_t; null when closed
  bool broken_ ABSL_GUARDED_BY(mu_) = false;   // aborted: Open again
  uint64_t channel_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_call_ ABSL_GUARDED_BY(mu_) = 1;
  // CUDA resources (cudaStream_t, cudaEvent_t, device and pinned host buffers).
  void* stream_ = nullptr;
  void* done_ = nullptr;
  void* ready_ = nullptr;
  void* d_header_ = nullptr;
  void* d_status_ = nullptr;
  uint8_t* h_header_ = nullptr;
  uint8_t* h_status_ = nullptr;

  // The WatchSession stream, kept open as the channel's lease, and its reader thread.
  std::unique_ptr<grpc::ClientContext> lease_context_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::ClientReader<kvpool::v1::WatchSessionResponse>> lease_ ABSL_GUARDED_BY(mu_);
  std::thread lease_thread_ ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex lease_mu_;
  bool lease_ended_ ABSL_GUARDED_BY(lease_mu_) = false;
  absl::Status lease_status_ ABSL_GUARDED_BY(lease_mu_);
};

}  // namespace kvpool::client
