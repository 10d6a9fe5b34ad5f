// TransportServiceImpl: the kvpool.v1.TransportService gRPC service, the one place where clients
// reach the daemon's data-plane transports (server/transport/transport.h). Negotiate picks the
// first offered transport the daemon hosts (grpc_inline when none matches) and answers what the
// client needs once the transport accepted (UCX: session id and secret, the listener's address,
// limits; NCCL: after the join; CUDA IPC: a session id); CloseSession ends a session of any
// kind. The transport-specific calls are routed to the transport that holds the session:
// PushKv (device pushes, NCCL and CUDA IPC: device_push_reactor.h), WatchSession (a session's
// lease: session_watch_reactor.h), SetAttentionPlan and DropAttentionPlan (NCCL attention
// channels), FetchToDevice (CUDA IPC: device_fetch.h).
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
  grpc::ServerReadReactor<::kvpool::v1::DevicePushRequest>* PushKv(
      grpc::CallbackServerContext* context, ::kvpool::v1::AppendKvResponse* response) override;
  grpc::ServerWriteReactor<::kvpool::v1::WatchSessionResponse>* WatchSession(
      grpc::CallbackServerContext* context,
      const ::kvpool::v1::WatchSessionRequest* request) override;
  grpc::ServerUnaryReactor* SetAttentionPlan(
      grpc::CallbackServerContext* context, const ::kvpool::v1::SetAttentionPlanRequest* request,
      ::kvpool::v1::SetAttentionPlanResponse* response) override;
  grpc::ServerUnaryReactor* DropAttentionPlan(
      grpc::CallbackServerContext* context, const ::kvpool::v1::DropAttentionPlanRequest* request,
      ::kvpool::v1::DropAttentionPlanResponse* response) override;
  grpc::ServerUnaryReactor* FetchToDevice(grpc::CallbackServerContext* context,
                                          const ::kvpool::v1::FetchToDeviceRequest* request,
                                          ::kvpool::v1::FetchToDeviceResponse* response) override;

 private:
  ServiceContext* const ctx_;
};

}  // namespace kvpool::server
