#include "server/transport/cuda_ipc/cuda_ipc_transport.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/transport/cuda_ipc/ipc_mappings.h"
#include "server/transport/cuda_ipc/ipc_range_check.h"
#include "server/transport/device/device_push_counters.h"
#include "server/transport/device/device_slots.h"
#include "server/transport/device/push_trace.h"
#include "server/transport/device_push.h"
#include "server/transport/session_registry.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

// Chunks are copied into these slots (shared by all pushes) before quantization.
constexpr int kIpcSlots = 4;

// What every push shares: the mappings, the slots chunks are copied into and the copy stream.
// Pushes hold it, so it outlives the transport while one still runs.
class IpcShared {
 public:
  explicit IpcShared(int device) : device_(device), slots_(device, kIpcSlots) {}
  ~IpcShared() {
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  }

  int device() const { return device_; }
  IpcMappings& mappings() { return mappings_; }
  DeviceSlots& slots() { return slots_; }

  // The stream that copies chunks from the prefill GPU into slots (copy engines over NVLink,
  // leaving the SMs to the arrival kernels).
  absl::StatusOr<cudaStream_t> CopyStream() {
    absl::MutexLock lock(&mu_);
    if (copy_stream_ == nullptr) {
      if (cudaSetDevice(device_) != cudaSuccess ||
          cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        copy_stream_ = nullptr;
        return absl::InternalError("cannot create the IPC copy stream");
      }
    }
    return copy_stream_;
  }

 private:
  const int device_;
  IpcMappings mappings_;
  DeviceSlots slots_;
  absl::Mutex mu_;
  cudaStream_t copy_stream_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// One push: each chunk names the client's buffers; they are mapped (once per push and handle),
// checked and copied into a slot, and staged from there.
class IpcPush final : public DevicePush, public std::enable_shared_from_this<IpcPush> {
 public:
  IpcPush(std::shared_ptr<IpcShared> shared, std::function<bool()> cancelled,
          std::shared_ptr<DevicePushCounters> counters)
      : shared_(std::move(shared)),
        cancelled_(std::move(cancelled)),
        counters_(std::move(counters)) {
    counters_->Opened();
  }
  ~IpcPush() override { CloseMappings(); }

  size_t max_pending_chunks() const override { return kIpcSlots; }

  absl::StatusOr<bool> Stage(const DeviceChunk& c, IngestAppend& append) override {
    const int traced =
        trace_.AddChunk(c.layer, static_cast<int>(c.token_offset), static_cast<int>(c.num_tokens));
    trace_.Mark(traced, PushTrace::kRead);
    KVPOOL_ASSIGN_OR_RETURN(const void* k, Map(c.k, c.bytes, "k"));
    KVPOOL_ASSIGN_OR_RETURN(const void* v, Map(c.v, c.bytes, "v"));
    // Copy engines pull the chunk over NVLink into a local slot while the previous chunk is
    // quantized (the arrival kernels reading peer memory directly ran at about a third of the
    // link's speed).
    DeviceSlots& slots = shared_->slots();
    KVPOOL_ASSIGN_OR_RETURN(DeviceSlots::Slot * s,
                            slots.Acquire(c.bytes, cancelled_, [] { return false; }));
    trace_.Mark(traced, PushTrace::kSlot);
    absl::StatusOr<cudaStream_t> stream = shared_->CopyStream();
    absl::Status copied = stream.status();
    if (copied.ok()) {
      const bool ok =
          cudaMemcpyAsync(s->k, k, c.bytes, cudaMemcpyDefault, *stream) == cudaSuccess &&
          cudaMemcpyAsync(s->v, v, c.bytes, cudaMemcpyDefault, *stream) == cudaSuccess &&
          cudaEventRecord(static_cast<cudaEvent_t>(s->done), *stream) == cudaSuccess;
      if (!ok) {
        (void)cudaGetLastError();
        copied = absl::InternalError("copying a CUDA IPC chunk failed");
        cudaStreamSynchronize(*stream);
      }
    }
    if (!copied.ok()) {
      slots.Release(s);
      return copied;
    }
    trace_.Mark(traced, PushTrace::kPosted);
    counters_->bytes_received += 2 * c.bytes;
    std::shared_ptr<IpcPush> self = shared_from_this();
    return append.StageDevice(
        c.layer, c.token_offset, c.num_tokens, static_cast<const Bf16*>(s->k),
        static_cast<const Bf16*>(s->v),
        [self, s, traced] {
          absl::Status st = DeviceSlots::Wait(
              s,
              [&]() -> absl::Status {
                return self->cancelled_() ? absl::CancelledError("push cancelled")
                                          : absl::OkStatus();
              },
              absl::Seconds(120));
          self->trace_.Mark(traced, PushTrace::kReady);
          return st;
        },
        [self, s, traced](absl::Status, bool) {
          // A chunk dropped before staging may still have its copy in flight.
          cudaEventSynchronize(static_cast<cudaEvent_t>(s->done));
          self->shared_->slots().Release(s);
          self->trace_.Mark(traced, PushTrace::kStaged);
        });
  }

