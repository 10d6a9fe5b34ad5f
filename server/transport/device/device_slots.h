// DeviceSlots: a few reusable GPU receive buffers (K and V of one chunk each) for the GPU data
// plane: an NCCL receive or a peer copy lands in a slot while the previous slot's chunk is being
// quantized, and a third chunk waits for a slot (backpressure, bounded memory).
//
//   DeviceSlots slots(/*device=*/0, /*count=*/2);
//   KVPOOL_ASSIGN_OR_RETURN(DeviceSlots::Slot* s, slots.Acquire(bytes, cancelled));
//   ... enqueue the transfer into s->k, s->v; cudaEventRecord(s->done, stream) ...
//   KVPOOL_RETURN_IF_ERROR(DeviceSlots::Wait(s, cancelled, deadline, poll));
//   slots.Release(s);
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvpool::server {

class DeviceSlots {
 public:
  struct Slot {
    void* k = nullptr;
    void* v = nullptr;
    size_t capacity = 0;   // bytes of each
    void* done = nullptr;  // cudaEvent_t recorded after the transfer into the slot
    bool busy = false;
  };

  DeviceSlots(int device, int count) : device_(device), count_(count) {}
  ~DeviceSlots();

  // A free slot of at least `bytes` per tensor (grown when needed), waiting while all are busy.
  // Cancelled when `cancelled()` turns true, FailedPrecondition when `closed()` does.
  absl::StatusOr<Slot*> Acquire(size_t bytes, const std::function<bool()>& cancelled,
                                const std::function<bool()>& closed);
  void Release(Slot* slot);

  // Polls until the slot's event completed; between polls `check` may return an error (peer
  // failure, cancellation), which ends the wait. DeadlineExceeded after `timeout`.
  static absl::Status Wait(const Slot* slot, const std::function<absl::Status()>& check,
                           absl::Duration timeout);

 private:
  const int device_;
  const int count_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  void* stream_ ABSL_GUARDED_BY(mu_) = nullptr;  // cudaStream_t that slots grow on
};

}  // namespace kvpool::server
