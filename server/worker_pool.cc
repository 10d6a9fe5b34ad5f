#include "server/worker_pool.h"

#include <algorithm>
#include <utility>

namespace kvpool::server {

WorkerPool::WorkerPool(int threads, size_t queue_capacity)
    : capacity_(std::max<size_t>(1, queue_capacity)), num_threads_(std::max(1, threads)) {
  const int n = num_threads_;
  threads_.reserve(n);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() { Shutdown(); }

bool WorkerPool::TrySubmit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || queue_.size() >= capacity_) {
    ++rejected_;
    return false;
  }
  queue_.push_back(std::move(task));
  return true;
}

void WorkerPool::Submit(std::function<void()> task) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(std::move(task));
      return;
    }
  }
  task();
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
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace kvpool::server
