#include "server/transport/nccl/nccl_channel.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/nccl_status.h"
#include "common/status_macros.h"
#include "server/transport/device/poll_backoff.h"

namespace kvpool::server {
namespace {

ncclComm_t Comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void DisableNvlinkMulticast() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

NcclChannel::NcclChannel(int device, void* comm, void* stream)
    : device_(device), comm_(comm), stream_(stream), slots_(device, kSlots) {}

absl::StatusOr<void*> JoinNcclComm(int device, const std::string& unique_id, absl::Duration timeout,
                                   const std::function<bool()>& cancelled, bool blocking_ops) {
  DisableNvlinkMulticast();
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl_unique_id must be ", sizeof(id), " bytes, got ", unique_id.size()));
  }
  std::memcpy(&id, unique_id.data(), sizeof(id));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait can give up
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, 1, &config);
  if (r != ncclSuccess && r != ncclInProgress) return NcclStatus(r, "ncclCommInitRankConfig");
  const absl::Time deadline = absl::Now() + timeout;
  // Polls `comm` until its pending operation (the join, then the split) ends; aborts it on an
  // error, the deadline or cancellation.
  auto settle = [&](const char* what) -> absl::Status {
    ncclResult_t state = ncclInProgress;
    while (true) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess || state != ncclInProgress) break;
      if (cancelled() || absl::Now() > deadline) {
        ncclCommAbort(comm);
        return cancelled() ? absl::CancelledError(absl::StrCat(what, ": the client left"))
                           : absl::DeadlineExceededError(
                                 absl::StrCat(what, ": the client did not take part in time"));
      }
      absl::SleepFor(absl::Microseconds(200));
    }
    if (state == ncclSuccess) return absl::OkStatus();
    ncclCommAbort(comm);
    return NcclStatus(state, what);
  };
  KVPOOL_RETURN_IF_ERROR(settle("joining the NCCL communicator"));
  if (!blocking_ops) return static_cast<void*>(comm);
  // The split runs in the parent's (non-blocking) mode, so it too can time out; the child is
  // blocking: its groups launch on the calling thread instead of a new one.
  ncclConfig_t child_config = NCCL_CONFIG_INITIALIZER;
  child_config.blocking = 1;
  ncclComm_t child = nullptr;
  const ncclResult_t split = ncclCommSplit(comm, /*color=*/0, /*key=*/1, &child, &child_config);
  if (split != ncclSuccess && split != ncclInProgress) {
    ncclCommAbort(comm);
    return NcclStatus(split, "ncclCommSplit");
  }
  KVPOOL_RETURN_IF_ERROR(settle("splitting the NCCL communicator"));
  ncclCommAbort(comm);  // the child has resources of its own (splitShare is off)
  if (child == nullptr) return absl::InternalError("ncclCommSplit gave no communicator");
  return static_cast<void*>(child);
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclChannel::Join(
    int device, const std::string& unique_id, absl::Duration timeout,
    const std::function<bool()>& cancelled, bool blocking_ops) {
  KVPOOL_ASSIGN_OR_RETURN(void* joined,
                          JoinNcclComm(device, unique_id, timeout, cancelled, blocking_ops));
  ncclComm_t comm = Comm(joined);
  cudaStream_t stream = nullptr;
  if (absl::Status s =
          CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      !s.ok()) {
    ncclCommAbort(comm);
    return s;
  }
  auto channel = std::unique_ptr<NcclChannel>(new NcclChannel(device, comm, stream));
  if (!blocking_ops) return channel;
  NcclChannel* raw = channel.release();  // the connecting thread's until it returns
  bool abandoned = false;
  absl::Status connected = ConnectWithin([raw, timeout] { return raw->Connect(timeout); },
                                         [raw] { delete raw; }, timeout, cancelled, &abandoned);
  if (abandoned) return connected;  // the connecting thread frees the channel
  channel.reset(raw);
  KVPOOL_RETURN_IF_ERROR(connected);
  return channel;
}

