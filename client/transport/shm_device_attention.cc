#include "client/transport/shm_device_attention.h"

#include <cuda_runtime.h>

#include <cstring>
#include <utility>

#include "common/cuda_status.h"
#include "common/status_macros.h"

namespace kvpool::client {

// One slot's mailbox as this process sees it: the daemon's memory and events, opened through
// their IPC handles, and a local event that marks the slot's outputs as copied out.
struct ShmDeviceAttention::Slot {
  uint8_t* memory = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr, consumed = nullptr;
  bool used = false;
  ~Slot() {
    if (ready != nullptr) cudaEventDestroy(ready);
    if (done != nullptr) cudaEventDestroy(done);
    if (consumed != nullptr) cudaEventDestroy(consumed);
    if (memory != nullptr) cudaIpcCloseMemHandle(memory);
  }
};

absl::StatusOr<std::unique_ptr<ShmDeviceAttention>> ShmDeviceAttention::Open(
    std::shared_ptr<grpc::Channel> channel, int device, ShmAttentionOptions options) {
  options.device_io = true;
  std::unique_ptr<ShmDeviceAttention> a(new ShmDeviceAttention());
  a->device_ = device;
  KVPOOL_ASSIGN_OR_RETURN(a->client_, ShmAttentionClient::Connect(std::move(channel), options));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  for (uint32_t i = 0; i < a->client_->layout().slots; ++i) {
    auto slot = std::make_unique<Slot>();
    const uint8_t* h = a->client_->MailboxHandles(i);
    cudaIpcMemHandle_t mh;
    cudaIpcEventHandle_t ready, done;
    static_assert(sizeof(mh) == server::kShmIpcHandleBytes);
    static_assert(sizeof(ready) == server::kShmIpcHandleBytes);
    std::memcpy(&mh, h, sizeof(mh));
    std::memcpy(&ready, h + server::kShmIpcHandleBytes, sizeof(ready));
    std::memcpy(&done, h + 2 * server::kShmIpcHandleBytes, sizeof(done));
    void* p = nullptr;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaIpcOpenMemHandle(&p, mh, cudaIpcMemLazyEnablePeerAccess),
                                      "open mailbox memory"));
    slot->memory = static_cast<uint8_t*>(p);
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaIpcOpenEventHandle(&slot->ready, ready), "open mailbox event"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaIpcOpenEventHandle(&slot->done, done), "open mailbox event"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&slot->consumed, cudaEventDisableTiming), "event"));
    a->slots_.push_back(std::move(slot));
  }
  return a;
}

ShmDeviceAttention::~ShmDeviceAttention() {
  cudaSetDevice(device_);
  for (auto& s : slots_) {
    if (s->used) cudaEventSynchronize(s->consumed);  // no copy may still read the mailbox
  }
  slots_.clear();
}

absl::StatusOr<std::vector<uint32_t>> ShmDeviceAttention::Attend(const RemoteAttentionPlan& plan,
                                                                 int layer, const float* d_queries,
                                                                 float* d_out, float* d_lse,
                                                                 CUstream_st* stream) {
  const server::ShmLayout& l = client_->layout();
  if (plan.query_bytes > l.max_query_bytes || plan.lse_bytes > l.max_lse_bytes) {
    return absl::InvalidArgumentError("the plan's calls do not fit this channel's mailboxes");
  }
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  const uint32_t index = client_->TakeSlot();
  Slot& s = *slots_[index];
  absl::StatusOr<std::vector<uint32_t>> tokens = [&]() -> absl::StatusOr<std::vector<uint32_t>> {
    // The slot's previous outputs are copied out before its mailbox is written again.
    if (s.used) {
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream, s.consumed, 0), "wait"));
    }
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(s.memory, d_queries, plan.query_bytes, cudaMemcpyDeviceToDevice, stream),
        "queries into the mailbox"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(s.ready, stream), "record ready"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> t,
                            client_->CallInSlot(index, plan, layer, server::kIoDevice));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream, s.done, 0), "wait done"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(d_out, s.memory + l.max_query_bytes, plan.query_bytes,
                                   cudaMemcpyDeviceToDevice, stream),
                   "outputs"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(d_lse, s.memory + 2 * l.max_query_bytes, plan.lse_bytes,
                                   cudaMemcpyDeviceToDevice, stream),
                   "LSE"));
    return t;
  }();
  // Recorded whatever happened: the next call of the slot orders itself after this one's work.
  if (cudaEventRecord(s.consumed, stream) == cudaSuccess) s.used = true;
  client_->GiveSlot(index);
  return tokens;
}

}  // namespace kvpool::client
