// DemotionBatcher: demotions (recent BF16 rows quantized into INT2 history blocks) that threads
// ask for at the same moment share one backend call, so a decode step of many sequences costs
// one DemoteRows (one kernel launch on the GPU) instead of one per sequence.
//
// The first caller to find no call running leads: it takes every waiting request, groups them by
// model, makes one DemoteRows per group, and repeats while new requests arrived meanwhile; the
// others wait for their result. A merged call that fails is redone request by request, so each
// caller gets its own error and no other's.
//
//   DemotionBatcher batcher(backend);
//   KVPOOL_RETURN_IF_ERROR(batcher.Demote(model, std::move(moves)));
//
// Thread-safe.
#pragma once

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/backend.h"

namespace kvpool::server {

class DemotionBatcher {
 public:
  explicit DemotionBatcher(ComputeBackend* backend) : backend_(backend) {}

  DemotionBatcher(const DemotionBatcher&) = delete;
  DemotionBatcher& operator=(const DemotionBatcher&) = delete;

  // DemoteRows(model, moves), possibly in one call with other threads' moves. Returns when the
  // moves are done, with DemoteRows' error for these moves.
  [[nodiscard]] absl::Status Demote(const Model& model, std::vector<RowMove> moves);

  // Requests waiting for a leader's next round (tests).
  size_t waiting_for_testing() {
    absl::MutexLock lock(&mu_);
    return waiting_.size();
  }

 private:
  struct Request {
    const Model* model;
    std::vector<RowMove> moves;
    absl::Status status;
    bool done = false;
  };
  // Runs `batch` (requests of any models) and sets each one's status.
  void Run(const std::vector<Request*>& batch);

  ComputeBackend* const backend_;
  absl::Mutex mu_;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Request*> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
