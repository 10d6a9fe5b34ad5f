#include "server/sequence_reaper.h"

#include "absl/time/clock.h"

namespace kvpool::server {

SequenceReaper::SequenceReaper(SequenceStore* store, absl::Duration period)
    : store_(store), period_(period), thread_([this] { Run(); }) {}

SequenceReaper::~SequenceReaper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void SequenceReaper::Run() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period_)) {
    mu_.Unlock();
    store_->ReleaseExpired(absl::Now());
    mu_.Lock();
  }
}

}  // namespace kvpool::server
