// AttentionChannel: the daemon's end (rank 1) of one decode worker's NCCL attention channel (an
// NCCL session of use ATTENTION, proto/kvpool/v1/transport_service.proto): a two-rank
// communicator, the plans that fix its calls' shapes, and one thread that serves the calls in
// order, each one moving only over NCCL (attention_wire.h):
//
//   receive the call header (device buffer -> host) -> validate it -> receive the queries into a
//   device buffer -> AttentionEngine::RunOnDevice (queries and outputs stay on the GPU) -> send
//   the status block, out and lse (zeros on error)
//
// Every wait is non-blocking: it polls the communicator's asynchronous error, Close and (once a
// call has begun) a deadline, and aborts the communicator (ncclCommAbort) on any of them. A call
// header that cannot be parsed, or whose call number is out of order, aborts the channel too
// (the byte stream can no longer be trusted). A call that fails for its own reasons (unknown
// plan or sequence, wrong layer, ...) gets its status back and the channel keeps serving.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AttentionChannel> ch,
//       AttentionChannel::Join(ctx, tenant, unique_id, absl::Seconds(60), "worker-3", cancelled,
//                              /*blocking_ops=*/true));
//   KVPOOL_ASSIGN_OR_RETURN(SetAttentionPlanResult plan, ch->AddPlan(model, ids, 1));
//   ch->Start([](absl::Status why) { ... });   // the loop thread runs until the channel ends
//   ch->Close();                                // aborts, frees, `why` is OK
//
// While waiting for the next call the loop spins for a few milliseconds (lowest latency for a
// decode worker's back-to-back layers), then sleeps in growing steps up to 1 ms.
//
// Thread-safe. `on_end` runs exactly once per started channel, on the loop thread, as the loop's
// last action (nothing of the channel is touched after it): it may destroy the channel.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataplane/attention_wire.h"
#include "server/service_context.h"
#include "server/tenant.h"
#include "server/transport/transport.h"

namespace kvpool::server {

class AttentionChannel {
 public:
  // Joins a two-rank communicator as rank 1 on the daemon's GPU, waiting up to `timeout` for
  // rank 0 (or until `cancelled()`), allocates the channel's buffers and makes the connect
  // exchange with the client (ConnectWithin, same limits); with `blocking_ops` the calls run on
  // a blocking communicator split from the joined one (JoinNcclComm). The loop does not run
  // until Start. InvalidArgument (id size), DeadlineExceeded, Cancelled,
  // Unavailable (NCCL), Internal / ResourceExhausted (CUDA).
  static absl::StatusOr<std::unique_ptr<AttentionChannel>> Join(
      ServiceContext* ctx, TenantId tenant, const std::string& unique_id, absl::Duration timeout,
      std::string name, const std::function<bool()>& cancelled, bool blocking_ops);
  // Close(), then frees what the loop did not.
  ~AttentionChannel();

  AttentionChannel(const AttentionChannel&) = delete;
  AttentionChannel& operator=(const AttentionChannel&) = delete;

  // Starts the loop thread (once); `on_end(reason)` runs when it ends: OK after Close, else the
  // abort's cause (the peer failed, an unparseable header, ...).
  void Start(std::function<void(absl::Status)> on_end);

  // Stops the loop (aborting the communicator, so a call in flight fails) and waits for it to
  // end, unless called from the loop thread itself (from `on_end`). Idempotent.
  void Close();

  // A new plan: `sequence_ids` of the tenant's model `model_id`, `num_queries` rows each.
  // NotFound (model), InvalidArgument (shape limits, empty id), ResourceExhausted (more than
  // kMaxPlans plans), FailedPrecondition (the channel ended).
  absl::StatusOr<AttentionPlanInfo> AddPlan(const std::string& model_id,
                                            std::vector<std::string> sequence_ids, int num_queries);
  // NotFound when the plan is absent.
  absl::Status DropPlan(uint32_t plan_id);

  // Most plans one channel holds at a time.
  static constexpr int kMaxPlans = 256;

  int device() const { return device_; }
  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }

 private:
  struct Plan {
    std::string model_id;
    std::vector<std::string> sequence_ids;
    AttentionPlanShape shape;
  };
  class Buffers;  // the CUDA side: stream, events, device and pinned host buffers

  AttentionChannel(ServiceContext* ctx, TenantId tenant, std::string name, int device, void* comm,
                   std::unique_ptr<Buffers> buffers);

  void Loop();
  // The first exchange, both directions at once (see attention_wire.h kConnectBytes); Join's.
  absl::Status Connect();
  // One call; an error means the channel must be aborted.
  absl::Status ServeOne(uint64_t expected_call);
  // The outcome of a parsed call (its status goes back to the client), queries received.
  absl::StatusOr<std::vector<int>> Attend(const CallHeader& h);
  std::shared_ptr<const Plan> FindPlan(uint32_t id) const;

  // Non-blocking NCCL discipline.
  absl::Status Settle(absl::Time deadline);     // until posted operations are enqueued
  absl::Status WaitEvent(absl::Time deadline);  // the buffers' event; spins, then sleeps
  absl::Status Failed(absl::Status why);        // aborts the communicator; returns `why`

  ServiceContext* const ctx_;
  const TenantId tenant_;
  const std::string name_;
  const int device_;
  void* comm_;  // ncclComm_t, used by the loop thread only (and the destructor after it)
  std::unique_ptr<Buffers> buffers_;
  bool aborted_ = false;  // loop thread only
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> calls_{0};

  absl::Mutex start_mu_;
  std::thread loop_ ABSL_GUARDED_BY(start_mu_);
  bool started_ ABSL_GUARDED_BY(start_mu_) = false;
  std::function<void(absl::Status)> on_end_;  // set before the loop starts

  mutable absl::Mutex plans_mu_;
  std::map<uint32_t, std::shared_ptr<const Plan>> plans_ ABSL_GUARDED_BY(plans_mu_);
  uint32_t next_plan_ ABSL_GUARDED_BY(plans_mu_) = 1;
  bool ended_ ABSL_GUARDED_BY(plans_mu_) = false;
};

}  // namespace kvpool::server
