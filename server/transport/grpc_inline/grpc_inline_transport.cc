#include "server/transport/grpc_inline/grpc_inline_transport.h"

#include "absl/strings/str_cat.h"

namespace kvpool::server {

const TransportCapabilities& GrpcInlineTransport::capabilities() const {
  static const TransportCapabilities kCaps{.kind = TransportKind::kGrpcInline,
                                           .host_memory = true,
                                           .device_memory = false,
                                           .local_peers = true,
                                           .remote_peers = true,
                                           .zero_copy = false,
                                           .layer_notifications = false,
                                           .remote_attention = true};
  return kCaps;
}

absl::StatusOr<TransportSession> GrpcInlineTransport::Accept(const TenantId& /*tenant*/,
                                                             const TransportOffer& offer) {
  if (offer.kind != TransportKind::kGrpcInline) {
    return absl::InvalidArgumentError(
        absl::StrCat("grpc_inline cannot accept an offer of ", TransportKindName(offer.kind)));
  }
  TransportSession s;
  s.kind = TransportKind::kGrpcInline;
  return s;
}

absl::StatusOr<int> GrpcInlineTransport::Close(const TenantId& /*tenant*/, uint64_t session_id) {
  return absl::NotFoundError(
      absl::StrCat("grpc_inline has no sessions (session ", session_id, ")"));
}

}  // namespace kvpool::server
