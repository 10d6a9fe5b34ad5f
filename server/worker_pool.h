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
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

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

  // Queues `task` unless the queue is full or the pool is shut down; false then (the task is
  // not run and is destroyed).
  [[nodiscard]] bool TrySubmit(std::function<void()> task);
  // Queues `task` regardless of the bound (for continuations of admitted work). After
  // Shutdown the task runs inline on the caller's thread.
  void Submit(std::function<void()> task);

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
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvpool::server
