// Conversions between TransportService's messages (proto/kvpool/v1/transport_service.proto) and
// the Transport interface's types: a client's offer, the answer for an accepted session, a
// device push's chunk.
//
//   std::optional<TransportOffer> offer = OfferFromProto(request.offers(0), request.client_name());
//   FillNegotiateResponse(session, reachable_host, &response);
//
// Pure functions; thread-safe.
#pragma once

#include <optional>
#include <string>

#include "kvpool/v1/transport_service.pb.h"
#include "server/transport/device_push.h"
#include "server/transport/transport.h"

namespace kvpool::server {

// The offer as the transports see it; nullopt for a kind this daemon does not know.
std::optional<TransportOffer> OfferFromProto(const ::kvpool::v1::TransportOffer& o,
                                             const std::string& client_name);

// The answer for an accepted session. `ucx_listener_host` is the host the client reaches the
// UCX listener at (the session's own, or the one it reached gRPC at when that is a wildcard).
void FillNegotiateResponse(const TransportSession& s, const std::string& ucx_listener_host,
                           ::kvpool::v1::NegotiateResponse* out);

// A device push's chunk message; `bytes` is its K's (and V's) size.
DeviceChunk DeviceChunkFromProto(const ::kvpool::v1::DevicePushChunk& c, size_t bytes);

}  // namespace kvpool::server
