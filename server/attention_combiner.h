// AttentionCombiner: plan calls of several callers (decode workers' same-host channels) fused
// into one backend call when they arrive together. A caller that finds nobody running calls its
// plan at once and alone: a lone caller is never held back. Callers that arrive while a call runs
// wait; when it ends, one of them leads the next round, which takes every call waiting then:
// those of one model and layer go to the backend as one batch (their sequences in one table,
// their queries and outputs as runs of rows in place, host I/O), a single one goes alone. The
// leader returns after its round; leadership passes on.
//
//   AttentionCombiner combiner(backend);
//   KVPOOL_ASSIGN_OR_RETURN(absl::Span<const int32_t> tokens,
//       combiner.Attend(plan.get(), layer, host_io, kernel_io, on_device));
//
// Thread-safe. A plan is used by one caller at a time (its channel's thread); while that caller
// waits here, the round's leader uses the plan on its behalf.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/attention_plan.h"
#include "server/backend.h"

namespace kvpool::server {

class AttentionCombiner {
 public:
  explicit AttentionCombiner(ComputeBackend* backend) : backend_(backend) {}

  // plan->Attend(layer, kernel_io, on_device) when the call runs alone; fused with others, the
  // backend reads `host_io` (the same buffers by their host addresses, host I/O). Returns once
  // this call's outputs are complete.
  absl::StatusOr<absl::Span<const int32_t>> Attend(AttentionPlan* plan, int layer,
                                                   const AttentionRows& host_io,
                                                   const AttentionRows& kernel_io, bool on_device);

  // Backend calls that carried more than one caller's call, and the calls they carried.
  uint64_t fused_calls() const { return fused_calls_.load(std::memory_order_relaxed); }
  uint64_t fused_members() const { return fused_members_.load(std::memory_order_relaxed); }
  // Calls waiting for a round now (tests).
  size_t waiting() const;

 private:
  struct Call;
  // One round: every call of `round`, fused by (model, layer).
  void RunRound(const std::vector<Call*>& round);
  void RunFused(const std::vector<Call*>& group);

  ComputeBackend* const backend_;
  mutable absl::Mutex mu_;
  std::vector<Call*> waiting_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> fused_calls_{0};
  std::atomic<uint64_t> fused_members_{0};
};

}  // namespace kvpool::server
