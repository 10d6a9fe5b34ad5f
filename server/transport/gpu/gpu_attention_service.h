// kvpool.v1.GpuAttentionService (proto/kvpool/v1/gpu_attention_service.proto): remote attention
// between GPUs over a persistent NCCL channel per decode worker (attention_channel.h), for a
// kvpoold whose pool is on a GPU.
//
//   builder.RegisterService(NewGpuAttentionService(&ctx).release());   // kvpoold: server.cc
//
// NewGpuAttentionService never returns null: where the daemon cannot serve the channels (a CPU
// backend, or a build without CUDA and NCCL) it returns a service that answers UNAVAILABLE to
// every call, so clients learn why. Thread-safe; the service object must outlive the gRPC
// server's calls (destroying it closes every channel).
#pragma once

#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/service_type.h"  // grpc::Service, complete for unique_ptr's deleter
#include "server/service_context.h"

namespace kvpool::server {

std::unique_ptr<grpc::Service> NewGpuAttentionService(ServiceContext* ctx);

// The service that answers UNAVAILABLE (with `reason`) to every GpuAttentionService call.
std::unique_ptr<grpc::Service> NewUnavailableGpuAttentionService(std::string reason);

}  // namespace kvpool::server
