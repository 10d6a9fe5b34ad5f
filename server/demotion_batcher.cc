#include "server/demotion_batcher.h"

#include <utility>

namespace kvpool::server {

absl::Status DemotionBatcher::Demote(const Model& model, std::vector<RowMove> moves) {
  if (moves.empty()) return absl::OkStatus();
  Request self{&model, std::move(moves), absl::OkStatus(), false};
  absl::MutexLock lock(&mu_);
  waiting_.push_back(&self);
  if (leading_) {  // a leader takes this request in its next round
    mu_.Await(absl::Condition(&self.done));
    return self.status;
  }
  leading_ = true;
  while (!waiting_.empty()) {
    std::vector<Request*> batch = std::move(waiting_);
    waiting_.clear();
    mu_.Unlock();
    Run(batch);
    mu_.Lock();
    for (Request* r : batch) r->done = true;
  }
  leading_ = false;
  return self.status;
}

void DemotionBatcher::Run(const std::vector<Request*>& batch) {
  std::vector<bool> taken(batch.size(), false);
  for (size_t i = 0; i < batch.size(); ++i) {
    if (taken[i]) continue;
    std::vector<Request*> group;
    std::vector<RowMove> merged;
    for (size_t j = i; j < batch.size(); ++j) {
      if (taken[j] || batch[j]->model != batch[i]->model) continue;
      taken[j] = true;
      group.push_back(batch[j]);
      merged.insert(merged.end(), batch[j]->moves.begin(), batch[j]->moves.end());
    }
    const absl::Status s = backend_->DemoteRows(*batch[i]->model, merged);
    if (s.ok() || group.size() == 1) {
      for (Request* r : group) r->status = s;
      continue;
    }
    // Whose moves failed? Each request alone (a failed call may have written some rows; every
    // request's target slots are its own, and a retry rewrites them).
    for (Request* r : group) r->status = backend_->DemoteRows(*r->model, r->moves);
  }
}

}  // namespace kvpool::server
