#include "client/transport/gpu_push.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/transport/gpu_client_common.h"
#include "common/cuda_status.h"
#include "common/nccl_status.h"
#include "common/status_macros.h"
#include "proto/status.h"

namespace kvpool::client {
namespace {

namespace v1 = ::kvpool::v1;

v1::DevicePushRequest Header(const GpuPushSpec& spec, uint64_t session) {
  v1::DevicePushRequest r;
  r.mutable_header()->set_session_id(session);
  v1::AppendKvHeader* h = r.mutable_header()->mutable_append();
  h->set_sequence_id(spec.sequence_id);
  h->set_token_start(spec.token_start);
  h->set_num_tokens(spec.num_tokens);
  h->set_dtype(v1::DTYPE_BF16);
  h->set_end_of_prefill(spec.end_of_prefill);
  return r;
}

absl::Status CloseSession(v1::TransportService::Stub& stub, uint64_t session) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CloseSessionRequest req;
  req.set_session_id(session);
  v1::CloseSessionResponse resp;
  return FromGrpcStatus(stub.CloseSession(&ctx, req, &resp), "CloseSession");
}

}  // namespace

GpuPushClient::GpuPushClient(std::shared_ptr<grpc::Channel> channel, int device)
    : stub_(v1::TransportService::NewStub(std::move(channel))), device_(device) {}

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
  if (ipc_session_ != 0) (void)CloseSession(*stub_, ipc_session_);
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status GpuPushClient::OpenNccl(absl::Duration timeout) {
  if (comm_ != nullptr) return absl::FailedPreconditionError("an NCCL session is already open");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  gpu_internal::ConnectPeer connect;
  if (gpu_internal::WantBlockingOps()) {
    connect = [this](ncclComm_t comm, absl::Time, const std::function<absl::Status()>&) {
      return Connect(comm);
    };
  }
  KVPOOL_ASSIGN_OR_RETURN(gpu_internal::NcclSessionJoin joined,
                          gpu_internal::JoinNcclSession(*stub_, v1::NCCL_CHANNEL_USE_INGEST,
                                                        timeout, "gpu-push", connect));
  comm_ = joined.comm;
  nccl_session_ = joined.session.session_id();
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
  const absl::Status s = CloseSession(*stub_, nccl_session_);
  ncclCommAbort(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
  nccl_session_ = 0;
  return s;
}

absl::StatusOr<uint64_t> GpuPushClient::IpcSession() {
  if (ipc_session_ != 0) return ipc_session_;
  v1::NegotiateRequest req;
  req.set_client_name("gpu-push");
  req.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
  v1::NegotiateResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  KVPOOL_RETURN_IF_ERROR(FromGrpcStatus(stub_->Negotiate(&ctx, req, &resp), "Negotiate"));
  if (resp.kind() != v1::TRANSPORT_KIND_CUDA_IPC) {
    return absl::UnavailableError(
        "the daemon offers no CUDA IPC: it needs kvpoold --device=cuda:N built with CUDA");
  }
  ipc_session_ = resp.cuda_ipc().session_id();
  return ipc_session_;
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
  if (comm_ == nullptr) return absl::FailedPreconditionError("no NCCL session: call OpenNccl");
  return Push(spec, layers, /*nccl=*/true);
}

absl::StatusOr<v1::AppendKvResponse> GpuPushClient::PushIpc(const GpuPushSpec& spec,
                                                            absl::Span<const GpuLayerRows> layers) {
  KVPOOL_RETURN_IF_ERROR(IpcSession().status());
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
  std::unique_ptr<grpc::ClientWriter<v1::DevicePushRequest>> w = stub_->PushKv(&ctx, &response);
  bool wrote = w->Write(Header(spec, nccl ? nccl_session_ : ipc_session_));
  absl::Status send_error;
  for (size_t layer = 0; layer < layers.size() && wrote && send_error.ok(); ++layer) {
    for (uint32_t at = 0; at < spec.num_tokens && wrote; at += chunk) {
      const uint32_t n = std::min(chunk, spec.num_tokens - at);
      const size_t bytes = static_cast<size_t>(n) * spec.row_bytes;
      const auto* k = static_cast<const uint8_t*>(layers[layer].k) + at * spec.row_bytes;
      const auto* v = static_cast<const uint8_t*>(layers[layer].v) + at * spec.row_bytes;
      v1::DevicePushRequest r;
      v1::DevicePushChunk* c = r.mutable_chunk();
      c->set_layer(static_cast<int32_t>(layer));
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
      nccl_session_ = 0;
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
  if (comm_ == nullptr) return absl::FailedPreconditionError("no NCCL session: call OpenNccl");
  stalled_context_ = std::make_unique<grpc::ClientContext>();
  stalled_writer_ = stub_->PushKv(stalled_context_.get(), &stalled_response_);
  v1::DevicePushRequest r;
  v1::DevicePushChunk* c = r.mutable_chunk();
  c->set_layer(0);
  c->set_token_offset(0);
  c->set_num_tokens(spec.chunk_tokens == 0 ? spec.num_tokens : spec.chunk_tokens);
  if (!stalled_writer_->Write(Header(spec, nccl_session_)) || !stalled_writer_->Write(r)) {
    return absl::UnavailableError("PushKv stream broke");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::client
