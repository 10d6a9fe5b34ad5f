#include "server/transport/gpu/gpu_transport_service.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kvpool/v1/gpu_transport_service.grpc.pb.h"
#include "server/proto_convert.h"
#include "server/transport/gpu/device_slots.h"
#include "server/transport/gpu/gpu_push_checks.h"
#include "server/transport/gpu/join_admission.h"
#include "server/transport/gpu/nccl_channel.h"
#include "server/transport/layerwise_append.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

// Most bytes of one chunk's K (or V) over NCCL: three slots of K + V stay allocated per channel.
constexpr size_t kMaxNcclChunkBytes = size_t{1} << 30;
// CUDA IPC chunks are copied into these slots (shared by all pushes) before quantization.
constexpr int kIpcSlots = 4;

// Size of the allocation holding `ptr` (device memory of this process, IPC-mapped included),
// through the driver's cuMemGetAddressRange fetched from the runtime (kvpoold does not link the
// driver library, so it still starts on machines without one).
absl::StatusOr<size_t> AllocationBytes(const void* ptr, const void** base) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) return absl::UnavailableError("cuMemGetAddressRange is not available");
  CUdeviceptr b = 0;
  size_t size = 0;
  if (fn(&b, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("not a device allocation");
  }
  *base = reinterpret_cast<const void*>(b);
  return size;
}

// Per-chunk timeline of one push, logged at its end when KVPOOL_TRACE_GPU_PUSH=1 (info level):
// where a push's time goes (read, slot acquired, receive posted, rows ready, staged) without a
// profiler.
class PushTrace {
 public:
  enum Event { kRead, kSlot, kPosted, kReady, kStaged, kEvents };

  static bool Enabled() {
    static const bool on = [] {
      const char* v = std::getenv("KVPOOL_TRACE_GPU_PUSH");
      return v != nullptr && v[0] == '1';
    }();
    return on;
  }

  PushTrace() : start_(absl::Now()) {}

  // A new chunk; returns its index.
  int AddChunk(int layer, int offset, int tokens) {
    if (!Enabled()) return 0;
    absl::MutexLock lock(&mu_);
    chunks_.push_back(Chunk{layer, offset, tokens, {}});
    return static_cast<int>(chunks_.size()) - 1;
  }
  void Mark(int chunk, Event e) {
    if (!Enabled()) return;
    const double us = absl::ToDoubleMicroseconds(absl::Now() - start_);
    absl::MutexLock lock(&mu_);
    if (chunk >= 0 && chunk < static_cast<int>(chunks_.size())) chunks_[chunk].us[e] = us;
  }
  void Log(const std::string& sequence_id, const absl::Status& status) {
    if (!Enabled()) return;
    absl::MutexLock lock(&mu_);
    std::string line =
        absl::StrCat("push ", sequence_id, " ", status.ok() ? "ok" : "failed", " in ",
                     absl::ToDoubleMicroseconds(absl::Now() - start_),
                     " us; chunks (layer@offset+tokens: read/slot/posted/ready/staged us):");
    for (const Chunk& c : chunks_) {
      absl::StrAppend(&line, " ", c.layer, "@", c.offset, "+", c.tokens, ":", c.us[kRead], "/",
                      c.us[kSlot], "/", c.us[kPosted], "/", c.us[kReady], "/", c.us[kStaged]);
    }
    spdlog::info("{}", line);
  }

 private:
  struct Chunk {
    int layer, offset, tokens;
    double us[kEvents];
  };
  const absl::Time start_;
  absl::Mutex mu_;
  std::vector<Chunk> chunks_ ABSL_GUARDED_BY(mu_);
};

