// The CUDA IPC transport: prefill K/V moving GPU to GPU on one host into a kvpoold whose pool is
// on a GPU (--device=cuda:N). A client offers CUDA_IPC in TransportService.Negotiate and gets a
// session; each push (TransportService.PushKv) names, per chunk, the client's buffers exported
// with cudaIpcGetMemHandle. The daemon maps each allocation once (reference counted, closed when
// its last push ends), checks the rows' range against it (ipc_range_check.h) and copies them
// into its own device slots on a copy stream (the copy engines pull over NVLink while the
// previous chunk is quantized), then the ingest engine stages them from there.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Transport> ipc, NewCudaIpcTransport(&ctx, {}));
//
// NewCudaIpcTransport is Unavailable where the daemon cannot serve it (a pool in host memory, a
// build without CUDA). Thread-safe.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "server/service_context.h"
#include "server/transport/transport.h"

namespace kvpool::server {

struct CudaIpcTransportOptions {
  size_t max_sessions = 1024;
};

[[nodiscard]] absl::StatusOr<std::unique_ptr<Transport>> NewCudaIpcTransport(
    ServiceContext* ctx, const CudaIpcTransportOptions& options);

}  // namespace kvpool::server