absl::Status NcclChannel::Connect(absl::Duration timeout) {
  // A blocking communicator connects a path inside the group that first uses it, waiting on
  // the host for the peer: that must happen here (the joining thread, where the client sends
  // kConnectBytes right after it joined), never inside a push on a gRPC thread.
  KVPOOL_ASSIGN_OR_RETURN(Slot * slot, AcquireSlot(kConnectBytes, [] { return false; }));
  absl::Status s = PostRecv(slot, kConnectBytes);
  if (s.ok())
    s = WaitRecv(
        slot, [] { return false; }, timeout);
  ReleaseSlot(slot);
  return s;
}

NcclChannel::~NcclChannel() {
  cudaSetDevice(device_);
  Abort();  // frees the communicator's resources whether or not it is busy
  cudaStreamSynchronize(Stream(stream_));
  cudaStreamDestroy(Stream(stream_));
}

absl::StatusOr<NcclChannel::Slot*> NcclChannel::AcquireSlot(
    size_t bytes, const std::function<bool()>& cancelled) {
  return slots_.Acquire(bytes, cancelled, [this] { return aborted(); });
}

void NcclChannel::ReleaseSlot(Slot* slot) { slots_.Release(slot); }

absl::Status AwaitCommSettled(void* comm, absl::Time deadline, const std::function<bool()>& stop,
                              const char* timeout_message) {
  PollBackoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(Comm(comm), &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, "NCCL (the peer failed or left)");
    if (stop()) return absl::CancelledError("stopped");
    if (absl::Now() > deadline) return absl::DeadlineExceededError(timeout_message);
    backoff.Pause();  // a 10 us sleep cost ~60 us of timer slack on every call
  }
}

absl::Status NcclChannel::Settle(const std::function<bool()>& cancelled, absl::Time deadline) {
  absl::Status s = AwaitCommSettled(comm_, deadline, cancelled, "NCCL operation timed out");
  if (s.ok()) return s;
  ncclCommAbort(Comm(comm_));
  aborted_ = true;
  return absl::IsCancelled(s) ? absl::CancelledError("push cancelled") : s;
}

absl::Status NcclChannel::PostRecv(Slot* slot, size_t bytes) {
  if (bytes > slot->capacity) return absl::InternalError("slot too small");
  absl::MutexLock lock(&comm_mu_);
  if (aborted_) return absl::FailedPreconditionError("the NCCL channel was aborted");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  ncclGroupStart();
  ncclRecv(slot->k, bytes, ncclUint8, /*peer=*/0, Comm(comm_), Stream(stream_));
  ncclRecv(slot->v, bytes, ncclUint8, /*peer=*/0, Comm(comm_), Stream(stream_));
  const ncclResult_t r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) {
    ncclCommAbort(Comm(comm_));
    aborted_ = true;
    return NcclStatus(r, "ncclRecv");
  }
  KVPOOL_RETURN_IF_ERROR(Settle([] { return false; }, absl::Now() + absl::Seconds(30)));
  return CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(slot->done), Stream(stream_)),
                    "cudaEventRecord");
}

absl::Status NcclChannel::WaitRecv(Slot* slot, const std::function<bool()>& cancelled,
                                   absl::Duration timeout) {
  absl::Status s = DeviceSlots::Wait(
      slot,
      [&]() -> absl::Status {
        absl::MutexLock lock(&comm_mu_);
        if (aborted_) return absl::FailedPreconditionError("the NCCL channel was aborted");
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(Comm(comm_), &state);
        if (state != ncclSuccess && state != ncclInProgress) {
          ncclCommAbort(Comm(comm_));
          aborted_ = true;
          return NcclStatus(state, "NCCL receive (the peer failed or left)");
        }
        if (cancelled()) return absl::CancelledError("push cancelled");
        return absl::OkStatus();
      },
      timeout);
  if (!s.ok()) Abort();  // a receive left pending must not complete into a reused slot
  return s;
}

void NcclChannel::Abort() {
  absl::MutexLock lock(&comm_mu_);
  if (aborted_) return;
  cudaSetDevice(device_);
  ncclCommAbort(Comm(comm_));
  aborted_ = true;
}

bool NcclChannel::aborted() const {
  absl::MutexLock lock(&comm_mu_);
  return aborted_;
}

}  // namespace kvpool::server
