// NewGpuTransportService in builds without CUDA and NCCL: there is no GPU data plane.
#include "server/transport/gpu/gpu_transport_service.h"

namespace kvpool::server {

std::unique_ptr<grpc::Service> NewGpuTransportService(ServiceContext* /*ctx*/) { return nullptr; }

}  // namespace kvpool::server
