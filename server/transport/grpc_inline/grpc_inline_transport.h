// GrpcInlineTransport: the data plane that is always there. K/V travel inline in
// SequenceService.AppendKv (client-streaming chunks, one worker-pool task each) and queries and
// outputs inline in AttentionService.Attend; gRPC's flow control is the backpressure. Accepting
// it sets nothing up: the client simply keeps using those RPCs.
//
//   GrpcInlineTransport inline_transport;
//   KVPOOL_ASSIGN_OR_RETURN(TransportSession s, inline_transport.Accept(tenant, offer));
//   // s.kind == TransportKind::kGrpcInline, s.session_id == 0
//
// Thread-safe (stateless).
#pragma once

#include "server/transport/transport.h"

namespace kvpool::server {

class GrpcInlineTransport final : public Transport {
 public:
  const TransportCapabilities& capabilities() const override;
  absl::StatusOr<TransportSession> Accept(const TenantId& tenant,
                                          const TransportOffer& offer) override;
  absl::StatusOr<int> Close(const TenantId& tenant, uint64_t session_id) override;
  TransportStats Stats() const override { return {}; }
  void Shutdown() override {}
};

}  // namespace kvpool::server
