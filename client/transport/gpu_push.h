// GpuPushClient: a prefill worker's side of kvpoold's GPU data plane: K/V that sit in this
// process's GPU memory go to a kvpoold whose pool is on a GPU (another one, or the same one in
// another process), over an NCCL session (this process is rank 0) or a CUDA IPC session (the
// daemon maps the registered buffers and copies them), both negotiated through
// TransportService.Negotiate; each push is a TransportService.PushKv stream, which carries the
// control messages only.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto gpu, GpuPushClient::Create(grpc_channel, /*device=*/0));
//   KVPOOL_RETURN_IF_ERROR(gpu->OpenNccl(absl::Seconds(60)));
//   GpuPushSpec spec{"seq-1", 0, n, /*end_of_prefill=*/true, row_bytes, /*chunk_tokens=*/4096};
//   KVPOOL_ASSIGN_OR_RETURN(v1::AppendKvResponse r, gpu->PushNccl(spec, layers));
//   KVPOOL_RETURN_IF_ERROR(gpu->RegisterBuffer(k_base, bytes));          // CUDA IPC instead
//   KVPOOL_ASSIGN_OR_RETURN(r, gpu->PushIpc(spec, layers));
//
// Every process that uses it runs NCCL with NVLink multicast off (Create sets NCCL_NVLS_ENABLE=0,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Not thread-safe: one push at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool::client {

// One push: input tokens [0, num_tokens) of every layer, sent in chunks of chunk_tokens.
struct GpuPushSpec {
  std::string sequence_id;
  uint32_t token_start = 0;
  uint32_t num_tokens = 0;
  bool end_of_prefill = false;
  size_t row_bytes = 0;       // kv_heads x head_dim x 2 (BF16) of the model
  uint32_t chunk_tokens = 0;  // 0: the whole layer in one chunk
};

// One layer's K and V rows in this process's GPU memory, [num_tokens][kv_heads][head_dim] BF16.
struct GpuLayerRows {
  const void* k = nullptr;
  const void* v = nullptr;
};

class GpuPushClient {
 public:
  static absl::StatusOr<std::unique_ptr<GpuPushClient>> Create(
      std::shared_ptr<grpc::Channel> channel, int device);
  ~GpuPushClient();

  // Opens an NCCL ingest session with the daemon (Negotiate offering NCCL, exchanging an
  // ncclUniqueId). UNAVAILABLE when the daemon hosts no NCCL.
  absl::Status OpenNccl(absl::Duration timeout);
  // Pushes over the open NCCL session: per chunk a gRPC message, then ncclSend of K and V.
  absl::StatusOr<kvpool::v1::AppendKvResponse> PushNccl(const GpuPushSpec& spec,
                                                        absl::Span<const GpuLayerRows> layers);
  // Closes the NCCL session (both ends).
  absl::Status CloseNccl();

  // Exports a cudaMalloc'ed buffer (its base) for CUDA IPC pushes.
  absl::Status RegisterBuffer(const void* base, size_t bytes);
  // Pushes through CUDA IPC: every row pointer must lie in a registered buffer. The first push
  // negotiates the CUDA IPC session (UNAVAILABLE when the daemon hosts no CUDA IPC).
  absl::StatusOr<kvpool::v1::AppendKvResponse> PushIpc(const GpuPushSpec& spec,
                                                       absl::Span<const GpuLayerRows> layers);

  // Test hook for fault tests: sends the header and the first chunk message of an NCCL push and
  // returns without sending the bytes (the caller then dies mid-transfer).
  absl::Status StartNcclPushAndStall(const GpuPushSpec& spec);

 private:
  GpuPushClient(std::shared_ptr<grpc::Channel> channel, int device);
  // Sends the connect messages the daemon waits for after joining.
  absl::Status Connect(void* comm);
  // The CUDA IPC session, negotiated on first use.
  absl::StatusOr<uint64_t> IpcSession();
  absl::StatusOr<kvpool::v1::AppendKvResponse> Push(const GpuPushSpec& spec,
                                                    absl::Span<const GpuLayerRows> layers,
                                                    bool nccl);

  struct Registered {
    size_t bytes = 0;
    std::string handle;
  };

  std::unique_ptr<kvpool::v1::TransportService::Stub> stub_;
  const int device_;
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t of the sends
  uint64_t nccl_session_ = 0;
  uint64_t ipc_session_ = 0;
  std::map<const uint8_t*, Registered> buffers_;  // by base address
  // Kept open by StartNcclPushAndStall.
  std::unique_ptr<grpc::ClientContext> stalled_context_;
  std::unique_ptr<grpc::ClientWriter<kvpool::v1::DevicePushRequest>> stalled_writer_;
  kvpool::v1::AppendKvResponse stalled_response_;
};

}  // namespace kvpool::client
