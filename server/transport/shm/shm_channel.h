// ShmChannel: the daemon's end of one same-host attention channel (a SHARED_MEMORY session,
// proto/kvpool/v1/transport_service.proto): a shared-memory region (dataplane/shm_wire.h), the
// plans that fix its calls' shapes (AttentionPlan: block tables resident, refreshed only when a
// sequence changes), and one loop thread that serves the calls:
//
//   wait on the doorbell (spin briefly, then block) -> for each slot in state REQUEST: copy its
//   call header out, validate it against the plan -> AttentionPlan::Attend with the queries, out
//   and lse in the region itself (registered with the backend: a GPU's kernels read and write
//   them in place, no copy) -> write the status block -> state DONE, wake the client if it sleeps
//
// The region is hostile memory (see shm_wire.h). A call that fails for its own reasons (unknown
// plan, bad layer or sizes, a released sequence) gets its status and the channel keeps serving.
// The channel ends when Close is called or the client's Unix socket closes (its lease).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ShmChannel> ch, ShmChannel::Create(ctx, tenant, l));
//   SendWithFd(sock, reply, ch->region_fd());
//   ch->Start(sock, [](absl::Status why) { ... });
//   KVPOOL_ASSIGN_OR_RETURN(AttentionPlanInfo plan, ch->AddPlan("llama", {"s1", "s2"}, 1));
//   ch->Close();
//
// Thread-safe. `on_end` runs exactly once per started channel, on the loop thread, as its last
// action (it may destroy the channel).
#pragma once

#include <atomic>
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
#include "dataplane/shm_wire.h"
#include "server/attention_plan.h"
#include "server/service_context.h"
#include "server/tenant.h"
#include "server/transport/transport.h"

namespace kvpool::server {

class ShmChannel {
 public:
  // Creates and maps the region of `layout` and registers it with the backend.
  // ResourceExhausted / Internal (memfd, mmap, registration).
  // With `device_io` each slot also gets a device mailbox (backend->CreateDeviceMailbox) whose
  // handles are written into the slot.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Create(ServiceContext* ctx, TenantId tenant,
                                                            const ShmLayout& layout,
                                                            bool device_io);
  ~ShmChannel();  // Close(), then unmaps and closes the region and the socket

  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // The region's descriptor, to hand to the client (it stays the channel's).
  int region_fd() const { return fd_; }

  // Starts the loop (once); the channel owns `peer_socket` from now on.
  void Start(int peer_socket, std::function<void(absl::Status)> on_end);
  // Stops the loop and waits for it (unless called from it). Idempotent.
  void Close();

  // As AttentionChannel::AddPlan: NotFound (model), InvalidArgument (shape, or calls larger than
  // the region's slots), ResourceExhausted (kMaxPlans), FailedPrecondition (ended).
  absl::StatusOr<AttentionPlanInfo> AddPlan(const std::string& model_id,
                                            std::vector<std::string> sequence_ids, int num_queries);
  absl::Status DropPlan(uint32_t plan_id);  // NotFound when absent

  static constexpr int kMaxPlans = 64;
  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }

 private:
  struct Plan {
    std::shared_ptr<AttentionPlan> plan;
    AttentionPlanShape shape;
  };
  ShmChannel(ServiceContext* ctx, TenantId tenant, const ShmLayout& layout, int fd,
             uint8_t* region);
  void Loop();
  void Serve(uint32_t slot);
  // The outcome of the call in `slot` (header already copied out).
  absl::StatusOr<std::vector<int32_t>> Attend(uint32_t slot, const CallHeader& h);
  bool PeerGone() const;

  ServiceContext* const ctx_;
  const TenantId tenant_;
  const ShmLayout layout_;
  const int fd_;
  uint8_t* const region_;
  std::unique_ptr<HostRegistration> registration_;
  std::vector<std::unique_ptr<DeviceMailbox>> mailboxes_;  // per slot, with device_io
  int peer_ = -1;                                          // the client's Unix socket, from Start
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> calls_{0};

  absl::Mutex start_mu_;
  std::thread loop_ ABSL_GUARDED_BY(start_mu_);
  bool started_ ABSL_GUARDED_BY(start_mu_) = false;
  std::function<void(absl::Status)> on_end_;

  mutable absl::Mutex plans_mu_;
  std::map<uint32_t, Plan> plans_ ABSL_GUARDED_BY(plans_mu_);
  uint32_t next_plan_ ABSL_GUARDED_BY(plans_mu_) = 1;
  bool ended_ ABSL_GUARDED_BY(plans_mu_) = false;
};

}  // namespace kvpool::server