// CUDA IPC mappings shared by every push: CUDA maps one handle once per process, so mappings are
// reference counted and closed when their last push ends.
class IpcMappings {
 public:
  // The mapped base of `handle` on `device` and its size.
  absl::StatusOr<std::pair<uint8_t*, size_t>> Open(int device, const std::string& handle) {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, got ", handle.size()));
    }
    absl::MutexLock lock(&mu_);
    auto it = maps_.find(handle);
    if (it == maps_.end()) {
      if (cudaSetDevice(device) != cudaSuccess) return absl::InternalError("cudaSetDevice");
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handle.data(), sizeof(h));
      void* ptr = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::InvalidArgumentError(
            absl::StrCat("cannot map the CUDA IPC handle: ", cudaGetErrorString(e)));
      }
      const void* base = nullptr;
      absl::StatusOr<size_t> size = AllocationBytes(ptr, &base);
      if (!size.ok() || base != ptr) {
        cudaIpcCloseMemHandle(ptr);
        return size.ok() ? absl::InternalError("IPC mapping is not an allocation base")
                         : size.status();
      }
      it = maps_.emplace(handle, Mapping{static_cast<uint8_t*>(ptr), *size, 0}).first;
    }
    ++it->second.refs;
    return std::make_pair(it->second.ptr, it->second.bytes);
  }

  void Close(int device, const std::string& handle) {
    absl::MutexLock lock(&mu_);
    auto it = maps_.find(handle);
    if (it == maps_.end() || --it->second.refs > 0) return;
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(it->second.ptr);
    maps_.erase(it);
  }

 private:
  struct Mapping {
    uint8_t* ptr;
    size_t bytes;
    int refs;
  };
  absl::Mutex mu_;
  std::map<std::string, Mapping> maps_ ABSL_GUARDED_BY(mu_);
};

class GpuTransportServiceImpl final : public v1::GpuTransportService::CallbackService {
 public:
  explicit GpuTransportServiceImpl(ServiceContext* ctx)
      : ctx_(ctx), ipc_slots_(ctx->backend->device(), kIpcSlots) {}
  ~GpuTransportServiceImpl() override {
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  }

