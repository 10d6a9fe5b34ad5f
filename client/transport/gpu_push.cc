#include "client/transport/gpu_push.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/transport/gpu_client_common.h"
#include "common/cuda_status.h"
#include "proto/status.h"
#include "common/nccl_status.h"
#include "common/status_macros.h"

namespace kvpool::client {
namespace {

namespace v1 = ::kvpool::v1;

v1::GpuPushRequest Header(const GpuPushSpec& spec, uint64_t channel) {
  v1::GpuPushRequest r;
  v1::GpuPushHeader* h = r.mutable_header();
  h->set_sequence_id(spec.sequence_id);
  h->set_token_start(spec.token_start);
  h->set_num_tokens(spec.num_tokens);
  h->set_end_of_prefill(spec.end_of_prefill);
  h->set_nccl_channel_id(channel);
  return r;
}

}  // namespace

GpuPushClient::GpuPushClient(std::shared_ptr<grpc::Channel> channel, int device)
    : stub_(v1::GpuTransportService::NewStub(std::move(channel))), device_(device) {}

absl::StatusOr<std::unique_ptr<GpuPushClient>> GpuPushClient::Create(
    std::shared_ptr<grpc::Channel> channel, int device) {
  gpu_internal::DisableNvlinkMulticast();  // shared hosts
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  auto c = std::unique_ptr<GpuPushClient>(new GpuPushClient(std::move(channel), device));
  cudaStream_t s = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"));
  c->stream_ = s;
  return c;
}

GpuPushClient::~GpuPushClient() {
  cudaSetDevice(device_);
  if (stalled_context_ != nullptr) stalled_context_->TryCancel();
  if (comm_ != nullptr) (void)CloseNccl();
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status GpuPushClient::OpenNccl(absl::Duration timeout) {
  if (comm_ != nullptr) return absl::FailedPreconditionError("an NCCL channel is already open");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  ncclUniqueId id;
  KVPOOL_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  v1::OpenNcclChannelRequest req;
  req.set_nccl_unique_id(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  req.set_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(timeout)));
  req.set_client_name("gpu-push");
  const bool blocking_ops = gpu_internal::WantBlockingOps();
  req.set_blocking_ops(blocking_ops);
  v1::OpenNcclChannelResponse resp;
  grpc::Status rpc;
  std::atomic<bool> rpc_done{false};
  // The daemon joins as rank 1 (then splits and waits for the connect messages) while this
  // thread does the same as rank 0; it answers once all of that is done.
  std::thread t([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout) + 5000));
    rpc = stub_->OpenNcclChannel(&ctx, req, &resp);
    rpc_done.store(true, std::memory_order_release);
  });
  ncclComm_t comm = nullptr;
  absl::Status joined;
  if (!blocking_ops) {
    joined = NcclStatus(ncclCommInitRank(&comm, 2, id, 0), "ncclCommInitRank");
  } else {
    // Non-blocking join, so that a daemon that refuses the channel (its answer comes before it
    // ever joins: a CPU daemon, a bad request) or never joins ends the wait; then the blocking
    // communicator the operations run on (JoinNcclComm on the daemon's side).
    const absl::Time deadline = absl::Now() + timeout + absl::Seconds(5);
    auto give_up = [&]() -> absl::Status {
      if (rpc_done.load(std::memory_order_acquire) && !rpc.ok()) {
        return FromGrpcStatus(rpc, "OpenNcclChannel");
      }
      return absl::OkStatus();
    };
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, 0, &config);
    joined = (r == ncclSuccess || r == ncclInProgress) ? absl::OkStatus()
                                                       : NcclStatus(r, "ncclCommInitRankConfig");
    if (joined.ok()) {
      joined = gpu_internal::AwaitComm(comm, "joining the NCCL communicator", deadline, give_up);
    }
    if (joined.ok()) {
      absl::StatusOr<ncclComm_t> child = gpu_internal::SplitBlocking(comm, deadline, give_up);
      comm = nullptr;  // aborted by SplitBlocking
      joined = child.status();
      if (joined.ok()) {
        comm = *child;
        joined = Connect(comm);
      }
    }
  }
  t.join();
  if (!joined.ok() || !rpc.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    KVPOOL_RETURN_IF_ERROR(FromGrpcStatus(rpc, "OpenNcclChannel"));
    return joined;
  }
  comm_ = comm;
  channel_id_ = resp.channel_id();
  return absl::OkStatus();
}

