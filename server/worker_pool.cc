#include "server/worker_pool.h"

#include <algorithm>
#include <utility>

#include "server/logging/request_context.h"

namespace kvpool::server {
namespace {

// `task` running under the submitting thread's request id, so its log lines name the call.
std::function<void()> WithCallersRequestId(std::function<void()> task) {
  const absl::string_view id = CurrentRequestId();
  if (id.empty()) return task;
  return [id = std::string(id), task = std::move(task)] {
    ScopedRequestId scope(id);
    task();
  };
}

}  // namespace

WorkerPool::WorkerPool(int threads, size_t queue_capacity)
    : capacity_(std::max<size_t>(1, queue_capacity)), num_threads_(std::max(1, threads)) {
  const int n = num_threads_;
  threads_.reserve(n);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() { Shutdown(); }

bool WorkerPool::TrySubmit(const TenantId& tenant, uint64_t cost, std::function<void()> task) {
  task = WithCallersRequestId(std::move(task));
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    ++rejected_;
    return false;
  }
  if (queue_.size() >= capacity_) {
    const size_t own = queue_.size(tenant);
    const size_t tenants = queue_.active_flows() + (own == 0 ? 1 : 0);
    if (own >= std::max<size_t>(1, capacity_ / tenants)) {
      ++rejected_;
      return false;
    }
  }
  queue_.Push(tenant, cost, std::move(task));
  return true;
}

void WorkerPool::Submit(const TenantId& tenant, uint64_t cost, std::function<void()> task) {
  task = WithCallersRequestId(std::move(task));
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.Push(tenant, cost, std::move(task));
      return;
    }
  }
  task();
}

void WorkerPool::SetWeights(std::map<TenantId, uint32_t> weights) {
  absl::MutexLock lock(&mu_);
  queue_.SetWeights(std::move(weights));
}

void WorkerPool::SetFairness(bool weighted) {
  absl::MutexLock lock(&mu_);
  queue_.SetWeighted(weighted);
}

FairFlowStats WorkerPool::TenantStats(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  return queue_.Stats(tenant);
}

void WorkerPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

size_t WorkerPool::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

uint64_t WorkerPool::rejected() const {
  absl::MutexLock lock(&mu_);
  return rejected_;
}

void WorkerPool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = queue_.Pop();
    }
    task();
  }
}

}  // namespace kvpool::server