  void End(const absl::Status& status, const std::string& sequence_id) override {
    CloseMappings();  // every chunk has finished: nothing reads them any more
    trace_.Log(sequence_id, status);
    counters_->Ended(status.ok());
  }

 private:
  // The device address of an IPC buffer's `bytes` bytes, checked against its allocation.
  absl::StatusOr<const void*> Map(const IpcBufferRef& b, size_t bytes, const char* what) {
    KVPOOL_ASSIGN_OR_RETURN(auto mapped, shared_->mappings().Open(shared_->device(), b.handle));
    {
      absl::MutexLock lock(&mu_);
      handles_.push_back(b.handle);
    }
    KVPOOL_RETURN_IF_ERROR(CheckIpcRange(b.offset, bytes, mapped.second, what));
    return mapped.first + b.offset;
  }

  void CloseMappings() {
    std::vector<std::string> handles;
    {
      absl::MutexLock lock(&mu_);
      handles.swap(handles_);
    }
    for (const std::string& h : handles) shared_->mappings().Close(shared_->device(), h);
  }

  const std::shared_ptr<IpcShared> shared_;
  const std::function<bool()> cancelled_;
  const std::shared_ptr<DevicePushCounters> counters_;
  PushTrace trace_;
  absl::Mutex mu_;
  std::vector<std::string> handles_ ABSL_GUARDED_BY(mu_);  // one reference each
};

// A fetch's destination: one reference on the mapping of a client allocation.
class IpcMappedBuffer final : public MappedClientBuffer {
 public:
  IpcMappedBuffer(std::shared_ptr<IpcShared> shared, std::string handle, uint8_t* data, size_t size)
      : shared_(std::move(shared)), handle_(std::move(handle)), data_(data), size_(size) {}
  ~IpcMappedBuffer() override { shared_->mappings().Close(shared_->device(), handle_); }
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }

 private:
  const std::shared_ptr<IpcShared> shared_;
  const std::string handle_;
  uint8_t* const data_;
  const size_t size_;
};

// A session keeps the arenas its fetches named mapped (a decode worker fetches into the same
// arena step after step; mapping a large allocation costs milliseconds). Pushes map what their
// chunks name for themselves.
struct IpcSession {
  static constexpr size_t kMaxKeptArenas = 8;
  absl::Mutex mu;
  // Most recently used last; each holds one reference on its mapping until the session ends.
  std::vector<std::pair<std::string, std::unique_ptr<IpcMappedBuffer>>> arenas ABSL_GUARDED_BY(mu);
};

class CudaIpcTransport final : public Transport {
 public:
  CudaIpcTransport(ServiceContext* ctx, const CudaIpcTransportOptions& options)
      : device_(ctx->backend->device()),
        sessions_(options.max_sessions),
        shared_(std::make_shared<IpcShared>(device_)),
        counters_(std::make_shared<DevicePushCounters>()) {}

  ~CudaIpcTransport() override { Shutdown(); }

  const TransportCapabilities& capabilities() const override {
    static const TransportCapabilities kCaps{.kind = TransportKind::kCudaIpc,
                                             .host_memory = false,
                                             .device_memory = true,
                                             .local_peers = true,
                                             .remote_peers = false,
                                             .zero_copy = false,
                                             .layer_notifications = false,
                                             .remote_attention = false,
                                             .device_pushes = true,
                                             .attention_plans = false,
                                             .device_fetches = true};
    return kCaps;
  }

