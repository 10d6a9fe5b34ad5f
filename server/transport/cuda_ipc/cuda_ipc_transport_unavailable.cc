// NewCudaIpcTransport in builds without CUDA: there is no CUDA IPC data plane.
#include "server/transport/cuda_ipc/cuda_ipc_transport.h"

namespace kvpool::server {

absl::StatusOr<std::unique_ptr<Transport>> NewCudaIpcTransport(
    ServiceContext* /*ctx*/, const CudaIpcTransportOptions& /*options*/) {
  return absl::UnavailableError("kvpoold was built without CUDA");
}

}  // namespace kvpool::server
