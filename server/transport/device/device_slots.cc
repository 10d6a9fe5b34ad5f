#include "server/transport/device/device_slots.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status_macros.h"
#include "server/transport/device/poll_backoff.h"

namespace kvpool::server {
namespace {}  // namespace

DeviceSlots::~DeviceSlots() {
  cudaSetDevice(device_);
  absl::MutexLock lock(&mu_);
  for (auto& slot : slots_) {
    cudaFree(slot->k);
    cudaFree(slot->v);
    cudaEventDestroy(static_cast<cudaEvent_t>(slot->done));
  }
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::StatusOr<DeviceSlots::Slot*> DeviceSlots::Acquire(size_t bytes,
                                                        const std::function<bool()>& cancelled,
                                                        const std::function<bool()>& closed) {
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  absl::MutexLock lock(&mu_);
  while (true) {
    if (closed()) return absl::FailedPreconditionError("the channel was aborted");
    if (cancelled()) return absl::CancelledError("push cancelled");
    Slot* free_slot = nullptr;
    for (auto& s : slots_) {
      if (!s->busy && (free_slot == nullptr || s->capacity > free_slot->capacity)) {
        free_slot = s.get();
      }
    }
    if (free_slot == nullptr && static_cast<int>(slots_.size()) < count_) {
      auto s = std::make_unique<Slot>();
      cudaEvent_t ev = nullptr;
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event"));
      s->done = ev;
      slots_.push_back(std::move(s));
      free_slot = slots_.back().get();
    }
    if (free_slot != nullptr) {
      if (free_slot->capacity < bytes) {
        // The slot is idle (its last chunk was staged and waited for): safe to free. In stream
        // order on a private stream, not with cudaFree, which waits for the whole device, where
        // an attention channel's receive may stay resident until its client's next call.
        if (stream_ == nullptr) {
          cudaStream_t st = nullptr;
          KVPOOL_RETURN_IF_ERROR(
              CudaStatus(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream"));
          stream_ = st;
        }
        cudaStream_t st = static_cast<cudaStream_t>(stream_);
        if (free_slot->k != nullptr) cudaFreeAsync(free_slot->k, st);
        if (free_slot->v != nullptr) cudaFreeAsync(free_slot->v, st);
        free_slot->k = free_slot->v = nullptr;
        free_slot->capacity = 0;
        KVPOOL_RETURN_IF_ERROR(
            CudaStatus(cudaMallocAsync(&free_slot->k, bytes, st), "cudaMallocAsync (slot)"));
        KVPOOL_RETURN_IF_ERROR(
            CudaStatus(cudaMallocAsync(&free_slot->v, bytes, st), "cudaMallocAsync (slot)"));
        KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st), "slot allocation"));
        free_slot->capacity = bytes;
      }
      free_slot->busy = true;
      return free_slot;
    }
    auto any_free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (auto& s : slots_) {
        if (!s->busy) return true;
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&any_free), absl::Milliseconds(20));
  }
}

void DeviceSlots::Release(Slot* slot) {
  absl::MutexLock lock(&mu_);
  slot->busy = false;
}

absl::Status DeviceSlots::Wait(const Slot* slot, const std::function<absl::Status()>& check,
                               absl::Duration timeout) {
  // `check` looks for rare events (a dead peer, a cancelled call) and may take locks that the
  // next chunk's receive needs: every 200 us is soon enough, the event itself is polled faster.
  constexpr absl::Duration kCheckEvery = absl::Microseconds(200);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Time last_check = absl::Now();
  PollBackoff backoff;
  while (true) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(slot->done));
    if (e == cudaSuccess) return check();
    if (e != cudaErrorNotReady) return CudaStatus(e, "transfer into a slot");
    const absl::Time now = absl::Now();
    if (now - last_check >= kCheckEvery) {
      KVPOOL_RETURN_IF_ERROR(check());
      last_check = now;
    }
    if (now > deadline) return absl::DeadlineExceededError("transfer timed out");
    backoff.Pause();
  }
}

}  // namespace kvpool::server
