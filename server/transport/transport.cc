#include "server/transport/transport.h"

namespace kvpool::server {

absl::string_view TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kGrpcInline:
      return "grpc_inline";
    case TransportKind::kUcx:
      return "ucx";
  }
  return "unknown";
}

}  // namespace kvpool::server
