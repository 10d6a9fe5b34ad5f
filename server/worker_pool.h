// WorkerPool: the threads that run kvpoold's heavy work (rotate + quantize on arrival, reads,
// attention), so gRPC threads only parse, validate and hand off.
//
// The queue is bounded: TrySubmit refuses work when it is full, and the caller fails the request
// with RESOURCE_EXHAUSTED (backpressure the client can retry). Continuations of work already
// admitted (the fan-out of one attention request) use Submit, which never refuses, so a request
// that was accepted always finishes.
//
//   WorkerPool pool(/*threads=*/4, /*queue_capacity=*/1024);
//   if (!pool.TrySubmit([&] { DoHeavyThing(); })) return absl::ResourceExhaustedError("busy");
//   pool.Shutdown();  // runs what is queued, then joins
//
// Work is queued per tenant and taken by weighted fair queueing (fair_queue.h): each task names
// its tenant and its cost in work units, so one tenant's flood of large tasks does not starve
// another's small ones, and a lone tenant's tasks run in arrival order. Tasks submitted without
// a tenant belong to the default tenant "".
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/fair_queue.h"
#include "server/tenant.h"

namespace kvpool::server {

// What a request gets when TrySubmit refuses its work: RESOURCE_EXHAUSTED, which the client may
// retry.
inline absl::Status BusyError() {
  return absl::ResourceExhaustedError("server busy: worker queue full, retry later");
}

class WorkerPool {
 public:
  // `threads` >= 1 workers; `queue_capacity` >= 1 tasks may wait.
  WorkerPool(int threads, size_t queue_capacity);
  ~WorkerPool();  // Shutdown()

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task` of `tenant` costing `cost` work units unless the pool is shut down, or the
  // queue is full and the tenant already holds its share of it (the capacity divided by the
  // tenants with work queued, counting this one): false then (the task is not run and is
  // destroyed). So a tenant filling the queue does not lock the others out of it.
  [[nodiscard]] bool TrySubmit(const TenantId& tenant, uint64_t cost, std::function<void()> task);
  [[nodiscard]] bool TrySubmit(std::function<void()> task) {
    return TrySubmit(kDefaultTenant, 1, std::move(task));
  }
  // Queues `task` regardless of the bound (for continuations of admitted work). After
  // Shutdown the task runs inline on the caller's thread.
  void Submit(const TenantId& tenant, uint64_t cost, std::function<void()> task);
  void Submit(std::function<void()> task) { Submit(kDefaultTenant, 1, std::move(task)); }

  // Tenants' compute weights (absent or 0: 1), for tasks queued from now on.
  void SetWeights(std::map<TenantId, uint32_t> weights);
  // false: plain arrival order (FIFO) across tenants, for comparison; true by default.
  void SetFairness(bool weighted);
  // A tenant's queued and served tasks and work units.
  FairFlowStats TenantStats(const TenantId& tenant) const;

  // Stops accepting work, runs everything queued, joins the threads. Idempotent.
  void Shutdown();

  int threads() const { return num_threads_; }
  size_t queue_capacity() const { return capacity_; }
  size_t queue_depth() const;
  uint64_t rejected() const;

 private:
  void Run();

  const size_t capacity_;
  const int num_threads_;
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  FairQueue<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvpool::server
