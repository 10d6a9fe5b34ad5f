#include "server/transport/transport.h"

#include <cstdlib>
#include <cstring>

#include "openssl/rand.h"
#include "server/transport/session_registry.h"

namespace kvpool::server {

uint64_t SecureRandomSessionId() {
  unsigned char bytes[sizeof(uint64_t)];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) std::abort();  // no entropy: nothing is safe
  uint64_t id;
  std::memcpy(&id, bytes, sizeof(id));
  return id;
}

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
    case TransportKind::kSharedMemory:
      return "shared_memory";
  }
  return "unknown";
}

}  // namespace kvpool::server