absl::Status GpuPushClient::Connect(void* comm) {
  // The daemon's NcclChannel::Join receives kConnectBytes twice (a K and a V slot) right after
  // the split, so the path is connected before the first push.
  constexpr size_t kConnectBytes = 16;  // NcclChannel::kConnectBytes
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  void* bytes = nullptr;
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&bytes, kConnectBytes, s), "cudaMallocAsync"));
  absl::Status st = CudaStatus(cudaMemsetAsync(bytes, 0, kConnectBytes, s), "cudaMemsetAsync");
  if (st.ok()) {
    ncclGroupStart();
    ncclSend(bytes, kConnectBytes, ncclUint8, /*peer=*/1, static_cast<ncclComm_t>(comm), s);
    ncclSend(bytes, kConnectBytes, ncclUint8, /*peer=*/1, static_cast<ncclComm_t>(comm), s);
    st = NcclStatus(ncclGroupEnd(), "connecting the NCCL channel");
  }
  cudaFreeAsync(bytes, s);
  if (st.ok()) st = CudaStatus(cudaStreamSynchronize(s), "connecting the NCCL channel");
  return st;
}

absl::Status GpuPushClient::CloseNccl() {
  if (comm_ == nullptr) return absl::OkStatus();
  grpc::ClientContext ctx;
  v1::CloseNcclChannelRequest req;
  req.set_channel_id(channel_id_);
  v1::CloseNcclChannelResponse resp;
  const grpc::Status s = stub_->CloseNcclChannel(&ctx, req, &resp);
  ncclCommAbort(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
  channel_id_ = 0;
  return FromGrpcStatus(s, "CloseNcclChannel");
}

absl::Status GpuPushClient::RegisterBuffer(const void* base, size_t bytes) {
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  cudaIpcMemHandle_t h;
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&h, const_cast<void*>(base)),
                                    "cudaIpcGetMemHandle (pass a cudaMalloc base)"));
  buffers_[static_cast<const uint8_t*>(base)] =
      Registered{bytes, std::string(reinterpret_cast<const char*>(&h), sizeof(h))};
  return absl::OkStatus();
}

absl::StatusOr<v1::AppendKvResponse> GpuPushClient::PushNccl(
    const GpuPushSpec& spec, absl::Span<const GpuLayerRows> layers) {
  if (comm_ == nullptr) return absl::FailedPreconditionError("no NCCL channel: call OpenNccl");
  return Push(spec, layers, /*nccl=*/true);
}

absl::StatusOr<v1::AppendKvResponse> GpuPushClient::PushIpc(const GpuPushSpec& spec,
                                                            absl::Span<const GpuLayerRows> layers) {
  return Push(spec, layers, /*nccl=*/false);
}

