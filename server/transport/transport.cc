#include "server/transport/transport.h"

namespace kvpool::server {

absl::string_view TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kGrpcInline:
      return "grpc_inline";
    case TransportKind::kUcx:
      return "ucx";
    case TransportKind::kNccl:
      return "nccl";
    case TransportKind::kCudaIpc:
      return "cuda_ipc";
  }
  return "unknown";
}

}  // namespace kvpool::server