  absl::StatusOr<TransportSession> Accept(const TenantId& tenant,
                                          const TransportOffer& offer) override {
    if (offer.kind != TransportKind::kCudaIpc) {
      return absl::InvalidArgumentError("the CUDA IPC transport got an offer of another kind");
    }
    if (shut_down_.load()) return absl::UnavailableError("kvpoold is shutting down");
    KVPOOL_ASSIGN_OR_RETURN(uint64_t id,
                            sessions_.Add(tenant, std::make_shared<IpcSession>(), false));
    spdlog::info("cuda_ipc: session {:x} for {} on cuda:{}", id, Quote(offer.client_name), device_);
    TransportSession ts;
    ts.kind = TransportKind::kCudaIpc;
    ts.session_id = id;
    ts.device = device_;
    return ts;
  }

  absl::StatusOr<int> Close(const TenantId& tenant, uint64_t session_id) override {
    KVPOOL_RETURN_IF_ERROR(sessions_.End(tenant, session_id, absl::OkStatus()).status());
    return 0;  // a push in flight ends on its own stream
  }

  TransportStats Stats() const override {
    TransportStats s;
    s.sessions = static_cast<uint32_t>(sessions_.size());
    counters_->Fill(&s);
    s.connections_refused += sessions_.foreign_attempts();  // another tenant's session named
    return s;
  }

  void Shutdown() override {
    if (shut_down_.exchange(true)) return;
    sessions_.EndAll(absl::UnavailableError("kvpoold is shutting down"));
  }

  // An optional lease: the session ends when its watch does.
  absl::Status WatchSession(const TenantId& tenant, uint64_t session_id,
                            std::function<void(absl::Status)> on_end) override {
    return sessions_.Watch(tenant, session_id, std::move(on_end));
  }

  absl::StatusOr<std::unique_ptr<MappedClientBuffer>> MapClientBuffer(
      const TenantId& tenant, uint64_t session_id, const std::string& handle) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<IpcSession> session,
                            sessions_.Find(tenant, session_id));
    // This call's own reference (the mapping stays open even if the session ends meanwhile).
    KVPOOL_ASSIGN_OR_RETURN(auto mapped, shared_->mappings().Open(device_, handle));
    auto buffer = std::unique_ptr<MappedClientBuffer>(
        new IpcMappedBuffer(shared_, handle, mapped.first, mapped.second));
    absl::MutexLock lock(&session->mu);
    auto& kept = session->arenas;
    auto it =
        std::find_if(kept.begin(), kept.end(), [&](const auto& e) { return e.first == handle; });
    if (it != kept.end()) {
      std::rotate(it, it + 1, kept.end());  // most recently used last
    } else {
      KVPOOL_ASSIGN_OR_RETURN(auto again, shared_->mappings().Open(device_, handle));
      if (kept.size() >= IpcSession::kMaxKeptArenas) kept.erase(kept.begin());
      kept.emplace_back(
          handle, std::make_unique<IpcMappedBuffer>(shared_, handle, again.first, again.second));
    }
    return buffer;
  }

  absl::StatusOr<std::shared_ptr<DevicePush>> OpenDevicePush(
      const TenantId& tenant, uint64_t session_id, std::function<bool()> cancelled) override {
    KVPOOL_RETURN_IF_ERROR(sessions_.Find(tenant, session_id).status());
    return std::make_shared<IpcPush>(shared_, std::move(cancelled), counters_);
  }

 private:
  const int device_;
  SessionRegistry<IpcSession> sessions_;
  const std::shared_ptr<IpcShared> shared_;
  const std::shared_ptr<DevicePushCounters> counters_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> NewCudaIpcTransport(
    ServiceContext* ctx, const CudaIpcTransportOptions& options) {
  if (ctx->backend->device() < 0) {
    return absl::UnavailableError(absl::StrCat(
        "CUDA IPC needs kvpoold --device=cuda:N; this one runs on '", ctx->backend->name(), "'"));
  }
  return std::unique_ptr<Transport>(new CudaIpcTransport(ctx, options));
}

}  // namespace kvpool::server
