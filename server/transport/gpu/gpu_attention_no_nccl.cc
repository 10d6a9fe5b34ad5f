// NewGpuAttentionService in builds without CUDA and NCCL: no NCCL attention channels.
#include "server/transport/gpu/gpu_attention_service.h"

namespace kvpool::server {

std::unique_ptr<grpc::Service> NewGpuAttentionService(ServiceContext* /*ctx*/) {
  return NewUnavailableGpuAttentionService(
      "NCCL attention channels need a kvpoold built with CUDA and NCCL, run with "
      "--device=cuda:N");
}

}  // namespace kvpool::server
