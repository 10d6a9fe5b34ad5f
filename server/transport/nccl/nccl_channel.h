// NcclChannel: the daemon's end (rank 1) of a two-rank NCCL communicator with one prefill
// worker (rank 0), with a few device staging slots that K/V chunks are received into.
//
// Joining runs in NCCL's non-blocking mode so that it can time out. The operations then run on
// that communicator or, when the client asks (blocking_ops), on a blocking one split from it
// once the client's path is connected (a blocking group then never waits for the peer on the
// host). Every
// wait polls the communicator's asynchronous error, a cancellation callback and a deadline, and
// aborts the communicator (ncclCommAbort) on any of them. An aborted channel fails every later
// call; the client must open a new one.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<NcclChannel> ch,
//       NcclChannel::Join(/*device=*/0, unique_id, absl::Seconds(60), cancelled,
//                         /*blocking_ops=*/true));
//   KVPOOL_ASSIGN_OR_RETURN(NcclChannel::Slot* slot, ch->AcquireSlot(bytes, cancelled));
//   KVPOOL_RETURN_IF_ERROR(ch->PostRecv(slot, bytes));        // K then V from rank 0
//   KVPOOL_RETURN_IF_ERROR(ch->WaitRecv(slot, cancelled));    // the bytes are in slot->k, slot->v
//   ch->ReleaseSlot(slot);
//
// Thread-safe. Receives are posted in call order (the order of the client's sends).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/transport/device/device_slots.h"
#include "server/transport/nccl/connect_within.h"

namespace kvpool::server {

// Sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 in this
// process (NVLink multicast can take a shared host's GPUs out of service). Called before any
// NCCL use; kvpoold also calls it at start.
void DisableNvlinkMulticast();

// Polls the non-blocking communicator `comm` (an ncclComm_t) until its posted operations are
// enqueued: OK; UNAVAILABLE when its peer failed or left; CANCELLED when `stop` returns true;
// DEADLINE_EXCEEDED (`timeout_message`) at `deadline`. Never aborts it: the channels do, each
// with its own accounting.
[[nodiscard]] absl::Status AwaitCommSettled(void* comm, absl::Time deadline,
                                            const std::function<bool()>& stop,
                                            const char* timeout_message);

// Joins a two-rank non-blocking NCCL communicator as rank 1 on GPU `device` (the client, rank 0,
// joins with the same ncclUniqueId), polling until it is up; aborts it and gives up after
// `timeout` (DeadlineExceeded) or once `cancelled()` (Cancelled). With `blocking_ops` both ranks
// then split it (ncclCommSplit, still polled) into a blocking communicator, whose groups launch
// on the calling thread (a non-blocking one starts a thread per group), and the parent is
// aborted. Returns the ncclComm_t. InvalidArgument (id size), Unavailable (NCCL errors).
absl::StatusOr<void*> JoinNcclComm(int device, const std::string& unique_id, absl::Duration timeout,
                                   const std::function<bool()>& cancelled, bool blocking_ops);

class NcclChannel {
 public:
  using Slot = DeviceSlots::Slot;

  // Bytes of each of the two messages (K, V) a client sends right after joining a channel with
  // blocking operations, so that the path is connected before the first push.
  static constexpr size_t kConnectBytes = 16;
  // Receive slots: a chunk is received while up to two earlier ones (of different layers) are
  // staged (staging runs slower than the link while NCCL shares the GPU, and two slots left the
  // link idle).
  static constexpr int kSlots = 3;

  // Joins a two-rank communicator as rank 1 on GPU `device`, waiting up to `timeout` for rank 0
  // (JoinNcclComm) or until `cancelled()`; with `blocking_ops` also receives the client's connect
  // messages (within `timeout`, ConnectWithin).
  // InvalidArgument (id size), DeadlineExceeded, Cancelled, Unavailable (NCCL errors).
  static absl::StatusOr<std::unique_ptr<NcclChannel>> Join(int device, const std::string& unique_id,
                                                           absl::Duration timeout,
                                                           const std::function<bool()>& cancelled,
                                                           bool blocking_ops);
  ~NcclChannel();

  NcclChannel(const NcclChannel&) = delete;
  NcclChannel& operator=(const NcclChannel&) = delete;

  int device() const { return device_; }

  // A free slot holding at least `bytes` per tensor, waiting while all are busy (backpressure).
  // Cancelled when `cancelled()` turns true, FailedPrecondition once aborted.
  absl::StatusOr<Slot*> AcquireSlot(size_t bytes, const std::function<bool()>& cancelled);
  void ReleaseSlot(Slot* slot);

  // Posts the receives of K and then V (`bytes` each) from rank 0 into the slot.
  absl::Status PostRecv(Slot* slot, size_t bytes);
  // Waits until the slot's receives completed. On cancellation, an NCCL error of the peer or
  // `timeout` the communicator is aborted and the error returned.
  absl::Status WaitRecv(Slot* slot, const std::function<bool()>& cancelled,
                        absl::Duration timeout = absl::Seconds(120));

  // Aborts the communicator (idempotent): pending receives end, later calls fail.
  void Abort();
  bool aborted() const;

 private:
  NcclChannel(int device, void* comm, void* stream);
  absl::Status Connect(absl::Duration timeout);
  // Polls until the communicator has no operation in progress; aborts on errors.
  absl::Status Settle(const std::function<bool()>& cancelled, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(comm_mu_);

  const int device_;
  void* comm_;                   // ncclComm_t
  void* stream_;                 // cudaStream_t the receives run on
  mutable absl::Mutex comm_mu_;  // serializes NCCL calls on the communicator
  bool aborted_ ABSL_GUARDED_BY(comm_mu_) = false;
  DeviceSlots slots_;
};

}  // namespace kvpool::server