absl::StatusOr<v1::AppendKvResponse> GpuPushClient::Push(const GpuPushSpec& spec,
                                                         absl::Span<const GpuLayerRows> layers,
                                                         bool nccl) {
  if (spec.row_bytes == 0 || spec.num_tokens == 0) {
    return absl::InvalidArgumentError("row_bytes and num_tokens must be positive");
  }
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  const uint32_t chunk = spec.chunk_tokens == 0 ? spec.num_tokens : spec.chunk_tokens;
  // The IPC buffer holding [p, p + bytes).
  auto locate = [&](const void* p, size_t bytes, v1::CudaIpcBuffer* out) -> absl::Status {
    const auto* q = static_cast<const uint8_t*>(p);
    auto it = buffers_.upper_bound(q);
    if (it == buffers_.begin())
      return absl::InvalidArgumentError("rows not in a registered buffer");
    --it;
    const size_t offset = static_cast<size_t>(q - it->first);
    if (offset + bytes > it->second.bytes) {
      return absl::InvalidArgumentError("rows run past their registered buffer");
    }
    out->set_handle(it->second.handle);
    out->set_offset(offset);
    return absl::OkStatus();
  };

  grpc::ClientContext ctx;
  v1::AppendKvResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::GpuPushRequest>> w = stub_->PushKv(&ctx, &response);
  bool wrote = w->Write(Header(spec, nccl ? channel_id_ : 0));
  absl::Status send_error;
  for (size_t layer = 0; layer < layers.size() && wrote && send_error.ok(); ++layer) {
    for (uint32_t at = 0; at < spec.num_tokens && wrote; at += chunk) {
      const uint32_t n = std::min(chunk, spec.num_tokens - at);
      const size_t bytes = static_cast<size_t>(n) * spec.row_bytes;
      const auto* k = static_cast<const uint8_t*>(layers[layer].k) + at * spec.row_bytes;
      const auto* v = static_cast<const uint8_t*>(layers[layer].v) + at * spec.row_bytes;
      v1::GpuPushRequest r;
      v1::GpuPushChunk* c = r.mutable_chunk();
      c->set_layer(static_cast<uint32_t>(layer));
      c->set_token_offset(at);
      c->set_num_tokens(n);
      if (!nccl) {
        send_error = locate(k, bytes, c->mutable_k());
        if (send_error.ok()) send_error = locate(v, bytes, c->mutable_v());
        if (!send_error.ok()) break;
      }
      wrote = w->Write(r);
      if (wrote && nccl) {
        // Enqueued on our stream; they complete when the daemon has posted its receives.
        ncclGroupStart();
        ncclSend(k, bytes, ncclUint8, /*peer=*/1, static_cast<ncclComm_t>(comm_),
                 static_cast<cudaStream_t>(stream_));
        ncclSend(v, bytes, ncclUint8, /*peer=*/1, static_cast<ncclComm_t>(comm_),
                 static_cast<cudaStream_t>(stream_));
        send_error = NcclStatus(ncclGroupEnd(), "ncclSend");
      }
    }
  }
  if (!send_error.ok()) ctx.TryCancel();
  w->WritesDone();
  const grpc::Status s = w->Finish();
  if (nccl) {
    if (!s.ok() || !send_error.ok()) {
      // The daemon aborted its end: our sends would never complete.
      ncclCommAbort(static_cast<ncclComm_t>(comm_));
      comm_ = nullptr;
      channel_id_ = 0;
    } else {
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "NCCL sends"));
    }
  }
  KVPOOL_RETURN_IF_ERROR(send_error);
  KVPOOL_RETURN_IF_ERROR(FromGrpcStatus(s, "PushKv"));
  return response;
}

absl::Status GpuPushClient::StartNcclPushAndStall(const GpuPushSpec& spec) {
  if (comm_ == nullptr) return absl::FailedPreconditionError("no NCCL channel: call OpenNccl");
  stalled_context_ = std::make_unique<grpc::ClientContext>();
  stalled_writer_ = stub_->PushKv(stalled_context_.get(), &stalled_response_);
  v1::GpuPushRequest r;
  v1::GpuPushChunk* c = r.mutable_chunk();
  c->set_layer(0);
  c->set_token_offset(0);
  c->set_num_tokens(spec.chunk_tokens == 0 ? spec.num_tokens : spec.chunk_tokens);
  if (!stalled_writer_->Write(Header(spec, channel_id_)) || !stalled_writer_->Write(r)) {
    return absl::UnavailableError("PushKv stream broke");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::client
