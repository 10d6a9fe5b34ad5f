// TransportServiceImpl: the kvpool.v1.TransportService gRPC service. Negotiate picks the first
// offered transport the daemon hosts (grpc_inline when none matches) and returns what the
// client needs (for UCX: session id and secret, the listener's address, limits); CloseSession
// ends a UCX session.
//
//   TransportServiceImpl transports(&service_context);   // uses service_context.transports
//   builder.RegisterService(&transports);
//
// Thread-safe.
#pragma once

#include "kvpool/v1/transport_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class TransportServiceImpl final : public ::kvpool::v1::TransportService::CallbackService {
 public:
  explicit TransportServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* Negotiate(grpc::CallbackServerContext* context,
                                      const ::kvpool::v1::NegotiateRequest* request,
                                      ::kvpool::v1::NegotiateResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const ::kvpool::v1::CloseSessionRequest* request,
                                         ::kvpool::v1::CloseSessionResponse* response) override;

 private:
  ServiceContext* const ctx_;
};

}  // namespace kvpool::server
