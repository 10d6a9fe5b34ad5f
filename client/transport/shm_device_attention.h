// ShmDeviceAttention: same-host remote attention for a caller whose queries and outputs live on
// a GPU (a decode worker beside kvpoold on one host). It rides a shared-memory session
// (shm_attention.h) negotiated with device_io: each slot has a device mailbox the daemon exports
// through CUDA IPC, with an event the caller records once its queries are in (`ready`) and one
// the daemon records once the outputs are (`done`). A call copies the queries into the mailbox
// on the caller's stream and records `ready`, publishes the call in shared memory (the daemon
// queues its kernels behind `ready` and answers at once), then makes the caller's stream wait
// for `done` and copy the outputs out: no data crosses the host, and the host waits only for
// the daemon to queue the work, not for the work.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto attn, ShmDeviceAttention::Open(grpc_channel, /*device=*/0, {}));
//   KVPOOL_ASSIGN_OR_RETURN(RemoteAttentionPlan plan, attn->client().SetPlan("llama", ids, 1));
//   KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens,
//                           attn->Attend(plan, layer, d_q, d_out, d_lse, stream));
//   // d_out and d_lse are ready in `stream` order
//
// Thread-safe (calls take slots as ShmAttentionClient's do; a slot's next call waits on the
// device for the previous one's outputs to be copied out).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/transport/shm_attention.h"
#include "grpcpp/grpcpp.h"

struct CUstream_st;

namespace kvpool::client {

class ShmDeviceAttention {
 public:
  // Negotiates a shared-memory session with device mailboxes and opens them on CUDA device
  // `device` of this process. FailedPrecondition (a CPU daemon), the daemon's and CUDA errors.
  static absl::StatusOr<std::unique_ptr<ShmDeviceAttention>> Open(
      std::shared_ptr<grpc::Channel> channel, int device, ShmAttentionOptions options);
  ~ShmDeviceAttention();

  ShmAttentionClient& client() { return *client_; }

  // One call of `plan` over `layer`: d_queries, d_out ([rows][Hq][D] float32) and d_lse
  // ([rows][Hq]) are device memory of this process; the call starts after the work queued on
  // `stream` and its outputs are written in `stream` order. Returns the attended tokens per
  // sequence once the daemon queued the work, or the call's error (then nothing was written).
  absl::StatusOr<std::vector<uint32_t>> Attend(const RemoteAttentionPlan& plan, int layer,
                                               const float* d_queries, float* d_out, float* d_lse,
                                               CUstream_st* stream);

 private:
  struct Slot;
  ShmDeviceAttention() = default;
  std::unique_ptr<ShmAttentionClient> client_;
  int device_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace kvpool::client