  grpc::ServerUnaryReactor* OpenNcclChannel(grpc::CallbackServerContext* call,
                                            const v1::OpenNcclChannelRequest* request,
                                            v1::OpenNcclChannelResponse* response) override {
    grpc::ServerUnaryReactor* reactor = call->DefaultReactor();
    const absl::StatusOr<absl::Duration> timeout = JoinTimeout(request->timeout_ms());
    if (!timeout.ok()) {
      reactor->Finish(ToGrpcStatus(timeout.status()));
      return reactor;
    }
    if (!joins_.TryAcquire()) {
      reactor->Finish(ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat(kMaxPendingJoins, " NCCL channels are joining; retry later"))));
      return reactor;
    }
    // Joining waits for the client's rank: off the gRPC thread.
    std::thread([this, reactor, id = request->nccl_unique_id(), timeout = *timeout, response,
                 name = request->client_name(), blocking = request->blocking_ops()] {
      absl::StatusOr<std::unique_ptr<NcclChannel>> ch =
          NcclChannel::Join(ctx_->backend->device(), id, timeout, blocking);
      joins_.Release();
      if (!ch.ok()) {
        reactor->Finish(ToGrpcStatus(ch.status()));
        return;
      }
      const uint64_t channel_id = next_channel_.fetch_add(1);
      {
        absl::MutexLock lock(&mu_);
        channels_[channel_id] = std::shared_ptr<NcclChannel>(std::move(*ch));
      }
      spdlog::info("NCCL channel {} open with {} on cuda:{}", channel_id, name,
                   ctx_->backend->device());
      response->set_channel_id(channel_id);
      response->set_device(static_cast<uint32_t>(ctx_->backend->device()));
      response->set_max_chunk_bytes(kMaxNcclChunkBytes);
      reactor->Finish(grpc::Status::OK);
    }).detach();
    return reactor;
  }

  grpc::ServerUnaryReactor* CloseNcclChannel(grpc::CallbackServerContext* call,
                                             const v1::CloseNcclChannelRequest* request,
                                             v1::CloseNcclChannelResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = call->DefaultReactor();
    std::shared_ptr<NcclChannel> ch;
    {
      absl::MutexLock lock(&mu_);
      auto it = channels_.find(request->channel_id());
      if (it != channels_.end()) {
        ch = std::move(it->second);
        channels_.erase(it);
      }
    }
    if (ch == nullptr) {
      reactor->Finish(ToGrpcStatus(
          absl::NotFoundError(absl::StrCat("no NCCL channel ", request->channel_id()))));
    } else {
      ch->Abort();  // pushes still using it fail; its memory goes with the last reference
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

  grpc::ServerReadReactor<v1::GpuPushRequest>* PushKv(grpc::CallbackServerContext* call,
                                                      v1::AppendKvResponse* response) override;

  ServiceContext* ctx() const { return ctx_; }
  IpcMappings& ipc() { return ipc_; }
  DeviceSlots& ipc_slots() { return ipc_slots_; }

  // The stream that copies CUDA IPC chunks from the prefill GPU into slots (copy engines over
  // NVLink, leaving the SMs to the arrival kernels).
  absl::StatusOr<cudaStream_t> CopyStream() {
    absl::MutexLock lock(&mu_);
    if (copy_stream_ == nullptr) {
      if (cudaSetDevice(ctx_->backend->device()) != cudaSuccess ||
          cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        copy_stream_ = nullptr;
        return absl::InternalError("cannot create the IPC copy stream");
      }
    }
    return copy_stream_;
  }

  absl::StatusOr<std::shared_ptr<NcclChannel>> Channel(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(id);
    if (it == channels_.end()) return absl::NotFoundError(absl::StrCat("no NCCL channel ", id));
    return it->second;
  }

 private:
  ServiceContext* const ctx_;
  PendingJoins joins_;
  IpcMappings ipc_;
  DeviceSlots ipc_slots_;
  cudaStream_t copy_stream_ = nullptr;
  std::atomic<uint64_t> next_channel_{1};
  absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<NcclChannel>> channels_ ABSL_GUARDED_BY(mu_);
};

// One PushKv call: the header begins a LayerwiseAppend; each chunk is received into a channel
// slot (NCCL) or mapped (CUDA IPC) and staged on the worker pool; the half-close commits.
class PushReactor final : public grpc::ServerReadReactor<v1::GpuPushRequest> {
 public:
  PushReactor(GpuTransportServiceImpl* service, grpc::CallbackServerContext* call,
              v1::AppendKvResponse* response)
      : service_(service), ctx_(service->ctx()), call_(call), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;  // answered already (a chunk failed while this read was pending)
    }
    absl::Status error;
    if (!ok) {
      error = call_->IsCancelled() ? absl::CancelledError("PushKv cancelled")
              : push_ == nullptr   ? absl::InvalidArgumentError("PushKv ended before a header")
                                   : absl::OkStatus();
      absl::MutexLock lock(&mu_);
      reads_done_ = true;
      if (!error.ok() && error_.ok()) error_ = error;
    } else {
      error = push_ == nullptr ? Begin() : Chunk();
      absl::MutexLock lock(&mu_);
      if (!error.ok() && error_.ok()) error_ = error;
      if (error_.ok()) {
        StartRead(&request_);
        return;
      }
      reads_done_ = true;  // failed: read nothing more
    }
    MaybeFinish();
  }

  void OnCancel() override {
    std::shared_ptr<LayerwiseAppend> push;
    std::shared_ptr<NcclChannel> channel;
    {
      absl::MutexLock lock(&mu_);
      push = push_;
      channel = channel_;
    }
    if (push != nullptr) push->Abort(absl::CancelledError("PushKv cancelled"));
    if (channel != nullptr) channel->Abort();
  }

  void OnDone() override {
    for (const std::string& h : ipc_handles_) service_->ipc().Close(device_, h);
    delete this;
  }

 private:
  absl::Status Begin() {
    if (request_.msg_case() != v1::GpuPushRequest::kHeader) {
      return absl::InvalidArgumentError("PushKv: the first message must be a header");
    }
    const v1::GpuPushHeader& h = request_.header();
    device_ = ctx_->backend->device();
    if (device_ < 0) {
      return absl::FailedPreconditionError("this kvpoold keeps its pool in host memory");
    }
    KVPOOL_RETURN_IF_ERROR(CheckGpuPushHeader(h, ctx_->config->max_append_tokens));
    std::shared_ptr<NcclChannel> channel;
    if (h.nccl_channel_id() != 0) {
      KVPOOL_ASSIGN_OR_RETURN(channel, service_->Channel(h.nccl_channel_id()));
    }
    AppendSpec spec;
    spec.token_start = static_cast<int>(h.token_start());
    spec.num_tokens = static_cast<int>(h.num_tokens());
    spec.kind = h.end_of_prefill() ? AppendKind::kFinalPrefill : AppendKind::kPrefill;
    spec.token_ids.assign(h.token_ids().begin(), h.token_ids().end());
    KVPOOL_ASSIGN_OR_RETURN(
        std::shared_ptr<LayerwiseAppend> push,
        LayerwiseAppend::Begin(ctx_, TenantOf(call_), h.sequence_id(), std::move(spec)));
    absl::MutexLock lock(&mu_);
    push_ = std::move(push);
    channel_ = std::move(channel);
    return absl::OkStatus();
  }

  absl::Status Chunk() {
    if (request_.msg_case() != v1::GpuPushRequest::kChunk) {
      return absl::InvalidArgumentError("PushKv: only the first message may be a header");
    }
    const v1::GpuPushChunk& c = request_.chunk();
    const Model& m = push_->model();
    KVPOOL_ASSIGN_OR_RETURN(const size_t bytes, CheckGpuPushChunk(c, push_->num_tokens(),
                                                                  m.row_values() * sizeof(Bf16)));
    const int layer = static_cast<int>(c.layer());
    const int offset = static_cast<int>(c.token_offset());
    const int n = static_cast<int>(c.num_tokens());
    const int traced = trace_.AddChunk(layer, offset, n);
    trace_.Mark(traced, PushTrace::kRead);
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
    }
    auto done = [this, traced](absl::Status s, bool /*layer_complete*/) {
      trace_.Mark(traced, PushTrace::kStaged);
      absl::MutexLock lock(&mu_);
      if (!s.ok() && error_.ok()) error_ = s;
      --pending_;
      MaybeFinishLocked();
    };
    if (channel_ != nullptr) {
      if (bytes > kMaxNcclChunkBytes) {
        done(absl::InvalidArgumentError(absl::StrCat("a chunk's K of ", bytes,
                                                     " bytes exceeds the NCCL chunk limit ",
                                                     kMaxNcclChunkBytes)),
             false);
        return absl::OkStatus();
      }
      auto cancelled = [call = call_] { return call->IsCancelled(); };
      absl::StatusOr<NcclChannel::Slot*> slot = channel_->AcquireSlot(bytes, cancelled);
      trace_.Mark(traced, PushTrace::kSlot);
      absl::Status posted = slot.ok() ? channel_->PostRecv(*slot, bytes) : slot.status();
      if (!posted.ok()) {
        if (slot.ok()) channel_->ReleaseSlot(*slot);
        done(posted, false);
        return absl::OkStatus();
      }
      trace_.Mark(traced, PushTrace::kPosted);
      std::shared_ptr<NcclChannel> ch = channel_;
      NcclChannel::Slot* s = *slot;
      push_->StageDevice(
          layer, offset, n, static_cast<const Bf16*>(s->k), static_cast<const Bf16*>(s->v),
          [this, ch, s, cancelled, traced] {
            absl::Status st = ch->WaitRecv(s, cancelled);
            trace_.Mark(traced, PushTrace::kReady);
            return st;
          },
          [ch, s, done](absl::Status st, bool complete) {
            ch->ReleaseSlot(s);
            done(std::move(st), complete);
          });
      return absl::OkStatus();
    }
    absl::StatusOr<const Bf16*> k = Map(c.k(), bytes, "k");
    absl::StatusOr<const Bf16*> v = k.ok() ? Map(c.v(), bytes, "v") : k;
    if (!v.ok()) {
      done(v.status(), false);
      return absl::OkStatus();
    }
    // Copy engines pull the chunk over NVLink into a local slot while the previous chunk is
    // quantized (the arrival kernels reading peer memory directly ran at about a third of the
    // link's speed).
    auto cancelled = [call = call_] { return call->IsCancelled(); };
    DeviceSlots& slots = service_->ipc_slots();
    absl::StatusOr<DeviceSlots::Slot*> slot = slots.Acquire(bytes, cancelled, [] { return false; });
    trace_.Mark(traced, PushTrace::kSlot);
    absl::StatusOr<cudaStream_t> stream = service_->CopyStream();
    absl::Status copied = !slot.ok() ? slot.status() : stream.status();
    if (copied.ok()) {
      DeviceSlots::Slot* s = *slot;
      const bool ok = cudaMemcpyAsync(s->k, *k, bytes, cudaMemcpyDefault, *stream) == cudaSuccess &&
                      cudaMemcpyAsync(s->v, *v, bytes, cudaMemcpyDefault, *stream) == cudaSuccess &&
                      cudaEventRecord(static_cast<cudaEvent_t>(s->done), *stream) == cudaSuccess;
      if (!ok) {
        (void)cudaGetLastError();
        copied = absl::InternalError("copying a CUDA IPC chunk failed");
      }
    }
    if (!copied.ok()) {
      if (slot.ok()) {
        cudaStreamSynchronize(*stream);
        slots.Release(*slot);
      }
      done(copied, false);
      return absl::OkStatus();
    }
    DeviceSlots::Slot* s = *slot;
    trace_.Mark(traced, PushTrace::kPosted);
    push_->StageDevice(
        layer, offset, n, static_cast<const Bf16*>(s->k), static_cast<const Bf16*>(s->v),
        [this, s, cancelled, traced] {
          absl::Status st = DeviceSlots::Wait(
              s,
              [&]() -> absl::Status {
                return cancelled() ? absl::CancelledError("push cancelled") : absl::OkStatus();
              },
              absl::Seconds(120));
          trace_.Mark(traced, PushTrace::kReady);
          return st;
        },
        [&slots, s, done](absl::Status st, bool complete) {
          // A chunk dropped before staging may still have its copy in flight.
          cudaEventSynchronize(static_cast<cudaEvent_t>(s->done));
          slots.Release(s);
          done(std::move(st), complete);
        });
    return absl::OkStatus();
  }

  // The device address of an IPC buffer's `bytes` bytes, checked against its allocation.
  absl::StatusOr<const Bf16*> Map(const v1::CudaIpcBuffer& b, size_t bytes, const char* what) {
    KVPOOL_ASSIGN_OR_RETURN(auto mapped, service_->ipc().Open(device_, b.handle()));
    ipc_handles_.push_back(b.handle());
    KVPOOL_RETURN_IF_ERROR(CheckIpcRange(b.offset(), bytes, mapped.second, what));
    return reinterpret_cast<const Bf16*>(mapped.first + b.offset());
  }

  void MaybeFinish() {
    absl::MutexLock lock(&mu_);
    MaybeFinishLocked();
  }

  // Answers once reading stopped and every chunk finished: commit, or the first error.
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || pending_ > 0 || !(reads_done_ || !error_.ok())) return;
    finished_ = true;
    absl::Status s = error_;
    if (s.ok() && call_->IsCancelled()) s = absl::CancelledError("PushKv cancelled");
    if (s.ok()) {
      const Model& model = push_->model();  // push_ holds it
      absl::StatusOr<AppendResult> r = push_->Commit();
      if (r.ok()) {
        FillSequenceInfo(r->info, response_->mutable_sequence());
        response_->set_to_history(r->to_history);
        response_->set_to_sink(r->to_sink);
        response_->set_to_recent(r->to_recent);
        for (const PrefixUnitKey& k : r->published) {
          FillPrefixUnit(k, response_->add_published_units());
        }
        ctx_->counters.ingested_tokens += push_->num_tokens();
        ctx_->counters.ingested_bytes += static_cast<uint64_t>(push_->num_tokens()) *
                                         model.bf16_token_bytes() * model.num_layers;
      }
      s = r.status();
    }
    if (!s.ok()) {
      if (push_ != nullptr) push_->Abort(s);
      // The client may be blocked in ncclSend for a chunk we will not receive: abort the
      // channel so that its NCCL calls fail instead of hanging.
      if (channel_ != nullptr) channel_->Abort();
    }
    trace_.Log(push_ != nullptr ? push_->sequence_id() : "", s);
    Finish(ToGrpcStatus(s));
  }

  GpuTransportServiceImpl* const service_;
  ServiceContext* const ctx_;
  grpc::CallbackServerContext* const call_;
  v1::AppendKvResponse* const response_;
  v1::GpuPushRequest request_;
  int device_ = -1;
  std::shared_ptr<LayerwiseAppend> push_;
  std::shared_ptr<NcclChannel> channel_;
  std::vector<std::string> ipc_handles_;
  absl::Mutex mu_;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  PushTrace trace_;
};

grpc::ServerReadReactor<v1::GpuPushRequest>* GpuTransportServiceImpl::PushKv(
    grpc::CallbackServerContext* call, v1::AppendKvResponse* response) {
  return new PushReactor(this, call, response);
}

}  // namespace

std::unique_ptr<grpc::Service> NewGpuTransportService(ServiceContext* ctx) {
  if (ctx->backend->device() < 0) return nullptr;
  return std::make_unique<GpuTransportServiceImpl>(ctx);
}

}  // namespace kvpool::server
