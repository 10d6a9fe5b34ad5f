// GpuTransportServiceImpl: kvpool.v1.GpuTransportService (proto/kvpool/v1/gpu_transport_service
// .proto): prefill K/V moving GPU to GPU into a kvpoold whose pool is on a GPU, over NCCL channels
// (nccl_channel.h) or CUDA IPC, rotated and quantized on arrival straight from the received or
// mapped GPU memory (LayerwiseAppend::StageDevice on the worker pool).
//
// NewGpuTransportService returns null where the daemon cannot serve it (CPU backend, or a build
// without CUDA and NCCL); kvpoold then leaves the service unregistered (UNIMPLEMENTED to
// clients).
#pragma once

#include <memory>

#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/service_type.h"  // grpc::Service complete, for the unique_ptr
#include "server/service_context.h"

namespace kvpool::server {

std::unique_ptr<grpc::Service> NewGpuTransportService(ServiceContext* ctx);

}  // namespace kvpool::server
